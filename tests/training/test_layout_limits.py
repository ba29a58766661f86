"""``layout_limits``: what a model's config says of the padding-free layouts (sliding windows, layers that read no
mask, masks that follow packed position ids), and the model types listed as packing several sequences into a row
re-checked in transformers' sources. The layouts themselves, run on every architecture of docs/models.md, are in
``tests/test_model_matrix.py``."""

import importlib
import inspect
import re

import pytest
import transformers
from transformers.models.auto.configuration_auto import model_type_to_module_name

from lightning_grpo.training.layout_limits import PACKED_ROWS_MODEL_TYPES, LayoutLimits, layout_limits

_MASK_CALL = re.compile(r"\b(create_causal_mask|create_sliding_window_causal_mask|mask_function)\(")


def _arguments(source: str, start: int) -> str:
    """The text between the parenthesis that opens at ``start - 1`` and the one that closes it."""
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    return source[start:i - 1]


def masks_follow_positions(model_type: str) -> bool:
    """Whether every mask-building call of the model type's modeling source gets ``position_ids`` (in its arguments
    or in the ``**kwargs`` dict it is given), and there is such a call."""
    module = model_type_to_module_name(model_type)
    source = inspect.getsource(importlib.import_module(f"transformers.models.{module}.modeling_{module}"))
    parenthesized = source.replace("{", "(").replace("}", ")")  # a dict literal's text by the same matching

    def dict_text(name: str, before: int) -> str:
        """The last ``name = {...}`` literal before ``before``, through ``name = other.copy()``."""
        found = [m for m in re.finditer(rf"\b{name} = (\{{|(\w+)\.copy\(\))", source) if m.start() < before]
        if not found:
            return ""
        last = found[-1]
        return dict_text(last.group(2), last.start()) if last.group(2) else _arguments(parenthesized, last.end())

    calls = [(m.start(), _arguments(source, m.end())) for m in _MASK_CALL.finditer(source)]
    if not calls:
        return False
    for start, arguments in calls:
        passed = arguments + "".join(dict_text(name, start) for name in re.findall(r"\*\*(\w+)", arguments))
        if "position_ids" not in passed:
            return False
    return True


@pytest.mark.parametrize("model_type", sorted(PACKED_ROWS_MODEL_TYPES))
def test_listed_model_types_build_their_masks_from_the_position_ids(model_type):
    assert masks_follow_positions(model_type)


def test_gpt_oss_builds_its_masks_without_them():
    """Why GPT-OSS is not listed (its packed sequences attended to each other: tests/test_model_matrix.py)."""
    assert "gpt_oss" not in PACKED_ROWS_MODEL_TYPES and not masks_follow_positions("gpt_oss")


def test_what_a_config_says_of_the_layouts():
    mistral = layout_limits(transformers.MistralConfig())  # no layer_types: every layer slides over 4,096 tokens
    assert mistral == LayoutLimits(window=4096, unmasked_layers=(), packed_rows=True)
    assert mistral.shared_prefix(4096) and not mistral.shared_prefix(4097) and mistral.several_sequences
    assert layout_limits(transformers.Qwen2Config()) == LayoutLimits()  # use_sliding_window=False
    gemma = layout_limits(transformers.Gemma3TextConfig(num_hidden_layers=2, sliding_window=8,
                                                        layer_types=["sliding_attention", "full_attention"]))
    assert gemma.window == 8 and gemma.several_sequences and gemma.shared_prefix(8) and not gemma.shared_prefix(9)
    hybrid = layout_limits(transformers.Qwen3_5TextConfig(num_hidden_layers=4))  # linear, linear, linear, full
    assert hybrid.unmasked_layers == ("linear_attention",)
    assert not hybrid.shared_prefix(2) and not hybrid.several_sequences
    assert "['linear_attention'] layers read no attention mask" in hybrid.reason()
    gpt_oss = layout_limits(transformers.GptOssConfig(num_hidden_layers=2))
    assert not gpt_oss.packed_rows and not gpt_oss.several_sequences and gpt_oss.window == 128
    assert gpt_oss.reason() == ("its 128-token sliding window is replaced by a 4-D mask; its masks do not follow "
                                "packed position ids")
    vision = layout_limits(transformers.Qwen2_5_VLConfig())  # the text config's layers, the outer model type
    assert vision == LayoutLimits()
    assert layout_limits(transformers.LlavaConfig()).several_sequences  # its language model's type: llama
