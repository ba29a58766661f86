"""LoRA fine-tuning of the policy through PEFT (``GRPOModule(lora=peft.LoraConfig(...))``).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685, eq. 3) trains, for
each targeted linear layer ``W0`` (out x in), two matrices ``B`` (out x r, zero at start) and ``A`` (r x in):
``h = W0 x + (lora_alpha / r) * B A x`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). ``W0`` stays frozen. The
adapters are PEFT's own (``peft.get_peft_model``); this module only connects them to GRPO:

* the policy is ``get_peft_model(policy, config)``: base weights frozen, adapters (and ``modules_to_save``
  copies) trainable, so ``configure_optimizers`` (which takes the parameters with ``requires_grad``) holds only
  those;
* the KL reference policy (``beta > 0``) is the same module with its adapters switched off
  (:class:`AdapterDisabledReference`, ``with policy.disable_adapter():``): exactly the base model, and no second
  copy of the weights;
* checkpoints hold the trainable tensors only (:func:`trim_frozen_weights`); a resume rebuilds the base from the
  model folder;
* rollouts: the HF engine generates with the adapted model; the vLLM engine gets merged weights
  ``W0 + scaling * B A`` computed from the tensors, never merging into the trained module
  (:func:`lightning_grpo.models.hf_weights.merge_lora`);
* export: the adapter folder (``PeftModel.save_pretrained``: ``adapter_config.json``,
  ``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained``) and, with ``export_merged``, the
  merged plain model in ``<export>/merged`` (:func:`export_policy`);
* QLoRA-style 4/8-bit base (Dettmers et al. 2023, arXiv:2305.14314) with bitsandbytes on CUDA only
  (:func:`lora_settings`).

Backends: single device, DDP and FSDP2; FSDP1 and Megatron raise (see the strategies).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import tempfile
from typing import Any, Callable, Optional, Union

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_grpo.models.hf_weights import (
    PEFT_PREFIX,
    check_syncable,
    checkpoint_name,
    lora_layers,
    merged_state_dict,
)
from lightning_grpo.models.loading import FrozenReference, load_policy, save_policy
from lightning_grpo.models.vision_loading import language_model_lora
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.vision import VisionSpec, vision_spec

log = logging.getLogger(__name__)

#: ``GRPOModule(quantization=...)`` values -> bits of the frozen base weights.
QUANTIZATIONS = {"4bit": 4, "8bit": 8}
#: Subfolder of the export folder that receives the merged model (``export_merged``).
MERGED_SUBFOLDER = "merged"


#: Common misnamings of LoraConfig fields, named in the error.
_LORA_ALIASES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target": "target_modules",
                 "targets": "target_modules", "modules": "target_modules"}


def _lora_fields(lora: dict) -> dict:
    """The fields of a LoRA dict that ``LoraConfig`` takes; the bookkeeping keys ``LoraConfig.to_dict`` adds
    (``peft_type``, ``peft_version``, ``auto_mapping``: a checkpoint's stored config) are dropped.

    Raises:
        ValueError: a key that is neither (the key, the field it probably means, and the fields are named).
    """
    names = {f.name for f in dataclasses.fields(LoraConfig)}
    bookkeeping = (set(LoraConfig().to_dict()) - names) | {"peft_type", "auto_mapping"}
    unknown = sorted(k for k in lora if k not in names and k not in bookkeeping)
    if unknown:
        hints = []
        for key in unknown:
            guess = _LORA_ALIASES.get(key) or next(iter(difflib.get_close_matches(key, names, 1)), None)
            hints.append(f"{key!r}" + (f" (did you mean {guess!r}?)" if guess else ""))
        raise ValueError(f"lora: unknown LoraConfig field(s) {', '.join(hints)}; peft would train its defaults for "
                         "them. Common fields: r, lora_alpha, lora_dropout, target_modules, modules_to_save, "
                         "use_rslora")
    return {k: v for k, v in lora.items() if k in names and k not in ("peft_type", "auto_mapping")}


def as_lora_config(lora: Union[LoraConfig, dict, None]) -> Optional[LoraConfig]:
    """``lora`` as a ``peft.LoraConfig`` (a dict, e.g. the plain data a checkpoint stores, is passed to it) with
    ``task_type="CAUSAL_LM"`` when unset (``PeftModelForCausalLM``); a copy: the caller's config is not changed.

    Raises:
        TypeError: neither a LoraConfig, a dict nor None.
        ValueError: a dict key that is not a LoraConfig field (e.g. ``rank`` for ``r``).
    """
    if lora is None:
        return None
    if isinstance(lora, dict):
        lora = LoraConfig(**_lora_fields(lora))
    if not isinstance(lora, LoraConfig):
        raise TypeError(f"lora must be a peft.LoraConfig, a dict of its fields or None, got {type(lora).__name__}")
    lora = dataclasses.replace(lora)
    lora.task_type = lora.task_type or "CAUSAL_LM"
    return lora


@dataclasses.dataclass
class LoraSettings:
    """``GRPOModule``'s LoRA arguments, checked (:func:`lora_settings`).

    Attributes:
        config: the LoRA config, None for full fine-tuning.
        quantization_config: the frozen base's ``transformers.BitsAndBytesConfig``, or None (unquantized).
    """

    config: Optional[LoraConfig] = None
    quantization_config: Any = None

    @property
    def hparams(self) -> Optional[dict[str, Any]]:
        """The LoRA config as plain JSON data (sets as sorted lists, enums as their values) for the checkpoint's
        hyperparameters, which load with ``torch.load(weights_only=True)``; None without LoRA."""
        if self.config is None:
            return None
        return json.loads(json.dumps(self.config.to_dict(),
                                     default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


def lora_settings(lora: Union[LoraConfig, dict, None], quantization: Optional[str], dtype: str,
                  export_merged: bool) -> LoraSettings:
    """Check ``GRPOModule``'s LoRA arguments together: the LoRA config (:func:`as_lora_config`) and the
    quantization config of a 4-bit (NF4, double quantization, compute in ``dtype``) or 8-bit frozen base (QLoRA,
    Dettmers et al. 2023, arXiv:2305.14314).

    Args:
        lora: the LoRA config, a dict of its fields, or None (full fine-tuning).
        quantization: None, "4bit" or "8bit": the frozen base weights' bits (bitsandbytes).
        dtype: the compute dtype name ("float32", "bfloat16", "float16").
        export_merged: also export the merged model.

    Raises:
        ValueError: ``export_merged`` without ``lora``; an unknown ``quantization``; quantization without ``lora``,
            with the vLLM engine or ``export_merged`` (a quantized base is not merged), or without a CUDA device
            (bitsandbytes' 4/8-bit layers do not run on this machine's CPU).
        ImportError: quantization without bitsandbytes installed.
    """
    lora = as_lora_config(lora)
    if export_merged and lora is None:
        raise ValueError("export_merged=True saves the policy with its LoRA adapters merged: it needs lora=LoraConfig")
    if quantization is None:
        return LoraSettings(lora)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose None, '4bit' or '8bit'")
    if lora is None:
        raise ValueError(f"quantization={quantization!r} freezes a quantized base: it needs lora=LoraConfig(...)")
    if export_merged:
        raise ValueError(f"quantization={quantization!r}: a quantized base is not merged with its adapters; use "
                         "export_merged=False")
    if not torch.cuda.is_available():
        raise ValueError(f"quantization={quantization!r} needs bitsandbytes on a CUDA device; this machine's device "
                         "is cpu, where bitsandbytes' 4/8-bit layers are not supported: use quantization=None")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(f"quantization={quantization!r} needs bitsandbytes: pip install bitsandbytes") from err
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return LoraSettings(lora, BitsAndBytesConfig(load_in_8bit=True))
    return LoraSettings(lora, BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                 bnb_4bit_use_double_quant=True,
                                                 bnb_4bit_compute_dtype=getattr(torch, dtype)))


def check_quantized_engine(settings: LoraSettings, engine: RolloutEngine) -> None:
    """A quantized base is never merged with its adapters, so only an engine that generates with the policy's own
    (quantized, adapted) parameters can sample from it.

    Raises:
        ValueError: ``settings`` quantize the base and ``engine`` holds its own weights (vLLM, the rollout servers).
    """
    if settings.quantization_config is not None and not engine.capabilities.uses_policy_parameters:
        raise ValueError("quantization: a quantized base is not merged with its adapters, so an engine with its own "
                         "weights cannot sample from it: use GRPOConfig.engine.name='hf'")


def check_tied_head(policy: nn.Module, base: nn.Module, engine: RolloutEngine) -> None:
    """At setup: an engine with its own weights (vLLM, the rollout servers) is loaded from the policy's checkpoint,
    so it ties ``lm_head`` to the embedding when the checkpoint's config (``base``'s, the policy's transformers model)
    does; a policy that trains a separate head then cannot be synced exactly
    (:data:`~lightning_grpo.protocols.weights.TIED_HEAD_ERROR`).

    Raises:
        ValueError: the checkpoint ties, the policy has a separate head and ``engine`` holds its own weights.
    """
    tied = bool(getattr(getattr(base, "config", None), "tie_word_embeddings", False))
    if not engine.capabilities.uses_policy_parameters:
        check_syncable(policy, tied)


@dataclasses.dataclass(frozen=True)
class LoadedPolicy:
    """A loaded policy and what it is, read once when it is loaded (:func:`load_lora_policy`).

    Attributes:
        policy: the policy module (a ``peft.PeftModel`` with LoRA).
        tokenizer: its tokenizer (with a pad token).
        path: its folder, or None for a module given without one.
        base: its transformers model: a PEFT model's base model (whose layers carry the adapters), else the policy.
        lora: it trains LoRA adapters (a PEFT model, or a module holding LoRA layers).
        vision: a vision-language model's image facts (:func:`~lightning_grpo.protocols.vision.vision_spec` of its
            config), None for a causal LM.
    """

    policy: nn.Module
    tokenizer: PreTrainedTokenizerBase
    path: Optional[str]
    base: nn.Module
    lora: bool
    vision: Optional[VisionSpec] = None

    @classmethod
    def of(cls, policy: nn.Module, tokenizer: PreTrainedTokenizerBase, path: Optional[str]) -> "LoadedPolicy":
        """What ``policy`` is (a PEFT model or not), read here once."""
        peft = isinstance(policy, PeftModel)
        base = policy.get_base_model() if peft else policy
        return cls(policy, tokenizer, path, base, peft or bool(lora_layers(policy)), vision_spec(base.config))


def load_lora_policy(model: Union[str, nn.Module, None], tokenizer: Union[str, PreTrainedTokenizerBase, None],
                     dtype: str, gradient_checkpointing: Union[bool, str], settings: LoraSettings) -> LoadedPolicy:
    """:func:`lightning_grpo.models.loading.load_policy` (quantized with ``settings.quantization_config``), then with
    LoRA ``peft.get_peft_model(policy, settings.config)`` (the policy's layers are adapted in place; a quantized base
    goes through ``peft.prepare_model_for_kbit_training`` first; a vision-language policy's vision tower and
    projector are excluded from the targets, :func:`~lightning_grpo.models.vision_loading.language_model_lora`).

    Raises:
        ValueError: see ``load_policy``.
    """
    policy, tokenizer, path = load_policy(model, tokenizer, dtype, gradient_checkpointing,
                                          settings.quantization_config)
    if settings.config is None:
        return LoadedPolicy.of(policy, tokenizer, path)
    if settings.quantization_config is not None:
        from peft import prepare_model_for_kbit_training

        policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=bool(gradient_checkpointing))
    config = settings.config if vision_spec(policy.config) is None else language_model_lora(settings.config)
    adapted = get_peft_model(policy, config)
    adapted.train(policy.training)
    check_lora_targets(adapted, config)
    return LoadedPolicy.of(adapted, tokenizer, path)


def _matches(name: str, target: str) -> bool:
    """PEFT's matching of a module name against a name in a list of targets: the name or its last parts."""
    return name == target or name.endswith("." + target)


def check_lora_targets(adapted: nn.Module, config: LoraConfig) -> None:
    """Every name listed in ``target_modules`` and ``modules_to_save`` matched a module of the policy (PEFT fails
    only when none of them matches, so a misspelt one beside a right one would leave its layers untrained).

    Raises:
        ValueError: naming the names that matched nothing and the layer names the model has.
    """
    modules = [checkpoint_name(n).removeprefix(PEFT_PREFIX) for n, _ in adapted.named_modules()]
    targeted = list(getattr(adapted.base_model, "targeted_module_names", []))
    problems = []
    if isinstance(config.target_modules, (list, set, tuple, frozenset)):
        missing = sorted(t for t in config.target_modules if not any(_matches(n, t) for n in targeted))
        if missing:
            problems.append(f"target_modules {missing} match no module")
    for name in config.modules_to_save or ():
        if not any(_matches(n, name) for n in modules):
            problems.append(f"modules_to_save entry {name!r} matches no module")
    if problems:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in adapted.get_base_model().named_modules()
                         if isinstance(m, nn.Linear)})
        raise ValueError(f"lora: {'; '.join(problems)} (a misspelling would leave those layers untrained); the "
                         f"model's linear layers are named {leaves}")


class AdapterDisabledReference(nn.Module):
    """The reference policy of a LoRA policy: the policy itself, each forward run inside
    ``policy.disable_adapter()`` (every adapter off, ``modules_to_save`` back to the originals), i.e. the frozen
    base model, with no copy of its weights. ``train``/``eval`` and ``training`` are the policy's.

    Args:
        policy: a ``peft.PeftModel`` (possibly FSDP2-sharded inside).
    """

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    @property  # type: ignore[override]
    def training(self) -> bool:
        policy = self.__dict__.get("_modules", {}).get("policy")
        return True if policy is None else policy.training

    @training.setter
    def training(self, mode: bool) -> None:
        """nn.Module sets it; the policy's own flag is the one read."""

    @property
    def config(self) -> Any:
        """The base model's config (attention implementation)."""
        return self.policy.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def reference_for(loaded: LoadedPolicy, beta: float) -> FrozenReference:
    """The KL reference for ``beta > 0``: :class:`AdapterDisabledReference` of a LoRA policy, else a frozen deep
    copy (:meth:`lightning_grpo.models.loading.FrozenReference.copy_of`); no reference for ``beta = 0``."""
    if beta <= 0:
        return FrozenReference()
    policy = loaded.policy
    return FrozenReference(AdapterDisabledReference(policy)) if loaded.lora else FrozenReference.copy_of(policy)


def trim_frozen_weights(root: nn.Module, loaded: LoadedPolicy, attribute: str = "policy") -> None:
    """Make ``root.state_dict()`` hold, of the policy (``root.<attribute>``, ``loaded.policy``), only the parameters
    that require grad (LoRA adapters and ``modules_to_save`` copies: the frozen base weights and buffers are left
    out), and make ``root.load_state_dict`` (strict too) accept their absence: a checkpoint then holds the trained
    tensors only, and a resume keeps the base weights the module was built with. A checkpoint that lacks a trainable
    tensor, or has a key the module does not (e.g. full fine-tuning's ``policy.model.*``), still fails strict
    loading. Installs state-dict hooks on ``root``; names are ``root``'s own (the keys of its top-level
    ``state_dict``). For a policy without LoRA nothing is installed. The LoRA backends shard or wrap the policy in
    place (FSDP2, DDP): it stays the same module.
    """
    if not loaded.lora:
        return
    prefix = f"{attribute}."
    policy = loaded.policy

    def kept(names_prefix: str) -> set[str]:
        return {f"{names_prefix}{prefix}{n}" for n, p in policy.named_parameters(remove_duplicate=False)
                if p.requires_grad}

    def drop_frozen(module: nn.Module, state_dict: dict, names_prefix: str, local_metadata: Any) -> None:
        keep = kept(names_prefix)
        for key in [k for k in state_dict if k.startswith(names_prefix + prefix) and k not in keep]:
            del state_dict[key]

    def allow_missing_frozen(module: nn.Module, incompatible_keys: Any) -> None:
        keep = kept("")
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if not k.startswith(prefix) or k in keep]

    root.register_state_dict_post_hook(drop_frozen)
    root.register_load_state_dict_post_hook(allow_missing_frozen)


def export_policy(policy: nn.Module, tokenizer: PreTrainedTokenizerBase, path: str,
                  state_dict: Optional[dict] = None, merged: bool = False) -> None:
    """Save the policy with ``save_pretrained`` (:func:`lightning_grpo.models.loading.save_policy`; a LoRA policy saves
    its
    adapter folder). With ``merged``, a LoRA policy's merged plain model (``W0 + scaling * B A``, loadable with
    ``AutoModelForCausalLM.from_pretrained``) also goes to ``<path>/merged``. ``state_dict``: the policy's full state
    dict when it is sharded (``ParallelBackend.export_state_dict``), else None.

    Raises:
        ValueError: ``merged`` for a policy without LoRA.
    """
    save_policy(policy, tokenizer, path, state_dict)
    if not merged:
        return
    if not callable(getattr(policy, "get_base_model", None)):
        raise ValueError("export_merged=True merges LoRA adapters: the policy has none (GRPOModule(lora=None))")
    target = os.path.join(path, MERGED_SUBFOLDER)
    save_policy(policy.get_base_model(), tokenizer, target, merged_state_dict(policy, state_dict))
    log.info("saved the merged LoRA policy to %s", target)


def engine_checkpoint(loaded: LoadedPolicy, save_processor: Optional[Callable[[str], None]] = None) -> str:
    """The folder an engine with its own weights is loaded from: the policy's folder, or (a module given without
    one) a temporary folder it is saved to with ``save_pretrained``, LoRA merged (:func:`merged_state_dict`), with
    its config, tokenizer and (``save_processor``, a vision-language policy's) image processor. The engine gets the
    trained weights by its syncs."""
    path = loaded.path
    if path is not None and os.path.isdir(path):
        return path
    path = tempfile.mkdtemp(prefix="lightning_grpo_engine_")
    base, policy = loaded.base, loaded.policy
    base.config.save_pretrained(path)
    base.save_pretrained(path, state_dict=merged_state_dict(policy) if base is not policy else None)
    loaded.tokenizer.save_pretrained(path)
    if save_processor is not None:
        save_processor(path)
    return path
