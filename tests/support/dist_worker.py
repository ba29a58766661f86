"""Multi-process GRPO runs for the distributed tests (FSDP2, DDP, FSDP1), run as a script.

``python tests/support/dist_worker.py <config.json>``; the config names a ``scenario`` (a function below) and its
arguments. Lightning's own launcher starts the other ranks (``Trainer(devices=2, accelerator="cpu")``
re-runs this script with ``LOCAL_RANK`` set), and every rank writes ``<out>/<name>_rank<r>.pt``; the tests
(``tests/support/dist.py``) read those files. Nothing here is mocked: the model, the strategies, the loop and
the collectives (gloo) are real; only the rollout is replaced by fixed experience in ``fixed_step``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 1)]  # the checkout, tests/ (for support.*)

collecting = gc.isenabled()  # the cyclic collector is paused while the libraries below are imported
gc.disable()  # (why: lightning_grpo/__init__.py)
import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import CompletionTable  # noqa: E402
from lightning_grpo.cli import use_cli_optimizer  # noqa: E402
from lightning_grpo.config import EngineConfig, EvalConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.data.datamodule import collate_prompts  # noqa: E402
from lightning_grpo.models.hf_weights import checkpoint_name  # noqa: E402
from lightning_grpo.strategies import FSDP2Strategy, full_state_dict, is_fsdp1, is_fsdp2  # noqa: E402
from lightning_grpo.training.experience import Experience  # noqa: E402

if collecting:
    gc.enable()


def make_strategy(spec: dict):
    """``{"name": "grpo_fsdp2"|"ddp"|"fsdp1_cpu"|"auto", **kwargs}`` -> a Trainer ``strategy`` argument."""
    spec = dict(spec)
    name = spec.pop("name")
    if name == "grpo_fsdp2":
        return FSDP2Strategy(**spec)
    if name == "fsdp1_cpu":
        from lightning.pytorch.strategies import FSDPStrategy

        if spec.pop("wrap_decoder_layers", False):  # nested FSDP units, one per decoder layer
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer

            spec["auto_wrap_policy"] = {LlamaDecoderLayer}

        class CPUFSDPStrategy(FSDPStrategy):
            """Lightning's FSDP1 strategy; a subclass only so Lightning's CUDA-only guard (an exact type check)
            lets it run on CPU with gloo, which torch supports."""

        return CPUFSDPStrategy(**spec)
    return name


def rank_file(out: str, name: str, rank: int) -> str:
    return os.path.join(out, f"{name}_rank{rank}.pt")


# ------------------------------------------------------------------------------------------------ fixed step
def fixed_experience(num_prompts: int, g: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A hand-made rollout of ``num_prompts * g`` rows: left-padded prompts (3..6 tokens), right-padded
    completions (1..7 tokens, random ids), standard-normal advantages."""
    gen = torch.Generator().manual_seed(seed)
    n, p, t = num_prompts * g, 6, 7
    prompt_len = torch.randint(3, p + 1, (num_prompts,), generator=gen).repeat_interleave(g)
    completion_len = torch.randint(1, t + 1, (n,), generator=gen)
    prompt_ids = torch.randint(10, vocab, (num_prompts, p), generator=gen).repeat_interleave(g, dim=0)
    completion_ids = torch.randint(10, vocab, (n, t), generator=gen)
    prompt_mask = (torch.arange(p).expand(n, p) >= (p - prompt_len).unsqueeze(1)).long()
    completion_mask = (torch.arange(t).expand(n, t) < completion_len.unsqueeze(1)).long()
    advantages = torch.randn(n, generator=gen)  # fixed, not group-centred, so the loss is not identically 0
    return dict(prompt_ids=prompt_ids * prompt_mask, prompt_mask=prompt_mask,
                completion_ids=completion_ids * completion_mask,
                completion_mask=completion_mask, advantages=advantages)


def full_grad(param):
    if param.grad is None:
        return None
    grad = param.grad
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu().clone()


class GradRecording:
    """Mixin: keeps the full gradients right after gradient clipping, before the optimizer update."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if is_fsdp1(self.policy):  # flat local shards: gather parameters and gradients in full
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(self.policy, writeback=False, with_grads=True):
                self.post_clip_grads = {checkpoint_name(n): full_grad(p) for n, p in self.policy.named_parameters()}
        else:
            self.post_clip_grads = {n: full_grad(p) for n, p in self.policy.named_parameters()}


class FixedExperienceModule(GradRecording, GRPOModule):
    """GRPOModule whose rollout returns rows of a fixed global experience: the rows of the prompts (by their
    "index" column) that Lightning's sampler gave this rank. Reference logprobs are computed as usual."""

    def __init__(self, *args, fixed: dict, num_generations: int, sampler_offsets=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fixed = fixed
        self.g = num_generations
        self.sampler_offsets = sampler_offsets
        self.seen: dict[int, torch.Tensor] = {}
        self.seen_teacher: dict[int, torch.Tensor] = {}

    def make_experience(self, batch, **kwargs):
        rows = torch.cat([torch.arange(i * self.g, (i + 1) * self.g) for i in batch["index"]])
        exp = Experience(**{k: v[rows].to(self.device) for k, v in self.fixed.items()}).trimmed()
        size = max(1, (self.config.mini_batch_size or len(exp)) // self.trainer.accumulate_grad_batches)
        context = self.trainer.precision_plugin.forward_context
        if self.ref_model is not None:
            exp.ref_logprobs = self.logprobs.batched(self.ref_model, exp, size, context)
            for j, row in enumerate(rows.tolist()):
                self.seen[row] = exp.ref_logprobs[j, : int(exp.completion_mask[j].sum())].cpu()
        if self.sampler_offsets is not None:  # an engine whose numerics differ: the policy's logprobs + offsets
            logprobs = self.logprobs.batched(self.policy, exp, size, context)
            offsets = self.sampler_offsets[rows][:, : logprobs.shape[1]].to(logprobs.device)
            exp.sampler_logprobs = torch.where(exp.completion_mask.bool(), logprobs + offsets, 0.0)
        if self.teacher is not None:  # on-policy distillation (issue 33)
            exp.teacher_logprobs = self.teacher.score(exp, size, context)
            for j, row in enumerate(rows.tolist()):
                self.seen_teacher[row] = exp.teacher_logprobs[j, : int(exp.completion_mask[j].sum())].cpu()
        return exp


def dtypes(policy, optimizer) -> dict:
    """The dtypes of the trained parameters (local shards) and of the optimizer's float states (AdamW's moments)."""
    params = {(p.to_local() if hasattr(p, "to_local") else p).dtype for p in policy.parameters() if p.requires_grad}
    states = {(v.to_local() if hasattr(v, "to_local") else v).dtype for state in optimizer.state.values()
              for k, v in state.items() if k != "step" and torch.is_tensor(v)}
    return {"params": sorted(str(d) for d in params), "optimizer": sorted(str(d) for d in states)}


class StepRecorder(Callback):
    """After each optimizer step: the logged loss and grad_norm, the full post-clip gradients (recorded by
    :class:`GradRecording`) and the full weights (collectives: every rank runs them in the same order)."""

    def __init__(self):
        self.records: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            grads = getattr(module, "post_clip_grads", None)
            self.records.append({"metrics": metrics, "grads": grads, "weights": full_state_dict(module.policy)})


class IndexPrompts(L.LightningDataModule):
    """``num_prompts`` prompts {"prompt": "p<i>", "index": i}, ``prompts_per_step`` per batch (per process)."""

    def __init__(self, num_prompts: int, prompts_per_step: int):
        super().__init__()
        self.rows = [{"prompt": f"p{i}", "index": i} for i in range(num_prompts)]
        self.prompts_per_step = prompts_per_step

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=self.prompts_per_step, collate_fn=collate_prompts)


def fixed_step(cfg: dict) -> None:
    """One optimizer step on fixed experience for each case in ``cfg["cases"]``."""
    for case in cfg["cases"]:
        torch.manual_seed(0)
        g, num_prompts = 2, 4
        beta = case.get("beta", 0.0)
        config = GRPOConfig.from_dict({"num_generations": g, "max_new_tokens": 7, "loss_type": case["loss_type"],
                                       "beta": beta, **case.get("config", {})})  # + issue 33's knobs
        model = case.get("model", cfg["model"])
        fixed = fixed_experience(num_prompts, g, AutoConfig.from_pretrained(model).vocab_size)
        if case.get("routed"):  # routed experts of the rollout, [layers, top_k, experts] (routing replay, issue 43)
            from support.moe import experts_of

            fixed["prompt_routed_experts"] = experts_of(fixed["prompt_ids"], fixed["prompt_mask"], *case["routed"])
            fixed["completion_routed_experts"] = experts_of(fixed["completion_ids"], fixed["completion_mask"],
                                                            *case["routed"])
        offsets = None
        if case.get("sampler_offsets"):
            offsets = 0.05 * torch.randn(num_prompts * g, 7, generator=torch.Generator().manual_seed(1))
        # the module's AdamW(lr=1e-3), or the CLI's --optimizer (and --lr_scheduler), installed as the CLI does
        own = {} if case.get("optimizer") else {"learning_rate": 1e-3}
        module = FixedExperienceModule(model, reward_funcs=[lambda p, c, **k: [0.0] * len(c)], config=config,
                                       fixed=fixed, num_generations=g, export_dir="", lora=case.get("lora"),
                                       sampler_offsets=offsets,
                                       gradient_checkpointing=case.get("gradient_checkpointing", False), **own)
        use_cli_optimizer(module, case.get("optimizer"), case.get("lr_scheduler"))
        if case.get("lora"):  # LoRA's B starts at 0 (no gradient for A): a random B makes every adapter move
            with torch.no_grad():
                for name, param in module.policy.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0.0, 0.1)
        recorder = StepRecorder()
        trainer = L.Trainer(
            accelerator="cpu", devices=cfg["devices"], strategy=make_strategy(case["strategy"]), max_steps=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[recorder], gradient_clip_val=case.get("gradient_clip_val"),
            default_root_dir=cfg["out"], precision=case.get("precision", "32-true"),
        )
        trainer.fit(module, datamodule=IndexPrompts(num_prompts, num_prompts // cfg["devices"]))
        record = recorder.records[-1]
        record["dtypes"] = dtypes(module.policy, trainer.optimizers[0])
        record["ref_logprobs"] = module.seen
        record["teacher_logprobs"] = module.seen_teacher
        teacher = module.teacher_model
        record["teacher_sharded"] = teacher is not None and (is_fsdp2(teacher) or is_fsdp1(teacher))
        record["sharded"] = is_fsdp2(module.policy) or is_fsdp1(module.policy)
        ref = module.ref_model
        record["ref_sharded"] = ref is not None and (is_fsdp2(ref) or is_fsdp1(ref))
        torch.save(record, rank_file(cfg["out"], case["name"], trainer.global_rank))


# ----------------------------------------------------------------------------------------------- GRPO run
def index_reward(prompts, completions, index, **columns):
    """index of the prompt + (0 or 1 by the completion's position in its group): a reward that varies between
    ranks (so a rank-0-only mean would be wrong) and inside each group (so advantages are nonzero)."""
    return [float(i) + float(k % 2) for k, i in enumerate(index)]


class ProfiledModule(GRPOModule):
    """Records, per rollout: this rank's prompt indices and the number of FSDP2 all-gathers (torch profiler
    ``FSDP::all_gather`` events) the rollout made."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollouts: list[dict] = []

    def make_experience(self, batch, **kwargs):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            experience = super().make_experience(batch, **kwargs)
        gathers = sum(1 for e in prof.events() if e.name.split(" (")[0] == "FSDP::all_gather")
        self.rollouts.append({"index": list(batch["index"]), "all_gathers": gathers})
        return experience


def fsdp_groups(model) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def local_and_full_numel(model) -> tuple[int, int]:
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return local, sum(p.numel() for p in model.parameters())


class ResumeProbe(Callback):
    """At train start (after the checkpoint is restored): global step, optimizer step count, full weights."""

    def __init__(self):
        self.start: dict = {}
        self.optimizer_steps = 0

    def on_train_start(self, trainer, module):
        optimizer = trainer.optimizers[0]
        steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
        weights = full_state_dict(module.policy)
        self.start = {"global_step": trainer.global_step, "adam_steps": steps[:1], "weights": weights}

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.optimizer_steps += 1


def _index_prompts(out: str, n: int) -> str:
    """``n`` prompts "What is i + 0?" with their ``index`` (for :func:`index_reward`) in ``out/prompts.jsonl``."""
    data = os.path.join(out, "prompts.jsonl")
    with open(data, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"What is {i} + 0?", "answer": str(i), "index": i}) + "\n")
    return data


def grpo_run(cfg: dict) -> None:
    """A 3-step GRPO run with rollouts, checkpoints every step and an HF export, then a resume for 1 step."""
    out = cfg["out"]
    data = _index_prompts(out, 12)
    config = GRPOConfig(num_generations=2, max_new_tokens=6, beta=0.04,
                        engine=EngineConfig(name=cfg.get("engine", "hf"), kv_cache_space_gib=0.25))

    def module(export_dir):
        return ProfiledModule(cfg["model"], reward_funcs=[index_reward], config=config, learning_rate=1e-3,
                              export_dir=export_dir, lora=cfg.get("lora"), export_merged=bool(cfg.get("lora")))

    def datamodule():
        return PromptDataModule(dataset=data, prompts_per_step=2, val_split="train", val_size=4, val_batch_size=2)

    first = module(os.path.join(out, "hf_export"))
    recorder = StepRecorder()
    checkpoint = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=make_strategy(cfg["strategy"]), max_steps=3, log_every_n_steps=1,
        logger=CSVLogger(out, name="logs"), callbacks=[checkpoint, recorder, CompletionTable()],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out, val_check_interval=3,
        check_val_every_n_epoch=None,
        gradient_clip_val=1.0,
    )
    trainer.fit(first, datamodule=datamodule())
    local, full = local_and_full_numel(first.policy)
    ref_local, ref_full = local_and_full_numel(first.ref_model)
    result = {
        "global_step": trainer.global_step,
        "rollouts": first.rollouts,
        "policy_groups": fsdp_groups(first.policy),
        "ref_groups": fsdp_groups(first.ref_model),
        "policy_numel": (local, full),
        "ref_numel": (ref_local, ref_full),
        "final_weights": recorder.records[-1]["weights"],
        "last_ckpt": os.path.join(out, "ckpt", "last.ckpt"),
        "export_dir": first.export_path(),
    }

    resumed = module("")  # no export: keep the first run's
    probe = ResumeProbe()
    trainer2 = L.Trainer(
        accelerator="cpu", devices=2, strategy=make_strategy(cfg["strategy"]), max_steps=4, logger=False,
        callbacks=[probe], enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        enable_checkpointing=False, limit_val_batches=0,
    )
    trainer2.fit(resumed, datamodule=datamodule(), ckpt_path=result["last_ckpt"])
    result["resume"] = {
        "start_global_step": probe.start["global_step"],
        "start_adam_steps": probe.start["adam_steps"],
        "start_weights": probe.start["weights"],
        "end_global_step": trainer2.global_step,
        "optimizer_steps": probe.optimizer_steps,
    }
    torch.save(result, rank_file(out, "grpo_run", trainer.global_rank))


class WeightsPerStep(Callback):
    """A copy of the policy's weights after each optimizer step (DDP: plain tensors)."""

    def __init__(self):
        self.weights: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end:
            self.weights.append({k: v.detach().cpu().clone() for k, v in module.policy.state_dict().items()})


class EngineVersion(Callback):
    """The rollout engine's weights version when training ends (the fit's teardown closes the engine after)."""

    version: int = -1

    def on_train_end(self, trainer: L.Trainer, module: GRPOModule) -> None:
        self.version = module.rollout_engine.version


def server_run(cfg: dict) -> None:
    """2 GRPO steps under DDP with rollouts from the rollout server at ``cfg["url"]`` (``engine.name=
    "vllm_server"``, the post-sync check on at 1e-4): each rank saves its global step, losses, engine's weights
    version and its weights after each step."""
    out = cfg["out"]
    data = _index_prompts(out, 8)
    config = GRPOConfig(num_generations=2, max_new_tokens=6, max_prompt_length=128,
                        engine=EngineConfig(name="vllm_server", server_urls=[cfg["url"]],
                                            server_group_port=cfg["group_port"], server_timeout=120.0,
                                            weight_sync_check=1e-4))
    module = GRPOModule(cfg["model"], reward_funcs=[index_reward], config=config, learning_rate=1e-2, export_dir="")
    recorder, weights, version = StepRecorder(), WeightsPerStep(), EngineVersion()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                        callbacks=[recorder, weights, version], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=out, limit_val_batches=0)
    trainer.fit(module, datamodule=PromptDataModule(dataset=data, prompts_per_step=2, val_size=0))
    assert module.rollout_engine is None  # the fit's end closed the engine the module made
    result = {"global_step": trainer.global_step, "engine_version": version.version,
              "losses": [r["metrics"]["loss"] for r in recorder.records], "weights": weights.weights}
    torch.save(result, rank_file(out, "server_run", trainer.global_rank))


def answer_is_one(prompts, completions, answer, **columns):
    """1 for the prompts whose gold is "1", else 0, whatever the completion: the evaluation metrics' true values
    are then fractions of prompts."""
    return [float(a == "1") for a in answer]


def eval_padding(cfg: dict) -> None:
    """``trainer.validate`` on 2 processes of 3 prompts (golds 1, 0, 0; Lightning's DistributedSampler pads rank 1
    with prompt 0 again) with 2 samples per prompt: each rank saves the logged metrics."""
    out = cfg["out"]
    data = os.path.join(out, "prompts.jsonl")
    with open(data, "w") as f:
        for i, gold in enumerate(["1", "0", "0"]):
            f.write(json.dumps({"question": f"What is {i} + 0?", "answer": gold}) + "\n")
    config = GRPOConfig(num_generations=2, max_new_tokens=4, eval=EvalConfig(num_samples=2))
    module = GRPOModule(cfg["model"], reward_funcs=[answer_is_one], config=config, export_dir="")
    trainer = L.Trainer(accelerator="cpu", devices=cfg.get("devices", 2), strategy="ddp", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    trainer.validate(module, datamodule=PromptDataModule(dataset=data, prompts_per_step=1, val_split="train",
                                                         val_size=3, val_batch_size=1))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    torch.save(metrics, rank_file(out, "eval_padding", trainer.global_rank))


class RankEcho:
    """Multi-turn episodes whose length depends on the rank: an observation after each model turn until 2 turns on
    rank 0, 4 elsewhere (so the ranks need different numbers of turns)."""

    def __init__(self) -> None:
        self.seen, self.turns = 0, 2 if torch.distributed.get_rank() == 0 else 4

    def reset(self, **row) -> None:
        pass

    def step(self, turn: str):
        from lightning_grpo.episodes import EnvStep

        self.seen += 1
        return EnvStep.finish(reward=1.0) if self.seen >= self.turns else EnvStep.observe(f"more ({self.seen})")

    def close(self) -> None:
        pass


def _two_steps_recording_turns(cfg: dict, module: GRPOModule, data: str) -> tuple[dict, int]:
    """2 steps of ``module`` on ``data`` under ``cfg["strategy"]`` on 2 CPU processes: this rank's
    ``{"global_step", "turns" (its episodes' model turns per rollout), "turns_max" (the logged turns/max per step)}``
    and its rank."""
    from lightning_grpo.callbacks import GRPOCallback

    class Turns(GRPOCallback):
        def __init__(self) -> None:
            self.turns: list[list[int]] = []
            self.turns_max: list[float] = []

        def on_rollout_end(self, trainer, module, rollout):
            self.turns.append([e.model_turns for e in rollout.episodes])

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch.step_end:
                self.turns_max.append(float(trainer.callback_metrics["turns/max"]))

    turns = Turns()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=make_strategy(cfg["strategy"]), max_steps=2,
                        logger=False, callbacks=[turns], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=cfg["out"], limit_val_batches=0)
    trainer.fit(module, datamodule=PromptDataModule(dataset=data, prompts_per_step=2, val_size=0))
    return {"global_step": trainer.global_step, "turns": turns.turns, "turns_max": turns.turns_max}, \
        trainer.global_rank


def episodes_run(cfg: dict) -> None:
    """2 GRPO steps on multi-turn episodes (HF engine) under ``cfg["strategy"]``, the ranks' episodes of different
    lengths (:class:`RankEcho`): each rank saves its global step, its episodes' model turns per rollout and the
    logged ``turns/max``."""
    from lightning_grpo.config import EpisodeConfig

    out = cfg["out"]
    data = _index_prompts(out, 8)
    config = GRPOConfig(num_generations=2, max_new_tokens=6, episode=EpisodeConfig(max_turns=4, max_tokens=48))
    module = GRPOModule(cfg["model"], reward_funcs=[index_reward], config=config, learning_rate=1e-3, export_dir="",
                        environment_factory=RankEcho)

    result, rank = _two_steps_recording_turns(cfg, module, data)
    torch.save(result, rank_file(out, "episodes_run", rank))


def rank_agent(base_url: str, api_key: str, row: dict) -> float:
    """An ``openai``-client agent making 2 calls on rank 0 and 4 elsewhere (each answered with an observation)."""
    from openai import OpenAI

    calls = 2 if torch.distributed.get_rank() == 0 else 4
    chat = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["question"]}]
    for k in range(calls):
        answer = chat.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                     {"role": "user", "content": f"more ({k})"}]
    return float(row["index"])


def agents_run(cfg: dict) -> None:
    """2 GRPO steps of :func:`rank_agent`'s episodes (HF engine) under ``cfg["strategy"]``: each rank saves its
    global step, its episodes' model calls per rollout, the logged ``turns/max`` and its gateways' addresses."""
    from lightning_grpo.config import EpisodeConfig
    from lightning_grpo.episodes.agents import gateway

    out = cfg["out"]
    data = _index_prompts(out, 8)
    config = GRPOConfig(num_generations=2, max_new_tokens=6, episode=EpisodeConfig(max_turns=4, max_tokens=60))
    module = GRPOModule(cfg["model"], reward_funcs=[index_reward], config=config, learning_rate=1e-3, export_dir="",
                        agent=rank_agent)
    gateways: set = set()
    start = gateway.Gateway.start

    def recorded_start(self, *args, **kwargs):
        gateways.add(self.url)
        return start(self, *args, **kwargs)

    gateway.Gateway.start = recorded_start

    result, rank = _two_steps_recording_turns(cfg, module, data)
    torch.save({**result, "gateways": gateways}, rank_file(out, "agents_run", rank))


SCENARIOS = {"fixed_step": fixed_step, "grpo_run": grpo_run, "server_run": server_run, "eval_padding": eval_padding,
             "episodes_run": episodes_run, "agents_run": agents_run}

if __name__ == "__main__":
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        config = json.load(f)
    SCENARIOS[config["scenario"]](config)
    from support.exit import end_if_launched_rank

    end_if_launched_rank()
