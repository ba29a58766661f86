"""The backend seam (``lightning_grpo.strategies.backend``): which backend each Lightning strategy gets, the
single-process backend's reductions and gradient handling, the engine wrappers' explicit forwarding, and the
import rule that keeps backends below the LightningModule."""

import subprocess
import sys

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

from lightning_grpo.protocols.engine import EngineCapabilities, EngineWrapper
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.strategies import (
    FSDP1Backend,
    FSDP2Backend,
    FSDP2Strategy,
    GatheredGenerationEngine,
    GRPOModels,
    LocalBackend,
    ParallelBackend,
    backend_for,
)
from lightning_grpo.strategies.backend import clips_by_norm
from lightning_grpo.strategies.backend_registry import compute_dtype, precision_dtype
from lightning_grpo.strategies.megatron.strategy import MegatronStrategy
from lightning_grpo.strategies.module_weights import ModuleWeights


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: SingleDeviceStrategy("cpu"), LocalBackend),
        (DDPStrategy, LocalBackend),
        (FSDP2Strategy, FSDP2Backend),
        (lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), FSDP2Backend),
        (FSDPStrategy, FSDP1Backend),
    ],
    ids=["single_device", "ddp", "grpo_fsdp2", "model_parallel", "fsdp1"],
)
def test_backend_for_wraps_each_lightning_strategy(make, expected):
    strategy = make()
    backend = backend_for(strategy)
    assert type(backend) is expected
    assert backend.strategy is strategy
    assert isinstance(backend, ParallelBackend)


@pytest.mark.parametrize(("precision", "expected"), [
    ("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16), ("16-mixed", torch.float16),
    ("16-true", torch.float16), ("64-true", torch.float64), ("32-true", torch.float32), ("32", torch.float32),
    ("transformer-engine", torch.float32)])
def test_the_compute_dtype_of_each_lightning_precision(precision, expected):
    """What ``engine.dtype="auto"`` and a reward model's ``dtype="auto"`` resolve to (issue 44): "32-true" computes in
    the parameters' dtype (float32 here; a policy loaded in bfloat16 computes in bfloat16)."""
    assert precision_dtype(precision, torch.float32) == expected
    assert precision_dtype("32-true", torch.bfloat16) == torch.bfloat16


def test_the_compute_dtype_of_each_strategy():
    """FSDP2's own ``mixed_precision`` and Megatron's ``params_dtype`` set it; otherwise the precision plugin does."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    assert compute_dtype(DDPStrategy(), torch.float32) == torch.float32
    assert compute_dtype(DDPStrategy(precision_plugin=MixedPrecision("bf16-mixed", "cpu")), torch.float32) == \
        torch.bfloat16
    assert compute_dtype(FSDP2Strategy(mixed_precision="bf16"), torch.float32) == torch.bfloat16
    assert compute_dtype(FSDP2Strategy(), torch.float32) == torch.float32
    assert compute_dtype(MegatronStrategy(params_dtype=torch.bfloat16), torch.float32) == torch.bfloat16
    assert compute_dtype(MegatronStrategy(), torch.float32) == torch.float32


def test_backend_for_returns_a_strategy_that_is_its_own_backend():
    strategy = MegatronStrategy(tensor_model_parallel_size=2)
    assert isinstance(strategy, ParallelBackend)
    assert backend_for(strategy) is strategy
    # a strategy that is not a backend is never returned as one
    assert not isinstance(DDPStrategy(), ParallelBackend)


def test_local_backend_without_a_strategy_is_one_process():
    backend = LocalBackend()
    values = torch.tensor([1.5, -2.0, 3.0])
    assert backend.data_parallel_size == 1
    assert backend.reduce_sum(values) is values
    assert backend.reduce_max(values) is values
    collectives = backend.collectives(values.device)
    assert collectives.reduce_sum(values) is values and collectives.device == values.device
    assert collectives.any_process(True) is True and collectives.any_process(False) is False
    assert backend.export_state_dict(torch.nn.Linear(2, 2)) is None
    models = GRPOModels(torch.nn.Linear(2, 2), None, None)
    configured = backend.configure(models)
    assert configured.policy is models.policy and configured.ref is None and configured.engine is None
    assert (configured.sharded, configured.scorer) == (False, None) and backend.restore(models) is models
    # the engines read the policy's own weights, by HF name, one tensor at a time
    weights = configured.weights
    assert isinstance(weights, ModuleWeights) and not weights.collective and not weights.separate_head
    assert {name: t.tolist() for name, t in weights.tensors()} == {
        name: p.tolist() for name, p in models.policy.named_parameters()}
    # a one-process strategy reduces nothing either (no process group exists here)
    single = LocalBackend(SingleDeviceStrategy("cpu"))
    assert single.data_parallel_size == 1 and single.reduce_sum(values) is values


def test_local_backend_grad_norm_and_clipping_defer_to_lightning():
    """Gradients [3, 0] and [4]: norm 5. Clipping is Lightning's own (the fallback gets the arguments as given)."""
    policy = torch.nn.Linear(2, 1, bias=True)
    backend = LocalBackend()
    assert backend.grad_norm(policy) is None  # before any backward
    policy.weight.grad, policy.bias.grad = torch.tensor([[3.0, 0.0]]), torch.tensor([4.0])
    assert backend.grad_norm(policy).item() == pytest.approx(5.0)
    calls = []
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    result = backend.clip_gradients(policy, optimizer, 1.0, "norm", lambda *args: calls.append(args))
    assert result is None and calls == [(optimizer, 1.0, "norm")]
    torch.testing.assert_close(policy.weight.grad, torch.tensor([[3.0, 0.0]]))  # untouched by the backend


def test_megatron_clip_by_value_and_no_clip_use_lightning():
    """Only clipping by norm is the backend's own: by value, or without a clip value, Lightning clips."""
    policy = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    for backend in (MegatronStrategy(), FSDP2Backend(FSDP2Strategy())):
        calls: list[tuple] = []

        def record(*args, calls=calls):
            calls.append(args)

        assert backend.clip_gradients(policy, optimizer, 0.5, "value", record) is None
        assert backend.clip_gradients(policy, optimizer, None, None, record) is None
        assert calls == [(optimizer, 0.5, "value"), (optimizer, None, None)]


def test_clips_by_norm():
    assert clips_by_norm(0.5, None) and clips_by_norm(0.5, "norm") and clips_by_norm(1, GradClipAlgorithmType.NORM)
    assert not clips_by_norm(0.5, "value") and not clips_by_norm(0.5, GradClipAlgorithmType.VALUE)
    assert not clips_by_norm(None, "norm") and not clips_by_norm(0.0, None)


def test_megatron_restore_leaves_unconverted_models():
    models = GRPOModels(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), None)
    assert MegatronStrategy().restore(models) is models


class _Engine:
    """An engine with every RolloutEngine member, recording calls."""

    pad_token_id = 7
    capabilities = EngineCapabilities(seeds_per_request=True)

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, num_generations, sampling):
        self.calls.append(("generate", num_generations))
        n = len(prompt_ids) * num_generations
        ids = torch.zeros(n, 1, dtype=torch.long)
        return RolloutOutput(ids, ids, ids, ids, torch.zeros(n, dtype=torch.bool), [""] * n)

    def sync_weights(self, weights):
        self.calls.append(("sync_weights", weights))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def close(self):
        self.calls.append(("close",))

    def set_lockstep(self, enabled):
        self.calls.append(("set_lockstep", enabled))


def test_engine_wrappers_forward_each_member_explicitly():
    engine = _Engine()
    model = torch.nn.Linear(2, 2)  # not sharded: gathering is a no-op
    wrapper = GatheredGenerationEngine(engine, model)
    assert isinstance(wrapper, EngineWrapper)
    out = wrapper.generate([[1, 2], [3]], 2, None)
    wrapper.sync_weights(model)
    wrapper.wake_up()
    wrapper.sleep(2)
    wrapper.close()
    wrapper.set_lockstep(True)
    assert out.completion_ids.shape == (4, 1) and wrapper.pad_token_id == 7
    assert wrapper.capabilities == EngineCapabilities(seeds_per_request=True)  # the wrapped engine's record
    assert engine.calls == [("generate", 2), ("sync_weights", model), ("wake_up",), ("sleep", 2), ("close",),
                            ("set_lockstep", True)]
    assert not hasattr(wrapper, "calls")  # no blanket attribute forwarding


def test_backends_never_import_the_module_or_the_loop():
    from test_architecture import GRAPH

    backends = {m: imports for m, imports in GRAPH.items() if m.startswith("lightning_grpo.strategies")}
    assert {"lightning_grpo.strategies.backend", "lightning_grpo.strategies.local", "lightning_grpo.strategies.fsdp",
            "lightning_grpo.strategies.fsdp1", "lightning_grpo.strategies.megatron.strategy"} <= set(backends)
    for module, imports in backends.items():
        bad = [m for m in imports if m == "lightning_grpo.module" or m.startswith("lightning_grpo.loop")]
        assert not bad, (module, bad)


@pytest.mark.distributed  # a fresh interpreter
def test_importing_the_strategies_does_not_import_megatron_core():
    """MegatronStrategy is imported on first use: megatron-core is optional and slow to import."""
    code = ("import sys, lightning_grpo.strategies as s; assert 'megatron' not in sys.modules; "
            "assert 'lightning_grpo.strategies.megatron.strategy' not in sys.modules; s.MegatronStrategy; "
            "assert 'lightning_grpo.strategies.megatron.strategy' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
