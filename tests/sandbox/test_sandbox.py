"""The sandbox against what an adversarial completion would try, under every isolation mechanism this machine has.

Each case is bounded: CPU 1 s, wall clock 30 s (3 s for the cases about the wall clock; a loaded machine can take
seconds to start Python), 256 MiB of address space (the 10 GB allocation fails at once, nothing
is allocated on the host), 16 processes, 64 KiB of output. Every case checks that the run was stopped or refused,
that this (the trainer's) process goes on (it forks and runs a command afterwards), and that no process of the run
is left. Files the tests plant outside the sandbox are never readable from it: under bubblewrap they do not exist
there; under the fallbacks (``unshare``, ``rlimits``), which share the host's filesystem, they are protected by
their permissions (the run is ``nobody``), and a world-readable file IS readable, which a test asserts so the docs'
statement stays true.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_grpo.sandbox import Sandbox, SandboxLimits
from lightning_grpo.sandbox.runner import _probed
from lightning_grpo.sandbox.users import LOCK_FOLDER, RUN_UID_BASE, RUN_UIDS
from lightning_grpo.sandbox.workdir import PREFIX

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")

LIMITS = SandboxLimits(wall_s=30.0, cpu_s=1, memory_bytes=256 << 20, max_processes=16, output_bytes=64 << 10)
#: For the cases stopped by the wall clock.
SHORT = SandboxLimits(wall_s=3.0, cpu_s=1, memory_bytes=256 << 20, max_processes=16, output_bytes=64 << 10)
AS_ROOT = os.geteuid() == 0


def _available() -> list[str]:
    found = []
    for mechanism in ("bwrap", "unshare", "rlimits"):
        sandbox = Sandbox(LIMITS, isolation=mechanism)
        try:
            assert sandbox.mechanism == mechanism
        except RuntimeError:
            continue
        found.append(mechanism)
    return found


MECHANISMS = _available()


@pytest.fixture(params=MECHANISMS)
def sandbox(request) -> Sandbox:
    return Sandbox(LIMITS, isolation=request.param)


@pytest.fixture
def secret_file(tmp_path) -> Path:
    """A file of the trainer's, outside the sandbox: mode 0600 in a 0700 folder (like ~/.ssh or an HF token)."""
    folder = tmp_path / "trainer_secrets"
    folder.mkdir(mode=0o700)
    path = folder / "token.txt"
    path.write_text("SECRET-" + uuid.uuid4().hex)
    path.chmod(0o600)
    return path


def _run(sandbox: Sandbox, source: str, *args: str):
    """Run ``source`` with a unique marker in its command line; afterwards no process with the marker is left."""
    marker = f"lgs-{uuid.uuid4().hex}"
    result = sandbox.run([sandbox.python, "-s", "main.py", marker, *args], {"main.py": source})
    assert _processes_with(marker) == [], "processes of the run were left behind"
    assert subprocess.run(["true"]).returncode == 0  # the trainer's process still forks and runs commands
    return result


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _processes_running(command: bytes) -> list[int]:
    """The processes whose command line is exactly ``command`` (its arguments joined by NUL)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().rstrip(b"\0") == command:
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_some_mechanism_works_and_auto_picks_the_strongest():
    assert MECHANISMS, f"no isolation mechanism works: {_probed}"
    assert Sandbox(LIMITS).mechanism == MECHANISMS[0]


def test_a_run_gets_its_files_stdin_a_clean_environment_and_a_fresh_directory(sandbox, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_trainer_secret")
    source = ("import os, sys\nprint(sorted(os.listdir('.')), sys.stdin.read(), open('data.txt').read())\n"
              "print(sorted(os.environ))\nopen('out.txt', 'w').write('x')\nprint(os.getuid())")
    result = sandbox.run_python(source, stdin=b"from-stdin", files={"data.txt": "given"})
    assert result.status == "ok" and result.isolation == sandbox.mechanism, result
    listing, env, uid = result.stdout.splitlines()
    assert listing == "['data.txt', 'main.py'] from-stdin given"
    assert "HF_TOKEN" not in env and "hf_trainer_secret" not in result.stdout
    names = {"HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "TMPDIR"}
    assert env in (str(sorted(names)), str(sorted(names | {"PWD"}))), env  # bubblewrap's shell-less exec sets PWD
    if sandbox.mechanism != "rlimits":
        assert uid == "65534"  # nobody (inside its user namespace, and outside when the trainer is root)
    elif AS_ROOT:  # a user id of its own (lightning_grpo/sandbox/users.py)
        assert RUN_UID_BASE <= int(uid) < RUN_UID_BASE + RUN_UIDS, uid
    again = sandbox.run_python("import os; print(sorted(os.listdir('.')))")
    assert again.stdout.strip() == "['main.py']"  # a fresh directory per run


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(sandbox):
    result = _run(sandbox, "while True:\n    pass\n")
    assert result.status == "cpu_limit", result  # SIGXCPU at 1 CPU second


def test_a_sleeping_loop_and_its_children_are_killed_at_the_wall_clock_limit(sandbox):
    sandbox = Sandbox(SHORT, isolation=sandbox.mechanism)
    source = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]])\n"
              "while True:\n    time.sleep(1)\n")
    result = _run(sandbox, source)  # _run: neither the loop nor its child (same marker) is left
    assert result.status == "timeout" and result.returncode is None, result


def test_a_fork_bomb_is_bounded_and_killed(sandbox):
    sandbox = Sandbox(SHORT, isolation=sandbox.mechanism)
    source = ("import os\nforks = 0\nwhile True:\n    try:\n        os.fork()\n        forks += 1\n"
              "    except OSError:\n        pass\n")
    result = _run(sandbox, source)
    assert result.status in ("timeout", "cpu_limit"), result


def test_a_fork_bomb_stops_at_the_process_limit(sandbox):
    """The number of processes a run can have is ``max_processes`` (counted in the run's own user namespace under
    bubblewrap and unshare)."""
    if sandbox.mechanism == "rlimits" and not AS_ROOT:
        pytest.skip("the rlimits fallback counts all processes of the trainer's own user")
    source = ("import os, time\nn = 1\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
              "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint(n)\n")
    result = _run(sandbox, source)
    assert result.status == "ok", result
    assert int(result.stdout) <= LIMITS.max_processes


@pytest.mark.skipif("rlimits" not in MECHANISMS or not AS_ROOT, reason="rlimits as root: a user id per run")
def test_concurrent_rlimits_runs_neither_share_a_process_budget_nor_signal_each_other():
    """Under ``rlimits`` (no namespaces) the kernel counts ``RLIMIT_NPROC`` per user id: a run holding its whole
    budget must not leave a concurrent run unable to fork, nor may one run signal another's processes (a completion
    would change how another is scored). Bounded: 16 sleeping processes at most, 8 s of wall clock each run."""
    sandbox = Sandbox(SandboxLimits(wall_s=8.0, cpu_s=1, memory_bytes=256 << 20, max_processes=16,
                                    output_bytes=64 << 10), isolation="rlimits")
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o777)  # the two runs (two users) meet here: the holder writes a pid, the other reads it
        pid_file = os.path.join(folder, "pid")
        holder = ("import os, sys, time\nkids = []\nwhile True:\n    try:\n        pid = os.fork()\n"
                  "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
                  "    kids.append(pid)\nopen(sys.argv[1] + '.tmp', 'w').write(str(kids[0]))\n"
                  "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\ntime.sleep(30)\n")
        other = ("import os, subprocess, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"
                 "try:\n    os.kill(int(open(sys.argv[1]).read()), 9)\n    print('killed')\n"
                 "except PermissionError:\n    print('refused')\n"
                 "print(subprocess.run(['/bin/echo', 'forked'], capture_output=True, text=True).stdout.strip())\n"
                 "print(os.getuid())\n")

        def run(source: str):
            return sandbox.run([sandbox.python, "-s", "main.py", pid_file], {"main.py": source})

        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(run, holder)
            result = pool.submit(run, other).result(timeout=60)
            held_result = held.result(timeout=60)
    assert result.status == "ok", result
    refused, forked, uid = result.stdout.split()
    assert (refused, forked) == ("refused", "forked"), result.stdout
    assert held_result.status == "timeout", held_result  # it slept on, its whole budget held, until the wall clock
    assert RUN_UID_BASE <= int(uid) < RUN_UID_BASE + RUN_UIDS


def test_allocating_10_gb_fails_inside_the_run(sandbox):
    result = _run(sandbox, "block = bytearray(10 * 2**30)\nprint('allocated')\n")
    assert result.status == "error" and "MemoryError" in result.stderr and "allocated" not in result.stdout, result


def test_the_trainers_files_are_not_readable(sandbox, secret_file):
    result = _run(sandbox, "import sys\nprint(open(sys.argv[2]).read())\n", str(secret_file))
    assert result.status == "error", result
    assert secret_file.read_text() not in result.stdout + result.stderr
    error = "FileNotFoundError" if sandbox.mechanism == "bwrap" else "PermissionError"
    assert error in result.stderr, result.stderr


def test_world_readable_files_exist_only_outside_bubblewrap(sandbox):
    """What the fallbacks do NOT guarantee (docs/rewards.md): a world-readable file in a world-readable folder."""
    folder = Path(tempfile.mkdtemp(prefix="lightning_grpo_public_"))
    try:
        path = folder / "public.txt"
        path.write_text("PUBLIC")
        path.chmod(0o644)
        folder.chmod(0o755)
        result = _run(sandbox, "import sys\nprint(open(sys.argv[2]).read())\n", str(path))
        if sandbox.mechanism == "bwrap":
            assert result.status == "error" and "FileNotFoundError" in result.stderr, result
        elif AS_ROOT or sandbox.mechanism == "unshare":
            assert result.stdout.strip() == "PUBLIC", result  # the fallbacks share the host's filesystem
    finally:
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


def test_the_trainers_environment_is_not_readable(sandbox, monkeypatch):
    monkeypatch.setenv("LIGHTNING_GRPO_TEST_SECRET", "env-secret-value")
    source = "import os, sys\nprint(dict(os.environ))\nprint(open('/proc/%s/environ' % sys.argv[2], 'rb').read())\n"
    result = _run(sandbox, source, str(os.getpid()))
    assert "env-secret-value" not in result.stdout + result.stderr
    assert result.status == "error", result  # /proc/<trainer>/environ: not there (PID namespace) or not allowed
    assert "FileNotFoundError" in result.stderr or "PermissionError" in result.stderr, result.stderr


def test_no_network(sandbox):
    """A listener of the trainer's on 127.0.0.1 is unreachable from a run with its own network namespace."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        source = ("import socket, sys\ns = socket.create_connection(('127.0.0.1', int(sys.argv[2])), timeout=2)\n"
                  "s.sendall(b'exfiltrated')\nprint('connected')\n")
        result = _run(sandbox, source, str(port))
        if sandbox.mechanism == "rlimits":
            assert result.stdout.strip() == "connected"  # the rlimits fallback has no network isolation (docs)
            return
        assert result.status == "error" and "connected" not in result.stdout, result
        assert "ConnectionRefusedError" in result.stderr or "Network is unreachable" in result.stderr, result.stderr
        with pytest.raises(TimeoutError):
            server.accept()


def test_writing_outside_the_run_directory_is_refused(sandbox, tmp_path):
    target = tmp_path / "written_by_the_sandbox.txt"
    source = "import sys\nopen(sys.argv[2], 'w').write('pwned')\nprint('wrote')\n"
    result = _run(sandbox, source, str(target))
    assert result.status == "error" and "wrote" not in result.stdout, result
    assert not target.exists()
    usr = _run(sandbox, "open('/usr/lightning_grpo_pwned', 'w').write('x')\n")
    assert usr.status == "error" and not os.path.exists("/usr/lightning_grpo_pwned"), usr


def test_printing_1_gb_is_cut_at_the_output_limit(sandbox):
    result = _run(sandbox, "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\n")
    assert result.status == "output_limit" and result.returncode is None, result
    assert len(result.stdout) + len(result.stderr) <= LIMITS.output_bytes


def test_a_large_file_is_cut_at_the_file_limit(sandbox):
    limits = SandboxLimits(wall_s=30.0, file_bytes=1 << 20)
    small = Sandbox(limits, isolation=sandbox.mechanism)
    result = small.run_python("f = open('big.bin', 'wb')\nfor _ in range(64):\n    f.write(b'x' * 65536)\n"
                              "    f.flush()\nprint('wrote 4 MiB')\n")
    assert result.status != "ok" and "wrote 4 MiB" not in result.stdout, result  # SIGXFSZ or "no space left"


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="isolation='docker'"):
        Sandbox(isolation="docker")
    with pytest.raises(ValueError, match="SandboxLimits.wall_s=0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s=1.5"):
        SandboxLimits(cpu_s=1.5)
    with pytest.raises(ValueError, match="plain name"):
        Sandbox().run_python("pass", files={"../escape.py": "x"})
    with pytest.raises(ValueError, match="absolute executable"):
        Sandbox().run(["python3", "-c", "pass"])


#: Run in the sandbox: every directory (but /proc and /sys) a file can be created in, and how many bytes fit there
#: in files of 256 KiB (each under the per-file limit, so that only the folder's own bound can stop them), at most
#: ``argv[1]`` bytes each.
WRITABLE_PATHS = r"""
import json, os, sys
cap, chunk, found = int(sys.argv[1]), b"x" * (256 << 10), {}
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
    try:
        os.close(os.open(os.path.join(root, ".w"), os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
    except OSError:
        continue
    total = 0
    while total < cap:
        try:
            with open(os.path.join(root, ".w%d" % total), "wb") as f:
                f.write(chunk)
        except OSError:
            break
        total += len(chunk)
    found[root] = total
print(json.dumps(found))
"""


def test_bubblewrap_writes_only_to_its_three_bounded_tmpfs():
    """Under bubblewrap the root and /dev are read-only: the only writable places are the working directory,
    /tmp and /dev/shm, each a tmpfs of ``file_bytes`` (here 1 MiB; a run that fills them gets "no space left",
    never the machine's memory). The device nodes stay usable."""
    if "bwrap" not in MECHANISMS:
        pytest.skip("bubblewrap is not installed")
    limits = SandboxLimits(wall_s=60.0, cpu_s=20, memory_bytes=256 << 20, file_bytes=1 << 20, output_bytes=64 << 10)
    result = Sandbox(limits, isolation="bwrap").run_python(
        WRITABLE_PATHS.replace("int(sys.argv[1])", str(2 * limits.file_bytes)) + "open('/dev/null', 'w').write('x')\n")
    assert result.status == "ok", result
    written = json.loads(result.stdout)
    assert set(written) == {"/sandbox", "/tmp", "/dev/shm"}, written
    for path, total in written.items():
        assert 0 < total <= limits.file_bytes, (path, total)  # cap 2 MiB: stopped by the tmpfs's size


@pytest.mark.parametrize("escape", ["", "    os.setsid()\n"], ids=["same_session", "own_session"])
def test_a_child_is_killed_at_the_wall_clock_even_in_its_own_session(sandbox, escape):
    """Under every mechanism, also ``rlimits`` (whose supervisor is a child subreaper: an orphan that started a
    session of its own is still the run's)."""
    sandbox = Sandbox(SHORT, isolation=sandbox.mechanism)
    source = f"import os, time\nif os.fork() == 0:\n{escape}    time.sleep(600)\n    os._exit(0)\ntime.sleep(600)\n"
    result = _run(sandbox, source)  # _run: no process with the run's marker is left
    assert result.status == "timeout", result


def _kill_a_trainer_during_a_run(sandbox: Sandbox, folder: Path) -> None:
    """Fork a trainer whose temporary folder is ``folder``, let it start a run that sleeps forever with a child in a
    session of its own, SIGKILL it, and wait (10 s at most) for the run's processes to be gone."""
    folder.chmod(0o1777)
    marker = f"lgs-{uuid.uuid4().hex}"
    source = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\ntime.sleep(600)\n"
    long = SandboxLimits(wall_s=600.0, cpu_s=1, memory_bytes=256 << 20, max_processes=16, output_bytes=64 << 10)
    trainer = os.fork()
    if trainer == 0:  # the trainer: one sandboxed run, killed by the test while it runs
        try:
            tempfile.tempdir = str(folder)
            Sandbox(long, isolation=sandbox.mechanism).run([sandbox.python, "-c", source, marker])
        finally:
            os._exit(0)
    command = "\0".join([sandbox.python, "-c", source, marker]).encode()
    try:
        deadline = time.monotonic() + 30
        while len(_processes_running(command)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_processes_running(command)) == 2, "the program and its child did not start"
    finally:
        os.kill(trainer, signal.SIGKILL)
        os.waitpid(trainer, 0)
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _processes_with(marker)
    for pid in left:  # so that a failure leaves nothing behind either
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert left == [], "the run outlived its trainer"


def test_a_run_dies_with_its_trainer(sandbox):
    """A trainer killed with SIGKILL takes its runs with it under every mechanism (bubblewrap's --die-with-parent;
    ``unshare`` behind the launcher's PDEATHSIG guard, its --kill-child ending the PID namespace; the ``rlimits``
    supervisor's PDEATHSIG): a program that sleeps forever, with a child in a session of its own, is gone within
    seconds. Its working folder: none on the host under bubblewrap; under the fallbacks the first run of the next
    process deletes it. Bounded: the trainer is a fork of this process, its run's wall clock 600 s, killed after
    the run's two processes appear (30 s at most)."""
    folder = Path(tempfile.mkdtemp(prefix="lightning_grpo_trainer_"))
    try:
        _kill_a_trainer_during_a_run(sandbox, folder)
        left = [name for name in os.listdir(folder) if name != LOCK_FOLDER]  # rlimits as root: the user ids' locks
        if sandbox.mechanism == "bwrap":
            assert left == []
            return
        assert len(left) == 1 and left[0].startswith(PREFIX), left
        # a later process (a fresh interpreter: only the standard library and sandbox/workdir.py) makes its folder
        workdir = ROOT / "lightning_grpo" / "sandbox" / "workdir.py"
        probe = ("import importlib.util, sys\nspec = importlib.util.spec_from_file_location('workdir', sys.argv[1])\n"
                 "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
                 "print(module.make_host_dir())\n")
        made = subprocess.run([sys.executable, "-I", "-c", probe, str(workdir)], capture_output=True, text=True,
                              env={**os.environ, "TMPDIR": str(folder)}, check=True, timeout=60).stdout.strip()
        assert [name for name in os.listdir(folder) if name != LOCK_FOLDER] == [os.path.basename(made)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
