"""The user ids of concurrent ``rlimits`` runs (lightning_grpo/sandbox/users.py): never two holders of one id, in
this process or another, an id free again when its run ends, a wait when all are held, a lock folder no one else
may open. The ids are only locked here, never used: no process runs as them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from lightning_grpo.sandbox import users
from lightning_grpo.sandbox.users import run_user


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """A temporary folder of this test's own (the lock folder goes in it)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    return tmp_path


def test_concurrent_holders_get_distinct_ids_and_ids_come_back():
    with run_user(1000, 3) as a, run_user(1000, 3) as b, run_user(1000, 3) as c:
        assert sorted({a, b, c}) == [1000, 1001, 1002]
    with run_user(1000, 1) as again:  # all released
        assert again == 1000


def test_another_process_never_gets_a_held_id(private_tmp):
    # a fresh interpreter with the standard library and sandbox/users.py only (the package's imports take seconds)
    code = ("import importlib.util, sys\nspec = importlib.util.spec_from_file_location('users', sys.argv[1])\n"
            "users = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(users)\n"
            "with users.run_user(500, 2) as uid:\n    print(uid)\n")
    env = {**os.environ, "TMPDIR": str(private_tmp)}
    with run_user(500, 2) as mine:
        theirs = subprocess.run([sys.executable, "-I", "-c", code, users.__file__], capture_output=True, text=True,
                                env=env, check=True, timeout=60).stdout.strip()
        assert {mine, int(theirs)} == {500, 501}


def test_a_holder_waits_while_every_id_is_held():
    got: list[tuple[int, float]] = []
    with run_user(7, 1) as first:
        waiter = threading.Thread(target=lambda: got.append(_hold(7, 1)))
        waiter.start()
        time.sleep(0.3)
        assert got == []  # still waiting
        released = time.monotonic()
    waiter.join(timeout=10)
    assert first == 7 and got and got[0][0] == 7 and got[0][1] >= released


def _hold(base: int, count: int) -> tuple[int, float]:
    with run_user(base, count) as uid:
        return uid, time.monotonic()


def test_a_lock_folder_others_may_open_is_refused(private_tmp):
    folder = private_tmp / users.LOCK_FOLDER
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match=r"no one else may open \(owner \d+, mode 0o777\)"):
        with run_user(1, 1):
            pass


def test_bad_ranges_are_errors():
    with pytest.raises(ValueError, match=r"run_user\(base=1, count=0\): both must be >= 1"):
        with run_user(1, 0):
            pass


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root trainer takes an id of its own under rlimits")
def test_a_planted_lock_folder_makes_sandbox_run_raise_permission_error(private_tmp):
    """``Sandbox.run`` under ``rlimits`` as root: a lock folder others may open (planted, or opened up) is refused
    with a ``PermissionError`` naming it, before anything runs; removed, runs go on."""
    from lightning_grpo.sandbox import Sandbox, SandboxLimits

    sandbox = Sandbox(SandboxLimits(wall_s=30.0), isolation="rlimits")
    assert sandbox.mechanism == "rlimits"
    folder = private_tmp / users.LOCK_FOLDER
    folder.mkdir(mode=0o700, exist_ok=True)
    folder.chmod(0o777)
    command = [sandbox.python, "-I", "-S", "-c", "print('ran')"]  # no file: this test's folder is root's only
    with pytest.raises(PermissionError, match=rf"{folder}: must be a folder of user 0 that no one else may open"):
        sandbox.run(command)
    for entry in folder.iterdir():
        entry.unlink()
    folder.rmdir()
    assert sandbox.run(command).stdout == "ran\n"
