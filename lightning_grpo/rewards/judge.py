"""An LLM judge over any OpenAI-compatible chat-completions endpoint as a reward function.

Two modes (:class:`JudgeReward`):

* pointwise (``group=False``): one request per completion; the judge reads the rubric, the task and the response
  (and the reference answer, when the dataset has one) and ends its answer with ``Score: <n>`` for an integer ``n``
  in ``score_range``; the reward is ``(n - low) / (high - low)`` in [0, 1].
* group-relative (``group=True``; RULER, ART's ``ruler_score_group``, OpenPipe 2025): one request per prompt with
  its G completions, numbered; the judge compares them with each other and answers ``{"scores": [s_1, ..., s_G]}``
  with each ``s_i`` in [0, 1]; the rewards are those scores. The group's advantages only read differences within
  the group (GRPO normalizes per group), which is what a relative judge is good at.

Any OpenAI-compatible server works: ``vllm serve`` (or ``python -m vllm.entrypoints.openai.api_server``), a hosted
API, SGLang, ... ``guided=True`` adds vLLM's ``structured_outputs`` regex of the expected answer to each request, so
that even a small judge always answers in the format (vLLM only; other servers reject the field).

Failures are never a silent 0: a request that fails after ``max_retries`` retries (connection refused, timeout,
HTTP 429/5xx) or an answer without a valid score either raises :class:`JudgeError` (``on_failure="raise"``, the
default: the run stops with the URL, the sample and the judge's answer in the message) or masks the completion's
reward (``on_failure="mask"``: None, so the completion gets no loss and is left out of its group's statistics),
counted in ``rewards/<name>/request_failed`` and ``rewards/<name>/unparsable``.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from typing import Any, Literal, Optional

import httpx

from lightning_grpo.rewards.pool import PooledReward, RewardChunk

#: The pointwise rubric; ``{low}``/``{high}`` are the score range, ``{task}``, ``{response}``, ``{reference}`` the
#: texts (``{reference}`` is the empty string when the dataset has no reference answer).
DEFAULT_RUBRIC = (
    "You are an impartial judge. Grade the response to the task below.\n"
    "Judge correctness first, then completeness and clarity.{reference}\n\n"
    "[Task]\n{task}\n\n[Response]\n{response}\n\n"
    "Explain your judgement in at most three sentences, then end with a last line of the form\n"
    "Score: <an integer from {low} to {high}>"
)
#: How a reference answer is shown (``{answer}``) inside :data:`DEFAULT_RUBRIC`'s ``{reference}``.
REFERENCE_TEMPLATE = "\nA reference answer is given; a response that reaches it is correct.\n\n[Reference]\n{answer}"

#: The group-relative rubric (RULER); ``{task}``, ``{responses}`` (numbered), ``{n}`` (how many), ``{reference}``.
DEFAULT_GROUP_RUBRIC = (
    "You are an impartial judge. Below are a task and {n} responses to it. Compare the responses with each other "
    "and score each from 0 to 1.{reference}\n"
    "- A response that solves the task scores clearly higher than one that does not.\n"
    "- Between responses that solve it, the more direct and clear one scores higher.\n"
    "- Partial progress earns partial credit; small differences in quality get small differences in score.\n\n"
    "[Task]\n{task}\n\n{responses}\n\n"
    'Answer with JSON only, one score per response in order: {{"scores": [s_1, ..., s_{n}]}}'
)

_SCORE = re.compile(r"Score:\s*([-+]?\d+(?:\.\d+)?)")
_UNIT = r"(0(\.[0-9]{1,3})?|1(\.0{1,3})?)"


class JudgeError(RuntimeError):
    """The judge failed to score a completion (the message has the URL, the reason and the judge's answer)."""


def task_text(prompt: Any) -> str:
    """A prompt as the judge reads it: a string as is; a list of chat messages as their non-system contents (with
    ``role:`` labels when there are several)."""
    if isinstance(prompt, str):
        return prompt
    turns = [m for m in prompt if m.get("role") != "system"]
    if len(turns) == 1:
        return str(turns[0]["content"])
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in turns)


class JudgeReward(PooledReward):
    """An LLM judge's score as a reward (see the module docstring).

    Args:
        base_url: the server's OpenAI API root, e.g. ``"http://127.0.0.1:8000/v1"``.
        model: the model name the server serves (``--served-model-name``).
        rubric: the prompt template (default :data:`DEFAULT_RUBRIC`, or :data:`DEFAULT_GROUP_RUBRIC` with
            ``group``).
        group: judge a prompt's G completions together, relative to each other (RULER); then one call of the
            reward pool per group.
        score_range: the integer scores of the pointwise rubric, (low, high), low < high.
        reference_column: a dataset column shown to the judge as the reference answer (e.g. ``"answer"``); None or a
            missing column: none.
        api_key_env: the environment variable holding the API key (sent as a bearer token when set); None: none.
        temperature, max_tokens, seed: the sampling of the judge (greedy and seeded by default, so a judge gives the
            same score to the same text; servers may still vary with batching).
        timeout_s: seconds per request (connect and read).
        max_retries: retries of a request that failed (connection error, timeout, HTTP 429 or 5xx), with
            exponential backoff from ``retry_backoff_s``; an unparsable answer is not retried.
        on_failure: ``"raise"`` (:class:`JudgeError`) or ``"mask"`` (None reward, counted).
        guided: add vLLM's ``structured_outputs`` regex of the expected answer to each request.
        extra_body: more fields for each request body (e.g. ``{"top_k": 1}``).
        name: the metric name.

    Raises:
        ValueError: a bad ``score_range``, ``on_failure``, ``timeout_s`` or ``max_retries``.
    """

    outcomes = ("request_failed", "unparsable")

    def __init__(self, base_url: str, model: str, rubric: Optional[str] = None, *, group: bool = False,
                 score_range: tuple[int, int] = (0, 10), reference_column: Optional[str] = "answer",
                 api_key_env: Optional[str] = "OPENAI_API_KEY", temperature: float = 0.0, max_tokens: int = 512,
                 seed: Optional[int] = 0, timeout_s: float = 60.0, max_retries: int = 2,
                 retry_backoff_s: float = 0.5, on_failure: Literal["raise", "mask"] = "raise", guided: bool = False,
                 extra_body: Optional[dict[str, Any]] = None, name: str = "judge") -> None:
        super().__init__(name)
        low, high = score_range
        if not (isinstance(low, int) and isinstance(high, int) and low < high):
            raise ValueError(f"JudgeReward score_range={score_range!r} must be two integers, low < high")
        if on_failure not in ("raise", "mask"):
            raise ValueError(f"JudgeReward on_failure={on_failure!r} must be 'raise' or 'mask'")
        if not timeout_s > 0 or max_retries < 0 or retry_backoff_s < 0:
            raise ValueError(f"JudgeReward timeout_s={timeout_s!r} must be > 0, max_retries={max_retries!r} and "
                             f"retry_backoff_s={retry_backoff_s!r} >= 0")
        self.chunk_size = "group" if group else 1
        self.base_url, self.model, self.group = base_url.rstrip("/"), model, group
        self.rubric = rubric or (DEFAULT_GROUP_RUBRIC if group else DEFAULT_RUBRIC)
        self.score_range, self.reference_column = (low, high), reference_column
        self.api_key_env, self.temperature, self.max_tokens, self.seed = api_key_env, temperature, max_tokens, seed
        self.timeout_s, self.max_retries, self.retry_backoff_s = timeout_s, max_retries, retry_backoff_s
        self.on_failure, self.guided, self.extra_body = on_failure, guided, dict(extra_body or {})
        self._client: Optional[httpx.Client] = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ scoring
    def score_chunk(self, prompts: list, completions: list[str], columns: dict[str, list]) -> RewardChunk:
        references = columns.get(self.reference_column) if self.reference_column else None
        outcomes = dict.fromkeys(self.outcomes, 0)
        if self.group:
            if any(p != prompts[0] for p in prompts):
                raise ValueError("a group-relative judge call got completions of different prompts: the group size "
                                 "must be GRPOConfig.num_generations")
            ref = references[0] if references else None
            return self._finish(self._judge(self._group_prompt(prompts[0], completions, ref), len(completions)),
                                len(completions), outcomes)
        values: list = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            ref = references[i] if references else None
            chunk = self._finish(self._judge(self._pointwise_prompt(prompt, completion, ref), 1), 1, outcomes)
            values += chunk.values
        return RewardChunk(values, outcomes)

    def _finish(self, result: tuple[Optional[list[float]], Optional[str], str], n: int,
                outcomes: dict[str, int]) -> RewardChunk:
        scores, failure, detail = result
        if scores is not None:
            return RewardChunk(list(scores), outcomes)
        assert failure is not None
        if self.on_failure == "raise":
            raise JudgeError(f"judge {self.__name__!r} at {self.base_url} ({self.model}): {detail}")
        outcomes[failure] += n
        return RewardChunk([None] * n, outcomes)

    def _pointwise_prompt(self, prompt: Any, completion: str, reference: Any) -> str:
        low, high = self.score_range
        shown = REFERENCE_TEMPLATE.format(answer=reference) if reference not in (None, "") else ""
        return self.rubric.format(task=task_text(prompt), response=completion, reference=shown, low=low, high=high)

    def _group_prompt(self, prompt: Any, completions: list[str], reference: Any) -> str:
        shown = REFERENCE_TEMPLATE.format(answer=reference) if reference not in (None, "") else ""
        responses = "\n\n".join(f"[Response {i + 1}]\n{c}" for i, c in enumerate(completions))
        return self.rubric.format(task=task_text(prompt), responses=responses, n=len(completions), reference=shown)

    def answer_regex(self, n: int) -> str:
        """The answer format as a regex (for ``guided``): pointwise, an explanation line of at most
        ``min(300, max_tokens - 12)`` characters (so the score always fits in ``max_tokens``: a token is at least a
        character) and ``Score: <n>``; group-relative, the JSON of ``n`` scores in [0, 1]."""
        if self.group:
            return r'\{"scores": \[' + ", ".join([_UNIT] * n) + r"\]\}"
        low, high = self.score_range
        numbers = "|".join(sorted((str(k) for k in range(low, high + 1)), key=len, reverse=True))
        return r"[^\n]{0," + str(max(0, min(300, self.max_tokens - 12))) + r"}\nScore: (" + numbers + ")"

    def parse(self, text: str, n: int) -> Optional[list[float]]:
        """The rewards in an answer: pointwise, the last ``Score: <n>`` in range, mapped to [0, 1]; group-relative,
        the ``scores`` list (length ``n``, each in [0, 1]) of the last JSON object. None if there is none."""
        if not self.group:
            found = _SCORE.findall(text)
            if not found:
                return None
            low, high = self.score_range
            value = float(found[-1])
            return [(value - low) / (high - low)] if low <= value <= high else None
        start = text.rfind('{"scores"') if '{"scores"' in text else text.rfind("{")
        try:
            scores = json.loads(text[start:text.rindex("}") + 1])["scores"] if start >= 0 else None
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(scores, list) or len(scores) != n:
            return None
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s <= 1 for s in scores):
            return None
        return [float(s) for s in scores]

    # ------------------------------------------------------------------ HTTP
    def _judge(self, content: str, n: int) -> tuple[Optional[list[float]], Optional[str], str]:
        """(scores, None, "") or (None, "request_failed" | "unparsable", what happened)."""
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": content}],
                                "temperature": self.temperature, "max_tokens": self.max_tokens, **self.extra_body}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.guided:
            body["structured_outputs"] = {"regex": self.answer_regex(n)}
        text, failure, error = self._post(body)
        if text is None:
            assert failure is not None
            return None, failure, error
        scores = self.parse(text, n)
        if scores is None:
            want = f'{{"scores": [...{n} numbers in [0, 1]]}}' if self.group else \
                f"a last line 'Score: <integer in {self.score_range}>'"
            return None, "unparsable", f"the answer has no valid score (wanted {want}): {text[:300]!r}"
        return scores, None, ""

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                key = os.environ.get(self.api_key_env) if self.api_key_env else None
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                self._client = httpx.Client(base_url=self.base_url, timeout=self.timeout_s, headers=headers)
            return self._client

    def _post(self, body: dict[str, Any]) -> tuple[Optional[str], Optional[str], str]:
        """The answer's text, or None, the failure ("request_failed" after the retries, or "unparsable" for a
        response that is not a chat completion) and what happened."""
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                response = self._http().post("/chat/completions", json=body)
            except httpx.HTTPError as err:  # connection refused, timeouts, protocol errors
                error = f"{type(err).__name__}: {err}"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                error = f"HTTP {response.status_code}: {response.text[:200]!r}"
                continue
            if response.status_code != 200:  # a client error is not retried
                return None, "request_failed", f"HTTP {response.status_code}: {response.text[:300]!r}"
            try:
                return str(response.json()["choices"][0]["message"]["content"] or ""), None, ""
            except (ValueError, KeyError, IndexError, TypeError):
                return None, "unparsable", f"the response is not a chat completion: {response.text[:300]!r}"
        return None, "request_failed", f"no answer after {self.max_retries + 1} attempts: {error}"

    def close(self) -> None:
        """Close the HTTP connections (a later call opens new ones)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __getstate__(self) -> dict[str, Any]:  # picklable (DDP spawn): no client, no lock
        state = self.__dict__.copy()
        state["_client"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
