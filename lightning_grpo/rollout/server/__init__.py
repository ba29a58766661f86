"""The rollout server (``lightning-grpo serve``, a separate process): the HTTP app (``app``), the vLLM worker
extension that receives weights (``vllm_extension``), the HTTP client (``client``) and the weight-sync groups and
wire format (``weight_sync``) that both sides use."""
