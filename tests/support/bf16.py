"""The bfloat16 tolerances of the checks that float32 runs pass with equality (issue 44): one step of 1 vs 2
processes (``tests/strategies/test_ddp.py``, ``tests/strategies/test_fsdp.py``) and 1 vs 4 micro-batches
(``tests/test_accumulation.py``) under ``Trainer(precision="bf16-mixed")``, ``"bf16-true"`` or FSDP2's
``mixed_precision="bf16"``.

Why the two runs differ at all: the same rows go through the model in passes of another shape (FSDP packs a rank's
rows into one pass, a micro-batch cuts a GRPO group's shared-prefix row in two), and a bfloat16 matmul of another
shape rounds some outputs to the neighbouring bfloat16 value (oneDNN blocks the reduction by shape); under
"bf16-true" the gradients are also summed in bfloat16, in another order. Where every row is computed alike and the
gradients sum in float32 (DDP under "bf16-mixed": whole groups per rank, float32 ``.grad``) the runs agree to float32
rounding (measured 2.4e-7), and :func:`assert_bf16_step` still holds them to the looser bound.

The bounds, with ``u = 2**-8`` (bfloat16's unit roundoff: 8 significand bits):

* loss and gradient norm: relative ``4 u``; gradients: ``4 u max|g|`` (an activation rounded one way or the other
  changes the gradients by about its own relative change, ``2 u``; twice that for the two runs). Measured: at most
  2.3 u max|g| (FSDP2 ``mixed_precision="bf16"``), 2.2 u (1 vs 4 micro-batches under "bf16-true");
* weights after one AdamW step of learning rate ``lr``: ``2 lr`` (AdamW's first step moves a weight by
  ``lr * g / (|g| + eps)``, about ``lr sign(g)``: where the two gradients differ in sign the weights end up to
  ``2 lr`` apart), plus one bfloat16 spacing ``2 u max|w|`` where the weights are bfloat16 (measured: 2.0e-3 at
  lr = 1e-3);
* reference logprobs: ``8 u max|z|`` (:func:`lightning_grpo.rollout.engines.probe.sync_check_tolerance`; the tiny
  Llamas' logits are below 1 in magnitude): measured 2.2e-3.
"""

from __future__ import annotations

import torch

#: bfloat16's unit roundoff, ``2**-8`` (8 significand bits, the implicit one included).
U = 2.0**-8


def assert_bf16_step(reference: dict, ranks: list[dict], lr: float, max_abs_logit: float = 1.0) -> None:
    """Each of ``ranks``' results of one ``fixed_step`` case (``support.dist_worker``) is ``reference``'s to the
    bfloat16 bounds of the module docstring (``lr``: the step's learning rate; ``max_abs_logit``: a bound of the
    policy's logits, for the reference logprobs)."""
    grad_scale = max(float(g.float().abs().max()) for g in reference["grads"].values() if g is not None)
    weight_scale = max(float(w.float().abs().max()) for w in reference["weights"].values())
    bf16_weights = any(w.dtype == torch.bfloat16 for w in reference["weights"].values())
    weight_atol = 2 * lr + (2 * U * weight_scale if bf16_weights else 0.0)
    for result in ranks:
        for key in ("loss", "grad_norm"):
            expected = reference["metrics"][key]
            assert abs(result["metrics"][key] - expected) <= 4 * U * max(abs(expected), 1e-6), key
        assert result["metrics"]["num_tokens"] == reference["metrics"]["num_tokens"]
        assert set(result["grads"]) == set(reference["grads"]) and set(result["weights"]) == set(reference["weights"])
        for name, grad in reference["grads"].items():
            if grad is not None:
                torch.testing.assert_close(result["grads"][name].float(), grad.float(), atol=4 * U * grad_scale,
                                           rtol=0, msg=f"gradient of {name}")
        for name, weight in reference["weights"].items():
            torch.testing.assert_close(result["weights"][name].float(), weight.float(), atol=weight_atol, rtol=0,
                                       msg=f"weight {name}")
    rows = {}
    for result in ranks:
        rows.update(result.get("ref_logprobs", {}))
    assert sorted(rows) == sorted(reference.get("ref_logprobs", {}))
    for row, logprobs in reference.get("ref_logprobs", {}).items():
        torch.testing.assert_close(rows[row], logprobs, atol=8 * U * max_abs_logit, rtol=0)
