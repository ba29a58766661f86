"""``lightning-grpo health URL ... [--secret-file F] [--wait SECONDS]``: the rollout servers' ``/health``, waiting
until every one answers; what a launch runs before it starts the trainer.

Prints one JSON object per server (its URL, then its ``/health``: ``version`` of the weights it serves,
``instance_id``, ``model``, ``world_size``, ...), in the order given. The secret goes in the ``Authorization``
header, read from ``--secret-file`` or ``$LIGHTNING_GRPO_SERVER_SECRET``, never from the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

from lightning_grpo.config.groups import parse_server_url
from lightning_grpo.rollout.server.security import authorization_header, read_secret

#: Seconds between two tries of a server that does not answer yet.
POLL_S = 1.0


class ServerRefused(RuntimeError):
    """A server answered, but refused the request (a wrong or missing secret: HTTP 401), so waiting cannot help."""


def read_health(url: str, secret: Optional[str], timeout_s: float = 10.0) -> dict:
    """``GET url/health`` once.

    Raises:
        ServerRefused: HTTP 401 (the secret is wrong or missing).
        OSError: the server did not answer (refused, unreachable, timed out, or an HTTP error other than 401).
    """
    request = urllib.request.Request(url.rstrip("/") + "/health", headers=authorization_header(secret))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - http(s) URLs only
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as err:
        if err.code == 401:
            raise ServerRefused(f"{url} refused the shared secret (HTTP 401): give the servers' --secret-file") \
                from None
        raise OSError(f"{url}/health answered HTTP {err.code}") from None


def wait_for_servers(urls: Sequence[str], secret: Optional[str], timeout_s: float) -> list[dict]:
    """Every server's ``/health``, trying each again every :data:`POLL_S` seconds until it answers, for at most
    ``timeout_s`` seconds in all (0: one try each).

    Raises:
        ValueError: a malformed URL (named).
        ServerRefused: a server refused the secret.
        TimeoutError: some server did not answer within ``timeout_s`` (the URLs and the last error are named).
    """
    for url in urls:
        parse_server_url(url)
    deadline = time.monotonic() + timeout_s
    answers: dict[str, dict] = {}
    last: dict[str, str] = {}
    while True:
        for url in urls:
            if url not in answers:
                try:
                    answers[url] = read_health(url, secret, timeout_s=max(1.0, min(10.0, timeout_s)))
                except OSError as err:
                    last[url] = str(err)
        if len(answers) == len(urls):
            return [answers[url] for url in urls]
        if time.monotonic() + POLL_S > deadline:
            waiting = [u for u in urls if u not in answers]
            raise TimeoutError(f"rollout server(s) {', '.join(waiting)} did not answer /health within {timeout_s:g} s "
                               f"(last error: {last[waiting[0]]})")
        time.sleep(POLL_S)


def health_main(argv: Sequence[str]) -> None:
    """The ``lightning-grpo health`` command; exits with status 1 and the reason when a server does not answer."""
    parser = argparse.ArgumentParser(prog="lightning-grpo health", description=__doc__.split("\n\n")[0])
    parser.add_argument("urls", nargs="+", metavar="URL", help="a rollout server's base URL, http://HOST:PORT")
    parser.add_argument("--secret-file", default=None,
                        help="file whose first line is the servers' shared secret (default: "
                             "$LIGHTNING_GRPO_SERVER_SECRET; none = servers without one)")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for every server to answer (default 0: one try each)")
    args = parser.parse_args(list(argv))
    if not args.wait >= 0:
        parser.error(f"--wait={args.wait}: must be >= 0 seconds")
    try:
        secret = read_secret(args.secret_file, "--secret-file")
        answers = wait_for_servers(args.urls, secret, args.wait)
    except ValueError as err:
        parser.error(str(err))
    except (ServerRefused, TimeoutError) as err:
        parser.exit(1, f"lightning-grpo health: {err}\n")
    for url, answer in zip(args.urls, answers, strict=True):
        print(json.dumps({"url": url, **answer}), flush=True)


if __name__ == "__main__":
    health_main(sys.argv[1:])
