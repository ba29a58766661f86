"""Policy loading and saving: a model id, folder or module -> ``(policy, tokenizer, model_path)``; the frozen
reference policy; ``save_pretrained`` of the trained policy and the folder it is exported to."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional, Union

from lightning_grpo.models.embedded import resolve_model_path
from lightning_grpo.models.vision_loading import is_vision_checkpoint, load_vision_policy

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: ``GRPOModule(dtype=...)`` names -> torch dtypes of the loaded weights.
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load_policy(model: Union[str, nn.Module, None], tokenizer: Union[str, PreTrainedTokenizerBase, None],
                dtype: str = "float32", gradient_checkpointing: Union[bool, str] = False,
                quantization_config: object = None) -> tuple[nn.Module, PreTrainedTokenizerBase, Optional[str]]:
    """The policy, its tokenizer and its folder (None for a module without one).

    Args:
        model: an HF model id, a local folder, a transformers causal LM module, or None / "embedded"; a folder or id
            of a vision-language checkpoint loads ``AutoModelForImageTextToText``
            (:mod:`lightning_grpo.models.vision_loading`).
        tokenizer: a tokenizer, its id/folder, or None (loaded from ``model``'s folder).
        dtype: "float32", "bfloat16" or "float16" (weights loaded from a folder or id).
        gradient_checkpointing: recompute each decoder layer's activations in backward from its input (transformers'
            non-reentrant gradient checkpointing; ``use_cache`` off); "offload": also keep those inputs in pinned
            CPU memory until backward (transformers' ``offload=True``; CUDA only).
        quantization_config: ``from_pretrained``'s (a ``transformers.BitsAndBytesConfig``), for a folder or id only.

    Returns:
        ``(policy, tokenizer, model_path)``; the policy in train mode, the tokenizer with a pad token (eos if none).

    Raises:
        ValueError: ``model`` is a module and ``tokenizer`` is None or ``quantization_config`` is set; ``dtype``
            or ``gradient_checkpointing`` unknown; "offload" without CUDA.
    """
    import torch
    from torch import nn
    from transformers import AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    if gradient_checkpointing not in (False, True, "offload"):
        raise ValueError(f"gradient_checkpointing={gradient_checkpointing!r}: choose False, True or 'offload'")
    if gradient_checkpointing == "offload" and not torch.cuda.is_available():
        raise ValueError("gradient_checkpointing='offload' keeps activations in pinned CPU memory instead of on a GPU; "
                         "without CUDA they are in CPU memory already: use gradient_checkpointing=True")
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ValueError("tokenizer is required when model is an nn.Module")
        if quantization_config is not None:
            raise ValueError("quantization is applied when loading from a folder or hub id, not to an nn.Module model")
        model_path: Optional[str] = getattr(getattr(model, "config", None), "_name_or_path", None) or None
        policy = model
    else:
        model_path = resolve_model_path(model)
        loader = load_vision_policy if is_vision_checkpoint(model_path) else _load_causal_lm  # models/vision_loading.py
        policy = loader(model_path, getattr(torch, DTYPES[dtype]), quantization_config)
        policy.train()  # from_pretrained returns eval mode; Lightning expects train mode at fit start
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                             offload=gradient_checkpointing == "offload")
        policy.config.use_cache = False
    return policy, tokenizer, model_path


def _load_causal_lm(path: str, dtype: object, quantization_config: object) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quantization_config)


class FrozenReference:
    """Holds the frozen reference policy outside the LightningModule's module tree (not an ``nn.Module``, so it is
    never checkpointed, optimized or moved by Lightning). ``model`` is None without a KL term (beta = 0)."""

    def __init__(self, model: Optional[nn.Module] = None) -> None:
        self.model = model

    @classmethod
    def copy_of(cls, policy: nn.Module) -> FrozenReference:
        """A deep copy of ``policy`` in eval mode without gradients."""
        import copy

        return cls(copy.deepcopy(policy).eval().requires_grad_(False))


def save_policy(policy: nn.Module, tokenizer: PreTrainedTokenizerBase, path: str,
                state_dict: Optional[dict] = None) -> None:
    """``save_pretrained`` the policy (with ``state_dict``, the full weights of a sharded one) and its tokenizer."""
    os.makedirs(path, exist_ok=True)
    policy.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)
    log.info("saved the trained policy to %s", path)


def export_folder(export_dir: Optional[str], log_dir: Optional[str], default_root_dir: str) -> Optional[str]:
    """Where ``GRPOModule`` exports the trained policy at the end of a fit: ``export_dir``; by default (None)
    ``<log_dir or default_root_dir>/hf_model`` (the trainer's); None (no export) when it is ""."""
    if export_dir is not None:
        return export_dir or None
    return os.path.join(log_dir or default_root_dir, "hf_model")
