"""The records of one prompt's group on its way through the stream: :class:`PromptItem` (a prompt drawn, with its
place in the data order), the group as sampled turned into a :class:`~lightning_grpo.protocols.rollout.RolloutOutput`
of G rows with each token's weight version (:func:`group_rollout`), and :class:`ScoredGroup` (scored on arrival,
waiting to be trained; its checkpoint state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from lightning_grpo.algorithm.dynamic_sampling import ScoredRollout
from lightning_grpo.protocols.rollout import RolloutOutput, left_pad
from lightning_grpo.protocols.streaming import SampledCompletion, SampledGroup
from lightning_grpo.protocols.tokens import Layout, TokenField, token_fields

#: The fields of :class:`RolloutOutput` that :func:`group_rollout` fills itself (the others come from a completion's
#: ``extra`` by name).
_OWN_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logprobs",
               "completion_versions")


@dataclass
class PromptItem:
    """One prompt drawn from the data for the stream.

    Attributes:
        key: its place in this process's data order over the whole run (the epoch's first prompt follows the
            previous epoch's last): the :class:`~lightning_grpo.protocols.streaming.GroupRequest` key, what the
            checkpoint counts as trained, dropped, ready or to sample again.
        row: its dataset row ("prompt" and the other columns, which the reward functions get).
        prompt_ids: its token ids (chat template applied, left-truncated to ``max_prompt_length``).
        truncated: whether it was truncated (``prompts/truncated``).
        attempts: how many times it was sent to the engine (an engine lost, or a stale group regenerated, sends it
            again).
    """

    key: int
    row: dict[str, Any]
    prompt_ids: tuple[int, ...]
    truncated: bool = False
    attempts: int = 0

    def state(self) -> dict[str, Any]:
        """As plain data, for a checkpoint (``torch.load(weights_only=True)``)."""
        return {"key": self.key, "row": self.row, "prompt_ids": list(self.prompt_ids), "truncated": self.truncated,
                "attempts": self.attempts}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PromptItem":
        return cls(int(state["key"]), dict(state["row"]), tuple(int(t) for t in state["prompt_ids"]),
                   bool(state["truncated"]), int(state["attempts"]))


def _extra_field(name: str, spec: TokenField, completions: Sequence[SampledCompletion], prompt_len: int,
                 width: int) -> torch.Tensor:
    """One per-token field a streaming engine sent by name (``SampledCompletion.extra``), laid out like the ids it is
    aligned with (``(G, P, ...)`` left-padded or ``(G, T, ...)`` right-padded, with the field's pad, in its declared
    dtype)."""
    rows = []
    for c in completions:
        if name not in c.extra:
            raise ValueError(f"the streaming engine sent {name!r} for some completions of a group and not others")
        rows.append(torch.as_tensor(c.extra[name], dtype=spec.dtype))
    trailing = rows[0].shape[1:]
    pad = spec.pad_value(0)
    size = prompt_len if spec.layout is Layout.PROMPT else width
    out = torch.full((len(rows), size, *trailing), pad, dtype=rows[0].dtype)
    for i, (row, c) in enumerate(zip(rows, completions, strict=True)):
        expected = prompt_len if spec.layout is Layout.PROMPT else len(c.token_ids)
        if row.shape[0] != expected:
            raise ValueError(f"the streaming engine's {name!r} has {row.shape[0]} values for {expected} "
                             f"{spec.layout.value} tokens")
        if spec.layout is Layout.PROMPT:
            out[i, size - expected:] = row
        else:
            out[i, :expected] = row
    return out


def group_rollout(group: SampledGroup, tokenizer: Any, pad_token_id: int) -> RolloutOutput:
    """The :class:`RolloutOutput` of one sampled group: ``G`` rows of its prompt (left-padded) and completions
    (right-padded), ``completion_mask`` 1 on every generated token (through the EOS), ``truncated`` where a
    completion reached ``max_new_tokens`` (finish reason "length"), the sampler's logprobs, each token's weight
    version (``completion_versions``, -1 on padding) and every other per-token field the engine sent by the name
    :class:`RolloutOutput` declares (``SampledCompletion.extra``); the texts decoded with ``tokenizer`` (special tokens
    skipped).

    Raises:
        ValueError: an ``extra`` field :class:`RolloutOutput` does not declare (it would be dropped), or one that is
            not aligned with its ids.
    """
    completions = group.completions
    g = len(completions)
    prompt = list(group.request.prompt_ids)
    width = max([1] + [len(c.token_ids) for c in completions])
    ids = torch.full((g, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((g, width), dtype=torch.long)
    logprobs = torch.zeros((g, width), dtype=torch.float32)
    versions = torch.full((g, width), -1, dtype=torch.long)
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[i, :n] = 1
        logprobs[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
        versions[i, :n] = torch.tensor(c.versions, dtype=torch.long)
    prompt_ids, prompt_mask = left_pad([prompt] * g, pad_token_id, torch.device("cpu"))
    declared = {name: spec for name, spec in token_fields(RolloutOutput) if name not in _OWN_FIELDS}
    names = sorted({name for c in completions for name in c.extra})
    unknown = [name for name in names if name not in declared]
    if unknown:
        raise ValueError(f"the streaming engine sent per-token fields {unknown} that RolloutOutput does not declare "
                         f"(declared: {sorted(declared)}): they would be dropped")
    extra = {name: _extra_field(name, declared[name], completions, len(prompt), width) for name in names}
    texts = tokenizer.batch_decode((ids * mask + pad_token_id * (1 - mask)).tolist(), skip_special_tokens=True)
    return RolloutOutput(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=mask,
                         truncated=torch.tensor([c.finish_reason == "length" for c in completions]),
                         completions=texts, sampler_logprobs=logprobs, completion_versions=versions, **extra)


@dataclass
class ScoredGroup:
    """A group sampled and scored, waiting in the buffer to be trained.

    Attributes:
        item: its prompt.
        scored: its ``G`` rows with their rewards (:class:`~lightning_grpo.algorithm.ScoredRollout`; the rollout
            carries each token's weight version).
        engine: which engine (server) sampled it.
        outcomes: the pooled rewards' outcome counts (``"<reward>/<outcome>"`` -> completions).
        reward_seconds: each reward function's seconds on this group (``timing/reward_<name>_s`` when trained).
    """

    item: PromptItem
    scored: ScoredRollout
    engine: str = ""
    outcomes: dict[str, float] = field(default_factory=dict)
    reward_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> int:
        return self.item.key

    def _versions(self) -> torch.Tensor:
        versions = self.scored.rollout.completion_versions
        assert versions is not None, "a streamed group carries its tokens' versions"
        return versions[versions >= 0]

    @property
    def oldest_version(self) -> Optional[int]:
        """The oldest weight version of any of its tokens (what the age bound reads); None without a token."""
        versions = self._versions()
        return int(versions.min()) if versions.numel() else None

    @property
    def newest_version(self) -> Optional[int]:
        """The newest weight version of any of its tokens; None without a token."""
        versions = self._versions()
        return int(versions.max()) if versions.numel() else None

    def state(self) -> dict[str, Any]:
        """As plain data, for a checkpoint (the rows, their rewards and the prompt)."""
        scored = self.scored
        return {"item": self.item.state(), "rollout": scored.rollout.state(), "per_function": scored.per_function,
                "rewards": scored.rewards, "num_generations": scored.num_generations,
                "pad_token_id": scored.pad_token_id, "engine": self.engine, "outcomes": dict(self.outcomes),
                "reward_seconds": dict(self.reward_seconds)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ScoredGroup":
        """The group :meth:`state` saved."""
        scored = ScoredRollout(RolloutOutput.from_state(state["rollout"]), per_function=state["per_function"],
                               rewards=state["rewards"], num_generations=int(state["num_generations"]),
                               pad_token_id=int(state["pad_token_id"]))
        return cls(PromptItem.from_state(state["item"]), scored, str(state["engine"]),
                   {k: float(v) for k, v in state["outcomes"].items()},
                   {k: float(v) for k, v in state["reward_seconds"].items()})
