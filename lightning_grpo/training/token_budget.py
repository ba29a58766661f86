"""``GRPOConfig.max_tokens_per_microbatch="auto"``: the micro-batch token budget chosen from measured memory.

Before the first optimizer step the training step (forward, loss, backward) runs on synthetic micro-batches of one
and of two sequences of ``max_prompt_length + max_new_tokens`` tokens (random ids, distinct prompts: no prompt is
shared, the most a sequence can cost), and the peak memory of each above the state before the probes is measured
(:class:`lightning_grpo.runtime.memory.PeakMeter`). A line through the two points,
``peak(tokens) = fixed + per_token * tokens``, plus the optimizer state the first step will allocate (AdamW: two
tensors per trainable parameter), must stay within ``token_budget_memory_fraction`` of the memory available before
the probes (:func:`lightning_grpo.runtime.memory.available_memory`):

    budget = floor((fraction * available - fixed - optimizer_state) / per_token)

capped at the whole mini-batch. Where even one sequence does not fit, or a probe itself runs out of memory, it is an
error that gives the figures. The probes draw no random numbers from the global generators (``fork_rng``), so a run
with the auto budget trains exactly as one given that budget (accumulation never changes the gradient).

What it does not see: memory used outside the training micro-batch (the rollout engine's generation, which comes
before it; other processes growing later). The fraction leaves room for those.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.runtime.memory import GIB, MemoryLimit, PeakMeter, available_memory
from lightning_grpo.training.experience import Experience

log = logging.getLogger(__name__)

#: Sequences in the two probe micro-batches.
PROBE_SEQUENCES = (1, 2)


@dataclass
class TokenBudget:
    """The chosen budget and the measurements behind it (all memory in bytes)."""

    tokens: int
    sequence_tokens: int
    probe_tokens: list[int]
    probe_peaks: list[int]
    fixed_bytes: float
    bytes_per_token: float
    optimizer_state_bytes: int
    available: MemoryLimit
    fraction: float
    capped: bool = field(default=False)

    def describe(self) -> str:
        probes = ", ".join(f"{t} tokens {p / GIB:.2f} GiB" for t, p in zip(self.probe_tokens, self.probe_peaks,
                                                                          strict=True))
        return (f"max_tokens_per_microbatch={self.tokens}{' (the whole mini-batch)' if self.capped else ''}: "
                f"measured step peaks {probes} -> {self.fixed_bytes / GIB:.2f} GiB + "
                f"{self.bytes_per_token / 2**20:.3f} MiB/token, + optimizer state "
                f"{self.optimizer_state_bytes / GIB:.2f} GiB, within {self.fraction:g} of "
                f"{self.available.describe()}")


def fit_budget(probe_tokens: list[int], probe_peaks: list[int], sequence_tokens: int, max_tokens: int,
               available: MemoryLimit, fraction: float, optimizer_state_bytes: int = 0) -> TokenBudget:
    """The token budget from two probe measurements (see the module docstring).

    Args:
        probe_tokens: tokens of the two probe micro-batches (different).
        probe_peaks: their measured peak bytes above the pre-probe state.
        sequence_tokens: tokens of the longest possible sequence (a micro-batch holds at least one).
        max_tokens: the largest useful budget (the tokens of a whole mini-batch of longest sequences).
        available: the memory available before the probes.
        fraction: in (0, 1], the share of ``available`` a step may use.
        optimizer_state_bytes: memory the first optimizer step will add (0 when the state exists).

    Returns:
        the :class:`TokenBudget`, ``sequence_tokens <= tokens <= max_tokens``.

    Raises:
        MemoryError: one sequence of ``sequence_tokens`` does not fit (the message gives the figures).
    """
    (t1, t2), (m1, m2) = probe_tokens, probe_peaks
    per_token = max(m2 - m1, 0) / (t2 - t1)
    fixed = max(m1 - per_token * t1, 0.0)
    room = fraction * available.bytes - fixed - optimizer_state_bytes
    tokens = math.floor(room / per_token) if per_token > 0 else max_tokens
    budget = TokenBudget(min(tokens, max_tokens), sequence_tokens, list(probe_tokens), list(probe_peaks), fixed,
                         per_token, optimizer_state_bytes, available, fraction, capped=tokens >= max_tokens)
    if tokens < sequence_tokens:
        need = fixed + optimizer_state_bytes + per_token * sequence_tokens
        allowed = fraction * available.bytes
        raise MemoryError(
            f"GRPOConfig.max_tokens_per_microbatch='auto': one sequence of {sequence_tokens} tokens (max_prompt_length "
            f"+ max_new_tokens) needs about {need / GIB:.2f} GiB for the training step, but "
            f"token_budget_memory_fraction={fraction:g} of {available.describe()} is {allowed / GIB:.2f} GiB "
            f"(measured: {budget.describe()}). Shorten the sequences, enable GRPOModule(gradient_checkpointing="
            "True), use a smaller model or more memory."
        )
    return budget


def probe_experience(num_sequences: int, prompt_tokens: int, completion_tokens: int, vocab_size: int,
                     device: torch.device, seed: int = 0) -> Experience:
    """A synthetic micro-batch: ``num_sequences`` sequences of random ids, distinct prompts of ``prompt_tokens`` and
    completions of ``completion_tokens`` (all loss tokens), advantages alternating +1 / -1, on-policy."""
    g = torch.Generator().manual_seed(seed)
    shape_p, shape_c = (num_sequences, prompt_tokens), (num_sequences, completion_tokens)
    return Experience(
        prompt_ids=torch.randint(0, vocab_size, shape_p, generator=g).to(device),
        prompt_mask=torch.ones(shape_p, dtype=torch.long, device=device),
        completion_ids=torch.randint(0, vocab_size, shape_c, generator=g).to(device),
        completion_mask=torch.ones(shape_c, dtype=torch.long, device=device),
        advantages=torch.tensor([(-1.0) ** i for i in range(num_sequences)], device=device),
        loss_normalizer=float(num_sequences * completion_tokens),
    )


def choose_token_budget(train_step: Callable[[Experience], None], config: GRPOConfig, vocab_size: int,
                        device: torch.device, mini_batch_sequences: int,
                        optimizer_state_bytes: int = 0) -> TokenBudget:
    """Probe ``train_step`` (forward, loss and backward of one micro-batch, gradients freed after) at
    :data:`PROBE_SEQUENCES` sequences of the longest length and fit the budget (:func:`fit_budget`).

    Args:
        train_step: runs the training step on a micro-batch; a collective under data parallelism (every process
            probes the same sizes).
        config: ``max_prompt_length``, ``max_new_tokens``, ``token_budget_memory_fraction``.
        vocab_size: the policy's vocabulary (the probe's ids are drawn from it).
        device: where the policy trains.
        mini_batch_sequences: sequences of one optimizer step on this process (caps the budget).
        optimizer_state_bytes: memory the first optimizer step will allocate.

    Raises:
        MemoryError: one sequence does not fit, or a probe ran out of memory.
    """
    sequence_tokens = config.max_prompt_length + config.max_new_tokens
    meter = PeakMeter(device)
    available = available_memory(device)
    tokens, peaks = [], []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for count in PROBE_SEQUENCES:
            batch = probe_experience(count, config.max_prompt_length, config.max_new_tokens, vocab_size, device,
                                     seed=count)
            meter.reset()
            try:
                train_step(batch)
            except (MemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                raise MemoryError(
                    f"GRPOConfig.max_tokens_per_microbatch='auto': the probe training step of {count} sequence(s) of "
                    f"{sequence_tokens} tokens ran out of memory ({type(error).__name__}: {error}); "
                    f"{available.describe()} was available. Shorten the sequences (max_prompt_length + "
                    "max_new_tokens), enable GRPOModule(gradient_checkpointing=True), use a smaller model or more "
                    "memory."
                ) from error
            finally:
                del batch
            tokens.append(count * sequence_tokens)
            peaks.append(meter.peak())
    budget = fit_budget(tokens, peaks, sequence_tokens, max(mini_batch_sequences, 1) * sequence_tokens, available,
                        config.token_budget_memory_fraction, optimizer_state_bytes)
    log.info("GRPOConfig.%s", budget.describe())
    return budget


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure: ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA) or the
    ``RuntimeError`` of torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def adamw_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes AdamW's first step allocates (``exp_avg`` and ``exp_avg_sq`` per trainable parameter, this process's
    shard of a ``DTensor``); 0 when the optimizer already has state (a resumed run)."""
    if optimizer.state:
        return 0
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p.to_local() if callable(getattr(p, "to_local", None)) else p
            total += 2 * local.numel() * local.element_size()
    return total


def fit_token_budget(loss: Callable[[Experience], Tensor], policy: nn.Module,
                     forward_context: Callable[[], ContextManager], config: GRPOConfig, prompts_per_step: Optional[int],
                     device: torch.device, optimizers: list[torch.optim.Optimizer],
                     reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """``max_tokens_per_microbatch="auto"`` resolved: :func:`choose_token_budget` on this process for the training
    step of ``policy`` (``loss`` of a micro-batch in the trainer's precision ``forward_context``, its backward, the
    gradients freed after; a mini-batch of ``mini_batch_size`` sequences, else the whole rollout of
    ``prompts_per_step * num_generations``), with the first optimizer's :func:`adamw_state_bytes`, the smallest over
    the data-parallel processes (``reduce_max`` of the negated budget, a collective), logged.

    Raises:
        MemoryError: as :func:`choose_token_budget`.
    """

    def train_step(batch: Experience) -> None:
        with forward_context():
            value = loss(batch)
        value.backward()
        policy.zero_grad(set_to_none=True)

    sequences = config.mini_batch_size or (prompts_per_step or 1) * config.num_generations
    state_bytes = adamw_state_bytes(optimizers[0]) if optimizers else 0
    budget = choose_token_budget(train_step, config, int(policy.config.vocab_size), device, sequences, state_bytes)
    smallest = -reduce_max(torch.tensor([-float(budget.tokens)], device=device))
    log.info("token budget: %s", budget.describe())
    return int(smallest.item())
