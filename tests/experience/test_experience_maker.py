"""ExperienceMaker.make on its own, with a RolloutContext and no Trainer or GRPOModule: golden advantages and masks
on a fixed rollout, the events it sends, the old and reference logprob passes, dynamic sampling rounds, the stop
flag at each stage, per-request seeds by rank and a prefetched (stale) rollout. A tiny random Llama."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo import GRPOConfig
from lightning_grpo.events import ExperienceReady, RolloutEnd
from lightning_grpo.experience.maker import ExperienceMaker, RolloutContext
from lightning_grpo.protocols.rollout import RolloutInterrupted, RowMetric
from lightning_grpo.rewards import RewardSet
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.metrics import StepTimer
from support.algorithm import FixedRolloutEngine, fixed_completions
from support.engines import RecordingEngine

BATCH = {"prompt": ["first prompt", "second prompt"], "answer": ["1", "2"]}
#: completion lengths through the EOS (7 > 6 tokens: row 0 is truncated)
LENGTHS = (7, 2, 5, 5, 3, 3, 3, 6)


def accuracy(prompts, completions, **kwargs):
    return [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def policy(tiny_llama_path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).train()  # as GRPOModule's


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


class _Parts:
    """An ExperienceMaker with its worker, engine, recorded events and timer."""

    def __init__(self, tokenizer, reward_funcs=(accuracy,), engine=None, **config):
        self.config = GRPOConfig(**{"num_generations": 4, "max_new_tokens": 6, **config})
        self.events = []
        self.worker = RolloutWorker(self.config, tokenizer, events=self._record)
        eos = tokenizer.eos_token_id
        self.engine = engine or FixedRolloutEngine(fixed_completions(LENGTHS, 6, eos), eos)
        self.worker.engine = self.engine
        self.maker = ExperienceMaker(self.config, self.worker, RewardSet.from_specs(list(reward_funcs)),
                                     CompletionLogprobs(self.config), events=self._record)
        self.timer = StepTimer()
        self.maker.bind(RolloutContext(timer=self.timer))

    def _record(self, name, payload):
        self.events.append((name, payload))

    def names(self):
        return [name for name, _ in self.events if name != "on_weights_synced"]


def test_golden_advantages_masks_events_and_timer(tokenizer, policy):
    parts = _Parts(tokenizer, mask_truncated_completions=True)
    experience = parts.maker.make(BATCH, policy, None)
    # rewards [1, 0, 1, 1 | 0, 0, 0, 1]: each group has mean 0.75 / 0.25 and unbiased std 0.5 (+ eps 1e-4)
    expected = torch.tensor([0.25, -0.75, 0.25, 0.25, -0.25, -0.25, -0.25, 0.75]) / 0.5001
    torch.testing.assert_close(experience.advantages, expected)
    # through the EOS; the truncated row 0 gets no loss but stays in its group's statistics
    assert experience.completion_mask.sum(dim=1).tolist() == [0, 2, 5, 5, 3, 3, 3, 6]
    assert experience.old_logprobs is None and experience.ref_logprobs is None  # one on-policy step
    assert experience.prompt_ids.shape[0] == 8 and experience.completion_ids.device.type == "cpu"
    assert experience.metrics["reward"] == pytest.approx(4 / 8)
    assert experience.metrics["completions/clipped_ratio"] == pytest.approx(1 / 8)
    assert experience.metrics["rollout/staleness_max"] == 0.0
    assert parts.timer.get("generated_tokens") == 6 + 2 + 5 + 5 + 3 + 3 + 3 + 6  # what the engine generated

    assert parts.names() == ["on_rollout_end", "on_experience"]
    rollout, ready = parts.events[0][1], parts.events[1][1]
    assert isinstance(rollout, RolloutEnd) and isinstance(ready, ExperienceReady)
    assert rollout.prompts == ["first prompt"] * 4 + ["second prompt"] * 4
    assert rollout.completions == [f"completion {i}" for i in range(8)]
    assert rollout.columns == {"answer": ["1"] * 4 + ["2"] * 4} and rollout.reward_names == ["accuracy"]
    assert rollout.lengths.tolist() == [6, 2, 5, 5, 3, 3, 3, 6] and rollout.truncated.tolist() == [True] + [False] * 7
    assert rollout.weights_version == 0 and rollout.num_generations == 4
    assert ready.experience is experience and ready.rollout is rollout
    torch.testing.assert_close(ready.shaped_rewards, torch.tensor(accuracy(None, [])))


def test_old_and_reference_logprobs_are_the_eval_passes_in_any_chunking(tokenizer, policy):
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    parts = _Parts(tokenizer, num_iterations=2, beta=0.1)
    entered = []

    def forward_context():
        entered.append(1)
        return torch.autocast("cpu", enabled=False)

    results = []
    for micro_batches_per_step in (1, 4):
        parts.maker.bind(RolloutContext(forward_context=forward_context, micro_batches_per_step=micro_batches_per_step))
        results.append(parts.maker.make(BATCH, policy, ref))
    assert len(entered) == 4  # an old and a reference pass per rollout, in the trainer's precision context
    assert policy.training  # the passes ran in eval mode and restored the mode
    policy.eval()
    try:
        with torch.no_grad():
            old, _ = CompletionLogprobs(parts.config)(policy, results[0])
            reference, _ = CompletionLogprobs(parts.config)(ref, results[0])
    finally:
        policy.train()
    mask = results[0].completion_mask.bool()
    for experience in results:
        torch.testing.assert_close(experience.old_logprobs[mask], old[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(experience.ref_logprobs[mask], reference[mask], atol=1e-5, rtol=0)
    assert not torch.allclose(old[mask], reference[mask])


def test_dynamic_sampling_generates_rounds_until_the_batch_holds_informative_groups(tokenizer, policy):
    def primary(prompts, completions, answer, **kwargs):
        return [float(a == "even" and i % 2 == 0) for i, a in enumerate(answer)]  # "even" groups: 1, 0, 1, 0

    eos = tokenizer.eos_token_id
    parts = _Parts(tokenizer, reward_funcs=[primary], dynamic_sampling=True, max_num_gen_batches=3,
                   engine=RecordingEngine(fixed_completions([3] * 8, 6, eos), eos))
    more = iter([{"prompt": ["c", "d"], "answer": ["odd", "even"]}, {"prompt": ["e", "f"], "answer": ["even", "odd"]}])
    drawn = []

    def next_prompt_batch():
        drawn.append(1)
        return next(more)

    experience = parts.maker.make({"prompt": ["a", "b"], "answer": ["odd", "odd"]}, policy, None,
                                  next_prompt_batch=next_prompt_batch)
    assert len(drawn) == 2 and len(experience) == 8
    kinds = [entry[0] for entry in parts.engine.log]
    assert kinds == ["wake_up", "sync"] + ["generate", "generated"] * 3 + ["sleep"]  # three rounds, one wake-up
    metrics = experience.metrics
    assert metrics["dynamic_sampling/gen_batches"] == 3 and metrics["dynamic_sampling/dropped_groups"] == 4
    assert metrics["dynamic_sampling/filled_groups"] == 0
    (rollout,) = [payload for name, payload in parts.events if name == "on_rollout_end"]
    # the kept groups: "d" (rows 4-7 of the second round) and "e" (rows 0-3 of the third), their own texts
    assert rollout.prompts == ["d"] * 4 + ["e"] * 4
    assert rollout.completions == [f"completion {i}" for i in (4, 5, 6, 7, 0, 1, 2, 3)]
    assert rollout.columns["answer"] == ["even"] * 8
    # each kept group: rewards 1, 0, 1, 0 -> mean 0.5, unbiased std sqrt(1/3)
    torch.testing.assert_close(experience.advantages, torch.tensor([0.5, -0.5] * 4) / (3 ** -0.5 + 1e-4))


@pytest.mark.parametrize("stage", ["before", "scoring", "logprobs"])
def test_a_stop_request_discards_the_rollout_at_every_stage(tokenizer, policy, stage):
    scored = []
    parts = None

    def reward(prompts, completions, **kwargs):
        scored.append(1)
        if stage == "scoring":
            parts.worker.stop.set()
        return [float(i % 2) for i in range(len(completions))]

    parts = _Parts(tokenizer, reward_funcs=[reward], num_iterations=2)

    def forward_context():
        if stage == "logprobs":
            parts.worker.stop.set()
        return torch.autocast("cpu", enabled=False)

    parts.maker.bind(RolloutContext(timer=parts.timer, forward_context=forward_context))
    if stage == "before":
        parts.worker.stop.set()
    with pytest.raises(RolloutInterrupted, match="stopped by a stop request"):
        parts.maker.make(BATCH, policy, None)
    assert scored == ([] if stage == "before" else [1])
    assert parts.names() == (["on_rollout_end"] if stage == "logprobs" else [])  # never on_experience
    assert parts.timer.get("generated_tokens") == 0.0


def test_per_request_seeds_come_from_torchs_generator_offset_by_rank(tokenizer, policy):
    eos = tokenizer.eos_token_id
    parts = _Parts(tokenizer, engine=RecordingEngine(fixed_completions(LENGTHS, 6, eos), eos))
    seeds = []
    for rank in (0, 1):
        parts.maker.bind(RolloutContext(rank=rank))
        torch.manual_seed(5)
        parts.maker.make(BATCH, policy, None)
        seeds.append([entry[2] for entry in parts.engine.log if entry[0] == "generate"][-1])
    torch.manual_seed(5)
    assert seeds[0] == int(torch.randint(0, 2**31 - 1, (1,)).item())
    assert seeds[1] == seeds[0] + 2**32


def test_a_prefetched_rollout_is_trained_with_its_staleness(tokenizer, policy):
    eos = tokenizer.eos_token_id
    parts = _Parts(tokenizer, engine=RecordingEngine(fixed_completions(LENGTHS, 6, eos), eos))
    prefetched = parts.maker.prefetch(BATCH, policy)
    parts.worker.mark_stale()
    parts.worker.mark_stale()  # two optimizer steps while it was generated
    experience = parts.maker.make(BATCH, policy, None, prefetched=prefetched)
    parts.maker.close()
    assert [entry[0] for entry in parts.engine.log].count("generate") == 1  # make generated nothing more
    assert experience.metrics["rollout/staleness_max"] == 2.0 and experience.metrics["rollout/staleness_mean"] == 2.0
    (rollout,) = [payload for name, payload in parts.events if name == "on_rollout_end"]
    assert rollout.weights_version == 0
    assert torch.equal(experience.completion_ids, prefetched.result().completion_ids)  # the prefetched completions
    assert experience.metrics["tokens_per_s"] == pytest.approx(33 / prefetched.generate_s)


def test_a_batch_without_prompts_is_refused_naming_its_columns(tokenizer, policy):
    parts = _Parts(tokenizer)
    with pytest.raises(KeyError, match=r"prompt batches need a 'prompt' column, got columns \['question'\]"):
        parts.maker.make({"question": ["1 + 1"]}, policy, None)


class TaggingSampler:
    """A sampler of one's own (the ``Sampler`` seam): ``engine.generate``, plus a reward column and per-row metrics;
    records what it was called with."""

    def __init__(self):
        self.calls = []

    def sample(self, engine, prompts, num_generations, sampling, any_process=None):
        self.calls.append((prompts.rows, any_process))
        out = engine.generate(prompts.ids, num_generations, sampling)
        lengths = out.completion_mask.sum(dim=1).double()
        out.columns = {"tag": [f"tag {i}" for i in range(len(out.completions))]}
        out.metrics = {"tags/length": RowMetric(lengths), "tags/longest": RowMetric(lengths, reduce="max"),
                       "tags/rate": RowMetric(torch.zeros_like(lengths), torch.zeros_like(lengths), empty=0.0)}
        return out


def tag_reward(prompts, completions, tag, **kwargs):
    return [float(int(t.split()[1]) % 3 == 0) for t in tag]


def test_a_sampler_given_to_the_worker_makes_every_rollout_and_adds_columns_and_metrics(tokenizer, policy):
    """One rollout path: the experience maker treats a sampler's output alike whatever made it; the sampler's reward
    columns reach the reward functions and the rollout event, its per-row metrics the logs (hand-worked values)."""
    parts = _Parts(tokenizer, reward_funcs=(tag_reward,))
    sampler = TaggingSampler()
    parts.worker = RolloutWorker(parts.config, tokenizer, sampler=sampler)
    parts.worker.engine = parts.engine
    parts.maker = ExperienceMaker(parts.config, parts.worker, RewardSet.from_specs([tag_reward]),
                                  CompletionLogprobs(parts.config), events=parts._record)
    collectives = parts.maker.context.collectives
    experience = parts.maker.make(BATCH, policy, None)
    assert sampler.calls == [([{"prompt": "first prompt", "answer": "1"}, {"prompt": "second prompt", "answer": "2"}],
                              collectives.any_process)]
    # tags 0..7: rewards 1 for tags 0, 3, 6
    assert experience.metrics["reward"] == pytest.approx(3 / 8)
    assert experience.metrics["tags/length"] == pytest.approx((6 + 2 + 5 + 5 + 3 + 3 + 3 + 6) / 8)
    assert experience.metrics["tags/longest"] == 6.0 and experience.metrics["tags/rate"] == 0.0
    rollout = parts.events[-2][1]
    assert rollout.columns["tag"] == [f"tag {i}" for i in range(8)] and rollout.episodes is None
    with pytest.raises(ValueError, match=r"the dataset has column\(s\) \['tag'\], which the rollout's sampler fills"):
        parts.maker.make({**BATCH, "tag": ["a", "b"]}, policy, None)


def test_the_sampler_metrics_are_those_of_the_rows_dynamic_sampling_keeps(tokenizer, policy):
    """Two generation rounds; the per-row metric is reduced over the rows trained on, found by row index."""
    lengths = (3, 3, 3, 3, 2, 5, 2, 5)  # round 1: group 1 all equal (dropped), group 2 varies; round 2 the same

    def by_length(prompts, completions, **kwargs):
        return [float(int(c.split()[1]) % 8 in (5, 7)) for c in completions]

    eos = tokenizer.eos_token_id
    parts = _Parts(tokenizer, reward_funcs=(by_length,), engine=FixedRolloutEngine(fixed_completions(lengths, 6, eos),
                                                                                   eos),
                   dynamic_sampling=True, max_num_gen_batches=2)
    sampler = TaggingSampler()
    parts.worker = RolloutWorker(parts.config, tokenizer, sampler=sampler)
    parts.worker.engine = parts.engine
    parts.maker = ExperienceMaker(parts.config, parts.worker, RewardSet.from_specs([by_length]),
                                  CompletionLogprobs(parts.config), events=parts._record)
    batches = iter([BATCH])
    experience = parts.maker.make(BATCH, policy, None, next_prompt_batch=lambda: next(batches, None))
    assert len(sampler.calls) == 2
    # kept: the informative group of each round (rows 4..7 of both), lengths 2, 5, 2, 5 twice
    assert experience.metrics["tags/length"] == pytest.approx(3.5)
    assert experience.metrics["tags/longest"] == 5.0


def test_rows_the_sampler_marks_unscored_get_no_loss_and_stay_out_of_their_groups(tokenizer, policy):
    """``RolloutOutput.unscored`` (a failed agent's episode under ``on_error="skip"``): as if every reward function
    returned None for those rows, whatever the functions say."""

    class Unscoring(FixedRolloutEngine):
        def generate(self, prompt_ids, num_generations, sampling):
            out = super().generate(prompt_ids, num_generations, sampling)
            out.unscored = torch.tensor([True, False, False, False, False, True, False, False])
            return out

    eos = tokenizer.eos_token_id
    parts = _Parts(tokenizer, engine=Unscoring(fixed_completions(LENGTHS, 6, eos), eos))
    experience = parts.maker.make(BATCH, policy, None)
    # rewards [-, 0, 1, 1 | 0, -, 0, 1]: groups of three, means 2/3 and 1/3, unbiased std sqrt(1/3) (+ eps 1e-4)
    std = (1 / 3) ** 0.5 + 1e-4
    expected = torch.tensor([0.0, -2 / 3, 1 / 3, 1 / 3, -1 / 3, 0.0, -1 / 3, 2 / 3]) / std
    torch.testing.assert_close(experience.advantages, expected)
    assert experience.completion_mask[[0, 5]].sum() == 0 and experience.completion_mask[[1, 2]].sum() > 0
