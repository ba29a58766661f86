"""``lightning-grpo launch`` and ``lightning-grpo health`` as a user runs them: the dry run writes nothing, a launch
writes its scripts and a secret file of mode 600 (and keeps an existing one, refusing one others may read), the
model comes from the configs or ``--model``, the SLURM job's own launcher line makes the scripts the dry run
shows; ``health`` waits for servers, reads their ``/health`` with the secret and fails on a wrong one."""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lightning_grpo.cli import main
from support.dist import free_port

SECRET = "0123456789abcdef0123456789abcdef"
BASE = ["launch", "--nodes", "2", "--devices-per-node", "2", "--servers", "2", "--hosts", "n0,n1,n2,n3"]


def launch(capsys, *args: str) -> str:
    main([*BASE, *args])
    return capsys.readouterr().out


def refused(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_dry_run_prints_the_wiring_and_the_scripts_and_writes_nothing(tmp_path, capsys):
    out = launch(capsys, "--secret-file", str(tmp_path / "secret"), "--out", str(tmp_path / "launch"),
                 "--workdir", str(tmp_path), "--dry-run")
    assert not (tmp_path / "secret").exists() and not (tmp_path / "launch").exists()
    assert out.splitlines()[:3] == ["trainer: 2 nodes x 2 processes = world size 4, MASTER_ADDR=n0 MASTER_PORT=29500",
                                    "  node 0 on n0: global ranks [0, 1]", "  node 1 on n1: global ranks [2, 3]"]
    assert ("  server 1: http://n3:8000 (server node 1, GPUs 0,1); weight-sync group at n0:51216, 3 ranks (trainer "
            "rank 0 + 2 workers)") in out
    assert f"(dry run: {tmp_path / 'secret'} would be made, with mode 600)" in out
    assert [line for line in out.splitlines() if line.startswith("==> ")] == [
        "==> server_node0.sh <==", "==> server_node1.sh <==", "==> trainer_node0.sh <==", "==> trainer_node1.sh <=="]


def test_a_launch_writes_its_scripts_and_a_secret_only_its_owner_reads(tmp_path, capsys):
    args = ["--secret-file", str(tmp_path / "keys" / "secret"), "--out", str(tmp_path / "launch"), "--workdir",
            str(tmp_path)]
    out = launch(capsys, *args)
    secret = (tmp_path / "keys" / "secret").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", secret)
    assert oct((tmp_path / "keys" / "secret").stat().st_mode & 0o777) == "0o600"
    assert sorted(os.listdir(tmp_path / "launch")) == ["server_node0.sh", "server_node1.sh", "trainer_node0.sh",
                                                      "trainer_node1.sh"]
    assert all(os.access(tmp_path / "launch" / name, os.X_OK) for name in os.listdir(tmp_path / "launch"))
    assert f"  on n3: bash {tmp_path / 'launch' / 'server_node1.sh'}" in out
    assert secret not in out and all(secret.strip() not in (tmp_path / "launch" / n).read_text()
                                     for n in os.listdir(tmp_path / "launch"))
    launch(capsys, *args)  # a second launch keeps the secret
    assert (tmp_path / "keys" / "secret").read_text() == secret


def test_a_secret_file_others_may_read_is_refused(tmp_path, capsys):
    (tmp_path / "secret").write_text(SECRET + "\n")
    os.chmod(tmp_path / "secret", 0o644)
    err = refused(capsys, *BASE, "--secret-file", str(tmp_path / "secret"), "--dry-run")
    assert f"--secret-file={str(tmp_path / 'secret')!r} has mode 644" in err and "chmod 600" in err


def test_other_machines_need_the_secret_file(capsys):
    err = refused(capsys, *BASE, "--dry-run")
    assert "need the shared secret: give --secret-file PATH" in err


def test_the_model_comes_from_the_configs_or_from_model(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("model:\n  model: /models/a\n")
    (tmp_path / "b.yaml").write_text("model:\n  config:\n    num_generations: 4\n")
    base = ["--hosts", "127.0.0.1", "--workdir", str(tmp_path), "--dry-run", "--config", "a.yaml", "--config",
            "b.yaml"]
    out = launch(capsys, *base)
    assert "serve --model /models/a " in out and "--model.model" not in out
    out = launch(capsys, *base, "--model", "/models/c")
    assert "serve --model /models/c " in out and "--model.model /models/c " in out
    err = refused(capsys, *BASE[:-2], "--hosts", "127.0.0.1", "--workdir", str(tmp_path), "--dry-run", "--",
                  "--model.model", "/models/d")
    assert "the launcher sets --model.model itself; use --model" in err
    err = refused(capsys, *BASE[:-2], "--workdir", str(tmp_path), "--dry-run", "--config", "missing.yaml")
    assert f"--config {str(tmp_path / 'missing.yaml')!r}: no such file" in err


def test_the_slurm_jobs_own_launch_line_makes_the_scripts_of_the_dry_run(tmp_path, capsys):
    """The job runs the launcher again with its node names: that line, with the names the dry run uses in their
    place, writes exactly the scripts the dry run shows."""
    options = ["launch", "--nodes", "2", "--devices-per-node", "4", "--servers", "2", "--secret-file",
               str(tmp_path / "secret"), "--workdir", str(tmp_path), "--out", str(tmp_path / "launch"), "--slurm"]
    main([*options, "--dry-run", "--", "--trainer.max_steps", "3"])
    dry = capsys.readouterr().out
    main([*options, "--", "--trainer.max_steps", "3"])
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path / "launch")) == ["job.sbatch"]
    sbatch = (tmp_path / "launch" / "job.sbatch").read_text()
    assert dry.split("==> job.sbatch <==\n")[1].split("\n==> ")[0] == sbatch
    line = next(line for line in sbatch.replace("\\\n", " ").splitlines() if line.startswith("lightning-grpo launch"))
    line = line.replace('"$(IFS=,; echo "${NODES[*]}")"', "NODE0,NODE1,NODE2,NODE3").replace(
        '"$OUT"', str(tmp_path / "job"))
    main(shlex.split(line)[1:])
    capsys.readouterr()
    for name in ("server_node0.sh", "server_node1.sh", "trainer.sh"):
        shown = dry.split(f"==> (the job's {name}, its nodes named NODE0..) <==\n")[1].split("\n==> ")[0]
        assert (tmp_path / "job" / name).read_text() == shown


def test_slurm_names_its_own_nodes(capsys, tmp_path):
    err = refused(capsys, *BASE, "--secret-file", str(tmp_path / "s"), "--slurm", "--dry-run")
    assert "--slurm names its nodes when the job runs" in err


class Health(BaseHTTPRequestHandler):
    """``GET /health`` of a server whose secret is :data:`SECRET`: 401 without it."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.headers.get("Authorization") != f"Bearer {SECRET}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"version": 3, "instance_id": "abc"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_health_prints_each_servers_health_and_refuses_a_wrong_secret(server, tmp_path, capsys):
    (tmp_path / "secret").write_text(SECRET + "\n")
    main(["health", "--secret-file", str(tmp_path / "secret"), server])
    assert json.loads(capsys.readouterr().out) == {"url": server, "version": 3, "instance_id": "abc"}
    (tmp_path / "wrong").write_text("f" * 32 + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["health", "--secret-file", str(tmp_path / "wrong"), "--wait", "30", server])
    assert exit_info.value.code == 1
    assert f"{server} refused the shared secret (HTTP 401)" in capsys.readouterr().err


def test_health_gives_up_on_a_server_that_never_answers(server, tmp_path, capsys):
    (tmp_path / "secret").write_text(SECRET + "\n")
    silent = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exit_info:
        main(["health", "--secret-file", str(tmp_path / "secret"), "--wait", "2", server, silent])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"rollout server(s) {silent} did not answer /health within 2 s" in err and "Connection refused" in err
