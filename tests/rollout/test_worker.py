"""RolloutWorker on its own: the weight-sync schedule (``engine.sync_every``, forced syncs, versions and events), the
``prepare``/``awake`` contract (NaN check, wake, sync, sleep, ``sync_s``), the engine's declared capabilities and prompt
encoding. A recording engine and a small module as the policy, no GRPOModule, no Trainer."""

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

from lightning_grpo import GRPOConfig
from lightning_grpo.config import EngineConfig, ResolvedConfig
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.engine import EngineWrapper
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.adapter import CoreEngineAdapter
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.strategies.module_weights import ModuleWeights
from lightning_grpo.training import metrics as metrics_module
from lightning_grpo.training.metrics import StepTimer
from lightning_grpo.training.nonfinite import NonFiniteError
from support.algorithm import FixedRolloutEngine, fixed_completions
from support.engines import RecordingEngine, weights_of

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def _worker(tokenizer, **config):
    events = []
    worker = RolloutWorker(GRPOConfig(**config), tokenizer, events=lambda name, payload: events.append((name, payload)))
    return worker, events


def _engine(**kwargs):
    return RecordingEngine(fixed_completions([3, 2, 4, 1], 4, EOS), EOS, **kwargs)


def _policy():
    torch.manual_seed(0)
    return nn.Linear(2, 2)


def _step(worker, policy):
    """An optimizer step: the policy's weights change and the worker's version goes up."""
    with torch.no_grad():
        policy.weight.add_(1.0)
    worker.mark_stale()


def _syncs(engine):
    return [entry[1] for entry in engine.log if entry[0] == "sync"]


def test_an_engine_with_its_own_weights_is_synced_every_sync_every_steps(tokenizer):
    worker, events = _worker(tokenizer, engine=EngineConfig(sync_every=2))
    policy, engine = _policy(), _engine()
    worker.engine = engine
    assert worker.engine is engine and worker.engine_version == -1  # never synced
    worker.prepare(policy)  # the first rollout gets the policy's weights
    first = weights_of(policy)
    assert engine.log == [("wake_up",), ("sync", first)] and worker.engine_version == 0
    _step(worker, policy)
    worker.prepare(policy)  # 1 step behind < sync_every: no sync
    assert _syncs(engine) == [first] and worker.engine_version == 0
    _step(worker, policy)
    worker.prepare(policy)  # 2 steps behind
    assert _syncs(engine)[-1] == weights_of(policy) and worker.engine_version == worker.weights_version == 2
    _step(worker, policy)
    worker.prepare(policy, force_sync=True)  # forced (e.g. before validation): 1 step behind is enough
    worker.prepare(policy, force_sync=True)  # nothing new: no sync
    assert len(_syncs(engine)) == 3 and worker.engine_version == 3
    assert events == [("on_weights_synced", 0), ("on_weights_synced", 2), ("on_weights_synced", 3)]
    assert [entry[0] for entry in engine.log].count("wake_up") == 5  # every prepare wakes the engine


def test_an_engine_that_is_the_policy_is_synced_at_the_first_rollout_after_each_step(tokenizer):
    worker, events = _worker(tokenizer)
    policy = _policy()
    worker.engine = FixedRolloutEngine(fixed_completions([3], 4, EOS), EOS)  # uses_policy_parameters
    assert worker.engine_version == 0
    worker.prepare(policy)
    assert events == []  # it generates with the policy itself: nothing to push before the first rollout
    _step(worker, policy)
    worker.prepare(policy)
    worker.prepare(policy)
    assert events == [("on_weights_synced", 1)]


def test_awake_wakes_syncs_then_sleeps_on_exit_also_after_an_error(tokenizer):
    worker, _ = _worker(tokenizer)
    policy, engine = _policy(), _engine()
    worker.engine = engine
    with worker.awake(policy) as awake:
        assert awake is engine and engine.log == [("wake_up",), ("sync", weights_of(policy))]
    assert engine.log[-1] == ("sleep", 1)
    with pytest.raises(KeyError):
        with worker.awake(policy):
            raise KeyError("in the rollout")
    assert engine.log[-2:] == [("wake_up",), ("sleep", 1)]


def test_a_policy_with_nonfinite_weights_is_never_sampled_from(tokenizer):
    worker, events = _worker(tokenizer)
    policy, engine = _policy(), _engine()
    worker.engine = engine
    with torch.no_grad():
        policy.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="before sampling a rollout: weight"):
        worker.prepare(policy)
    assert engine.log == [] and events == []  # not even woken


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_wake_up_and_sync_count_as_sync_s(tokenizer, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(metrics_module.time, "perf_counter", clock)

    class Slow(RecordingEngine):
        def wake_up(self):
            clock.now += 1.0

        def sync_weights(self, weights):
            clock.now += 2.0

    worker, _ = _worker(tokenizer)
    worker.engine = Slow(fixed_completions([3], 4, EOS), EOS)
    timer = StepTimer()
    worker.prepare(_policy(), timer=timer)
    assert timer.get("sync_s") == 3.0 and timer.get("rollout_s") == 0.0


class _CoreOnly:
    """A user engine with only the core members."""

    pad_token_id = EOS

    def __init__(self):
        self.synced = 0

    def generate(self, prompt_ids, num_generations, sampling):
        raise NotImplementedError

    def sync_weights(self, weights):
        self.synced += 1


def test_engine_capabilities_decide_the_sync_and_asynchronous_rollouts(tokenizer):
    worker, _ = _worker(tokenizer)
    user = _CoreOnly()
    worker.engine = user  # adapted: lifecycle no-ops, its own weights
    assert isinstance(worker.engine, CoreEngineAdapter) and worker.engine_version == -1
    with worker.awake(_policy()):
        pass
    assert user.synced == 1
    asynchronous, _ = _worker(tokenizer, max_staleness=2)
    asynchronous.engine = _engine()  # its own weights: fine
    with pytest.raises(ValueError, match="max_staleness=2 needs a rollout engine with its own copy of the weights"):
        asynchronous.engine = FixedRolloutEngine(fixed_completions([3], 4, EOS), EOS)
    with pytest.raises(TypeError, match="object is not a rollout engine: it lacks generate, sync_weights"):
        worker.engine = object()


def test_no_engine_before_start_and_start_keeps_a_given_engine(tokenizer):
    worker, _ = _worker(tokenizer)
    with pytest.raises(RuntimeError, match="the rollout engine is not started: call RolloutWorker.start"):
        worker.prepare(_policy())
    engine = _engine()
    worker.engine = engine
    resolved = ResolvedConfig("hf")
    assert worker.start(_policy(), lambda: "unused", resolved) is resolved  # the engine is not replaced
    assert worker.engine is engine and worker.own_engine is engine and not worker.made_engine


def test_a_backend_wraps_the_engine_for_a_stage_and_the_engine_stays_after_it(tokenizer):
    """``attach`` gives the stage's wrapper and the backend's weights (synced from), ``detach`` goes back to the
    engine as it was given; the engine is never closed by the worker when it was given."""
    worker, _ = _worker(tokenizer)
    engine, policy = _engine(), _policy()
    worker.engine = engine
    wrapper = EngineWrapper(engine)
    stream = ModuleWeights(policy)
    worker.attach(wrapper, stream)
    assert worker.engine is wrapper and worker.own_engine is engine and worker.weights is stream
    worker.prepare(nn.Linear(2, 2))  # the backend's weights are synced, not the module given to prepare
    assert _syncs(engine) == [weights_of(policy)]
    worker.detach()
    worker.close()
    assert worker.engine is engine and ("close",) not in engine.log


def test_prompts_are_encoded_and_truncated_from_the_left_before_the_engine(tokenizer):
    worker, _ = _worker(tokenizer, max_prompt_length=8)
    engine = _engine()
    worker.engine = engine
    prompts = ["a short one", "one two three four five six seven eight nine ten eleven twelve"]
    ids, truncated = worker.encode_prompts(prompts)
    assert truncated == 1 and len(ids[1]) == 8
    assert ids[0] == tokenizer(prompts[0])["input_ids"] and ids[1] == tokenizer(prompts[1])["input_ids"][-8:]
    out = worker.sample_prompts(prompts, 2, SamplingConfig(max_new_tokens=4))
    assert engine.prompts == [ids] and len(out.completions) == 4


class _Encoder:
    def encode_prompts(self, prompts, max_prompt_length):
        return [[len(p), max_prompt_length] for p in prompts], 0


class _Sampler:
    def __init__(self):
        self.calls = []

    def sample(self, engine, prompts, num_generations, sampling, any_process=None):
        self.calls.append((prompts.ids, num_generations, prompts.rows, prompts.images, any_process))
        return engine.generate(prompts.ids, num_generations, sampling)


def test_every_rollout_goes_through_the_prompt_encoder_and_sampler_it_was_made_with(tokenizer):
    """The rollout path is given at construction (single-turn by default); the worker passes one record of the
    prompts (their ids, images and dataset rows) and, on the trainer's thread, the processes' agreement."""
    default = RolloutWorker(GRPOConfig(), tokenizer)
    assert type(default.prompts).__name__ == "TemplatePrompts" and type(default.sampler).__name__ == "SingleTurnSampler"
    sampler = _Sampler()
    worker = RolloutWorker(GRPOConfig(max_prompt_length=9), tokenizer, prompts=_Encoder(), sampler=sampler)
    engine = _engine()
    worker.engine = engine
    agree = Collectives()
    worker.sample_prompts(["ab", "abc"], 2, SamplingConfig(max_new_tokens=4), [{"x": 1}, {"x": 2}], agree)
    worker.sample_prompts(["abcd"], 1, SamplingConfig(max_new_tokens=4))
    assert engine.prompts == [[[2, 9], [3, 9]], [[4, 9]]]
    assert sampler.calls == [([[2, 9], [3, 9]], 2, [{"x": 1}, {"x": 2}], [(), ()], agree.any_process),
                             ([[4, 9]], 1, [{}], [()], None)]


#: A chat template that writes the text parts of a message's content and nothing of its image parts: with it, a causal
#: LM's prompt with pictures would encode as the text alone (the images silently dropped).
TEXT_PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", ["own", "text_parts"])
def test_image_prompts_for_a_causal_lm_are_refused_before_the_engine(tokenizer, template):
    """A causal LM has no image encoder: a prompt with an image part is refused naming it (its index, message and
    part), whether the chat template would fail on the part list (SmolLM2's own) or write its text alone; the engine
    generates nothing. A prompt without image parts is a text prompt (text parts where the template writes them)."""
    from support.vision import image_prompt, picture

    if template == "text_parts":
        tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
        tokenizer.chat_template = TEXT_PARTS_TEMPLATE
    worker, _ = _worker(tokenizer)
    engine = _engine()
    worker.engine = engine
    text = [{"role": "user", "content": "What colour?"}]
    if template == "text_parts":
        text = [{"role": "user", "content": [{"type": "text", "text": "What colour?"}]}]
    pictured = [{"role": "system", "content": "Look."}, *image_prompt("What colour?", picture(), picture("blue"))]
    with pytest.raises(ValueError, match=r"prompts\[1\] has 2 image part\(s\) \(message 1 part 0 is .*not a "
                                         r"vision-language model"):
        worker.sample_prompts([text, pictured], 2, SamplingConfig(max_new_tokens=4))
    assert engine.prompts == []
    worker.sample_prompts([text], 2, SamplingConfig(max_new_tokens=4))
    assert len(engine.prompts) == 1


def test_an_image_column_for_a_causal_lm_is_refused_naming_the_column(tokenizer):
    worker, _ = _worker(tokenizer)
    worker.check_image_column(None)  # text prompts
    with pytest.raises(ValueError, match=r"image column 'picture' \(PromptDataModule\(image_field='picture'\)\).*"
                                         r"not a vision-language model"):
        worker.check_image_column("picture")
