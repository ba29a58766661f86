"""CompletionLogprobs on its own: every forward layout (padded, packed, shared prefix; one or several rows per
pass) against a plain forward of each unpadded sequence, the no-grad batched pass, the forward-token counts and the
hand-over to a model that scores its own completions. A tiny random Llama, no GRPOModule, no Trainer."""

import contextlib

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_grpo import GRPOConfig
from lightning_grpo import functional as F
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.packing import arrange

#: rows 0, 1, 3 share a prompt, rows 4, 5 share another; row 2 has no loss tokens (masked or unscored)
GROUPS = ([0, 1, 3], [4, 5])


@pytest.fixture(scope="module")
def model(tiny_llama_path):
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    return policy.eval()


def _experience(vocab_size: int) -> Experience:
    g = torch.Generator().manual_seed(0)
    prompt_lengths, completion_lengths = [5, 5, 3, 5, 2, 2], [4, 1, 0, 3, 4, 2]
    prompt_ids = torch.zeros(6, 5, dtype=torch.long)
    prompt_mask = torch.zeros(6, 5, dtype=torch.long)
    for group in (*GROUPS, [2]):
        length = prompt_lengths[group[0]]
        ids = torch.randint(0, vocab_size, (length,), generator=g)
        for row in group:
            prompt_ids[row, 5 - length:], prompt_mask[row, 5 - length:] = ids, 1  # left-padded
    completion_mask = torch.tensor([[1] * n + [0] * (4 - n) for n in completion_lengths])
    return Experience(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                      completion_ids=torch.randint(0, vocab_size, (6, 4), generator=g), completion_mask=completion_mask,
                      advantages=torch.zeros(6))


def _plain(model, batch: Experience, config: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence alone, without padding, attention mask or position ids: ``(logprobs, entropy)`` at its loss
    tokens, 0 elsewhere."""
    logprobs, entropy = torch.zeros(batch.completion_ids.shape), torch.zeros(batch.completion_ids.shape)
    for row in range(len(batch)):
        n = int(batch.completion_mask[row].sum())
        if n == 0:
            continue
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
        targets = batch.completion_ids[row, :n]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, targets])[None]).logits[0]
        lp, ent = F.token_logprobs(logits[len(prompt) - 1: len(prompt) - 1 + n][None], targets[None],
                                   config.temperature, with_entropy=True, top_k=config.top_k, top_p=config.top_p,
                                   min_p=config.min_p)
        logprobs[row, :n], entropy[row, :n] = lp[0], ent[0]
    return logprobs, entropy


@pytest.mark.parametrize("padding_free, shared_prefix, packed_row_tokens", [
    (False, False, None),  # padded rows with an attention mask
    (True, False, None),  # packed, one sequence per pass
    (True, False, 10**6),  # packed, every sequence in one row
    (True, True, None),  # shared prefix, one group per pass
    (True, True, 10**6),  # shared prefix, every group in one row
])
@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 20}])
def test_every_layout_equals_a_plain_forward_of_each_sequence(model, padding_free, shared_prefix, packed_row_tokens,
                                                              sampling):
    config = GRPOConfig(padding_free=padding_free, shared_prefix=shared_prefix, packed_row_tokens=packed_row_tokens,
                        **sampling)
    computer = CompletionLogprobs(config)
    batch = _experience(model.config.vocab_size)
    assert computer.shared_prefix(model, batch) == (shared_prefix and padding_free)  # sdpa attention
    with torch.no_grad():
        logprobs, entropy = computer(model, batch, with_entropy=True)
    expected_logprobs, expected_entropy = _plain(model, batch, config)
    mask = batch.completion_mask.bool()
    assert logprobs.shape == (6, 4) and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs[mask], expected_logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], atol=1e-5, rtol=0)
    assert expected_logprobs[mask].abs().min() > 0  # real values, not an agreement of zeros
    if padding_free:  # only the loss tokens are computed
        assert (logprobs[~mask] == 0).all() and (entropy[~mask] == 0).all()


def test_batched_is_the_eval_mode_pass_in_any_chunking(model):
    config = GRPOConfig()
    batch = _experience(model.config.vocab_size)
    entered = []

    def forward_context():
        entered.append(1)
        return torch.autocast("cpu", enabled=False)

    model.train()
    try:
        whole = CompletionLogprobs(config).batched(model, batch, micro_batch_size=100, forward_context=forward_context)
        assert model.training  # the mode is restored
        singles = CompletionLogprobs(config).batched(model, batch, micro_batch_size=1)
        budget = CompletionLogprobs(config).batched(model, batch, micro_batch_size=1, max_tokens=12)
    finally:
        model.eval()
    assert entered == [1] and not whole.requires_grad
    expected, _ = _plain(model, batch, config)
    mask = batch.completion_mask.bool()
    for result in (whole, singles, budget):  # (a chunk without loss tokens takes the padded forward: compare the mask)
        assert result.shape == (6, 4)
        torch.testing.assert_close(result[mask], expected[mask], atol=1e-5, rtol=0)


def test_forward_tokens_counts_what_each_layout_computes(model):
    batch = _experience(model.config.vocab_size)
    completion = 4 + 1 + 3 + 4 + 2  # loss tokens; row 2 has none
    padded = CompletionLogprobs(GRPOConfig(padding_free=False))
    packed = CompletionLogprobs(GRPOConfig(padding_free=True, shared_prefix=False))
    shared = CompletionLogprobs(GRPOConfig(padding_free=True, shared_prefix=True))
    assert padded.forward_tokens(model, batch) == 6 * (5 + 4)
    assert packed.forward_tokens(model, batch) == (5 + 5 + 5 + 2 + 2) + completion  # the prompts of the loss rows
    assert shared.forward_tokens(model, batch) == (5 + 2) + completion  # each group's prompt once
    batch.completion_mask.zero_()
    assert shared.forward_tokens(model, batch) == 6 * (5 + 4)  # no loss token: the padded forward


class _ScoresItself(nn.Module):
    """A policy with its own completion logprobs (as Megatron's vocab-parallel ones)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def completion_logprobs(self, batch, temperature, with_entropy=False):
        self.calls.append((temperature, with_entropy))
        return torch.full(batch.completion_ids.shape, -0.5), None


def _own_scores(model, batch, temperature, with_entropy):
    """A backend's scorer (``GRPOModels.scorer``): the model scores its completions itself."""
    return model.completion_logprobs(batch, temperature, with_entropy=with_entropy)


def _with_scorer(config):
    computer = CompletionLogprobs(config)
    computer.use(_own_scores, sharded=False)
    return computer


def test_a_backends_scorer_gets_the_model_and_the_batch(model):
    """A backend that says its models score their completions themselves (Megatron) gets every call; the checks of
    what such a scorer cannot give (an entropy gradient, a truncated distribution) name the model."""
    batch = _experience(model.config.vocab_size)
    policy = _ScoresItself()
    logprobs, entropy = _with_scorer(GRPOConfig(temperature=0.7))(policy, batch, with_entropy=True)
    assert policy.calls == [(0.7, True)] and entropy is None and (logprobs == -0.5).all()
    with pytest.raises(ValueError, match=r"entropy_coef=0.01 needs the entropy's gradient.*_ScoresItself"):
        _with_scorer(GRPOConfig(entropy_coef=0.01))(policy, batch, entropy_grad=True)
    with pytest.raises(ValueError, match=r"top_k=5, top_p=1.0, min_p=0.0: _ScoresItself scores the untruncated"):
        _with_scorer(GRPOConfig(top_k=5))(policy, batch)
    # without a scorer the layouts' own forward runs (this module has none: nn.Module's unimplemented forward)
    with pytest.raises(TypeError, match="unexpected keyword argument 'input_ids'"):
        CompletionLogprobs(GRPOConfig())(policy, batch)


def test_a_scorer_that_replays_the_routing_itself_takes_the_policys_routing_only(model):
    """Position inputs need the forward layouts, which a scorer skips: an error, except the policy's routing for a
    scorer that replays the batches' routed experts itself (``GRPOModels.scorer_replays_routing``: Megatron's)."""
    batch = _experience(model.config.vocab_size)
    policy, routing, other = _ScoresItself(), lambda batch, source: contextlib.nullcontext(), object()
    for replays in (False, True):
        computer = CompletionLogprobs(GRPOConfig())
        computer.use_routing(routing)
        computer.use(_own_scores, sharded=False, scorer_replays_routing=replays)
        if replays:
            computer(policy, batch)
            computer.add_position_inputs(other)
        with pytest.raises(ValueError, match="_ScoresItself scores its completions itself, without the forward"):
            computer(policy, batch)
    assert len(policy.calls) == 1


class _RecordPositions:
    """A :class:`PositionInputs` that lays out the batch's own ids by each pass's source map and records them beside
    the ids the model's forward really receives (read by a forward pre-hook while its context is open)."""

    def __init__(self, model):
        self.model, self.pairs = model, []

    @contextlib.contextmanager
    def __call__(self, batch, source):
        arranged = arrange(batch.prompt_ids, batch.completion_ids, source)

        def capture(module, args, kwargs):
            self.pairs.append((arranged, kwargs["input_ids"].clone()))

        handle = self.model.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


@pytest.mark.parametrize("padding_free, shared_prefix, packed_row_tokens", [
    (False, False, None), (True, False, None), (True, False, 10**6), (True, True, None), (True, True, 10**6),
])
def test_position_inputs_see_each_layouts_ids_exactly(model, padding_free, shared_prefix, packed_row_tokens):
    # what a per-token field (routed experts, say) is replayed by: laid out by the pass's source map, it must sit on
    # exactly the token the forward computes at that position, in every layout (google/tunix PR #2046's failure)
    config = GRPOConfig(padding_free=padding_free, shared_prefix=shared_prefix, packed_row_tokens=packed_row_tokens)
    computer = CompletionLogprobs(config)
    recorder = _RecordPositions(model)
    computer.add_position_inputs(recorder)
    batch = _experience(model.config.vocab_size)
    with torch.no_grad():
        computer(model, batch)
    expected_passes = {(False, False, None): 1, (True, False, None): 5, (True, False, 10**6): 1,
                       (True, True, None): 2, (True, True, 10**6): 1}  # 5 rows with loss tokens, 2 prompts
    assert len(recorder.pairs) == expected_passes[(padding_free, shared_prefix, packed_row_tokens)]
    for arranged, input_ids in recorder.pairs:
        assert torch.equal(arranged, input_ids)
