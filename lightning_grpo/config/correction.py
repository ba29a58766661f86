"""``GRPOConfig.correction``: the rollout-correction knobs beyond the truncated importance weight (rejection masks,
DeepSeek-V3.2's off-policy sequence mask, bypass mode), validated on construction. The math is in
:mod:`lightning_grpo.algorithm.correction`; docs/algorithm.md maps each knob to TRL's and verl's names.

The importance weight itself (TIS, IcePop's two-sided token mask, the geometric-mean sequence weight) stays in the
flat ``GRPOConfig.importance_sampling_*`` fields, next to TRL's ``vllm_importance_sampling_*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from lightning_grpo.config.groups import fail

KLMaskEstimator = Literal["k1", "k2", "k3"]
KLMaskAggregation = Literal["token", "seq_mean", "seq_sum", "seq_max"]
_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
_AGGREGATIONS: tuple[str, ...] = ("token", "seq_mean", "seq_sum", "seq_max")


def _fail(name: str, value: object, requirement: str) -> None:
    fail(f"correction.{name}", value, requirement)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class CorrectionConfig:
    """Rejection masks and bypass mode of the rollout correction (``GRPOConfig.correction``;
    ``--model.config.correction.<field>``). Every mask drops the policy-gradient term of the tokens it rejects (the
    KL and entropy terms and the loss denominator are unchanged, as TRL's masks do); all of them must keep a token
    for it to be trained. Their log-ratio is ``log(pi_old / pi_sampler)`` of the trainer's behaviour logprobs and the
    engine's (:mod:`lightning_grpo.algorithm.correction`); an engine that reports no sampler logprobs samples with
    the trained policy itself, so its log-ratio is 0 and nothing is rejected.

    Raises:
        ValueError: on construction, a field out of range, not finite, or set without the field that turns it on
            (the field and value are named).
    """

    geo_mask_low: Optional[float] = None
    """Geometric-mean sequence mask (verl Geo-RS, ``rollout_rs="seq_mean_k1"``; SkyRL ``geo_mask_low``, which
    recommends 0.99): a sequence whose ``exp(mean_t log(pi_old / pi_sampler))`` is below this gets no
    policy-gradient loss; in (0, 1]; None = no lower bound."""
    geo_mask_high: Optional[float] = None
    """Upper bound (>= 1) of the geometric-mean sequence mask (SkyRL ``geo_mask_high``, 1.01 recommended); None = no
    upper bound. Length-invariant, unlike the product of the ratios ("the length trap", verl docs)."""
    kl_mask_threshold: Optional[float] = None
    """KL-estimate rejection (verl ``rollout_rs="<aggregation>_<estimator>"``, preset K3-RS; AReaL
    ``kl_k1/k2/k3``): tokens or sequences whose estimate of KL(pi_sampler || pi_old) exceeds this (> 0) get no
    policy-gradient loss; None = off. With k1 the bound applies to ``|k1|``."""
    kl_mask_estimator: Optional[KLMaskEstimator] = None
    """The per-token estimate of ``kl_mask_threshold`` (Schulman 2020), with ``d = log(pi_old / pi_sampler)``: "k1"
    (``-d``), "k2" (``d**2 / 2``) or "k3" (``exp(d) - 1 - d``); None = "k3" (only with ``kl_mask_threshold``)."""
    kl_mask_aggregation: Optional[KLMaskAggregation] = None
    """How ``kl_mask_threshold`` reads the per-token estimates: "token" (each token on its own), "seq_mean",
    "seq_sum" or "seq_max" (one value per sequence over its model tokens; verl's prefixes); None = "seq_mean"
    (only with ``kl_mask_threshold``)."""
    off_policy_mask_threshold: Optional[float] = None
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556 eq. 9, delta; TRL ``off_policy_mask_threshold``,
    e.g. 0.5): a token whose advantage is negative gets no policy-gradient loss when its sequence's mean of
    ``log pi_sampler - log pi_theta`` (the sampler's logprobs, else the old policy's, against the detached current
    ones) exceeds this (>= 0); None = off."""
    bypass_mode: bool = False
    """Use the sampler's logprobs as the old policy's (verl ``bypass_mode``, prime-rl's default): no old-logprob
    forward pass, and the PPO ratio ``pi_theta / pi_sampler`` carries the engine mismatch from the first update on
    (the rejection masks then read ``log(pi_theta / pi_sampler)``, detached). Needs an engine that reports sampler
    logprobs (checked per rollout); refused with an importance weight (``importance_sampling_cap`` /
    ``importance_sampling_min``: it would be 1), and with ``max_staleness > 0`` unless a mask above is on (the
    trust region would be centred on the stale policy with nothing to bound the gap)."""

    def __post_init__(self) -> None:
        for name in ("geo_mask_low", "geo_mask_high", "kl_mask_threshold", "off_policy_mask_threshold"):
            value = getattr(self, name)
            if value is not None and not _number(value):
                _fail(name, value, "must be a finite number or None")
        self._check_ranges()
        for name, choices in (("kl_mask_estimator", _ESTIMATORS), ("kl_mask_aggregation", _AGGREGATIONS)):
            value = getattr(self, name)
            if value is not None and value not in choices:
                _fail(name, value, f"choose one of {', '.join(choices)}")
            if value is not None and self.kl_mask_threshold is None:
                _fail(name, value, "is read only with kl_mask_threshold: set it, or leave this None")
        if not isinstance(self.bypass_mode, bool):
            _fail("bypass_mode", self.bypass_mode, "must be True or False")

    def _check_ranges(self) -> None:
        if self.geo_mask_low is not None and not 0 < self.geo_mask_low <= 1:
            _fail("geo_mask_low", self.geo_mask_low, "must be in (0, 1] or None")
        if self.geo_mask_high is not None and self.geo_mask_high < 1:
            _fail("geo_mask_high", self.geo_mask_high, "must be >= 1 or None")
        if self.kl_mask_threshold is not None and not self.kl_mask_threshold > 0:
            _fail("kl_mask_threshold", self.kl_mask_threshold, "must be > 0 or None (off)")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            _fail("off_policy_mask_threshold", self.off_policy_mask_threshold, "must be >= 0 or None (off)")

    @property
    def estimator(self) -> str:
        """The KL-rejection estimator in effect ("k3" unless set)."""
        return self.kl_mask_estimator or "k3"

    @property
    def aggregation(self) -> str:
        """The KL-rejection aggregation in effect ("seq_mean" unless set)."""
        return self.kl_mask_aggregation or "seq_mean"

    @property
    def masks_on(self) -> bool:
        """Whether any rejection mask is on (geometric, KL or off-policy)."""
        return (self.geo_mask_low is not None or self.geo_mask_high is not None or self.kl_mask_threshold is not None
                or self.off_policy_mask_threshold is not None)

    def check_with(self, *, importance_sampling_cap: Optional[float], importance_sampling_min: Optional[float],
                   max_staleness: int, streaming: bool = False) -> None:
        """The combinations with ``GRPOConfig``'s own fields (called by ``GRPOConfig.__post_init__``).

        Raises:
            ValueError: bypass mode with an importance weight, or with stale rollouts (``max_staleness > 0`` or
                ``streaming``) and no mask (named).
        """
        if not self.bypass_mode:
            return
        for name, value in (("importance_sampling_cap", importance_sampling_cap),
                            ("importance_sampling_min", importance_sampling_min)):
            if value is not None:
                _fail("bypass_mode", True, f"takes the sampler's logprobs as the old policy's, so the importance "
                      f"weight pi_old / pi_sampler would be 1 and GRPOConfig.{name}={value} ignored: set it to None "
                      "(the PPO ratio pi_theta / pi_sampler is clipped instead) or turn bypass_mode off")
        if max_staleness > 0 and not self.masks_on:
            _fail("bypass_mode", True, f"with max_staleness={max_staleness} trains stale rollouts against the stale "
                  "sampler's logprobs with nothing bounding the gap (no importance weight in bypass mode): set a "
                  "rejection mask (geo_mask_low/high, kl_mask_threshold or off_policy_mask_threshold) or turn "
                  "bypass_mode off (the default decoupled objective corrects staleness with the TIS weight)")
        if streaming and not self.masks_on:
            _fail("bypass_mode", True, "with streaming.enabled trains stale samples against the stale sampler's "
                  "logprobs with nothing bounding the gap (no importance weight in bypass mode): set a rejection mask "
                  "(geo_mask_low/high, kl_mask_threshold or off_policy_mask_threshold) or turn bypass_mode off")
