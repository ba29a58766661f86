"""ExperienceFetcher on its own: a real DataLoader (through Lightning's CombinedLoader, as the fit loop sets it up), a
small ExperienceSource and a LoopPlan, no model and no Trainer. The order of micro-batches, each step planned before
its first micro-batch and its plan on every one of them, dynamic sampling's extra prompt batches, a failed rollout, the
resume position (exact continuation) and the prefetch schedule of asynchronous rollouts; that position (the
RolloutCursor) through GRPOFitLoop's checkpoint state (a bare Trainer, never fitted), the earlier key layout too."""

import io

import pytest
import torch
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader

from lightning_grpo import GRPOConfig
from lightning_grpo.data.datamodule import collate_prompts
from lightning_grpo.loop.cursor import CURSOR_KEY, LEGACY_KEYS, PARTIAL, PREFETCHED, PROMPT_BATCHES, RNG
from lightning_grpo.loop.fetcher import ExperienceFetcher
from lightning_grpo.loop.fit_loop import GRPOFitLoop, install_loop
from lightning_grpo.loop.resume import REPLICAS_KEY
from lightning_grpo.loop.schedule import LoopPlan
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.training.experience import Experience, StepPlan

G = 2  # completions per prompt; prompt batches of 2: rollouts of 4 sequences


class Source:
    """An ExperienceSource whose rollout of a prompt batch ``["2", "3"]`` has prompt ids 2, 2, 3, 3, random
    completion ids (torch's global generator: a resume must restore it); its :meth:`plan` cuts a rollout into 2
    optimizer steps of 2 micro-batches (``mini_batch_size=2``, ``accumulate_grad_batches=2``), shuffled with the step
    it was made at, and ``ahead`` rollouts generated ahead (``max_staleness = 2 * ahead``).

    ``log`` records ``("make", prompts)``, ``("prefetch", prompts)``, ``("plan", micro-batches)`` and, from the
    consumer, ``("yield", micro-batch)``."""

    def __init__(self, extra_batches: int = 0, ahead: int = 0, fail_at: int = -1):
        self.global_step = 0
        self.log: list[tuple] = []
        self.extra_batches, self.ahead, self.fail_at = extra_batches, ahead, fail_at
        self.fetcher = None
        self.seen_while_making: list[tuple] = []

    def plan(self) -> LoopPlan:
        config = GRPOConfig(num_generations=G, mini_batch_size=2, loss_type="dapo", max_new_tokens=3,
                            max_staleness=2 * self.ahead)
        return LoopPlan(config, prompts_per_step=2, accumulate_grad_batches=2, data_parallel_size=1,
                        collectives=Collectives(), token_budget=None, plan_step=self.plan_step)

    def plan_step(self, members):
        self.log.append(("plan", list(members)))
        return [StepPlan(statistics={"step": self.global_step, "index": i}) for i in range(len(members))]

    def make_experience(self, batch, next_prompt_batch=None, prefetched=None):
        prompts = list(batch["prompt"])
        if self.fetcher is not None:
            cursor = self.fetcher.cursor
            self.seen_while_making.append((cursor.prompt_batches_drawn, cursor.rng is not None))
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
    fetcher = ExperienceFetcher(source, source.plan(), resume)
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


def test_micro_batches_come_rollout_by_rollout_with_each_step_planned_before_its_first():
    source = Source()
    fetcher = _fetcher(source, prompts=6)
    assert fetcher.length == 3 * 4  # prompt batches x micro-batches per rollout
    out = _consume(fetcher, source)
    assert len(out) == 12 and fetcher.done and fetcher.cursor.prompt_batches_drawn == 3
    assert fetcher.current is out[-1]  # the micro-batch handed out last (install_step_boundaries reads its flags)
    kinds = [entry[0] for entry in source.log]
    rollout = ["make"] + ["plan", "yield", "yield"] * 2
    assert kinds == rollout * 3  # a rollout is made only when the last one is used up
    assert [entry[1] for entry in source.log if entry[0] == "make"] == [["0", "1"], ["2", "3"], ["4", "5"]]
    for i, (kind, members) in enumerate(source.log):
        if kind == "plan":  # exactly the next two micro-batches handed out, in order, each carrying its plan
            handed = [entry[1] for entry in source.log[i + 1: i + 3]]
            assert all(a is b for a, b in zip(handed, members, strict=True))
            assert [m.step_start for m in members] == [True, False] and [m.step_end for m in members] == [False, True]
            step = members[0].step_plan.statistics["step"]
            assert [m.step_plan.statistics for m in members] == [{"step": step, "index": 0}, {"step": step, "index": 1}]
            assert members[0].step_plan.later == (members[1],) and members[1].step_plan.later == ()
            assert members[0].step_members() == (members[0], members[1])
    assert [entry[1][0].step_plan.statistics["step"] for entry in source.log if entry[0] == "plan"] == list(range(6))
    # each rollout is cut (shuffled) with the optimizer step it was made at: shuffle_seed (0) + 0, 2, 4
    for first, step in zip((0, 4, 8), (0, 2, 4), strict=True):
        order = torch.randperm(4, generator=torch.Generator().manual_seed(step))
        assert torch.cat([mb.rows for mb in out[first: first + 4]]).tolist() == order.tolist()
    assert [int(out[i].prompt_ids.max()) // 2 for i in (0, 4, 8)] == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(fetcher)


def test_dynamic_sampling_draws_more_prompt_batches_and_the_epoch_ends_with_the_data():
    source = Source(extra_batches=1)
    fetcher = _fetcher(source, prompts=10)  # 5 prompt batches: 2 per rollout
    out = _consume(fetcher, source)
    assert [entry[1] for entry in source.log if entry[0] == "make"] == [["0", "1", "2", "3"], ["4", "5", "6", "7"],
                                                                        ["8", "9"]]  # the last found no more
    assert len(out) == 12 and fetcher.done and fetcher.cursor.prompt_batches_drawn == 5


def test_a_failed_rollout_counts_as_not_drawn():
    source = Source(fail_at=1)
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 4)
    with pytest.raises(RolloutInterrupted):
        next(fetcher)
    # while a rollout is made, its prompt batch does not count yet and its RNG states are kept for a checkpoint
    assert source.seen_while_making == [(0, True), (1, True)]
    cursor = fetcher.cursor
    assert cursor.prompt_batches_drawn == 1 and cursor.rng is None
    assert cursor.position() == (1, []) and cursor.partial_rollout() is None  # regenerated on resume


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
    state = _roundtrip(fetcher.cursor.state_dict())
    assert set(state) == {PROMPT_BATCHES, RNG, PARTIAL, PREFETCHED}
    assert state[PROMPT_BATCHES] == 2 and state[PREFETCHED] == []
    assert state[PARTIAL]["step"] == 2 and state[PARTIAL]["consumed"] == 2

    torch.manual_seed(123)  # the resumed process starts with other RNG states
    resumed = Source()
    resumed.global_step = 3
    fetcher = _fetcher(resumed, prompts=6, resume=state)
    fetcher.fetched = 6  # Lightning restores the micro-batches already trained on
    rest = _consume(fetcher, resumed)
    assert [entry[1] for entry in resumed.log if entry[0] == "make"] == [["4", "5"]]  # only the third is made
    assert len(rest) == 6
    for got, want in zip(rest, expected[6:], strict=True):
        for name in ("prompt_ids", "completion_ids", "advantages", "rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.step_start, got.step_end, got.on_policy) == (want.step_start, want.step_end, want.on_policy)
    assert all(mb.step_plan is not None for mb in rest)  # the resumed steps are planned too


def test_a_checkpoint_inside_an_epoch_without_a_position_is_refused():
    fetcher = _fetcher(Source(), prompts=6, resume={PROMPT_BATCHES: None})
    fetcher.fetched = 3
    with pytest.raises(ValueError, match="holds no 'rollout_cursors': it was not written by GRPOFitLoop"):
        next(fetcher)


def test_asynchronous_rollouts_are_started_ahead_and_checkpointed_with_their_position():
    source = Source(ahead=1)
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 1)
    kinds = [(entry[0], entry[1]) for entry in source.log if entry[0] in ("prefetch", "make")]
    assert kinds == [("prefetch", ["0", "1"]), ("prefetch", ["2", "3"]), ("make", ["0", "1"])]
    fetcher.wait_for_rollouts()
    assert source.log[-1] == ("wait",)
    cursor = fetcher.cursor
    drawn, prefetched = cursor.position()  # batch 0 is being trained on (a partial rollout), batch 1 generated ahead
    assert drawn == 2 and [entry["drawn_before"] for entry in prefetched] == [1]
    assert cursor.partial_rollout()["consumed"] == 1
    assert prefetched[0]["rollout"]["batch"] == {"prompt": ["2", "3"]}
    _consume(fetcher, source)
    kinds = [(entry[0], entry[1]) for entry in source.log if entry[0] in ("prefetch", "make")]
    assert kinds[3:] == [("prefetch", ["4", "5"]), ("make", ["2", "3"]), ("make", ["4", "5"])]
    assert fetcher.done and fetcher.cursor.prompt_batches_drawn == 3


def test_the_fit_loop_checkpoints_every_processs_cursor(cpu_trainer):
    trainer = cpu_trainer(1, logger=False)
    loop = install_loop(trainer)
    assert isinstance(trainer.fit_loop, GRPOFitLoop) and install_loop(trainer) is loop  # idempotent
    source = Source()
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 6)
    loop.use_fetcher(fetcher)  # what setup_data does
    state = _roundtrip(loop.on_save_checkpoint())
    (cursor,) = state[CURSOR_KEY]  # one entry per process
    assert state[REPLICAS_KEY] == [None]
    assert cursor[PROMPT_BATCHES] == 2 and cursor[PREFETCHED] == []
    assert torch.equal(cursor[RNG]["torch"], torch.get_rng_state())
    assert cursor[PARTIAL]["step"] == 2 and cursor[PARTIAL]["consumed"] == 2
    assert torch.equal(cursor[PARTIAL]["experience"]["advantages"],
                       fetcher.cursor.partial_rollout()["experience"]["advantages"])
    loaded = install_loop(cpu_trainer(1, logger=False))
    loaded.on_load_checkpoint(state)
    resume = loaded.resume_state
    assert resume[PROMPT_BATCHES] == 2 and resume[PARTIAL]["consumed"] == 2 and resume[PREFETCHED] == []
    state[CURSOR_KEY] = state[CURSOR_KEY] * 2  # written by two processes
    with pytest.raises(ValueError, match="the checkpoint's rollout cursors come from 2 processes but this run has 1"):
        install_loop(cpu_trainer(1, logger=False)).on_load_checkpoint(state)


def test_a_checkpoint_of_the_earlier_key_layout_resumes_alike(cpu_trainer):
    """Before the cursor, the fit loop wrote one key per part: the prompt batches drawn once, the RNG states, partly
    used rollouts and prefetched rollouts each a list by global rank. Such a state loads into the same cursor state;
    per-process lists of different lengths are refused."""
    source = Source()
    fetcher = _fetcher(source, prompts=6)
    _consume(fetcher, source, 6)
    cursor = _roundtrip(fetcher.cursor.state_dict())
    earlier = {"prompt_batches_drawn": cursor[PROMPT_BATCHES], "rng_states": [cursor[RNG]],
               "partial_rollouts": [cursor[PARTIAL]], "prefetched_rollouts": [cursor[PREFETCHED]]}
    assert sorted(earlier) == sorted(LEGACY_KEYS)
    loop = install_loop(cpu_trainer(1, logger=False))
    loop.on_load_checkpoint(earlier)
    resume = loop.resume_state
    assert sorted(resume) == sorted(cursor) and resume[PROMPT_BATCHES] == 2 and resume[PREFETCHED] == []
    assert resume[PARTIAL]["consumed"] == 2 and torch.equal(resume[RNG]["torch"], cursor[RNG]["torch"])
    assert torch.equal(resume[PARTIAL]["experience"]["completion_ids"], cursor[PARTIAL]["experience"]["completion_ids"])
    earlier["rng_states"] = earlier["rng_states"] * 2
    with pytest.raises(ValueError, match="per-process lists of different lengths"):
        install_loop(cpu_trainer(1, logger=False)).on_load_checkpoint(earlier)
