"""The rollout producer: a coroutine on a background thread's asyncio event loop (the engine's
:class:`~lightning_grpo.rollout.streaming.event_loop.EngineLoop`) that keeps groups in flight on a
:class:`~lightning_grpo.protocols.streaming.StreamingEngine`.

Threads: the loop's thread (it sends the requests, awaits the groups and the pooled rewards' calls), one scoring
thread (the plain reward functions, one group at a time, in the order their pooled results come in), the reward
pool's threads (the slow rewards, :mod:`lightning_grpo.rewards.pool`), and the trainer's thread,
which feeds prompts, takes finished groups and sends the weights (:mod:`lightning_grpo.rollout.streaming.stream`).
They share one :class:`~lightning_grpo.rollout.streaming.buffer.GroupBuffer`, whose bounds decide when a group
starts: the loop starts every group the bounds allow whenever it is woken (prompts fed, a group finished, taken or
dropped), in the order the prompts were fed.

A group whose engine is lost (:class:`~lightning_grpo.protocols.streaming.EngineUnavailable`) goes first in line
again, at most :data:`MAX_ATTEMPTS` times; anything else that fails (the engine, a reward function) is kept and
raised on the trainer's thread at its next take.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from lightning_grpo.protocols.streaming import EngineUnavailable, GroupRequest, StreamingEngine
from lightning_grpo.rollout.streaming.buffer import GroupBuffer
from lightning_grpo.rollout.streaming.event_loop import EngineLoop
from lightning_grpo.rollout.streaming.group_scoring import GroupScorer
from lightning_grpo.rollout.streaming.scored_groups import PromptItem

log = logging.getLogger(__name__)

#: Most times one prompt's group is sent to the engine before an engine that keeps failing stops the run.
MAX_ATTEMPTS = 16


class StreamingProducer:
    """Keeps groups in flight (see the module docstring).

    Args:
        engine: samples the groups.
        loop: the event loop the engine is driven from (the producer's coroutine runs there).
        buffer: the shared state (its bounds say when a group may start).
        request: the :class:`GroupRequest` of a prompt (sampling settings, G, seeds).
        scorer: scores a group as it arrives.
    """

    def __init__(self, engine: StreamingEngine, loop: EngineLoop, buffer: GroupBuffer,
                 request: Callable[[PromptItem], GroupRequest], scorer: GroupScorer) -> None:
        self.engine, self.loop, self.buffer, self.request, self.scorer = engine, loop, buffer, request, scorer
        self._main_task: Optional[Future] = None
        self._wake: Optional[asyncio.Event] = None
        self._closing = False
        self._scoring: Optional[ThreadPoolExecutor] = None
        buffer.on_change = self.wake

    @property
    def running(self) -> bool:
        return self._main_task is not None and not self._main_task.done()

    def start(self) -> None:
        """Start keeping groups in flight on the engine's loop (idempotent)."""
        if self.running:
            return
        self._closing = False
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_grpo_stream_scoring")
        started = threading.Event()
        self._main_task = self.loop.submit(self._main(started))
        started.wait()

    def wake(self) -> None:
        """Look for groups to start (from any thread)."""
        wake = self._wake
        if wake is not None:
            self.loop.call_soon(wake.set)

    def close(self) -> None:
        """Cancel the groups in flight (they stay in the buffer's ``in_flight``: a checkpoint samples them again) and
        stop; a later :meth:`start` starts again. The loop itself is the engine's."""
        if self._main_task is None:
            return
        self._closing = True
        self.wake()
        try:
            self._main_task.result()
        finally:
            self._main_task = None
            if self._scoring is not None:
                self._scoring.shutdown(wait=True, cancel_futures=True)
                self._scoring = None

    async def _main(self, started: threading.Event) -> None:
        self._wake = asyncio.Event()
        started.set()
        tasks: set[asyncio.Task] = set()
        try:
            while not self._closing:
                while (item := self.buffer.start_next()) is not None:
                    task = asyncio.create_task(self._group(item))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await self._wake.wait()
                self._wake.clear()
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._wake = None

    async def _group(self, item: PromptItem) -> None:
        """Sample one group, score it, hand it to the buffer."""
        try:
            group = await self.engine.sample_group(self.request(item))
        except EngineUnavailable as err:
            if item.attempts >= MAX_ATTEMPTS:
                self.buffer.fail(RuntimeError(f"group {item.key} was lost by {item.attempts} engines in a row: "
                                              f"{err}"))
                return
            log.warning("group %d: its engine was lost (%s); it is sampled again", item.key, err)
            self.buffer.resample(item)
            return
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - raised on the trainer's thread
            self.buffer.fail(err)
            return
        if group.request.key != item.key or len(group.completions) != group.request.num_generations:
            self.buffer.fail(ValueError(f"the streaming engine answered request {item.key} with group "
                                        f"{group.request.key} of {len(group.completions)} completions"))
            return
        try:
            out, started = self.scorer.start(item, group)
            if started is not None:  # the pooled rewards' calls, awaited without blocking the other groups
                await asyncio.gather(*(asyncio.wrap_future(f) for f in started.futures()), return_exceptions=True)
            loop = asyncio.get_running_loop()
            scored = await loop.run_in_executor(self._scoring, self.scorer.score, item, group, out, started)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - raised on the trainer's thread
            self.buffer.fail(err)
            return
        self.buffer.finish(item, scored)
