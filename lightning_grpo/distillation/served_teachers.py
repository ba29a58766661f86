"""On-policy distillation's served teachers (``GRPOConfig.distillation.teacher_url``).

* :class:`RolloutServerTeacher`: a rollout server (``lightning-grpo serve --model TEACHER``) scoring given token ids
  with its ``/probe_logprobs`` (vLLM's prompt logprobs, temperature 1).
* :class:`OpenAITeacher`: any OpenAI-compatible server whose ``/v1/completions`` returns prompt logprobs (vLLM's
  ``prompt_logprobs`` extension; prime-rl's teacher is such a server).

Both implement :class:`~lightning_grpo.protocols.teacher.Teacher`: ``(N, T)`` float32 logprobs of each completion token
given the prompt and the completion before it (the environment's tokens of multi-turn episodes included as context),
0 where the row has no loss. They check the tokenizer before their first request and split their requests by size.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.config.distillation import DistillationConfig
from lightning_grpo.distillation.tokenizer_check import TokenizerMismatchError, check_same_tokenizer
from lightning_grpo.training.experience import Experience

#: Most prompt + completion tokens per request to a served teacher (the rollout server may allow fewer).
SERVED_REQUEST_TOKENS = 1 << 16


def scored_sequences(experience: Experience) -> list[tuple[int, list[int], int]]:
    """``(row, prompt + attended completion ids, completion length)`` of every row with loss tokens: what a served
    teacher scores (multi-turn environment tokens included: they are context)."""
    attended = experience.completion_attention_mask.bool()
    has_loss = experience.completion_mask.bool().any(dim=1)
    out = []
    for row in range(len(experience)):
        if not bool(has_loss[row]):
            continue
        prompt = experience.prompt_ids[row][experience.prompt_mask[row].bool()].tolist()
        length = int(attended[row].sum())
        out.append((row, prompt + experience.completion_ids[row, :length].tolist(), length))
    return out


def _chunks(items: list[tuple[int, list[int], int]], budget: int) -> list[list[tuple[int, list[int], int]]]:
    """Consecutive groups of ``items`` of at most ``budget`` tokens (a longer item is a group of its own)."""
    groups: list[list[tuple[int, list[int], int]]] = [[]]
    total = 0
    for item in items:
        if groups[-1] and total + len(item[1]) > budget:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += len(item[1])
    return [g for g in groups if g]


class _ServedTeacher:
    """A teacher behind HTTP: builds the sequences, sends them in chunks (:meth:`_score_sequences`), places the
    completion tokens' logprobs; checks the tokenizer once (:meth:`_check`)."""

    def __init__(self, config: DistillationConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model: Optional[nn.Module] = None  # nothing runs here
        self._checked = False

    def score(self, experience: Experience, micro_batch_size: int, forward_context: Callable[[], ContextManager],
              max_tokens: Optional[int] = None) -> Tensor:
        """See :meth:`~lightning_grpo.protocols.teacher.Teacher.score`: the sequences go in requests of at most the
        server's token limit (``micro_batch_size``, ``forward_context`` and ``max_tokens`` are the trainer's)."""
        if not self._checked:
            self._check()
            self._checked = True
        out = torch.zeros(experience.completion_ids.shape, dtype=torch.float32)
        items = scored_sequences(experience)
        for chunk in _chunks(items, self._request_tokens()):
            answers = self._score_sequences([ids for _, ids, _ in chunk])
            for (row, ids, length), logprobs in zip(chunk, answers, strict=True):
                if len(logprobs) != len(ids) - 1:
                    raise RuntimeError(f"{self.config.teacher_url}: the teacher returned {len(logprobs)} logprobs for "
                                       f"a sequence of {len(ids)} tokens (expected {len(ids) - 1})")
                out[row, :length] = torch.tensor(logprobs[len(ids) - 1 - length:], dtype=torch.float32)
        return out.to(experience.completion_ids.device)

    def _request_tokens(self) -> int:
        return SERVED_REQUEST_TOKENS

    def _check(self) -> None:
        raise NotImplementedError

    def _score_sequences(self, sequences: list[list[int]]) -> list[list[float]]:
        raise NotImplementedError

    def _check_tokenizer_of(self, path: Optional[str], described: str) -> None:
        """Compare the policy's tokenizer with the one at ``distillation.teacher_tokenizer`` (else ``path``)."""
        from transformers import AutoTokenizer

        name = self.config.teacher_tokenizer or path
        if name is None:
            raise ValueError(f"GRPOConfig.distillation.teacher_url={self.config.teacher_url!r}: {described}; set "
                             "distillation.teacher_tokenizer to the teacher's tokenizer (folder or hub id) so that it "
                             "can be checked against the policy's")
        try:
            teacher_tokenizer = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as err:
            raise ValueError(f"GRPOConfig.distillation.teacher_url={self.config.teacher_url!r}: the teacher's "
                             f"tokenizer {name!r} could not be loaded here ({err}); set "
                             "distillation.teacher_tokenizer to a folder or hub id of it") from None
        check_same_tokenizer(self.tokenizer, teacher_tokenizer, f"GRPOConfig.distillation.teacher_url="
                                                                f"{self.config.teacher_url!r}")


class RolloutServerTeacher(_ServedTeacher):
    """A rollout server as the teacher (``distillation.teacher_api="rollout_server"``): its ``/health`` names the
    model folder whose tokenizer is checked (or ``teacher_tokenizer``), and ``/probe_logprobs`` scores the ids, at
    most its ``max_request_tokens`` per request."""

    def __init__(self, config: DistillationConfig, tokenizer: Any) -> None:
        from lightning_grpo.rollout.server.client import ServerClient
        from lightning_grpo.rollout.server.security import read_secret

        super().__init__(config, tokenizer)
        assert config.teacher_url is not None
        secret = read_secret(config.teacher_secret_file, "GRPOConfig.distillation.teacher_secret_file")
        self.client = ServerClient(config.teacher_url, config.teacher_timeout, secret,
                                   field="GRPOConfig.distillation.teacher_url")
        self._limit = SERVED_REQUEST_TOKENS

    def _check(self) -> None:
        health = self.client.request("GET", "/health")
        self._limit = min(SERVED_REQUEST_TOKENS, int(health.get("max_request_tokens", SERVED_REQUEST_TOKENS)))
        vocab = int(health["vocab_size"])
        if vocab < len(self.tokenizer):
            raise TokenizerMismatchError(
                f"GRPOConfig.distillation.teacher_url={self.config.teacher_url!r}: the served teacher "
                f"{health.get('model')!r} has a vocabulary of {vocab} ids, fewer than the policy's tokenizer's "
                f"{len(self.tokenizer)}: not the same tokenizer")
        self._check_tokenizer_of(health.get("model"), "the server names no model folder")

    def _request_tokens(self) -> int:
        return self._limit

    def _score_sequences(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.client.request("POST", "/probe_logprobs", {"sequences": sequences})["logprobs"]


class OpenAITeacher(_ServedTeacher):
    """An OpenAI-compatible server as the teacher (``distillation.teacher_api="openai"``): ``POST
    <teacher_url>/completions`` with the token ids as the prompt, ``max_tokens=1``, ``prompt_logprobs=0`` (vLLM's
    extension; each position's entry holds the logprob of the prompt's own token) and ``echo``/``logprobs=0`` (the
    classic OpenAI echo, whose ``logprobs.token_logprobs`` are read when ``prompt_logprobs`` is absent). The
    tokenizer is checked with ``teacher_tokenizer``, else by vLLM's ``/tokenize`` of probe texts."""

    #: Texts whose encoding by the server's tokenizer must equal the policy's (``/tokenize``).
    PROBES = ("What is 13 - 6? Let's think step by step.\n#### 7", " Über naïve café — 東京 42,000.5 ✓\t\n  x",
              "def f(x):\n    return x ** 2  # ok")

    def __init__(self, config: DistillationConfig, tokenizer: Any) -> None:
        import httpx

        from lightning_grpo.rollout.server.security import read_secret

        super().__init__(config, tokenizer)
        assert config.teacher_url is not None
        secret = read_secret(config.teacher_secret_file, "GRPOConfig.distillation.teacher_secret_file")
        headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
        self.base = config.teacher_url.strip().rstrip("/")
        self.http = httpx.Client(headers=headers, timeout=config.teacher_timeout)

    def _post(self, url: str, body: dict) -> dict:
        import httpx

        try:
            answer = self.http.post(url, json=body)
        except httpx.HTTPError as err:
            raise RuntimeError(f"GRPOConfig.distillation.teacher_url={self.config.teacher_url!r}: POST {url} failed: "
                               f"{err!r}") from None
        if answer.status_code >= 300:
            raise RuntimeError(f"GRPOConfig.distillation.teacher_url={self.config.teacher_url!r}: POST {url} answered "
                               f"HTTP {answer.status_code}: {answer.text[:500]}")
        return answer.json()

    def _check(self) -> None:
        if self.config.teacher_tokenizer is not None:
            self._check_tokenizer_of(None, "")
            return
        root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        for text in self.PROBES:
            try:
                served = self._post(f"{root}/tokenize", {"model": self.config.teacher_model_name, "prompt": text,
                                                          "add_special_tokens": False})["tokens"]
            except (RuntimeError, KeyError) as err:
                raise ValueError(f"GRPOConfig.distillation.teacher_url={self.config.teacher_url!r}: the teacher's "
                                 f"tokenizer could not be checked ({err}); set distillation.teacher_tokenizer to it "
                                 "(folder or hub id)") from None
            ours = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if served != ours:
                raise TokenizerMismatchError(
                    f"GRPOConfig.distillation.teacher_url={self.config.teacher_url!r}: the teacher's tokenizer differs "
                    f"from the policy's: {text!r} is {served} there and {ours} here. On-policy distillation scores the "
                    "policy's token ids with the teacher, so both need the same tokenizer")

    def _score_sequences(self, sequences: list[list[int]]) -> list[list[float]]:
        body = {"model": self.config.teacher_model_name, "prompt": sequences, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "echo": True, "logprobs": 0}
        choices = sorted(self._post(f"{self.base}/completions", body)["choices"], key=lambda c: c["index"])
        return [_prompt_logprobs(choice, ids) for choice, ids in zip(choices, sequences, strict=True)]


def _prompt_logprobs(choice: dict, ids: list[int]) -> list[float]:
    """The logprob of each token of ``ids`` but the first, from a completion choice: vLLM's ``prompt_logprobs``
    (a list of ``{token_id: {"logprob": ...}}``, None first), else the echoed ``logprobs.token_logprobs``.

    Raises:
        RuntimeError: the choice has neither, or not the token asked for.
    """
    entries = choice.get("prompt_logprobs")
    if entries is not None:
        values = []
        for position, token in enumerate(ids[1:], start=1):
            entry = entries[position] or {}
            found = entry.get(str(token), entry.get(token))
            if found is None:
                raise RuntimeError(f"the teacher's prompt_logprobs at position {position} have no entry for token "
                                   f"{token}")
            values.append(float(found["logprob"] if isinstance(found, dict) else found))
        return values
    echoed = (choice.get("logprobs") or {}).get("token_logprobs")
    if echoed is None:
        raise RuntimeError("the teacher's answer has neither prompt_logprobs nor echoed logprobs.token_logprobs: the "
                           "server does not return prompt logprobs (vLLM does)")
    return [float(v) for v in echoed[1:len(ids)]]
