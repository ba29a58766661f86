"""The rollout server's shared secret: where it comes from, how a request carries it, when one is required.

Security model (docs/engines.md, "Security"): whoever can call a rollout server can change the weights it samples
with, so every endpoint requires the shared secret when the server has one (``/health`` included), and a server
that listens beyond the loopback interface must have one. The trainer sends it as ``Authorization: Bearer
<secret>`` (the scheme of vLLM's ``--api-key`` and of OpenAI's API); the server compares it in constant time
(:func:`hmac.compare_digest`). The secret is read from the environment variable :data:`SECRET_ENV` or from a file
(``lightning-grpo serve --secret-file``, ``engine.server_secret_file``), never from a command-line value (other
users of the machine can read those with ``ps``), and it is never logged, printed or stored in a checkpoint.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Optional

#: The environment variable that holds the shared secret, on the server and on the trainer.
SECRET_ENV = "LIGHTNING_GRPO_SERVER_SECRET"
#: Shortest secret accepted, in characters (a 32-character hex string carries 128 random bits).
MIN_SECRET_LENGTH = 16
#: How to make one, for the error messages.
HOW_TO_SET = (f"generate one with `python -c 'import secrets; print(secrets.token_hex(32))'` and give the same "
              f"value to the servers and the trainer, in the environment variable {SECRET_ENV} or in a file "
              "(lightning-grpo serve --secret-file PATH; the trainer's engine.server_secret_file)")


def read_secret(secret_file: Optional[str], what: str) -> Optional[str]:
    """The shared secret: the first line of ``secret_file`` (stripped) when given, else
    ``$LIGHTNING_GRPO_SERVER_SECRET`` when set and not empty, else None.

    Args:
        secret_file: a file holding the secret, or None.
        what: the option that named the file, for the messages (e.g. ``"--secret-file"``).

    Raises:
        ValueError: the file cannot be read or is empty, or the secret is shorter than :data:`MIN_SECRET_LENGTH`
            (the option is named; the secret itself never is).
    """
    if secret_file:
        try:
            with open(secret_file, encoding="utf-8") as f:
                secret = f.readline().strip()
        except OSError as err:
            raise ValueError(f"{what}={secret_file!r} cannot be read: {err.strerror}") from err
        source = f"{what}={secret_file!r}"
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
        source = f"${SECRET_ENV}"
    if not secret:
        if secret_file:
            raise ValueError(f"{source} holds no secret (its first line is empty)")
        return None
    if len(secret) < MIN_SECRET_LENGTH:
        raise ValueError(f"the shared secret in {source} has {len(secret)} characters; use at least "
                         f"{MIN_SECRET_LENGTH}: {HOW_TO_SET}")
    return secret


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to any interface
        return False


def check_bind(host: str, secret: Optional[str]) -> None:
    """Refuse to listen beyond the loopback interface without a secret.

    Raises:
        ValueError: ``host`` is not a loopback address and ``secret`` is None (the message says how to set one).
    """
    if secret is None and not is_loopback(host):
        raise ValueError(f"--host {host} listens beyond this machine, where anyone who reaches the port could "
                         f"replace the served weights: a shared secret is required. {HOW_TO_SET}")


def authorization_header(secret: Optional[str]) -> dict[str, str]:
    """The request header that carries ``secret`` (none without one)."""
    return {} if secret is None else {"Authorization": f"Bearer {secret}"}


def authorized(header: Optional[str], secret: Optional[str]) -> bool:
    """Whether an ``Authorization`` header value carries ``secret`` (constant-time); always True without a secret."""
    if secret is None:
        return True
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), secret.encode())
