"""``GRPOConfig.distillation``: on-policy distillation's teacher and coefficients, validated on construction.

The math is :mod:`lightning_grpo.algorithm.distillation`; the teachers are :mod:`lightning_grpo.distillation` (a
frozen model, a rollout server, an OpenAI-compatible server);
docs/algorithm.md maps the knobs to TRL's, verl's, slime's and prime-rl's.
"""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass
from typing import Literal, Optional

from lightning_grpo.config.groups import fail

TeacherAPI = Literal["rollout_server", "openai"]
_APIS: tuple[str, ...] = ("rollout_server", "openai")


def _fail(name: str, value: object, requirement: str) -> None:
    fail(f"distillation.{name}", value, requirement)


@dataclass
class DistillationConfig:
    """On-policy distillation (``GRPOConfig.distillation``; ``--model.config.distillation.<field>``): set ``teacher``
    or ``teacher_url``. The teacher scores the student's sampled token ids, teacher-forced (a local teacher with the
    policy's sampling distribution, as the reference model; a served one at temperature 1, untruncated, so it needs
    that sampling), and each token's advantage becomes
    ``reward_weight * A_i - coef * (log pi(y_t) - log pi_teacher(y_t))``. Teacher and student must share a
    tokenizer (checked: an error names the first difference).

    Raises:
        ValueError: on construction, a field out of range, not finite, or set without the field that turns it on
            (the field and value are named).
    """

    teacher: Optional[str] = None
    """A local folder or hub id of the teacher (a causal LM with the policy's tokenizer), loaded frozen in the
    policy's dtype on each training process and sharded like the reference model (FSDP); TRL
    ``teacher_model_name_or_path``. None = no local teacher."""
    teacher_url: Optional[str] = None
    """A served teacher's base URL: a rollout server (``lightning-grpo serve --model TEACHER``, ``http://host:port``,
    its ``/probe_logprobs``) or, with ``teacher_api="openai"``, an OpenAI-compatible server that returns prompt
    logprobs (vLLM's ``/v1/completions`` with ``prompt_logprobs``; e.g. ``http://host:port/v1``). None = not
    served."""
    teacher_api: TeacherAPI = "rollout_server"
    """What ``teacher_url`` speaks: "rollout_server" or "openai"."""
    teacher_model_name: Optional[str] = None
    """"openai": the ``model`` of each request (the served model's name); required there."""
    teacher_tokenizer: Optional[str] = None
    """A served teacher's tokenizer (folder or hub id) to compare with the policy's; None = the rollout server's
    model folder (from ``/health``), or vLLM's ``/tokenize`` of probe texts for "openai"."""
    teacher_secret_file: Optional[str] = None
    """A file whose first line is the served teacher's secret: the rollout server's shared secret, or the
    OpenAI-compatible server's API key (a bearer token). Only the path is stored; None = none."""
    teacher_timeout: float = 600.0
    """Seconds (> 0) one request to a served teacher may take, retries included."""
    coef: float = 1.0
    """lambda (> 0): the weight of the per-token reverse KL in the advantage (Thinking Machines' ``kl_penalty_coef``;
    slime ``--opd-kl-coef``)."""
    reward_weight: float = 0.0
    """w (>= 0): the weight of the reward's group advantage in the advantage; 0 = distillation alone (the rewards
    are still scored and logged), 1 = mixed as slime does."""

    def __post_init__(self) -> None:
        for name in ("teacher_timeout", "coef", "reward_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                _fail(name, value, "must be a finite number")
        self._check_teacher()
        if not self.teacher_timeout > 0:
            _fail("teacher_timeout", self.teacher_timeout, "must be > 0 seconds")
        if not self.coef > 0:
            _fail("coef", self.coef, "must be > 0 (the reverse KL's weight in the advantage)")
        if self.reward_weight < 0:
            _fail("reward_weight", self.reward_weight, "must be >= 0 (0 = distillation alone)")
        if not self.enabled and self.reward_weight != 0:
            _fail("reward_weight", self.reward_weight, "is read only with a teacher: set teacher or teacher_url")

    def _check_teacher(self) -> None:
        """Where the teacher is: a model or a served one, and the fields each reads."""
        if self.teacher is not None and self.teacher_url is not None:
            _fail("teacher_url", self.teacher_url, f"a teacher is either a model (teacher={self.teacher!r}) or "
                  "served, not both")
        for name in ("teacher", "teacher_url", "teacher_model_name", "teacher_tokenizer", "teacher_secret_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                _fail(name, value, "must be a non-empty string or None")
        if self.teacher_api not in _APIS:
            _fail("teacher_api", self.teacher_api, f"choose one of {', '.join(_APIS)}")
        if self.teacher_url is None:
            served_only = {"teacher_model_name": self.teacher_model_name, "teacher_tokenizer": self.teacher_tokenizer,
                           "teacher_secret_file": self.teacher_secret_file,
                           "teacher_api": None if self.teacher_api == "rollout_server" else self.teacher_api}
            for name, value in served_only.items():
                if value is not None:
                    _fail(name, value, "is read only for a served teacher: set teacher_url")
        else:
            self._check_served(self.teacher_url)

    def _check_served(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            _fail("teacher_url", url, "must be http(s)://HOST[:PORT][/path]")
        if self.teacher_api == "openai" and self.teacher_model_name is None:
            _fail("teacher_model_name", None, "teacher_api='openai' needs the served model's name")
        if self.teacher_api == "rollout_server" and self.teacher_model_name is not None:
            _fail("teacher_model_name", self.teacher_model_name, "is read only with teacher_api='openai'")

    @property
    def enabled(self) -> bool:
        """Whether a teacher is set (local or served)."""
        return self.teacher is not None or self.teacher_url is not None

    def check_with(self, *, policy_loss_mode: str, dynamic_sampling: bool, temperature: float, top_p: float,
                   top_k: int, min_p: float) -> None:
        """The combinations with ``GRPOConfig``'s own fields (called by ``GRPOConfig.__post_init__``).

        Raises:
            ValueError: a combination that cannot work (named).
        """
        if not self.enabled:
            return
        if policy_loss_mode != "vanilla":
            _fail("teacher", self.teacher or self.teacher_url, f"distillation gives each token its own advantage; "
                  f"policy_loss_mode={policy_loss_mode!r} selects tokens by the sequence advantage's covariance: use "
                  "policy_loss_mode='vanilla'")
        if dynamic_sampling and self.reward_weight == 0:
            _fail("reward_weight", 0.0, "with dynamic_sampling=True the groups are filtered by a reward that does "
                  "not train (reward_weight=0): set reward_weight > 0 or dynamic_sampling=False")
        truncated = top_p < 1 or top_k > 0 or min_p > 0
        if self.teacher_url is not None and (temperature != 1 or truncated):
            _fail("teacher_url", self.teacher_url, f"a served teacher scores at temperature 1 without truncation, but "
                  f"the policy samples at temperature={temperature}, top_p={top_p}, top_k={top_k}, min_p={min_p}: "
                  "the reverse KL would compare different distributions; sample at temperature 1 without "
                  "truncation, or load the teacher locally (distillation.teacher), which is scored like the policy")
