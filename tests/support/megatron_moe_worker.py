"""Mixture-of-experts runs under MegatronStrategy for ``tests/strategies/test_megatron_experts.py``, launched with
torchrun (CPU processes, gloo):

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/support/megatron_moe_worker.py OUT RUNS_JSON

``RUNS_JSON`` is a list of runs, each ``{"name": ..., "kind": "fit" | "replay" | "gradients", ...}``:

- ``fit``: ``lightning-grpo fit --config recipes/megatron.yaml`` (the documented CLI's ``GRPOCLI``, in this process)
  with the ``strategy`` init args given, HF rollouts of the tiny MoE whose routing the policy replays
  (``routing_replay="R3"``), ``max_steps`` steps; CSV metrics under
  ``OUT/<name>`` and (rank 0) the trained HF policy's weights in ``OUT/<name>/weights.pt``, a checkpoint after every
  step with ``checkpoints``, resumed from ``resume``;
- ``replay``: megatron-core's parallel state with PP stages of EP = DP = world / PP ranks, the policy's routers
  replaying the routing the HF model chose for each data-parallel replica's own rows, and the negated routers'
  disagreement with it counted over every stage's MoE layers: ``OUT/<name>_rank<r>.json``;
- ``gradients``: one backward pass of each rank's own rows at EP=1 and at EP=``expert_model_parallel_size`` (all
  ranks data-parallel), the gradients reduced as ``MegatronStrategy`` does and gathered into HF names: their largest
  differences and the full gradient's norms, ``OUT/<name>_rank<r>.json``.
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
from typing import Optional  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout, tests/ (for support.*)

collecting = gc.isenabled()  # the cyclic collector is paused while the libraries below are imported
gc.disable()  # (why: lightning_grpo/__init__.py)
import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|TE|apex).*")
if collecting:
    gc.enable()

CHECKPOINTS = """trainer:
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {dirpath}
        every_n_train_steps: 1
        save_top_k: -1
"""


def fit(out: Path, name: str, model: str, data: str, strategy: dict, max_steps: int = 3,
        checkpoints: bool = False, resume: Optional[str] = None, extra: tuple[str, ...] = ()) -> None:
    """One ``lightning-grpo fit`` through the CLI (see the module docstring)."""
    from lightning_grpo import GRPOModule
    from lightning_grpo.cli import GRPOCLI
    from lightning_grpo.data import PromptDataModule

    run = out / name
    run.mkdir(parents=True, exist_ok=True)
    args = ["fit", "--config", str(ROOT / "recipes" / "megatron.yaml")]
    if checkpoints:
        overlay = run / "checkpoints.yaml"
        overlay.write_text(CHECKPOINTS.format(dirpath=run / "ckpt"))
        args += ["--config", str(overlay)]
    for key, value in strategy.items():
        args += [f"--trainer.strategy.init_args.{key}", json.dumps(value)]
    args += [
        "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.devices", os.environ["WORLD_SIZE"],
        "--trainer.max_steps", str(max_steps), "--trainer.log_every_n_steps", "1", "--trainer.gradient_clip_val", "1.0",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir", str(run),
        "--trainer.default_root_dir", str(run), "--trainer.enable_checkpointing", json.dumps(checkpoints),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.model", model, "--model.reward_funcs", "[support.megatron_worker.char_sum_reward]",
        "--model.learning_rate", "0.01", "--model.export_dir", "",
        "--model.config.engine.name", "hf", "--model.config.num_generations", "4",
        "--model.config.max_new_tokens", "8", "--model.config.beta", "0.04", "--model.config.num_iterations", "2",
        "--model.config.mini_batch_size", "4", "--model.config.routing_replay", "R3",
        "--data.dataset", data, "--data.prompts_per_step", "1", "--data.val_size", "0",
    ]
    if resume is not None:
        args += ["--ckpt_path", resume]
    args += list(extra)
    cli = GRPOCLI(GRPOModule, PromptDataModule, args=args, save_config_kwargs={"overwrite": True})  # as cli.main
    if int(os.environ["RANK"]) == 0:
        torch.save(cli.model.policy.state_dict(), run / "weights.pt")  # the HF policy again after fit


def replay(out: Path, name: str, model: str, pipeline_model_parallel_size: int = 1) -> dict:
    """PP stages of EP = DP = world / PP ranks: each data-parallel replica scores its own rows (different lengths, so
    the all-to-all moves uneven token counts) with the HF model's recorded routing, at the HF weights (logprobs
    against transformers') and with the routers negated (each stage's replayed experts against the recorded ones);
    the weight stream against the HF state dict."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from lightning_grpo.functional import token_logprobs
    from lightning_grpo.models.moe import ReplayStats
    from lightning_grpo.strategies.megatron.convert import default_tensor_init
    from lightning_grpo.strategies.megatron.pipeline import replayed_routing
    from lightning_grpo.strategies.megatron.policy import MegatronPolicy
    from lightning_grpo.strategies.megatron.replay import pipeline_sum
    from support.megatron_moe import experience, hf_routing

    pp = pipeline_model_parallel_size
    _init(int(os.environ["WORLD_SIZE"]) // pp, pp)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with default_tensor_init():
        policy = MegatronPolicy.from_hf(hf, replay_routing=True)
    replica = parallel_state.get_data_parallel_rank()  # the stages of one pipeline score the same rows
    batch = hf_routing(hf, experience(hf.config.pad_token_id, rows=2 + replica, seed=replica))
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        attention = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
        logits = hf(input_ids=input_ids, attention_mask=attention,
                    position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
        t = batch.completion_ids.shape[1]
        expected, _ = token_logprobs(logits[:, -t - 1:-1], batch.completion_ids, 1.0)
        replayed, _ = policy.completion_logprobs(batch, 1.0)
        gathered = {k: v.clone() for k, v in policy.iter_hf_weights()}
        for layer in policy.model.decoder.layers:
            layer.mlp.router.weight.neg_()  # every layer is a mixture here
        lists = policy.replay.record()
        counts = ReplayStats()  # negated: each router's own top-2 of 4 is the complement of the replayed pair
        with policy.replay.counting(counts):
            policy.completion_logprobs(batch, 1.0)
        group = parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None
        disagreement = [float(v) for v in pipeline_sum(counts, group, torch.device("cpu"))]  # every stage's layers
    routing = replayed_routing(batch)
    needed = routing[..., 0, 0] >= 0
    b, s = routing.shape[:2]
    slots = [index for index, _ in policy.replay.slots]  # this stage's MoE layers
    equal = [bool(torch.equal(chosen[0].view(s, b, -1).transpose(0, 1)[needed], routing[:, :, index][needed]))
             for index, chosen in zip(slots, lists, strict=True)]
    reference = hf.state_dict()
    result = {
        "local_experts": len(policy.model.decoder.layers[0].mlp.experts.local_experts), "moe_layers": slots,
        "rows": b, "needed_tokens": int(needed.sum()), "replayed_equal_recorded": equal,
        "disagreement": disagreement,
        "logprob_diff": float((replayed - expected)[mask].abs().max()),
        "weights_exact": sorted(gathered) == sorted(reference) and all(torch.equal(gathered[k], reference[k])
                                                                        for k in reference),
    }
    _done()
    return result


def _init(expert_model_parallel_size: int, pipeline_model_parallel_size: int = 1) -> None:
    from megatron.core import parallel_state

    from lightning_grpo.strategies.megatron import cpu_shims

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    cpu_shims.apply()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pipeline_model_parallel_size,
                                             expert_model_parallel_size=expert_model_parallel_size,
                                             create_gloo_process_groups=True)


def _done() -> None:
    from megatron.core import parallel_state

    from lightning_grpo.strategies.megatron import cpu_shims

    parallel_state.destroy_model_parallel()
    cpu_shims.remove()


def gradients(out: Path, name: str, model: str, expert_model_parallel_size: int) -> dict:
    """The reduced gradients (HF names, full tensors) of one backward pass at EP=1 and at EP=N, every rank a data
    parallel replica with its own rows (the loss scaled by the DP size, as ``MegatronStrategy.train_step`` does)."""
    from transformers import AutoModelForCausalLM

    from lightning_grpo.strategies.megatron import gradients as megatron_gradients
    from lightning_grpo.strategies.megatron.convert import default_tensor_init, gather_map, param_maps
    from lightning_grpo.strategies.megatron.policy import MegatronPolicy
    from support.megatron_moe import experience

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    grads, norms = {}, {}
    for ep in (1, expert_model_parallel_size):
        _init(ep)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        with default_tensor_init():
            policy = MegatronPolicy.from_hf(hf)
        batch = experience(hf.config.pad_token_id, rows=3, seed=rank)
        logprobs, _ = policy.completion_logprobs(batch, 1.0)
        (logprobs * batch.completion_mask).sum().mul(world).backward()
        params = list(policy.model.parameters())
        megatron_gradients.reduce_gradients(params, policy, world, 1)
        norms[ep] = float(megatron_gradients.full_grad_norm(params, 1, 1, torch.device("cpu")))
        named = dict(policy.model.named_parameters())
        grads[ep] = {h: t.clone() for pm in param_maps(policy.arch, False, policy.stage)
                     for h, t in zip(pm.hf, gather_map(pm, [named[n].grad for n, _ in pm.local(policy.experts)],
                                                       policy.arch), strict=True)}
        _done()
    n = expert_model_parallel_size
    return {"norms": [norms[1], norms[n]], "scale": max(float(g.abs().max()) for g in grads[1].values()),
            "diff": {k: float((grads[1][k] - grads[n][k]).abs().max()) for k in grads[1]}}


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    for run in json.loads(argv[1]):
        run = dict(run)
        kind, name = run.pop("kind"), run["name"]
        if kind == "fit":
            fit(out, **run)
        else:
            result = replay(out, **run) if kind == "replay" else gradients(out, **run)
            (out / f"{name}_rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from support.exit import end_process

    end_process()
