"""Rollout engines, one file (or folder) each: HF ``generate`` (``hf``), colocated vLLM (``vllm/``); rows <-> rollouts
(``rows``), images in the engines' requests (``multimodal``) and the post-sync check (``probe``), shared by them and
by the rollout servers' client (:mod:`lightning_grpo.rollout.server.remote`, beside its server; the server imports
from here, never the other way). An engine is given token ids and, to sync, the policy's weights as a stream
(:class:`~lightning_grpo.protocols.weights.PolicyWeights`): none imports the trainer's models."""
