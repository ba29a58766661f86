"""What an exact resume needs beyond Lightning's own state, as plain data: every process's RNG states, an
:class:`Experience` (a partly used rollout), and the checks that a checkpoint's processes and data-parallel replicas
are this run's.

The fit loop (:mod:`lightning_grpo.loop.fit_loop`) stores them with the fetcher's position
(:class:`~lightning_grpo.loop.cursor.RolloutCursor`) in its checkpoint state. Everything here is plain data (ints,
floats, strings, tensors, lists, dicts), so a checkpoint still loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from lightning_grpo.protocols.vision import images_to, row_images_from_state, row_images_state
from lightning_grpo.training.experience import Experience

#: Every process's data-parallel replica ``[sampler rank, replicas]`` (the strategy's ``distributed_sampler_kwargs``;
#: None on one process), a key of the fit loop's checkpoint state: a partly used rollout belongs to its replica.
REPLICAS_KEY = "data_parallel_replicas"


def rng_states() -> dict[str, Any]:
    """This process's global RNG states: torch CPU, every CUDA device, numpy and Python's ``random``."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "torch.cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(state), gauss],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore the states :func:`rng_states` returned (CUDA ones only where CUDA is available)."""
    torch.set_rng_state(states["torch"])
    if states.get("torch.cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))


def this_process(values: Optional[list[Any]], what: str) -> Any:
    """This process's entry of a :func:`gather_per_process` list saved in a checkpoint.

    Raises:
        ValueError: the checkpoint was written by a different number of processes (naming ``what``).
    """
    if values is None:
        return None
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if len(values) != world:
        raise ValueError(
            f"the checkpoint's {what} come from {len(values)} processes but this run has {world}: an exact resume "
            "needs the same number of processes"
        )
    return values[rank]


def check_replicas(saved: Optional[list[Any]], current: list[Any], pending: bool) -> None:
    """Refuse to resume rollouts that were partly used or generated ahead (``pending``) when the processes'
    data-parallel replicas (:data:`REPLICAS_KEY`, every process's) differ from the checkpoint's: each process would
    get another replica's rollout (e.g. a Megatron checkpoint resumed with other TP/PP/DP sizes). Weights and
    optimizer states are not concerned; checkpoints at rollout boundaries resume with any replicas.

    Raises:
        ValueError: naming both assignments (same on every process).
    """
    if saved is None or not pending or list(saved) == list(current):
        return
    raise ValueError(
        f"this checkpoint was written in the middle of a rollout by processes in data-parallel replicas "
        f"[sampler rank, replicas] {list(saved)}; this run's are {list(current)}, so processes would get another "
        "replica's partly used rollout. Resume with the same data-parallel layout (for MegatronStrategy: the same DP "
        "size and TP x PP), or from a checkpoint taken at a rollout boundary (every_n_train_steps a multiple of the "
        "optimizer steps per rollout)")


def experience_state(experience: Experience) -> dict[str, Any]:
    """An :class:`Experience` as plain data on the CPU."""
    state = {}
    for field in dataclasses.fields(experience):
        if field.name == "step_plan":  # planned again when its step's first micro-batch is handed out
            continue
        value = getattr(experience, field.name)
        state[field.name] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    state["images"] = row_images_state(experience.images)  # the images once per prompt, as plain data
    return state


def experience_from_state(state: dict[str, Any], device: torch.device) -> Experience:
    """The :class:`Experience` :func:`experience_state` saved, its tensors (images too) on ``device``."""
    values = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    values["images"] = images_to(row_images_from_state(state.get("images")), device)
    return Experience(**values)
