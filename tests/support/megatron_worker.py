"""Multi-process scenarios for the Megatron tests, run under ``torchrun`` (2 CPU processes, gloo) by
``tests/test_megatron_*.py``; each writes its results as JSON into the output folder, which the tests check.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/support/megatron_worker.py OUT SCENARIO...

Also holds the helpers the tests share with the workers: the tiny GQA models and a deterministic rollout engine.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Sequence  # noqa: E402

collecting = gc.isenabled()  # the cyclic collector is paused while the libraries below are imported
gc.disable()  # (why: lightning_grpo/__init__.py)
import torch  # noqa: E402

if collecting:
    gc.enable()

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|TE|apex).*")

VOCAB_RANGE = (200, 2000)  # completion tokens are drawn from ordinary (non-special) ids of SmolLM2's vocabulary


# ----------------------------------------------------------------------------------------------- shared helpers
def save_tiny_model(root: str, tokenizer_path: str, tied: bool, model_type: str = "llama") -> str:
    """A random SmolLM2-like model: 2 layers, hidden 128, 4 query heads of 32, 2 KV heads (GQA), MLP 256,
    SmolLM2's 49152-token vocabulary and tokenizer; Qwen2 gets random q/k/v biases. Saved with
    ``save_pretrained`` into ``root``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    qwen = model_type == "qwen2"
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=tied, rope_theta=50000.0, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)  # non-trivial norms and biases
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


class FixedRolloutEngine:
    """Completions that are a fixed pseudo-random function of each prompt's tokens (independent of the model and
    of the prompt order), so runs with different parallel layouts train on identical experience. Some
    completions end with EOS early, so masks vary. It holds no weights: nothing to gather for it."""

    uses_policy_parameters = False
    seeds_per_request = False
    sync_is_collective = False

    def __init__(self, eos_token_id: int, pad_token_id: int, length: int = 6) -> None:
        self.eos_token_id, self.pad_token_id, self.length = eos_token_id, pad_token_id, length

    def set_lockstep(self, enabled: bool) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def sync_weights(self, weights: Any) -> None:  # a PolicyWeights
        pass

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: Any) -> Any:
        from lightning_grpo.protocols.rollout import RolloutOutput, completion_mask_from_eos, left_pad

        rows = []
        for prompt in prompt_ids:
            generator = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(prompt)) % (2**31))
            for _ in range(num_generations):
                ids = torch.randint(*VOCAB_RANGE, (self.length,), generator=generator)
                end = int(torch.randint(2, self.length + 3, (1,), generator=generator))
                if end < self.length:
                    ids[end] = self.eos_token_id
                    ids[end + 1 :] = self.pad_token_id
                rows.append(ids)
        completion_ids = torch.stack(rows)
        mask, truncated = completion_mask_from_eos(completion_ids, [self.eos_token_id])
        ids, prompt_mask = left_pad(prompt_ids, self.pad_token_id, torch.device("cpu"))
        rows = zip(completion_ids, mask, strict=True)
        texts = [" ".join(str(int(t)) for t, m in zip(r, mr, strict=True) if m) for r, mr in rows]
        return RolloutOutput(
            prompt_ids=ids.repeat_interleave(num_generations, 0),
            prompt_mask=prompt_mask.repeat_interleave(num_generations, 0),
            completion_ids=completion_ids, completion_mask=mask, truncated=truncated, completions=texts,
        )


def char_sum_reward(prompts: list, completions: list[str], **columns: Any) -> list[float]:
    """A reward that varies within groups of random completions: (sum of the characters' code points) mod 3."""
    return [float(sum(map(ord, c)) % 3) for c in completions]


def write_prompts(path: str, n: int = 4) -> str:
    """A jsonl prompt dataset of ``n`` questions of different lengths."""
    with open(path, "w") as f:
        for i in range(n):
            question = f"What is {i} + {i * 7} plus " + "one " * i + "?"
            f.write(json.dumps({"question": question, "answer": str(8 * i)}) + "\n")
    return path


def one_step_module(model_path: str, **config: Any) -> Any:
    """A GRPOModule (beta 0.04, G=4, a fixed rollout engine) whose optimizer is plain SGD, so the updated weights
    show the gradient itself (Adam's first step only shows its sign)."""
    from lightning_grpo import GRPOConfig, GRPOModule

    class SGDGRPOModule(GRPOModule):
        def configure_optimizers(self) -> Any:
            params = [p for p in self.policy.parameters() if p.requires_grad]
            return torch.optim.SGD(params, lr=self.hparams.learning_rate)

    config = {"num_generations": 4, "max_new_tokens": 6, "beta": 0.04, "temperature": 0.8, "loss_type": "bnpo",
              **config}
    module = SGDGRPOModule(model_path, reward_funcs=[char_sum_reward], config=GRPOConfig(**config),
                           learning_rate=5.0, export_dir="")
    module.rollout_engine = FixedRolloutEngine(module.tokenizer.eos_token_id, module.tokenizer.pad_token_id)
    return module


class LossRecorder:
    """Lightning callback (built lazily) that records the logged step loss and the gradient norm before clipping."""

    @staticmethod
    def make() -> Any:
        from lightning.pytorch.callbacks import Callback

        class _Recorder(Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []
                self.grad_norms: list[float] = []

            def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
                # before clipping; MegatronStrategy's own norm is that of the full (unsharded) gradient
                own = getattr(trainer.strategy, "grad_norm", None)
                if callable(own):
                    self.grad_norms.append(float(own(module.policy)))

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                if batch.step_end:
                    self.losses.append(float(trainer.callback_metrics["loss"]))
                    if not callable(getattr(trainer.strategy, "grad_norm", None)):
                        self.grad_norms.append(float(trainer.callback_metrics["grad_norm"]))

        return _Recorder()


def run_one_step(model_path: str, data_path: str, strategy: Any, devices: int, prompts_per_step: int,
                 gradient_clip_val: float, precision: str = "32-true", callbacks: Sequence[Any] = (),
                 **config: Any) -> tuple[Any, float, float]:
    """One GRPO optimizer step on the fixed experience of the 4 prompts in ``data_path`` (``config``: GRPOConfig
    fields over :func:`one_step_module`'s) in Lightning's ``precision``, with more ``callbacks``. Returns the module
    (its ``policy`` is an HF model again after fit), the step loss and the gradient norm before clipping."""
    import lightning as L

    from lightning_grpo.data import PromptDataModule

    L.seed_everything(0, verbose=False)
    module = one_step_module(model_path, **config)
    recorder = LossRecorder.make()
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder, *callbacks],
        gradient_clip_val=gradient_clip_val, precision=precision,
    )
    trainer.fit(module, datamodule=PromptDataModule(dataset=data_path, prompts_per_step=prompts_per_step, val_size=0))
    (loss,) = recorder.losses
    (grad_norm,) = recorder.grad_norms
    return module, loss, grad_norm


# -------------------------------------------------------------------------------------------------- scenarios
def _process_group_count() -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _parallel_state_left(groups_before: int) -> dict:
    """What a finished fit left behind: megatron-core's model-parallel state, new torch process groups (Lightning's
    default group counts when the fit created it), the CPU shim."""
    from megatron.core import parallel_state

    from lightning_grpo.strategies.megatron import cpu_shims

    return {"model_parallel_initialized": parallel_state.model_parallel_is_initialized(),
            "new_process_groups": _process_group_count() - groups_before, "cpu_shims": cpu_shims.is_applied()}


def _rank() -> int:
    return torch.distributed.get_rank()


def _init(tp: int) -> None:
    from megatron.core import parallel_state

    from lightning_grpo.strategies.megatron import cpu_shims

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    cpu_shims.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def _done() -> None:
    """Undo :func:`_init` (the default process group stays for the next scenario)."""
    from megatron.core import parallel_state

    from lightning_grpo.strategies.megatron import cpu_shims

    parallel_state.destroy_model_parallel()
    cpu_shims.remove()


def scenario_logits(out: Path, model_paths: list[str]) -> dict:
    """TP=world: vocab-parallel logits (gathered here only to compare) vs transformers; HF weights round trip."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from lightning_grpo.strategies.megatron.policy import MegatronPolicy

    _init(int(os.environ["WORLD_SIZE"]))
    result = {}
    for path in model_paths:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        policy = MegatronPolicy.from_hf(hf, parallel_state.get_tensor_model_parallel_world_size())
        input_ids = torch.randint(0, hf.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            local = policy(input_ids)  # [B, S, V/TP]
            shards = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
            torch.distributed.all_gather(shards, local, group=parallel_state.get_tensor_model_parallel_group())
            logits = torch.cat(shards, dim=-1)
            expected = hf(input_ids).logits
        gathered = dict(policy.iter_hf_weights())
        reference = hf.state_dict()
        result[os.path.basename(path)] = {
            "local_vocab": local.shape[-1],
            "max_abs_diff": float((logits - expected).abs().max()),
            "logit_scale": float(expected.abs().max()),
            "same_names": sorted(gathered) == sorted(reference),
            "bit_exact": all(torch.equal(gathered[k], reference[k]) for k in reference if k in gathered),
        }
    _done()
    return result


def scenario_logprobs(out: Path) -> dict:
    """vocab_parallel_logprobs on this rank's vocabulary slice vs functional.token_logprobs on the full logits:
    values, entropy and the gradient w.r.t. the logits (this rank's slice), at temperature 0.7."""
    from megatron.core import parallel_state

    from lightning_grpo.functional import token_logprobs
    from lightning_grpo.strategies.megatron.vocab_parallel import vocab_parallel_logprobs

    _init(int(os.environ["WORLD_SIZE"]))
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    generator = torch.Generator().manual_seed(7)
    full = (torch.randn(3, 5, 64, generator=generator) * 4).requires_grad_(True)
    labels = torch.randint(0, 64, (3, 5), generator=generator)
    weights = torch.randn(3, 5, generator=generator)
    expected, expected_entropy = token_logprobs(full, labels, 0.7, with_entropy=True)
    (expected * weights).sum().backward()
    local = full.detach().chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs(local, labels, 0.7, with_entropy=True)
    (logprobs * weights).sum().backward()
    assert full.grad is not None and local.grad is not None
    _done()
    return {
        "tp": tp,
        "logprob_diff": float((logprobs - expected).abs().max()),
        "entropy_diff": float((entropy - expected_entropy).abs().max()),
        "grad_diff": float((local.grad - full.grad.chunk(tp, dim=-1)[rank]).abs().max()),
        "grad_scale": float(full.grad.abs().max()),
        "labels_on_other_ranks": int(((labels // (64 // tp)) != rank).sum()),
    }


def scenario_step(out: Path, model_path: str, data_path: str, tp: int, clip: float) -> dict:
    """One GRPO step through L.Trainer(strategy=MegatronStrategy(tp)) on 2 processes; weights saved by rank 0."""
    from megatron.core import parallel_state

    from lightning_grpo.strategies.megatron.strategy import MegatronStrategy

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    world = int(os.environ["WORLD_SIZE"])
    groups_before = _process_group_count()
    strategy = MegatronStrategy(tensor_model_parallel_size=tp)
    module, loss, grad_norm = run_one_step(model_path, data_path, strategy, world, prompts_per_step=4 * tp // world,
                                           gradient_clip_val=clip)
    name = f"step_tp{tp}"
    if int(os.environ["RANK"]) == 0:
        torch.save(module.policy.state_dict(), out / f"{name}_weights.pt")
    return {"loss": loss, "grad_norm": grad_norm, "policy_type": type(module.policy).__name__,
            **_parallel_state_left(groups_before)}


def scenario_bf16_step(out: Path, model_path: str, data_path: str, clip: float) -> dict:
    """One GRPO step under MegatronStrategy(TP=2) on 2 processes in each bf16 precision (issue 44): "bf16-mixed"
    (float32 megatron-core weights, bf16 autocast) and "bf16-true" (megatron-core built in bfloat16); the weights
    saved by rank 0, the megatron-core weights' dtypes seen during the step."""
    from lightning.pytorch.callbacks import Callback
    from megatron.core import parallel_state

    from lightning_grpo.strategies.megatron.strategy import MegatronStrategy

    class Dtypes(Callback):
        def __init__(self) -> None:
            self.seen: set[str] = set()

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.seen.update(str(p.dtype) for p in module.policy.model.parameters())

    results: dict[str, Any] = {}
    for precision in ("bf16-mixed", "bf16-true"):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dtypes = Dtypes()
        strategy = MegatronStrategy(tensor_model_parallel_size=2)
        module, loss, grad_norm = run_one_step(model_path, data_path, strategy, 2, prompts_per_step=4,
                                               gradient_clip_val=clip, precision=precision, callbacks=[dtypes])
        if int(os.environ["RANK"]) == 0:
            torch.save(module.policy.state_dict(), out / f"bf16_step_{precision}_weights.pt")
        results[precision] = {"loss": loss, "grad_norm": grad_norm, "megatron_dtypes": sorted(dtypes.seen)}
    return results


def scenario_train(out: Path, model_path: str, data_path: str) -> dict:
    """A 3-step GRPO run with HF rollouts under MegatronStrategy(TP=2), checkpoint every step; then resume from
    the last checkpoint for 2 more steps, checking that the restored weights and optimizer state equal the
    checkpoint's and that each rollout's HF copy holds the current weights."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_grpo import GRPOConfig, GRPOModule
    from lightning_grpo.data import PromptDataModule
    from lightning_grpo.strategies.megatron.strategy import MegatronStrategy

    ckpt_dir = out / "ckpt"
    checks: dict[str, Any] = {"hf_copy_current": [], "completions_match": [], "step_tokens": []}

    class Checks(Callback):
        def __init__(self, checkpoint: Any = None) -> None:
            self.checkpoint = checkpoint

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if self.checkpoint is None:
                return
            gathered = dict(module.policy.iter_hf_weights())
            saved = {k[len("policy."):]: v for k, v in self.checkpoint["state_dict"].items() if k.startswith("policy.")}
            checks["resumed_weights_equal"] = sorted(gathered) == sorted(saved) and all(
                torch.equal(gathered[k], saved[k]) for k in saved)
            state = trainer.strategy.optimizer_state(trainer.optimizers[0], all_ranks=True)
            saved_state = self.checkpoint["optimizer_states"][0]["state"]
            checks["resumed_optimizer_equal"] = sorted(state["state"]) == sorted(saved_state) and all(
                torch.equal(torch.as_tensor(v), torch.as_tensor(saved_state[n][k]))
                for n, entry in state["state"].items() for k, v in entry.items())
            checks["resumed_optimizer_has_moments"] = all("exp_avg" in e for e in state["state"].values())

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if self.checkpoint is None and batch.step_end:
                checks["step_tokens"].append(int(batch.completion_mask.sum()))  # one micro-batch per step here
            if batch_idx % trainer.fit_loop.plan.micro_batches_per_rollout() != 0:
                return
            # right after a rollout: the HF copy that generated it must hold the current (gathered) weights
            gathered = dict(module.policy.iter_hf_weights())
            if trainer.strategy.tensor_model_parallel_rank == 0:
                hf = module.policy.hf_model.state_dict()
                checks["hf_copy_current"].append(all(torch.equal(hf[k], gathered[k]) for k in hf))
            ids = batch.completion_ids.contiguous()
            other = [torch.empty_like(ids) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(other, ids)
            checks["completions_match"].append(all(torch.equal(other[0], o) for o in other))

    def make_module() -> Any:
        config = GRPOConfig(num_generations=4, max_new_tokens=8, beta=0.04, num_iterations=2)
        return GRPOModule(model_path, reward_funcs=[char_sum_reward, "gsm8k_format"], config=config,
                          learning_rate=1e-3, export_dir=str(out / "hf_export"))

    L.seed_everything(0, verbose=False)
    groups_before = _process_group_count()
    module = make_module()
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=2, strategy=MegatronStrategy(tensor_model_parallel_size=2),
        logger=CSVLogger(str(out), name="logs"), log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=1.0,
        callbacks=[Checks(), ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, every_n_train_steps=1)],
    )
    trainer.fit(module, datamodule=PromptDataModule(dataset=data_path, prompts_per_step=2, val_size=0))
    checks["first_global_step"] = trainer.global_step
    checks["first_policy_type"] = type(module.policy).__name__
    checks["first_run_left"] = _parallel_state_left(groups_before)
    if _rank() == 0:
        torch.save(module.policy.state_dict(), out / "train_final_weights.pt")
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    checks["checkpoint_policy_keys"] = sorted(k for k in checkpoint["state_dict"] if k.startswith("policy."))
    checks["checkpoint_optimizer_format"] = checkpoint["optimizer_states"][0].get("format")

    L.seed_everything(0, verbose=False)
    resumed = L.Trainer(
        max_steps=5, accelerator="cpu", devices=2, strategy=MegatronStrategy(tensor_model_parallel_size=2),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        gradient_clip_val=1.0, callbacks=[Checks(checkpoint)],
    )
    resumed_module = make_module()
    resumed.fit(resumed_module, datamodule=PromptDataModule(dataset=data_path, prompts_per_step=2, val_size=0),
                ckpt_path=str(ckpt_dir / "last.ckpt"))
    checks["resumed_global_step"] = resumed.global_step
    if _rank() == 0:
        torch.save(resumed_module.policy.state_dict(), out / "resumed_final_weights.pt")
    checks["resumed_run_left"] = _parallel_state_left(groups_before)
    return checks


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    scenarios = json.loads(argv[1])  # [[name, kwargs], ...]
    for name, kwargs in scenarios:
        result = globals()[f"scenario_{name}"](out, **kwargs)
        rank = int(os.environ["RANK"])
        tag = kwargs.get("tp", "")
        (out / f"{name}{tag}_rank{rank}.json").write_text(json.dumps(result))
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 1)]  # the checkout, tests/ (for support.*)
    main(sys.argv[1:])
    from support.exit import end_process

    end_process()
