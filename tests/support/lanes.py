"""The ``engine`` lane enforced: a test that builds a vLLM engine in this process, or starts a rollout server, and
is not marked ``engine`` fails with a message saying so (so ``-m "not slow and not distributed and not engine"``
really is the quick unit lane). ``conftest.py`` sets :data:`CURRENT` to the running test (setup, call, teardown) and
wraps ``VLLMRolloutEngine.__init__`` once per session; :class:`support.rollout_server.Server` asks too."""

from __future__ import annotations

import functools
from typing import Any, Optional

#: The test being set up, run or torn down (None between tests).
CURRENT: Optional[Any] = None


def require_engine_lane(what: str) -> None:
    """Fail unless the running test is marked ``engine``. ``what``: what it does, for the message."""
    if CURRENT is not None and CURRENT.get_closest_marker("engine") is None:
        raise AssertionError(f"{CURRENT.nodeid} {what} but is not marked engine: mark it @pytest.mark.engine (or "
                             "take the session's pooled engine with the vllm_engine fixture, which marks it)")


def watch_vllm_constructions() -> None:
    """Wrap ``VLLMRolloutEngine.__init__`` (the product class, unchanged otherwise) with the lane check."""
    from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine

    init = VLLMRolloutEngine.__init__
    if getattr(init, "_lane_checked", False):
        return

    @functools.wraps(init)
    def checked(self, *args: Any, **kwargs: Any) -> None:
        require_engine_lane("builds a vLLM engine")
        init(self, *args, **kwargs)

    checked._lane_checked = True  # type: ignore[attr-defined]
    VLLMRolloutEngine.__init__ = checked  # type: ignore[method-assign]
