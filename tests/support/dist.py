"""Run ``tests/support/dist_worker.py`` scenarios in a fresh Python process and load what each rank wrote.

The worker is started with ``sys.executable`` (the test's own interpreter); Lightning's launcher inside it
starts the other ranks. Running it outside pytest's process avoids fork/spawn trouble with pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
REPO = WORKER.parents[2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(config: dict, out: Path, timeout: float = 300, worker: Path = WORKER) -> None:
    """Run the ``worker`` script (default ``tests/support/dist_worker.py``) with ``config`` (``out`` is added);
    raise with its output when it fails."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps({**config, "out": str(out)}))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(worker), str(path)], cwd=str(REPO), env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def load(out: Path, name: str, world_size: int) -> list[dict]:
    """What each rank saved for ``name``, in rank order."""
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(world_size)]


_REFERENCES: dict[str, dict] = {}


def reference_step(case: dict, model: str, tmp: Path) -> dict:
    """The 1-process result of a ``fixed_step`` case (same case, Lightning's single-device strategy), computed
    in this process once per (case, model) and cached."""
    key = json.dumps({**case, "model": model}, sort_keys=True)
    if key not in _REFERENCES:
        from support import dist_worker as _dist_worker

        single = {**case, "strategy": {"name": "auto"}}
        out = tmp / f"reference_{len(_REFERENCES)}"
        out.mkdir(parents=True, exist_ok=True)
        _dist_worker.fixed_step({"model": model, "devices": 1, "cases": [single], "out": str(out)})
        _REFERENCES[key] = torch.load(out / f"{case['name']}_rank0.pt", weights_only=False)
    return _REFERENCES[key]


ADAM_LR, ADAM_EPS = 1e-3, 1e-8  # the workers' AdamW (GRPOModule(learning_rate=1e-3), torch's default eps)


def assert_same_step(reference: dict, ranks: list[dict], atol: float = 1e-5) -> None:
    """The distributed run's loss, grad_norm, post-clip gradients, updated weights and reference logprobs equal the
    1-process run's, on every rank."""
    for result in ranks:
        for key in ("loss", "grad_norm", "num_tokens"):
            expected = reference["metrics"][key]
            assert abs(result["metrics"][key] - expected) <= atol * max(1.0, abs(expected)), key
        assert set(result["grads"]) == set(reference["grads"])
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, atol=atol, rtol=0, msg=f"gradient of {name}")
        assert set(result["weights"]) == set(reference["weights"])
        for name, weight in reference["weights"].items():
            # AdamW's first step moves a weight by lr * g / (|g| + eps), whose derivative lr * eps / (|g| + eps)^2 is
            # up to lr / eps = 1e5 where |g| is near eps: there the float32 summation-order difference of the two
            # gradients (held to the gradient check above) may move the weights apart by that much, and no more.
            grad, other = reference["grads"].get(name), result["grads"].get(name)
            slack = 0.0
            if grad is not None and other is not None:
                smaller = torch.minimum(grad.abs(), other.abs())
                slack = ADAM_LR * ADAM_EPS * (other - grad).abs() / (smaller + ADAM_EPS) ** 2
            excess = (result["weights"][name] - weight).abs() - (atol + 2 * slack)
            assert excess.max() <= 0, f"weight {name}: off by {excess.max().item():.3g} more than allowed"
    for key in ("ref_logprobs", "teacher_logprobs"):  # the reference's and the distillation teacher's
        rows = {}
        for result in ranks:
            rows.update(result.get(key, {}))
        assert sorted(rows) == sorted(reference.get(key, {}))  # every row on exactly one rank
        for row, logprobs in reference.get(key, {}).items():
            torch.testing.assert_close(rows[row], logprobs, atol=atol, rtol=0)


#: The CLI's ``--optimizer`` of the cases that take it: SGD(lr=0.1), whose step is exactly -0.1 * the gradient.
CLI_SGD = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}
#: ... and ``--lr_scheduler`` ConstantLR(factor=0.5): the first step is -0.05 * the gradient.
CLI_HALVED_LR = {"class_path": "torch.optim.lr_scheduler.ConstantLR", "init_args": {"factor": 0.5}}


def assert_first_step_update(result: dict, model: str, step_lr: float) -> None:
    """A ``fixed_step`` rank's full weights after the step are exactly (to float32 rounding) the model's initial
    weights minus ``step_lr`` times the full post-clip gradients: the optimizer stepped the trained parameters."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    grads = result["grads"]
    assert grads and all(grad is not None for grad in grads.values())  # every trained parameter has a gradient
    assert max(float(grad.abs().max()) for grad in grads.values()) > 1e-3
    for name, grad in grads.items():
        torch.testing.assert_close(result["weights"][name], initial[name] - step_lr * grad, atol=1e-6, rtol=0,
                                   msg=f"weight {name}")
