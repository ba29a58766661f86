"""ExperienceFetcher on its own: a real DataLoader (through Lightning's CombinedLoader, as the fit loop sets it up) and
a small ExperienceSource, no model and no Trainer. The order of micro-batches, ``prepare_step`` with each step's
micro-batches before their first, ``current_step``, dynamic sampling's extra prompt batches, a failed rollout, the
resume position (exact continuation) and the prefetch schedule of asynchronous rollouts; that position through
GRPOFitLoop's checkpoint state (a bare Trainer, never fitted)."""

import io

import pytest
import torch
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader

from lightning_grpo.data.module import collate_prompts
from lightning_grpo.loop.fetcher import ExperienceFetcher
from lightning_grpo.loop.fit_loop import GRPOFitLoop, install_loop
from lightning_grpo.loop.resume import PARTIAL_KEY, PREFETCHED_KEY, PROMPT_BATCHES_KEY, RNG_KEY, ResumeState, rng_states
from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.training.experience import Experience, micro_batches

G = 2  # completions per prompt; prompt batches of 2: rollouts of 4 sequences


class Source:
    """An ExperienceSource whose rollout of a prompt batch ``["2", "3"]`` has prompt ids 2, 2, 3, 3, random
    completion ids (torch's global generator: a resume must restore it), and 2 optimizer steps of 2 micro-batches.

    ``log`` records ``("make", prompts)``, ``("prefetch", prompts)``, ``("prepare", micro-batches)`` and, from the
    consumer, ``("yield", micro-batch)``; ``steps`` the ``step`` each rollout was cut with."""

    def __init__(self, extra_batches: int = 0, ahead: int = 0, fail_at: int = -1):
        self.global_step = 0
        self.device = torch.device("cpu")
        self.log: list[tuple] = []
        self.steps: list[int] = []
        self.extra_batches, self.ahead, self.fail_at = extra_batches, ahead, fail_at
        self.fetcher = None
        self.seen_while_making: list[tuple] = []

    def make_experience(self, batch, next_prompt_batch=None, prefetched=None):
        prompts = list(batch["prompt"])
        if self.fetcher is not None:
            self.seen_while_making.append((self.fetcher.prompt_batches_drawn, self.fetcher.rollout_rng is not None))
        if len(self.seen_while_making) - 1 == self.fail_at:
            raise RolloutInterrupted("stopped")
        for _ in range(self.extra_batches):  # dynamic sampling: more prompt batches for the same rollout
            more = next_prompt_batch()
            prompts += [] if more is None else list(more["prompt"])
        self.log.append(("make", prompts))
        ids = torch.tensor([int(p) for p in batch["prompt"] for _ in range(G)]).unsqueeze(1)
        return Experience(prompt_ids=ids, prompt_mask=torch.ones_like(ids),
                          completion_ids=torch.randint(0, 1000, (len(ids), 3)),
                          completion_mask=torch.ones(len(ids), 3, dtype=torch.long),
                          advantages=torch.arange(len(ids), dtype=torch.float32) + 10 * ids.flatten())

    def micro_batches(self, experience, step=None):
        self.steps.append(step)
        return micro_batches(experience, mini_batch_size=2, accumulate_grad_batches=2, num_iterations=1,
                             loss_type="dapo", max_new_tokens=3, generator=torch.Generator().manual_seed(step))

    def micro_batches_per_rollout(self):
        return 4

    def prepare_step(self, members):
        self.log.append(("prepare", members))

    def rollouts_ahead(self, prompt_batches=None):
        return self.ahead

    def prefetch_rollout(self, batch):
        self.log.append(("prefetch", list(batch["prompt"])))
        ids = torch.tensor([int(p) for p in batch["prompt"] for _ in range(G)]).unsqueeze(1)
        output = RolloutOutput(prompt_ids=ids, prompt_mask=torch.ones_like(ids), completion_ids=ids,
                               completion_mask=torch.ones_like(ids), truncated=torch.zeros(len(ids), dtype=torch.bool),
                               completions=["x"] * len(ids))
        return PrefetchedRollout(batch, 0, G, SamplingConfig(max_new_tokens=1), self.global_step, output=output)

    def wait_for_rollouts(self):
        self.log.append(("wait",))


def _fetcher(source: Source, prompts: int, resume=None) -> ExperienceFetcher:
    """The fetcher over a DataLoader of ``prompts`` prompts "0", "1", ... in batches of 2, set up as the fit loop
    does."""
    data = DataLoader([{"prompt": str(i)} for i in range(prompts)], batch_size=2, collate_fn=collate_prompts)
    fetcher = ExperienceFetcher(source, source.micro_batches_per_rollout(), resume)
    fetcher.setup(CombinedLoader(data, mode="max_size_cycle"))
    iter(fetcher)
    source.fetcher = fetcher
    return fetcher


def _consume(fetcher: ExperienceFetcher, source: Source, count: int = 10**6) -> list[Experience]:
    """Up to ``count`` micro-batches, stepping the optimizer (``global_step``) after each step's last one."""
    out = []
    while len(out) < count:
        try:
            micro, index, dataloader_index = next(fetcher)
        except StopIteration:
            break
        assert (index, dataloader_index) == (fetcher.fetched - 1, 0)
        source.log.append(("yield", micro))
        out.append(micro)
        if micro.step_end:
            source.global_step += 1
    return out


def test_micro_batches_come_rollout_by_rollout_with_each_step_prepared_before_its_first():
    source = Source()
    fetcher = _fetcher(source, prompts=6)
    assert fetcher.length == 3 * 4  # prompt batches x micro-batches per rollout
    first = _consume(fetcher, source, 1)
    assert fetcher.current is first[0] and fetcher.current_step() == source.log[1][1]  # the step's micro-batches
    out = first + _consume(fetcher, source)
    assert len(out) == 12 and fetcher.done and fetcher.prompt_batches_drawn == 3
    kinds = [entry[0] for entry in source.log]
    rollout = ["make"] + ["prepare", "yield", "yield"] * 2
    assert kinds == rollout * 3  # a rollout is made only when the last one is used up
    assert [entry[1] for entry in source.log if entry[0] == "make"] == [["0", "1"], ["2", "3"], ["4", "5"]]
    for i, (kind, members) in enumerate(source.log):
        if kind == "prepare":  # exactly the next two micro-batches handed out, in order
            assert [entry[1] for entry in source.log[i + 1: i + 3]] == members
            assert [m.step_start for m in members] == [True, False] and [m.step_end for m in members] == [False, True]
    assert source.steps == [0, 2, 4]  # each rollout is cut (shuffled) with the optimizer step it was made at
    # each rollout's 4 sequences, once each
    assert [sorted(int(r) for mb in out[i: i + 4] for r in mb.rows) for i in (0, 4, 8)] == [[0, 1, 2, 3]] * 3
    assert [int(out[i].prompt_ids.max()) // 2 for i in (0, 4, 8)] == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(fetcher)


def test_dynamic_sampling_draws_more_prompt_batches_and_the_epoch_ends_with_the_data():
    source = Source(extra_batches=1)
    fetcher = _fetcher(source, prompts=10)  # 5 prompt batches: 2 per rollout
    out = _consume(fetcher, source)
    assert [entry[1] for entry in source.log if entry[0] == "make"] == [["0", "1", "2", "3"], ["4", "5", "6", "7"],
                                                                        ["8", "9"]]  # the last found no more
    assert len(out) == 12 and fetcher.done and fetcher.prompt_batches_drawn == 5


def test_a_failed_rollout_counts_as_not_drawn():
    source = Source(fail_at=1)
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 4)
    with pytest.raises(RolloutInterrupted):
        next(fetcher)
    # while a rollout is made, its prompt batch does not count yet and its RNG states are kept for a checkpoint
    assert source.seen_while_making == [(0, True), (1, True)]
    assert fetcher.prompt_batches_drawn == 1 and fetcher.rollout_rng is None
    assert fetcher.position() == (1, []) and fetcher.partial_rollout() is None  # regenerated on resume


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_resume_in_the_middle_of_a_rollout_continues_exactly():
    torch.manual_seed(0)
    reference = Source()
    expected = _consume(_fetcher(reference, prompts=6), reference)

    torch.manual_seed(0)
    source = Source()
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 6)  # rollout 1 and the first optimizer step of rollout 2
    drawn, prefetched = fetcher.position()
    assert (drawn, prefetched) == (2, [])
    state = _roundtrip({"drawn": drawn, "rng": rng_states(), "partial": fetcher.partial_rollout()})
    assert state["partial"]["step"] == 2 and state["partial"]["consumed"] == 2

    torch.manual_seed(123)  # the resumed process starts with other RNG states
    resumed = Source()
    resumed.global_step = 3
    fetcher = _fetcher(resumed, prompts=6, resume=ResumeState(prompt_batches=state["drawn"], rng=state["rng"],
                                                              partial=state["partial"]))
    fetcher.fetched = 6  # Lightning restores the micro-batches already trained on
    rest = _consume(fetcher, resumed)
    assert [entry[1] for entry in resumed.log if entry[0] == "make"] == [["4", "5"]]  # only the third is made
    assert len(rest) == 6
    for got, want in zip(rest, expected[6:], strict=True):
        for name in ("prompt_ids", "completion_ids", "advantages", "rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.step_start, got.step_end, got.on_policy) == (want.step_start, want.step_end, want.on_policy)


def test_a_checkpoint_inside_an_epoch_without_a_position_is_refused():
    fetcher = _fetcher(Source(), prompts=6, resume=ResumeState(prompt_batches=None))
    fetcher.fetched = 3
    with pytest.raises(ValueError, match="holds no 'prompt_batches_drawn': it was not written by GRPOFitLoop"):
        next(fetcher)


def test_asynchronous_rollouts_are_started_ahead_and_checkpointed_with_their_position():
    source = Source(ahead=1)
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 1)
    kinds = [(entry[0], entry[1]) for entry in source.log if entry[0] in ("prefetch", "make")]
    assert kinds == [("prefetch", ["0", "1"]), ("prefetch", ["2", "3"]), ("make", ["0", "1"])]
    fetcher.wait_for_rollouts()
    assert source.log[-1] == ("wait",)
    drawn, prefetched = fetcher.position()  # batch 0 is being trained on (a partial rollout), batch 1 generated ahead
    assert drawn == 2 and [entry["drawn_before"] for entry in prefetched] == [1]
    assert fetcher.partial_rollout()["consumed"] == 1
    assert prefetched[0]["rollout"]["batch"] == {"prompt": ["2", "3"]}
    _consume(fetcher, source)
    kinds = [(entry[0], entry[1]) for entry in source.log if entry[0] in ("prefetch", "make")]
    assert kinds[3:] == [("prefetch", ["4", "5"]), ("make", ["2", "3"]), ("make", ["4", "5"])]
    assert fetcher.done and fetcher.prompt_batches_drawn == 3


def test_the_fit_loop_checkpoints_the_fetchers_position_for_this_process(cpu_trainer):
    trainer = cpu_trainer(1, logger=False)
    loop = install_loop(trainer)
    assert isinstance(trainer.fit_loop, GRPOFitLoop) and install_loop(trainer) is loop  # idempotent
    source = Source()
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 6)
    loop.use_fetcher(fetcher)  # what setup_data does
    state = _roundtrip(loop.on_save_checkpoint())
    # one entry per process for the per-process parts
    assert state[PROMPT_BATCHES_KEY] == 2 and state[PREFETCHED_KEY] == [[]]
    assert len(state[RNG_KEY]) == 1 and torch.equal(state[RNG_KEY][0]["torch"], torch.get_rng_state())
    (partial,) = state[PARTIAL_KEY]
    assert partial["step"] == 2 and partial["consumed"] == 2
    assert torch.equal(partial["experience"]["advantages"], fetcher.partial_rollout()["experience"]["advantages"])
    loaded = install_loop(cpu_trainer(1, logger=False))
    loaded.on_load_checkpoint(state)
    resume = loaded.resume_state
    assert resume.prompt_batches == 2 and resume.partial["consumed"] == 2 and resume.prefetched == []
    state[RNG_KEY] = state[RNG_KEY] * 2  # written by two processes
    with pytest.raises(ValueError, match="the checkpoint's RNG states come from 2 processes but this run has 1"):
        install_loop(cpu_trainer(1, logger=False)).on_load_checkpoint(state)
