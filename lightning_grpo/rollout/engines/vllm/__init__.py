"""The colocated vLLM engine (``engine.name="vllm"``): the engine and its registry factory (``colocated``), vLLM in
this process (``runtime``: the import, CPU or not, ``max_model_len``, a stop between engine steps), the
``torch.distributed`` groups closing it may destroy (``process_groups``) and its KV cache sized to one rollout
(``kv_cache``)."""
