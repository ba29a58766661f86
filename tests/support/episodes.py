"""Helpers of the multi-turn tests: a scripted engine (a stand-in for the model: its turns are given ids) and a
scripted environment (a stand-in for a game: it answers every turn with a fixed observation for a fixed number of
turns)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lightning_grpo.episodes import BaseEnvironment, EnvStep
from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.rollout.engines.rows import rollout_from_rows


class ScriptedEngine:
    """A rollout engine whose model turns are ``script(call, row, prompt_ids) -> ids`` (cut at
    ``sampling.max_new_tokens``; EOS where the script puts it), with sampler logprobs ``-0.01 * (position + 1)``.
    Records every call: ``(prompt_ids, num_generations, sampling)``. ``weight_versions[call]``: the call's
    ``weight_version``; ``token_versions(call, position)``: each token's version (``completion_versions``, as an
    engine that takes weights while it generates reports them)."""

    capabilities = EngineCapabilities(uses_policy_parameters=True)

    def __init__(self, tokenizer, script: Callable[[int, int, list[int]], list[int]], eos: int = 2,
                 weight_versions: Optional[list[int]] = None,
                 token_versions: Optional[Callable[[int, int], int]] = None) -> None:
        self.tokenizer, self.script, self.eos = tokenizer, script, eos
        self.pad_token_id = eos
        self.calls: list[tuple[list[list[int]], int, SamplingConfig]] = []
        self.weight_versions = weight_versions
        self.token_versions = token_versions

    def generate(self, prompt_ids, num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        call = len(self.calls)
        self.calls.append(([list(p) for p in prompt_ids], num_generations, sampling))
        rows = []
        for i, prompt in enumerate(prompt_ids):
            for j in range(num_generations):
                ids = list(self.script(call, i * num_generations + j, list(prompt)))[: sampling.max_new_tokens]
                rows.append((ids, [-0.01 * (k + 1) for k in range(len(ids))]))
        version = None if self.weight_versions is None else self.weight_versions[call]
        out = rollout_from_rows(prompt_ids, rows, num_generations, self.pad_token_id, [self.eos], self.tokenizer,
                                weight_version=version)
        if self.token_versions is not None:
            width = out.completion_ids.shape[1]
            versions = torch.tensor([[self.token_versions(call, k) for k in range(width)]] * len(out))
            out.completion_versions = versions.masked_fill(out.completion_mask == 0, -1)
        return out

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Nothing to do: the script is the model (``uses_policy_parameters``)."""

    def set_lockstep(self, enabled: bool) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class EchoEnvironment(BaseEnvironment):
    """Answers each of the first ``turns - 1`` model turns with the observation ``"obs <n>"`` (role user), then ends
    the episode with reward ``len(answer) / 100`` (the answer's characters). Counts its resets and closes."""

    resets: list[dict] = []
    closed = 0

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, **row) -> None:
        EchoEnvironment.resets.append(row)

    def step(self, turn: str) -> EnvStep:
        self.seen += 1
        if self.seen >= self.turns:
            return EnvStep.finish(reward=len(turn) / 100)
        return EnvStep.observe(f"obs {self.seen}")

    def close(self) -> None:
        EchoEnvironment.closed += 1


def save_talkative_llama(dest, smollm2_path: str, eos_logit: float = 11.0) -> str:
    """A tiny random Llama (:func:`lightning_grpo.demos.tiny_models.save_tiny_llama`, untied) that ends its turns after
    a few tokens, so that real sampling (HF, vLLM, a rollout server) gives multi-turn episodes: every token embedding
    gets +100 in dimension 0, which then dominates the final RMSNorm's output (about sqrt(hidden) = 8 there), and the
    output row of EOS gets ``eos_logit / 8`` in that dimension: EOS's logit is about ``eos_logit`` at every position
    (P(EOS) ~ 0.55 per token for 11 against SmolLM2's 49,152 tokens). Saved with its tokenizer; returns ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_grpo.demos.tiny_models import save_tiny_llama

    path = save_tiny_llama(dest, smollm2_path, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 100.0
        model.lm_head.weight[eos, 0] = eos_logit / 8.0
    model.save_pretrained(path)
    return path
