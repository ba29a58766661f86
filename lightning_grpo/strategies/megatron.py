"""``MegatronStrategy``: GRPO on megatron-core with tensor (TP) and data (DP) parallelism, as a Lightning strategy.

``L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2), devices=4)`` trains a
:class:`lightning_grpo.GRPOModule` whose HF Llama/Qwen2 policy is converted into a megatron-core ``GPTModel``
split over TP ranks; the ``world_size / TP`` groups of TP ranks are data-parallel replicas. What it does:

- process groups: Lightning's DDP setup (NCCL on GPU, gloo on CPU), then
  ``parallel_state.initialize_model_parallel(TP, PP=1)`` (rank order tp-dp: ranks ``[k TP, (k+1) TP)`` form a
  TP group). On CPU the :mod:`lightning_grpo.megatron.cpu_shims` are applied for the run.
- the policy (and the reference policy when ``beta > 0``) becomes a
  :class:`~lightning_grpo.megatron.policy.MegatronPolicy`; ``GRPOModule.completion_logprobs`` dispatches to its
  vocab-parallel logprobs. The HF model is kept as the rollout copy: before each rollout after a weight
  update, the shards are gathered into it in HF format (as a vLLM weight sync would), TP rank 0 of each DP
  group generates and broadcasts the completions to its TP group
  (:class:`~lightning_grpo.megatron.rollout.TensorParallelRolloutEngine`).
- data: each DP group gets its own prompts (the ``DistributedSampler`` is keyed by DP rank; TP ranks of a group
  see the same ones). ``reduce`` (hence ``GRPOModule``'s metric and loss-normalizer sums) runs over the DP group.
- gradients: after the last backward of an optimizer step they are averaged over the DP group (one flat
  all-reduce); gradient clipping by norm uses the norm of the full, unsharded gradient.
- checkpoints: the policy weights and the optimizer state are gathered into HF names (``policy.model.
  embed_tokens.weight``, ...), so a checkpoint does not depend on the TP size and its ``state_dict`` loads into a
  plain ``GRPOModule``; on resume each rank takes its shard.
- teardown: the trained weights are put back into the HF policy (``module.policy`` is the HF model again, so
  ``GRPOModule.on_fit_end`` exports it as usual); megatron-core's model-parallel state and the process groups
  it created are destroyed (the default group stays, as with ``DDPStrategy``).

Limits (raise or are documented): pipeline parallelism (PP > 1) is rejected; the optimizer is the module's own
(torch AdamW) over this rank's shards, not megatron-core's distributed optimizer; the gathered checkpoint and
HF rollout copy hold a full model per process (fine for models that fit one device, which is the HF-rollout
regime); the vLLM engine is not set up per TP group yet.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    import lightning as L

log = logging.getLogger(__name__)

_POLICY_PREFIX = "policy."


class MegatronStrategy(DDPStrategy):
    """Lightning strategy that trains ``GRPOModule.policy`` as a megatron-core model with tensor and data
    parallelism (see the module docstring).

    Args:
        tensor_model_parallel_size: TP size; must divide the number of processes, the vocabulary, the key/value
            heads and the MLP size of the model.
        pipeline_model_parallel_size: must be 1 (pipeline parallelism is not supported yet).
        params_dtype: dtype of the megatron-core weights; default: the HF policy's dtype.
        use_transformer_engine: build the layers from Transformer Engine (CUDA and ``transformer_engine`` needed).
        seed: seed of megatron-core's CUDA model-parallel RNG tracker (GPU only; no randomness is drawn with
            dropout 0).
        process_group_backend: "nccl" / "gloo"; default: nccl on GPU, gloo on CPU.
        timeout: process-group timeout.
        kwargs: other ``DDPStrategy`` arguments (``start_method``, ...).

    Raises:
        ValueError: ``pipeline_model_parallel_size != 1`` or ``tensor_model_parallel_size < 1`` (at construction);
            a world size that TP does not divide, or a policy that cannot be converted (at setup).
    """

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        use_transformer_engine: bool = False,
        seed: int = 1234,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        if pipeline_model_parallel_size != 1:
            raise ValueError(
                f"MegatronStrategy(pipeline_model_parallel_size={pipeline_model_parallel_size}): pipeline parallelism "
                "is not supported yet, use pipeline_model_parallel_size=1"
            )
        if tensor_model_parallel_size < 1:
            raise ValueError(f"MegatronStrategy(tensor_model_parallel_size={tensor_model_parallel_size}) must be >= 1")
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.params_dtype = params_dtype
        self.use_transformer_engine = use_transformer_engine
        self.seed = seed
        self._shims_applied = False
        self._model_parallel_groups: list[Any] = []
        self._hf_ref: Optional[nn.Module] = None

    # ------------------------------------------------------------------ environment
    @property
    def data_parallel_size(self) -> int:
        """Processes with different data: ``world_size / tensor_model_parallel_size``."""
        return self.world_size // self.tensor_model_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel group index (TP ranks of one group share it)."""
        return self.global_rank // self.tensor_model_parallel_size

    @property
    def tensor_model_parallel_rank(self) -> int:
        return self.global_rank % self.tensor_model_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def setup_environment(self) -> None:
        if self.world_size % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"MegatronStrategy(tensor_model_parallel_size={self.tensor_model_parallel_size}) must divide the "
                f"number of processes (world size {self.world_size})"
            )
        if self.root_device.type == "cpu" and not self._shims_applied:
            from lightning_grpo.megatron import cpu_shims

            cpu_shims.apply()
            self._shims_applied = True
        super().setup_environment()  # accelerator device setup + process group (DDPStrategy.setup_distributed)
        from megatron.core import parallel_state, tensor_parallel

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        existing = set(_process_groups())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=1,
            create_gloo_process_groups=self.root_device.type == "cpu",
        )
        self._model_parallel_groups = [g for g in _process_groups() if g not in existing]
        if self.root_device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        rank_zero_info(
            f"MegatronStrategy: {self.world_size} processes = TP {self.tensor_model_parallel_size} x "
            f"DP {self.data_parallel_size} ({self.process_group_backend})"
        )

    # ------------------------------------------------------------------------ setup
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: the data-parallel gradient average is done in
        :meth:`reduce_gradients` over the DP group only (TP ranks hold different shards)."""

    def setup(self, trainer: "L.Trainer") -> None:
        self._convert_module()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        super().setup(trainer)

    def _convert_module(self) -> None:
        """Replace the module's HF policy (and reference policy) with megatron-core ones; wrap its rollout engine."""
        from lightning_grpo.megatron.policy import MegatronPolicy
        from lightning_grpo.megatron.rollout import TensorParallelRolloutEngine

        module = self.lightning_module
        assert module is not None
        policy = getattr(module, "policy", None)
        if policy is None:
            raise ValueError(f"MegatronStrategy trains a GRPOModule's `policy`; {type(module).__name__} has none")
        if isinstance(policy, MegatronPolicy):
            return
        dtype = self.params_dtype
        policy_mp = MegatronPolicy.from_hf(policy, self.tensor_model_parallel_size, dtype, self.use_transformer_engine)
        policy_mp.model.train(policy.training)
        module.policy = policy_mp
        refs = getattr(module, "_ref", None)
        if refs:
            self._hf_ref = refs[0]
            ref = MegatronPolicy.from_hf(refs[0], self.tensor_model_parallel_size, dtype, self.use_transformer_engine)
            refs[0] = ref.eval().requires_grad_(False)
        engine = getattr(module, "rollout_engine", None)
        if engine is not None and not isinstance(engine, TensorParallelRolloutEngine):
            module.rollout_engine = TensorParallelRolloutEngine(engine, policy_mp)
        assert policy_mp.hf_model is not None
        policy_mp.hf_model.to(self.root_device)
        log.info("MegatronStrategy: converted the policy to megatron-core (TP=%d)", self.tensor_model_parallel_size)

    def _megatron_policy(self) -> Optional[Any]:
        from lightning_grpo.megatron.policy import MegatronPolicy

        policy = getattr(self.lightning_module, "policy", None)
        return policy if isinstance(policy, MegatronPolicy) else None

    # --------------------------------------------------------------- communication
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Tensor:
        """Reduce over the data-parallel group by default (TP ranks hold copies of the same values)."""
        if group is None and torch.distributed.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_data_parallel_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        total = super().reduce(flag, reduce_op="sum")  # over every process
        return bool(total == self.world_size) if all else bool(total)

    # -------------------------------------------------------------------- gradients
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            self.reduce_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients of all trainable parameters over the data-parallel group (one flat all-reduce).
        Called after the last backward of each optimizer step, before clipping and ``on_before_optimizer_step``."""
        from megatron.core import parallel_state

        if self.data_parallel_size == 1:
            return
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        flat /= self.data_parallel_size
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).clone()
            offset += n

    @torch.no_grad()
    def full_grad_norm(self, params: Sequence[Tensor]) -> Tensor:
        """The 2-norm (0-dim float32) of the full, unsharded gradient of ``params``: squares of tensor-parallel
        shards (``param.tensor_model_parallel``) are summed over the TP group, replicated parameters (the norms)
        counted once. A collective over the TP group."""
        from megatron.core import parallel_state

        grads = [p for p in params if p.grad is not None]
        device = grads[0].grad.device if grads else self.root_device
        squares = torch.zeros(2, device=device)  # [sharded, replicated]
        for p in grads:
            squares[0 if getattr(p, "tensor_model_parallel", False) else 1] += p.grad.float().square().sum()
        sharded = squares[:1].clone()
        if self.tensor_model_parallel_size > 1:
            torch.distributed.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        return (sharded[0] + squares[1]).sqrt()

    def policy_grad_norm(self, module: Any) -> Optional[Tensor]:
        """The norm of the policy's full gradient (for the ``grad_norm`` metric), or None before any gradient."""
        params = list(module.policy.parameters())
        if all(p.grad is None for p in params):
            return None
        return self.full_grad_norm(params)

    @torch.no_grad()
    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """``clip_grad_norm_`` with the norm of the full gradient (:meth:`full_grad_norm`); installed as the
        precision plugin's ``clip_grad_by_norm``, which ``LightningModule.clip_gradients`` calls."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return
        total_norm = self.full_grad_norm(params)
        coefficient = (float(clip_val) / (total_norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coefficient.to(p.grad.dtype))

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with the policy gathered into HF names (``policy.<hf name>``). A collective: every
        rank calls it (Lightning does, in ``dump_checkpoint``)."""
        module = self.lightning_module
        assert module is not None
        policy = self._megatron_policy()
        if policy is None:
            return module.state_dict()
        state = {k: v for k, v in module.state_dict().items() if not k.startswith(_POLICY_PREFIX)}
        for name, tensor in policy.iter_hf_weights():
            state[_POLICY_PREFIX + name] = tensor.cpu().clone()
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a state dict with the policy in HF names (a Megatron or a plain GRPOModule checkpoint)."""
        from lightning_grpo.megatron.convert import load_hf_state_dict

        module = self.lightning_module
        assert module is not None
        policy = self._megatron_policy()
        if policy is None:  # restored before setup: the policy is still the HF model
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        hf_state = {k[len(_POLICY_PREFIX):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(_POLICY_PREFIX)}
        load_hf_state_dict(policy.model, hf_state, policy.arch)
        rest = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(_POLICY_PREFIX)}
        own = {k: v for k, v in module.state_dict().items() if k.startswith(_POLICY_PREFIX)}
        module.load_state_dict({**own, **rest}, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state with the policy's per-parameter tensors gathered into HF names:
        ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}], "format": "megatron-hf"}``.
        A collective over the TP group."""
        from lightning_grpo.megatron.convert import gather_hf_tensors

        optimizer = getattr(optimizer, "_optimizer", optimizer)
        raw = optimizer.state_dict()
        names = self._optimizer_param_names(optimizer)
        maps = self._param_maps()
        group = self._tp_group()
        state: dict[str, dict[str, Any]] = {}
        for index, values in sorted(raw["state"].items()):
            name = names[index]
            pm = maps.get(name)
            param = self._param_by_index(optimizer, index)
            hf_names = pm.hf if pm is not None else (name,)
            per_name: dict[str, dict[str, Any]] = {h: {} for h in hf_names}
            for key, value in values.items():
                if pm is not None and torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                    for h, full in zip(hf_names, gather_hf_tensors(pm, value, self._arch(), group)):
                        per_name[h][key] = full.cpu().clone()
                else:
                    for h in hf_names:
                        per_name[h][key] = value
            state.update(per_name)
        groups = []
        for g in raw["param_groups"]:
            params = []
            for index in g["params"]:
                pm = maps.get(names[index])
                params.extend(pm.hf if pm is not None else (names[index],))
            groups.append({**g, "params": params})
        return {"state": state, "param_groups": groups, "format": "megatron-hf"}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load optimizer states saved by :meth:`optimizer_state`, taking this rank's shards.

        Raises:
            ValueError: an optimizer state in another format (e.g. from a plain, non-Megatron run).
        """
        from lightning_grpo.megatron.convert import shard

        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        maps = self._param_maps()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            if saved.get("format") != "megatron-hf":
                raise ValueError("the checkpoint's optimizer state was not saved by MegatronStrategy (no 'format': "
                                 "'megatron-hf'); resume it with the strategy that saved it or load weights only")
            names = self._optimizer_param_names(optimizer)
            current = optimizer.state_dict()
            state: dict[int, dict[str, Any]] = {}
            for index in range(len(names)):
                pm = maps.get(names[index])
                hf_names = pm.hf if pm is not None else (names[index],)
                if hf_names[0] not in saved["state"]:
                    continue
                first = saved["state"][hf_names[0]]
                param = self._param_by_index(optimizer, index)
                entry: dict[str, Any] = {}
                for key, value in first.items():
                    if pm is not None and torch.is_tensor(value) and value.dim() > 0:
                        parts = [saved["state"][h][key] for h in hf_names]
                        entry[key] = shard(pm, parts, self._arch(), tp_rank, tp_size).to(param.device).clone()
                    else:
                        entry[key] = value
                state[index] = entry
            groups = [{**saved_group, "params": group["params"]}
                      for saved_group, group in zip(saved["param_groups"], current["param_groups"])]
            optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _param_maps(self) -> dict[str, Any]:
        """ParamMaps by the module's parameter name (``policy.model.<mcore name>``)."""
        from lightning_grpo.megatron.convert import param_maps

        policy = self._megatron_policy()
        if policy is None:
            return {}
        te = any(n.endswith("layer_norm_weight") for n, _ in policy.model.named_parameters())
        return {_POLICY_PREFIX + "model." + pm.mcore: pm for pm in param_maps(policy.arch, te)}

    def _optimizer_param_names(self, optimizer: Optimizer) -> list[str]:
        """The module's parameter name of each optimizer index (torch numbers them across param groups)."""
        by_id = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return [by_id.get(id(p), f"<unnamed {i}>")
                for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])]

    @staticmethod
    def _param_by_index(optimizer: Optimizer, index: int) -> Tensor:
        return [p for g in optimizer.param_groups for p in g["params"]][index]

    def _arch(self) -> Any:
        policy = self._megatron_policy()
        assert policy is not None
        return policy.arch

    @staticmethod
    def _tp_group() -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    # -------------------------------------------------------------------- lifecycle
    def on_train_end(self) -> None:
        """Gather the trained weights into the HF policy copy on every rank (a collective), for the export and
        for :meth:`teardown` to hand the module back with an HF policy."""
        policy = self._megatron_policy()
        if policy is not None and policy.hf_model is not None:
            policy.sync_hf_model(load=True)

    def teardown(self) -> None:
        """Put the HF policy back (when it holds the trained weights), destroy megatron-core's model-parallel
        state and the process groups it created, remove the CPU shims. The default process group is Lightning's
        and lives as long as the process (as with ``DDPStrategy``), so a later ``fit`` can reuse it."""
        module = self.lightning_module
        policy = self._megatron_policy()
        if module is not None and policy is not None:
            from lightning_grpo.megatron.rollout import TensorParallelRolloutEngine

            if policy.hf_model_is_current() and policy._hf_loaded:
                module.policy = policy.hf_model
                engine = getattr(module, "rollout_engine", None)
                if isinstance(engine, TensorParallelRolloutEngine):
                    module.rollout_engine = engine.engine
                refs = getattr(module, "_ref", None)
                if refs and self._hf_ref is not None:
                    refs[0] = self._hf_ref
                self.optimizers = []  # they hold the megatron-core parameters
            else:
                log.warning("MegatronStrategy.teardown: the run did not finish; module.policy stays a MegatronPolicy")
        super().teardown()
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            for group in self._model_parallel_groups:
                if group in _process_groups():  # some are aliases of one another
                    torch.distributed.destroy_process_group(group)
        self._model_parallel_groups = []
        if self._shims_applied:
            from lightning_grpo.megatron import cpu_shims

            cpu_shims.remove()
            self._shims_applied = False



def _process_groups() -> list[Any]:
    """Every process group torch knows in this process (the default one and all subgroups)."""
    if not torch.distributed.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)
