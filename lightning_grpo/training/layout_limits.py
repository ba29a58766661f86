"""Which padding-free layouts of :class:`~lightning_grpo.training.logprobs.CompletionLogprobs` score a model's
sequences as if each ran alone, read from its transformers config.

* A shared-prefix row (a group's prompt once, then each of its completions, with a custom 4-D attention mask:
  :func:`~lightning_grpo.training.packing.shared_prefix_rows`) is exact only where that mask is every layer's whole
  mask. transformers hands a 4-D mask to each attention layer as it is, so a sliding-window layer then attends past
  its window (Gemma 3, GPT-OSS, Mistral: exact while every sequence of the batch fits in the window), and a layer
  that is not attention (Qwen3.5's and Qwen3-Next's Gated DeltaNet linear attention, Mamba layers) reads no mask at
  all: its state runs from one completion into the next.
* A packed row of several sequences (position ids restarting at each: :func:`~lightning_grpo.training.packing.
  pack_sequences`) is exact only where the model builds block-diagonal masks from the position ids
  (:data:`PACKED_ROWS_MODEL_TYPES`; GPT-OSS's forward builds its masks without them, so its packed sequences attend
  to each other) and has no layer that is not attention.

Where a layout is not exact the scoring falls back, never to a wrong number: shared-prefix rows to packed sequences,
several sequences in a row to one sequence per forward pass (``tests/test_model_matrix.py`` checks every
architecture of docs/models.md against a plain forward of each sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: ``config.layer_types`` entries of attention layers that take the mask transformers builds (the others: linear
#: attention, Mamba, convolutions, chunked attention, ... are treated as reading no mask).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

#: ``config.model_type`` values whose causal-LM forward passes the position ids to its mask functions
#: (transformers 5.x: ``create_causal_mask(..., position_ids=position_ids)``), which then make one causal block per
#: packed sequence; a test re-checks them in transformers' sources. Not here: gpt_oss (its masks are built without
#: them), opt, bloom, falcon, mpt, ... and every model type not checked.
PACKED_ROWS_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3", "olmo",
    "olmo2", "olmo3", "olmoe", "gemma", "gemma2", "gemma3_text", "smollm3", "deepseek_v3", "glm", "glm4",
    "starcoder2", "stablelm", "gpt_neox", "seed_oss", "exaone4", "ernie4_5", "apertus", "arcee", "qwen3_5_text",
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
})


@dataclass(frozen=True)
class LayoutLimits:
    """What a model's layers allow of the padding-free layouts (:func:`layout_limits`).

    Attributes:
        window: the smallest sliding window of its attention layers in tokens, None when none slides.
        unmasked_layers: its layer types that read no attention mask (e.g. ``("linear_attention",)``), sorted.
        packed_rows: its masks follow the position ids of a packed row (:data:`PACKED_ROWS_MODEL_TYPES`).
    """

    window: Optional[int] = None
    unmasked_layers: tuple[str, ...] = ()
    packed_rows: bool = True

    def shared_prefix(self, longest: int) -> bool:
        """Whether shared-prefix rows are exact for a batch whose longest sequence (prompt + completion) has
        ``longest`` tokens: no layer without a mask, and every sequence within the sliding window."""
        return not self.unmasked_layers and (self.window is None or longest <= self.window)

    @property
    def several_sequences(self) -> bool:
        """Whether one packed row may hold several sequences."""
        return self.packed_rows and not self.unmasked_layers

    def reason(self) -> str:
        """Why a layout is refused, for the log: the unmasked layers, the window or the model type."""
        if self.unmasked_layers:
            return f"its {list(self.unmasked_layers)} layers read no attention mask"
        parts = [f"its {self.window}-token sliding window is replaced by a 4-D mask"] if self.window else []
        if not self.packed_rows:
            parts.append("its masks do not follow packed position ids")
        return "; ".join(parts)


def layout_limits(config: Any) -> LayoutLimits:
    """The :class:`LayoutLimits` of a model with the transformers ``config`` (a vision-language model's: its text
    config's layers, and its masks follow packed positions when its own or its language model's type is listed, e.g.
    LLaVA's Llama). ``layer_types`` gives each layer's kind; without it every layer slides over ``sliding_window``
    when that is set (Mistral)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    types = tuple(getattr(text, "layer_types", None) or ())
    window = getattr(text, "sliding_window", None)
    slides = "sliding_attention" in types if types else window is not None
    return LayoutLimits(window=int(window) if slides and window is not None else None,
                        unmasked_layers=tuple(sorted(set(types) - ATTENTION_LAYER_TYPES)),
                        packed_rows=bool({str(getattr(each, "model_type", "")) for each in (config, text)}
                                         & PACKED_ROWS_MODEL_TYPES))
