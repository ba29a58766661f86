"""A sandbox for model-written code: each run in its own process tree, isolated, limited, killed on timeout.

The code reward (:class:`lightning_grpo.rewards.code.CodeReward`) and tools that run model-written code use
:class:`Sandbox`. Isolation is bubblewrap where it is installed (Debian package ``bubblewrap``), else namespaces
through util-linux's ``unshare``, else resource limits only; docs/rewards.md ("The sandbox") says plainly what each
guarantees. Pure standard library (layer 0): no torch, no third-party package.
"""

from lightning_grpo.sandbox.limits import SandboxLimits, SandboxResult, Status
from lightning_grpo.sandbox.runner import NOBODY, Isolation, Sandbox, default_python

__all__ = ["NOBODY", "Isolation", "Sandbox", "SandboxLimits", "SandboxResult", "Status", "default_python"]
