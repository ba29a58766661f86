"""A tiny-model GRPO run under an address-space cap it sets on itself (tests/training/test_token_budget.py).

Usage: ``python tests/support/token_budget_worker.py '<json spec>'``.
Spec keys: ``model``, ``data`` (prompt jsonl), ``out``
(result json), ``cap_bytes`` (``RLIMIT_AS`` = the process's address space after the model is loaded + this), ``budget``
(``GRPOConfig.max_tokens_per_microbatch``: null = the whole rollout in one micro-batch, or "auto").

The result: ``{"ok": bool, "error": type and message, "token_budget": the chosen budget, "steps": optimizer steps,
"micro_batches": sizes}``. The rollout engine returns fixed completions of 512 tokens (no EOS), so every run trains on
the same 8 sequences of ~540 tokens; the logits are computed in full (``lm_head_chunk_size=None``), so the memory of
a micro-batch grows by ~0.6 MB per token and 8 sequences need well over the cap.
"""

import gc
import json
import os
import resource
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 1)]  # the checkout, tests/ (for support.*)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MALLOC_ARENA_MAX", "2")

collecting = gc.isenabled()  # the cyclic collector is paused while the libraries below are imported
gc.disable()  # (why: lightning_grpo/__init__.py)
import torch  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.training.token_budget import is_out_of_memory  # noqa: E402
from support.algorithm import FixedRolloutEngine, Recorder, fixed_completions, quiet_trainer  # noqa: E402

if collecting:
    gc.enable()


def constant_reward(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def main(spec: dict) -> dict:
    torch.set_num_threads(1)
    config = GRPOConfig(num_generations=4, max_new_tokens=512, max_prompt_length=64, lm_head_chunk_size=None,
                        max_tokens_per_microbatch=spec["budget"], token_budget_memory_fraction=0.7)
    module = GRPOModule(spec["model"], reward_funcs=[constant_reward], config=config, export_dir="")
    eos = module.tokenizer.eos_token_id
    module.rollout_engine = FixedRolloutEngine(fixed_completions([600] * 8, 512, eos), eos)
    recorder = Recorder()
    trainer = quiet_trainer(spec["root"], 1, callbacks=[recorder])
    data = PromptDataModule(dataset=spec["data"], prompts_per_step=2, val_size=0)
    size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + int(spec["cap_bytes"]), resource.RLIM_INFINITY))
    result = {"token_budget": None, "error": None}
    try:
        trainer.fit(module, datamodule=data)
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        result["error"] = f"{type(error).__name__}: {error}"
    result.update(ok=result["error"] is None, token_budget=module.token_budget, steps=trainer.global_step,
                  micro_batches=[len(b) for b in recorder.batches])
    return result


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    outcome = main(spec)
    with open(spec["out"], "w") as handle:
        json.dump(outcome, handle)
