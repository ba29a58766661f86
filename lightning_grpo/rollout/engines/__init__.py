"""Rollout engines, one file each: HF ``generate`` (``hf``), colocated vLLM (``vllm``), the rollout-server client
(``remote``); rows <-> rollouts (``rows``) and HF-format weight iteration (``hf_weights``) shared by them."""
