"""megatron-core support: HF <-> megatron-core conversion, vocab-parallel logprobs, the policy wrapper and the
CPU shim used by :class:`lightning_grpo.strategies.megatron.MegatronStrategy`.

Needs ``megatron-core`` (``pip install megatron-core``); nothing here is imported by ``lightning_grpo`` itself.
"""
