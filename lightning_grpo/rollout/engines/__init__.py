"""Rollout engines, one file each: HF ``generate`` (``hf``), colocated vLLM (``vllm``), the rollout-server client
(``remote``); rows <-> rollouts (``rows``), the KV-cache size (``kv_cache``) and the post-sync check (``probe``)
shared by them. An engine is given token ids and, to sync, the policy's weights as a stream
(:class:`~lightning_grpo.protocols.weights.PolicyWeights`): none imports the trainer's models."""
