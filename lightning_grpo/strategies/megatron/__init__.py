"""megatron-core for :class:`~lightning_grpo.strategies.megatron.strategy.MegatronStrategy` (``strategy``): HF <->
megatron-core conversion, vocab-parallel logprobs, the policy wrapper and the CPU shim.

Needs ``megatron-core`` (``pip install megatron-core``); nothing here is imported by ``lightning_grpo`` itself.
"""
