"""``GRPOConfig``: every knob of the algorithm, validated on construction.

Names follow TRL's ``GRPOConfig`` where they mean the same thing; docs/algorithm.md maps each to TRL and verl. The
engine, evaluation and episode settings are nested groups (:mod:`lightning_grpo.config.groups`), as are the rollout
correction's masks (:mod:`lightning_grpo.config.correction`) and on-policy distillation
(:mod:`lightning_grpo.config.distillation`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from lightning_grpo.config.correction import CorrectionConfig
from lightning_grpo.config.distillation import DistillationConfig
from lightning_grpo.config.groups import EngineConfig, EpisodeConfig, EvalConfig, check_fields, fail
from lightning_grpo.config.streaming import StreamingConfig
from lightning_grpo.protocols.sampling import sampling_errors

LossType = Literal["grpo", "bnpo", "token_mean", "dapo", "dr_grpo", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]
ScaleRewards = Literal["group", "batch", "none"]
AdvantageEstimator = Literal["grpo", "rloo"]
ImportanceSamplingLevel = Literal["token", "sequence", "sequence_token"]
RolloutImportanceSamplingLevel = Literal["token", "sequence", "geometric"]
PolicyLossMode = Literal["vanilla", "clip_cov", "kl_cov"]
ImportanceSamplingMode = Literal["truncate", "mask"]
OnNonFinite = Literal["error", "skip"]
RoutingReplayMode = Literal["off", "R3", "R2"]

#: The truncated-importance-sampling cap C that ``max_staleness > 0`` and streaming rollouts use when
#: ``importance_sampling_cap`` is None (Yao et al. 2025 and verl's ``rollout_is_threshold`` use 2); see
#: :meth:`GRPOConfig.tis_cap`.
ASYNC_IMPORTANCE_SAMPLING_CAP = 2.0


@dataclass
class GRPOConfig:
    """Settings of the GRPO algorithm (DeepSeekMath, arXiv:2402.03300, sec. 4.1) and its variants.

    Each field is documented by the string below it (shown by ``lightning-grpo fit --help`` as the help of
    ``--model.config.<field>``). Order of the reward shaping steps: weighted reward sum -> + overlong penalty ->
    scale/bias/clip -> - beta * KL (kl_in_reward) -> advantages (:func:`lightning_grpo.functional.group_advantages`).

    Raises:
        ValueError: on construction, a field out of range or not finite (the field and value are named).
    """

    # --- Rollout ---
    num_generations: int = 8
    """G, completions sampled per prompt (a "group"); >= 2, group statistics need two."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are left-truncated (counted in ``prompts/truncated``)."""
    max_new_tokens: int = 256
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the trainer divides logits by it too, so the logprobs are those of the
    distribution that was sampled."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Top-k sampling, 0 = off."""
    min_p: float = 0.0
    """Min-p sampling (Nguyen et al. 2024, arXiv:2407.01082; TRL ``min_p``): keep the tokens whose probability is
    at least ``min_p`` times the most likely token's, in [0, 1]; 0 = off. Applied after temperature and before
    top-k and top-p (vLLM's order) by both engines; the trainer's logprobs, entropy and KL are those of the same
    truncated distribution (docs/algorithm.md, "Behaviour policy")."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine and its settings (:class:`EngineConfig`: ``name`` "hf", "vllm", "vllm_server", "auto")."""

    # --- Rewards and advantages (see lightning_grpo.functional.group_advantages) ---
    advantage_estimator: AdvantageEstimator = "grpo"
    """Baseline: "grpo" (the group mean, DeepSeekMath eq. 3) or "rloo" (the mean of the other G - 1 completions,
    Ahmadian et al. 2024 eq. 6; verl ``adv_estimator=rloo`` is "rloo" with ``scale_rewards="none"``)."""
    scale_rewards: ScaleRewards = "group"
    """Advantage scaling: "group" divides by the group's std (DeepSeekMath eq. 3 outcome supervision), "batch" by
    the std of the whole rollout batch (all processes), "none" does not divide (Dr. GRPO sec. 3.1)."""
    advantage_eps: float = 1e-4
    """Added to the std before dividing (TRL uses 1e-4)."""
    advantage_std_floor: float = 0.0
    """The std is raised to at least this before dividing (>= 0; 0 = off), so that groups whose rewards differ only
    by float noise are not scaled up to unit advantages."""
    reward_scale: float = 1.0
    """Reward multiplier (> 0): ``r <- clip(reward_scale * r + reward_bias, -reward_clip, reward_clip)`` before
    advantages."""
    reward_bias: float = 0.0
    """Added to the scaled reward: ``r <- clip(reward_scale * r + reward_bias, -reward_clip, reward_clip)``."""
    reward_clip: Optional[float] = None
    """Bound (> 0) of ``r <- clip(reward_scale * r + reward_bias, -reward_clip, reward_clip)``; None = no clipping."""
    overlong_buffer: int = 0
    """Soft overlong punishment (DAPO eq. 13) over the last this many of the max_new_tokens tokens; 0 = off."""
    overlong_penalty_factor: float = 1.0
    """The soft overlong punishment at max_new_tokens is ``-overlong_penalty_factor`` (>= 0)."""
    mask_truncated_completions: bool = False
    """Completions without EOS (cut at max_new_tokens) get no loss (DAPO sec. 3.4 "overlong filtering"); they still
    count in the group statistics."""

    # --- Dynamic sampling (DAPO eq. 11) ---
    dynamic_sampling: bool = False
    """Drop groups whose primary reward is the same for all G completions and generate more prompt batches until the
    rollout batch is full again (DAPO eq. 11)."""
    max_num_gen_batches: int = 10
    """Most prompt batches generated per rollout batch (>= 1); when reached, the batch is filled up with dropped
    groups (logged as ``dynamic_sampling/filled_groups``)."""
    primary_reward: Optional[str] = None
    """Name of the reward function (as in ``rewards/<name>/mean``) whose raw value the dynamic sampling filter reads;
    None = the first reward function."""

    # --- Policy loss ---
    epsilon_low: float = 0.2
    """Lower clip range in [0, 1] (1 = no lower bound): the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high]
    (PPO eq. 7). The same bounds clip GSPO's sequence ratio (the paper uses 3e-4 / 4e-4) and CISPO's weight."""
    epsilon_high: float = 0.2
    """Upper clip range (>= 0): the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high] (PPO eq. 7; larger than
    epsilon_low is the asymmetric "clip-higher" of DAPO eq. 10)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip bound (> 1) for negative advantages (Ye et al. 2020, arXiv:1912.09729); None = off."""
    delta: Optional[float] = None
    """Upper cap (> 1 + epsilon_high) on the unclipped ratio (INTELLECT-2, arXiv:2505.07291); None = off."""
    beta: float = 0.0
    """KL coefficient (>= 0); 0 disables the KL term and no reference model is loaded."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator "k1", "k2" or "k3" (Schulman 2020; DeepSeekMath eq. 4 is k3)."""
    kl_in_reward: bool = False
    """Subtract ``beta * sum_t KL_t`` (the behaviour policy's KL to the reference, per sequence) from the reward
    before advantages (verl ``use_kl_in_reward``) instead of adding ``beta * KL`` to the loss (the default,
    DeepSeekMath eq. 3). Needs beta > 0."""
    loss_type: LossType = "grpo"
    """How per-token losses are averaged, see :func:`lightning_grpo.functional.loss_normalizer`; "cispo" is the CISPO
    loss (MiniMax-M1 eq. 4) averaged like "dapo" (TRL's ``loss_type="cispo"``)."""
    entropy_coef: float = 0.0
    """Entropy bonus, ``loss -= entropy_coef * H`` (per token, aggregated like the loss; >= 0)."""
    top_entropy_quantile: float = 1.0
    """Only the top this fraction of the micro-batch's tokens by entropy get the policy-gradient loss (rho of
    arXiv:2506.01939, which uses 0.2); 1.0 = all tokens."""
    importance_sampling_cap: Optional[float] = None
    """Truncated importance sampling (TIS) cap C (>= 1) for engines that report sampler logprobs (vLLM): the
    policy-gradient loss is weighted by ``min(pi_old / pi_sampler, C)``; None = off (2.0 when ``max_staleness > 0``
    or ``streaming.enabled``, where it corrects the stale rollouts: :meth:`tis_cap`). The HF engine reports none, so
    its weight is 1."""
    importance_sampling_min: Optional[float] = None
    """Lower bound C_min in (0, 1] of the importance weight (TRL ``vllm_importance_sampling_clip_min``): "truncate"
    raises smaller weights to it, "mask" zeroes them; with ``importance_sampling_mode="mask"``,
    ``importance_sampling_cap=5`` and 0.5 this is IcePop's two-sided token mask. None = no lower bound."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """Level of the policy importance ratio pi / pi_old (TRL ``importance_sampling_level``): "token" (GRPO, one ratio
    per token), "sequence" (GSPO, arXiv:2507.18071 eq. 5-7: ``s_i = exp(mean_t log(pi / pi_old))`` clipped once per
    sequence with epsilon_low / epsilon_high; use ``loss_type="grpo"`` for the paper's per-sequence mean) or
    "sequence_token" (GSPO-token, sec. 4.3: value ``s_i`` on every token, gradient per token). The level of the TIS
    weight is ``rollout_importance_sampling_level``."""
    rollout_importance_sampling_level: RolloutImportanceSamplingLevel = "token"
    """Level of the truncated importance sampling weight pi_old / pi_sampler (``importance_sampling_cap``): "token"
    (a weight per token), "sequence" (the product over the sequence; verl ``rollout_is="sequence"``) or "geometric"
    (the geometric mean over the sequence, length-invariant: truncated, or with "mask" a geometric-mean sequence
    mask that keeps the weight)."""
    importance_sampling_mode: ImportanceSamplingMode = "truncate"
    """Importance weight cap mode: "truncate" (``min(w, C)``) or "mask" (weight 0 where ``w > C``)."""
    policy_loss_mode: PolicyLossMode = "vanilla"
    """Policy loss (verl ``actor.policy_loss.loss_mode``): "vanilla" (the clipped surrogate), "clip_cov" (Clip-Cov) or
    "kl_cov" (KL-Cov), both from Cui et al. 2025, arXiv:2505.22617 sec. 4; token level only. KL-Cov's surrogate is
    unclipped (as in verl). CISPO is ``loss_type="cispo"`` (TRL's name)."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: fraction (0, 1] of a micro-batch's loss tokens whose loss is dropped (at least one token);
    verl ``policy_loss.clip_cov_ratio``."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound (exclusive) of the covariance of the tokens that may be dropped; verl ``clip_cov_lb``."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound (exclusive, > clip_cov_lb) of that covariance; verl ``clip_cov_ub``."""
    kl_cov_ratio: float = 2e-3
    """KL-Cov: fraction (0, 1] of the loss tokens, those of the largest covariance, that get the KL penalty (at least
    one token); verl ``policy_loss.kl_cov_ratio`` (its default 2e-4; the paper's Qwen2.5-7B recipe uses 2e-3)."""
    ppo_kl_coef: float = 1.0
    """KL-Cov: coefficient (>= 0) of the penalty ``|log pi - log pi_old|``; verl ``policy_loss.ppo_kl_coef`` (its
    default 0.1; the paper's recipes use 1)."""

    # --- Updates ---
    num_iterations: int = 1
    """Passes over each rollout batch (mu in DeepSeekMath Alg. 1)."""
    mini_batch_size: Optional[int] = None
    """Sequences per optimizer step on each process; None = the whole rollout batch (prompts_per_step * G). Each
    mini-batch is split into ``Trainer(accumulate_grad_batches)`` micro-batches, one ``training_step`` each."""
    shuffle_seed: int = 0
    """Seed of the mini-batch shuffling (combined with the step number)."""
    disable_dropout: bool = False
    """Set every dropout of the policy to 0 (``nn.Dropout`` modules, LoRA's ``lora_dropout`` included, and the
    attention dropout of HF layers), as TRL's ``disable_dropout``. With the default (False) the training forward
    passes use the model's dropout while the old logprobs of the ratio pi / pi_old are computed in eval mode without
    it, so with several updates per rollout (``num_iterations > 1`` or mini-batches) the ratio is not 1 at the first
    update; a warning says so when the policy has dropout."""
    max_tokens_per_microbatch: Union[int, Literal["auto"], None] = None
    """Form each mini-batch's micro-batches by a token budget instead of a count: sequences (real prompt +
    completion tokens) are packed into micro-batches of at most this many tokens, balanced
    (:func:`lightning_grpo.training.packing.token_budget_partition`; a longer sequence gets a micro-batch of its own).
    The number of micro-batches per optimizer step then varies: it needs ``Trainer(accumulate_grad_batches=1)``.
    "auto": chosen before the first step from the measured peak memory of two probe steps so that a step fits
    ``token_budget_memory_fraction`` of the available memory (:mod:`lightning_grpo.training.token_budget`; logged as
    ``token_budget``); an error when one sequence of ``max_prompt_length + max_new_tokens`` tokens does not fit.
    None = ``accumulate_grad_batches`` micro-batches per step."""

    # --- Performance ---
    padding_free: bool = True
    """Training and old/reference logprob passes compute only real tokens, and logits only at completion positions.
    How sequences are laid out: with ``shared_prefix`` (sdpa/eager attention) each group of sequences sharing a
    prompt is one row; otherwise sequences are packed into rows with position ids restarting per sequence
    (:func:`lightning_grpo.training.packing.pack_sequences`; transformers derives the block-diagonal causal mask from
    them).
    False keeps the padded ``(B, P + T)`` forward for models whose attention cannot pack."""
    packed_row_tokens: Optional[int] = None
    """Most tokens per forward pass when rows are combined (rows formed like token-budget micro-batches). None =
    automatic: one pass for the whole micro-batch with a flash-attention kernel (varlen) or a model sharded by FSDP
    (which all-gathers on every forward call); otherwise one pass per group row (``shared_prefix``) or per sequence,
    since sdpa/eager attention over a combined row is computed densely, across sequences (2-core CPU, SmolLM2,
    8 x (200 + 192) tokens, fwd+bwd: one sequence per pass 14.4 s, one pass for all 23.6 s, padded 17.4 s)."""
    shared_prefix: bool = True
    """With ``padding_free`` and sdpa/eager attention, lay out each group of sequences that share a prompt (a GRPO
    group) as one row, the prompt once and then every completion, with a 4-D attention mask that lets each
    completion see the prompt and itself only: the prompt is computed once instead of G times. Exact (same logprobs
    and gradients). With flash attention (no custom masks) it is ignored. A token-budget micro-batch may split a
    group, which then shares its prompt within each part only."""

    # --- Memory (docs/performance.md) ---
    lm_head_chunk_size: Optional[int] = 1024
    """Tokens per chunk of the output layer -> logprob computation of every training, old-policy and reference pass:
    the logprobs (and entropy, with its gradient) are computed from the final hidden states ``chunk`` tokens at a
    time in forward and recomputed chunk by chunk in backward, so the ``[tokens, vocab]`` logits never exist (their
    float32 copy and gradient neither); exact (tests assert 1e-5), on for the model types whose forward applies
    nothing after the output layer (:data:`lightning_grpo.training.logprob_head.PLAIN_HEAD_MODEL_TYPES`; others keep
    the full logits, logged). Peak memory of the head: a few ``chunk x vocab`` float32 buffers (top-p: chunks 8 times
    smaller). None = full logits."""
    token_budget_memory_fraction: float = 0.8
    """With ``max_tokens_per_microbatch="auto"``: the fraction in (0, 1] of the memory available to the training
    process (CUDA: free device memory; CPU: the smallest of ``MemAvailable``, the cgroup limit and ``RLIMIT_AS``) that
    the training step's measured peak may use (:mod:`lightning_grpo.training.token_budget`)."""

    # --- Evaluation ---
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The validation/test rollouts (:class:`EvalConfig`: ``max_new_tokens``, ``num_samples``, ``k``,
    ``temperature``)."""

    # --- Multi-turn episodes (docs/multiturn.md) ---
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Limits of multi-turn episodes with tools or an environment (:class:`EpisodeConfig`: ``max_turns``,
    ``max_tokens``, ``tool_timeout_s``, ``env_workers``); unused by single-turn rollouts."""

    # --- Rollout correction and on-policy distillation (lightning_grpo.algorithm.correction / .distillation) ---
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Rejection masks (geometric-mean, KL-estimate, DeepSeek-V3.2's off-policy mask) and bypass mode
    (:class:`~lightning_grpo.config.correction.CorrectionConfig`); the importance weight is
    ``importance_sampling_*`` above."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation: a teacher (model or served) whose per-token reverse KL is the advantage
    (:class:`~lightning_grpo.config.distillation.DistillationConfig`); off unless a teacher is set."""

    # --- Asynchronous rollouts (lightning_grpo.rollout.prefetch) ---
    max_staleness: int = 0
    """Bounded staleness (AReaL's eta, Fu et al. 2025, arXiv:2505.24298): rollouts are generated in a background
    thread while the trainer trains, from weights at most this many optimizer steps older than the weights they are
    trained on: ``max_staleness // steps_per_rollout`` rollouts are generated ahead, each from the weights at the
    start of the rollout that started it (a fixed, reproducible schedule; it restarts at each epoch, whose first
    rollouts are fresher). 0 = synchronous (each rollout from the current weights).
    Needs an engine with its own copy of the weights (not "hf"; checked when the engine is made),
    ``engine.sync_every=1``, no sleep mode and no ``dynamic_sampling``. The off-policy gap is corrected by truncated
    importance sampling against the sampler's logprobs (docs/algorithm.md, "Asynchronous rollouts"): with
    ``importance_sampling_cap=None`` the cap is 2.0 (:meth:`tis_cap`). Logged: ``rollout/staleness_{mean,max}``."""
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    """Streaming rollouts, the fully asynchronous mode beside the fixed schedule (:class:`StreamingConfig`:
    ``enabled``, ``max_inflight_groups``, ``buffer_groups``, ``max_off_policy_steps``, ``on_stale``,
    ``newest_version_only``; docs/engines.md, "Streaming rollouts")."""

    # --- Reward pool (lightning_grpo.rewards.pool; docs/rewards.md) ---
    reward_num_workers: int = 8
    """Threads that run the calls of the slow rewards (reward models, LLM judges, sandboxed code: the
    ``PooledReward`` functions), so that that many calls run at once (>= 1); with ``max_staleness > 0`` they start
    as soon as a rollout is generated, while the trainer trains. The rewards do not depend on it. Logged:
    ``timing/reward_<name>_s`` per reward function."""

    # --- Mixture-of-experts policies (docs/algorithm.md "Routing replay") ---
    routing_replay: RoutingReplayMode = "off"
    """Which experts a mixture-of-experts policy's routers use in the trainer's forward passes of the policy (the
    old-logprob pass, the training forward and the step's statistics pass; never the reference's or a teacher's):
    "off": their own top-k. "R3" (rollout routing replay, Ma et al. 2025, arXiv:2510.11370): the experts the rollout
    engine's routers selected for each token (the engine records them: ``RolloutOutput.prompt_routed_experts`` and
    ``completion_routed_experts``), so the trainer scores the sampled tokens through the sampler's experts. "R2"
    (routing replay, GSPO, arXiv:2507.18071 sec. 4.3; slime ``--use-routing-replay``): the experts of the trainer's
    own old-policy pass, replayed in the updates after the rollout's first optimizer step (a rollout trained by one
    optimizer step has no old pass: its routing is the policy's own). Either way the mixing weights come from the
    live router logits at the replayed experts, so the router is still trained. Needs a policy of a supported family
    (:data:`lightning_grpo.models.moe.FAMILIES`: Qwen3-MoE, OLMoE, Mixtral; an error at setup otherwise) and, for
    "R3", an engine whose rollouts carry the routing (``returns_routed_experts``: the "hf" engine). Logged:
    ``sampling/router_disagreement`` (docs/algorithm.md "Routing replay")."""
    routing_replay_diagnostics: bool = False
    """With ``routing_replay`` on: one more no-grad forward pass of the policy over each rollout, without replay,
    that logs what the sampler/trainer mismatch would have been without it on the same rollout
    (``sampling/without_replay/router_disagreement`` and, when the engine reports sampler logprobs,
    ``sampling/without_replay/k3_kl`` and ``sampling/without_replay/sampling_logp_difference/mean``)."""
    router_aux_loss_coef: float = 0.0
    """Weight of a mixture-of-experts policy's load-balancing loss (Switch Transformer, Fedus et al. 2021,
    arXiv:2101.03961 eq. 4-6, transformers' ``load_balancing_loss_func``), added to the loss: ``coef * E * sum_e f_e
    P_e`` per routing layer (mean over layers), ``f_e`` the share of the step's loss tokens routed to expert ``e``
    and ``P_e`` their mean router probability, over the whole optimizer step on every process (``f_e`` from a no-grad
    pass at the step's start, like the other step statistics), so accumulation and the process count do not change
    it. 0 (default) = off, as RL recipes for MoE policies set it (slime's Qwen3.5-35B-A3B ``--moe-aux-loss-coeff 0``;
    SkyRL's ``moe_aux_loss_coeff: 0.0``; TRL instead uses the checkpoint's ``router_aux_loss_coef``). Logged:
    ``aux_loss``. Needs a policy of a supported family."""

    on_nonfinite: OnNonFinite = "error"
    """What a NaN or infinite loss or gradient norm, found before an optimizer step, does: "error" stops the run
    with an error naming the step and the quantity (the step is not taken); "skip" drops the step's gradients, so
    the weights and the optimizer state stay unchanged, logs ``nonfinite_steps`` (steps skipped so far) and goes on.
    Either way a policy with non-finite weights is never sampled from or saved (an error)."""

    def __post_init__(self) -> None:
        for name, group in _GROUPS:
            if not isinstance(getattr(self, name), group):
                fail(name, getattr(self, name), f"must be a {group.__name__} (GRPOConfig.from_dict builds one from a "
                      "dict)")
        check_fields(self, "")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            fail("num_generations", self.num_generations, "need >= 2 completions per prompt for group statistics")
        for name in ("max_prompt_length", "max_new_tokens", "num_iterations", "max_num_gen_batches"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        for name, value, requirement in sampling_errors(self.temperature, self.top_p, self.top_k, self.min_p):
            fail(name, value, requirement)
        self._check_rewards()
        self._check_policy_loss()
        self._check_batches()
        self._check_staleness()
        if self.router_aux_loss_coef < 0:
            fail("router_aux_loss_coef", self.router_aux_loss_coef, "must be >= 0 (0 = off)")
        if self.max_tokens_per_microbatch == "auto" and (self.routing_replay == "R3" or self.router_aux_loss_coef):
            fail("max_tokens_per_microbatch", "auto", "measures synthetic micro-batches, which carry no routed experts "
                  "(routing_replay='R3') and no step for the load-balancing loss's expert shares "
                  "(router_aux_loss_coef > 0): give a number of tokens")
        if self.routing_replay_diagnostics and self.routing_replay == "off":
            fail("routing_replay_diagnostics", True, "compares the mismatch with and without routing replay: set "
                  "routing_replay='R3' or 'R2'")
        # issue 33: the correction and distillation groups' combinations with the fields above
        self.correction.check_with(importance_sampling_cap=self.importance_sampling_cap,
                                   importance_sampling_min=self.importance_sampling_min,
                                   max_staleness=self.max_staleness, streaming=self.streaming.enabled)
        self.distillation.check_with(policy_loss_mode=self.policy_loss_mode, dynamic_sampling=self.dynamic_sampling,
                                     temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                     min_p=self.min_p)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        """A config from plain data (``dataclasses.asdict`` of one, as checkpoints store it): the ``engine``,
        ``eval``, ``episode``, ``correction``, ``distillation`` and ``streaming`` groups may be dicts.

        Raises:
            TypeError: an unknown field (named by the dataclass constructor).
        """
        values = dict(values)
        for name, group in _GROUPS:
            if isinstance(values.get(name), dict):
                values[name] = group(**values[name])
        return cls(**values)

    def tis_cap(self) -> Optional[float]:
        """The truncated-importance-sampling cap in effect: ``importance_sampling_cap``, or
        :data:`ASYNC_IMPORTANCE_SAMPLING_CAP` (2.0) when it is None and ``max_staleness > 0`` or
        ``streaming.enabled`` (the stale rollouts of asynchronous training are always corrected; not in
        ``correction.bypass_mode``, whose old policy is the sampler); None = no upper bound."""
        asynchronous = self.max_staleness > 0 or self.streaming.enabled
        if self.importance_sampling_cap is None and asynchronous and not self.correction.bypass_mode:
            return ASYNC_IMPORTANCE_SAMPLING_CAP
        return self.importance_sampling_cap

    def importance_weight_on(self) -> bool:
        """Whether the rollout importance weight applies (a cap in effect or ``importance_sampling_min``)."""
        return self.tis_cap() is not None or self.importance_sampling_min is not None

    def _check_rewards(self) -> None:
        """Reward shaping and advantage knobs."""
        if self.advantage_eps < 0:
            fail("advantage_eps", self.advantage_eps, "must be >= 0")
        if self.advantage_std_floor < 0:
            fail("advantage_std_floor", self.advantage_std_floor, "must be >= 0 (0 disables the floor)")
        if self.scale_rewards != "none" and self.advantage_eps == 0 and self.advantage_std_floor == 0:
            fail("advantage_eps", self.advantage_eps, "with advantage_std_floor=0 and scale_rewards "
                  f"{self.scale_rewards!r} a group whose rewards differ by float noise would be divided by ~0: "
                  "set advantage_eps > 0 or advantage_std_floor > 0")
        if self.reward_scale <= 0:
            fail("reward_scale", self.reward_scale, "must be > 0 (a negative scale turns the reward into a cost)")
        if self.reward_clip is not None and self.reward_clip <= 0:
            fail("reward_clip", self.reward_clip, "must be > 0 (clips to [-reward_clip, reward_clip]) or None")
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            fail("overlong_buffer", self.overlong_buffer, f"must be in [0, max_new_tokens={self.max_new_tokens}]")
        if self.overlong_penalty_factor < 0:
            fail("overlong_penalty_factor", self.overlong_penalty_factor, "must be >= 0")
        if not isinstance(self.reward_num_workers, int) or self.reward_num_workers < 1:
            fail("reward_num_workers", self.reward_num_workers, "must be an integer >= 1")
        if self.kl_in_reward and self.beta == 0:
            fail("kl_in_reward", self.kl_in_reward, "needs beta > 0 (the KL coefficient)")

    def _check_batches(self) -> None:
        """Mini-batch, micro-batch and forward-layout sizes, and the memory knobs."""
        for name in ("mini_batch_size", "packed_row_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(name, value, "must be >= 1 or None")
        budget = self.max_tokens_per_microbatch
        if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                                                        or budget < 1):
            fail("max_tokens_per_microbatch", budget, "must be an int >= 1, 'auto' or None")
        if budget == "auto" and not self.padding_free:
            fail("max_tokens_per_microbatch", "auto", "needs padding_free=True (a padded micro-batch costs more than "
                  "its tokens: its rows are padded to the longest)")
        chunk = self.lm_head_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            fail("lm_head_chunk_size", chunk, "must be an int >= 1 or None (full logits)")
        if not 0 < self.token_budget_memory_fraction <= 1:
            fail("token_budget_memory_fraction", self.token_budget_memory_fraction, "must be in (0, 1]")

    def _check_staleness(self) -> None:
        """``max_staleness`` and the settings asynchronous rollouts need (the engine's own copy of the weights is
        checked when the engine is made: :meth:`lightning_grpo.rollout.worker.RolloutWorker.start`)."""
        k = self.max_staleness
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            fail("max_staleness", k, "must be an int >= 0 (0 = synchronous rollouts)")
        if self.streaming.enabled:
            self._check_streaming()
        if k == 0:
            return
        if self.dynamic_sampling:
            fail("max_staleness", k, "is not supported with dynamic_sampling=True (the number of generation rounds "
                  "of a rollout depends on its rewards): set one of them off")
        if self.engine.sync_every != 1:
            fail("max_staleness", k, f"decides when weights are synced (before every prefetched rollout); "
                  f"engine.sync_every={self.engine.sync_every} must be 1")
        if self.engine.enable_sleep_mode:
            fail("max_staleness", k, "needs the engine awake while the trainer trains: set "
                  "engine.enable_sleep_mode=False")

    def _check_streaming(self) -> None:
        """The settings streaming rollouts need (the engine is checked when it is made: a streaming engine, the rollout
        servers' pool with ``engine.name="vllm_server"``)."""
        if self.max_staleness > 0:
            fail("streaming.enabled", True, f"streams rollouts; max_staleness={self.max_staleness} is the fixed "
                 "schedule: choose one (set max_staleness=0, or streaming.enabled=False)")
        if self.engine.sync_every != 1:
            fail("streaming.enabled", True, f"sends the weights after every optimizer step; engine.sync_every="
                 f"{self.engine.sync_every} must be 1")
        if self.engine.enable_sleep_mode:
            fail("streaming.enabled", True, "needs the engines awake while the trainer trains: set "
                 "engine.enable_sleep_mode=False")

    def _check_policy_loss(self) -> None:  # noqa: C901 - one flat list of field checks
        """Knobs of the policy objectives (clipping, KL, entropy, TIS, GSPO, CISPO, Clip-Cov, KL-Cov) and their
        combinations."""
        if not 0 <= self.epsilon_low <= 1:
            fail("epsilon_low", self.epsilon_low, "must be in [0, 1] (1 = no lower bound)")
        if self.epsilon_high < 0:
            fail("epsilon_high", self.epsilon_high, "must be >= 0")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            fail("clip_ratio_c", self.clip_ratio_c, "the dual-clip bound must be > 1")
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            fail("delta", self.delta, f"must be > 1 + epsilon_high = {1 + self.epsilon_high}")
        if self.beta < 0:
            fail("beta", self.beta, "must be >= 0")
        if self.entropy_coef < 0:
            fail("entropy_coef", self.entropy_coef, "must be >= 0 (an entropy bonus)")
        if not 0 <= self.top_entropy_quantile <= 1:
            fail("top_entropy_quantile", self.top_entropy_quantile, "must be in [0, 1] (1 keeps every token)")
        if self.importance_sampling_cap is not None and self.importance_sampling_cap < 1:
            fail("importance_sampling_cap", self.importance_sampling_cap, "must be >= 1 or None (off)")
        if self.importance_sampling_min is not None and not 0 < self.importance_sampling_min <= 1:
            fail("importance_sampling_min", self.importance_sampling_min, "must be in (0, 1] or None (off)")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                fail(name, getattr(self, name), "must be in (0, 1] (a fraction of the loss tokens)")
        if self.clip_cov_lb >= self.clip_cov_ub:
            fail("clip_cov_lb", self.clip_cov_lb, f"must be < clip_cov_ub={self.clip_cov_ub}")
        if self.ppo_kl_coef < 0:
            fail("ppo_kl_coef", self.ppo_kl_coef, "must be >= 0")
        unused = [n for n in ("clip_ratio_c", "delta") if getattr(self, n) is not None]
        if self.loss_type == "cispo" and unused:
            fail("loss_type", self.loss_type, f"CISPO clips the importance weight only; {' and '.join(unused)} "
                  "would be ignored: set them to None")
        if self.policy_loss_mode != "vanilla":
            if self.loss_type == "cispo":
                fail("policy_loss_mode", self.policy_loss_mode, "replaces the policy loss as loss_type='cispo' "
                      "does: choose one")
            if self.importance_sampling_level != "token":
                fail("policy_loss_mode", self.policy_loss_mode, "selects tokens: it needs "
                      f"importance_sampling_level='token', not {self.importance_sampling_level!r}")
        if self.policy_loss_mode == "kl_cov" and unused:
            fail("policy_loss_mode", self.policy_loss_mode, f"KL-Cov's surrogate is unclipped; {' and '.join(unused)} "
                  "would be ignored: set them to None")
        if self.importance_sampling_level == "sequence" and self.loss_type != "grpo":
            warnings.warn(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} weights each sequence's loss "
                "by its number of tokens; GSPO (arXiv:2507.18071 eq. 5) averages over sequences: loss_type='grpo'.",
                UserWarning,
                stacklevel=4,
            )


#: The nested setting groups of :class:`GRPOConfig`: field name -> dataclass.
_GROUPS: tuple[tuple[str, type], ...] = (("engine", EngineConfig), ("eval", EvalConfig), ("episode", EpisodeConfig),
                                         ("correction", CorrectionConfig), ("distillation", DistillationConfig),
                                         ("streaming", StreamingConfig))
