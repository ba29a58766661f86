"""The rollout server (``lightning-grpo serve``, a separate process) and its client engine, side by side: the HTTP
app (``app``, ``asgi``, ``schema``), the vLLM worker extension that receives weights (``vllm_extension``); the
trainer's engine of one or more servers (``remote``, ``engine.name="vllm_server"``) and its HTTP client (``client``);
the weight-sync groups and wire format (``weight_sync``) and the shared secret (``security``) that both sides use."""
