"""``max_tokens_per_microbatch="auto"`` (issue 24 item 4): the budget fitted from two measured probe steps.

* golden arithmetic of the fit, its cap and its refusal when one sequence does not fit (the peak meter it reads:
  tests/runtime/test_memory.py);
* under an address-space cap (``RLIMIT_AS``) that a subprocess sets on itself, a run whose rollout is trained as one
  micro-batch dies of out-of-memory, and the same run with the auto budget picks a budget and completes.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.runtime.memory import GIB, MemoryLimit
from lightning_grpo.training.token_budget import adamw_state_bytes, fit_budget
from support.algorithm import write_prompts

WORKER = Path(__file__).resolve().parents[1] / "support" / "token_budget_worker.py"


def test_fit_budget_golden():
    # 1,000 tokens peak at 1 GiB, 2,000 at 1.5 GiB: 0.5 GiB fixed + 0.5 GiB per 1,000 tokens; 0.75 of 4 GiB = 3 GiB,
    # minus 0.5 fixed and 0.5 optimizer state leaves 2 GiB = 4,000 tokens
    budget = fit_budget([1000, 2000], [GIB, 3 * GIB // 2], sequence_tokens=900, max_tokens=10_000,
                        available=MemoryLimit(4 * GIB, "test"), fraction=0.75, optimizer_state_bytes=GIB // 2)
    assert budget.tokens == 4000 and not budget.capped
    assert budget.fixed_bytes == GIB / 2 and budget.bytes_per_token == GIB / 2 / 1000
    assert "max_tokens_per_microbatch=4000" in budget.describe()
    capped = fit_budget([1000, 2000], [GIB, 3 * GIB // 2], 900, 3000, MemoryLimit(4 * GIB, "test"), 0.75)
    assert capped.tokens == 3000 and capped.capped


def test_fit_budget_refuses_when_one_sequence_does_not_fit():
    with pytest.raises(MemoryError, match=r"one sequence of 2500 tokens .* needs about 1\.75 GiB .* is 1\.50 GiB"):
        fit_budget([1000, 2000], [GIB, 3 * GIB // 2], sequence_tokens=2500, max_tokens=10_000,
                   available=MemoryLimit(2 * GIB, "test"), fraction=0.75)


def test_config_checks_the_auto_budget():
    assert GRPOConfig(max_tokens_per_microbatch="auto").max_tokens_per_microbatch == "auto"
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch='auto' is invalid: needs padding_free=True"):
        GRPOConfig(max_tokens_per_microbatch="auto", padding_free=False)
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch='many' is invalid"):
        GRPOConfig(max_tokens_per_microbatch="many")
    with pytest.raises(ValueError, match=r"token_budget_memory_fraction=1.5 is invalid"):
        GRPOConfig(token_budget_memory_fraction=1.5)


def test_adamw_state_bytes_counts_two_tensors_per_parameter():
    weight = torch.nn.Parameter(torch.zeros(10, 3))
    optimizer = torch.optim.AdamW([weight])
    assert adamw_state_bytes(optimizer) == 2 * 30 * 4
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    assert adamw_state_bytes(optimizer) == 0  # the state exists (a resumed run)


def _run(tiny_llama_path, tmp_path, budget, cap):
    out = tmp_path / f"{budget}.json"
    spec = dict(model=tiny_llama_path, data=write_prompts(tmp_path / "prompts.jsonl"), out=str(out), cap_bytes=cap,
                budget=budget, root=str(tmp_path / f"run_{budget}"))
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=600, cwd=str(WORKER.parent))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.distributed  # spawns processes
def test_auto_budget_completes_a_run_that_dies_of_out_of_memory(tiny_llama_full_vocab_path, tmp_path):
    """SmolLM2's whole vocabulary: a micro-batch's memory is mostly its vocabulary-sized logits."""
    tiny_llama_path = tiny_llama_full_vocab_path
    cap = 3 * GIB // 2  # the 8 sequences of ~540 tokens as one micro-batch need ~3 GiB (float32 logits + grads)
    whole = _run(tiny_llama_path, tmp_path, None, cap)
    assert not whole["ok"] and whole["steps"] == 0, whole
    assert "can't allocate memory" in whole["error"] or "MemoryError" in whole["error"]
    auto = _run(tiny_llama_path, tmp_path, "auto", cap)
    assert auto["ok"], auto
    assert auto["steps"] == 1 and sum(auto["micro_batches"]) == 8
    assert 1 < len(auto["micro_batches"]) < 8  # the budget split the rollout, into more than one sequence each
    assert 540 <= auto["token_budget"] < 8 * 540, auto
