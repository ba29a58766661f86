"""On-policy distillation's teacher model: loaded frozen, and checked to share the policy's tokenizer.

The teacher scores the student's own token ids, so both must map every id to the same token. TRL's
``DistillationTrainer`` checks the vocabulary sizes only; here the whole vocabulary and the special tokens are
compared, and the first difference is named (a different tokenizer needs cross-tokenizer distillation, TRL's GOLD).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_grpo.models.embedded import resolve_model_path
from lightning_grpo.models.loading import DTYPES


class TokenizerMismatchError(ValueError):
    """The teacher's tokenizer is not the policy's (the message names the first difference)."""


def tokenizer_difference(student: Any, teacher: Any) -> Optional[str]:
    """The first difference between two tokenizers' vocabularies (token -> id, added tokens included), as a
    sentence; None when they are the same. Special-token roles (EOS, pad) may differ: the teacher only scores ids."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if len(mine) != len(theirs):
        extra = sorted(set(theirs) ^ set(mine), key=lambda t: mine.get(t, theirs.get(t, 0)))[:3]
        return f"vocabularies of {len(mine)} (policy) and {len(theirs)} (teacher) tokens, e.g. {extra} in one only"
    for token, index in sorted(mine.items(), key=lambda kv: kv[1]):
        if theirs.get(token) != index:
            return f"token {token!r} is id {index} in the policy's tokenizer and {theirs.get(token)} in the teacher's"
    return None


def check_same_tokenizer(student: Any, teacher: Any, where: str) -> None:
    """Raise :class:`TokenizerMismatchError` naming ``where`` (the teacher setting) and the first difference when
    ``teacher``'s vocabulary is not ``student``'s."""
    difference = tokenizer_difference(student, teacher)
    if difference is not None:
        raise TokenizerMismatchError(
            f"{where}: the teacher's tokenizer differs from the policy's ({difference}). On-policy distillation scores "
            "the policy's sampled token ids with the teacher, so both need the same tokenizer; for different "
            "tokenizers use cross-tokenizer distillation (e.g. TRL's GOLD)")


def load_teacher(name_or_path: str, student_tokenizer: Any, dtype: str = "float32") -> nn.Module:
    """The teacher causal LM at ``name_or_path`` (a folder, a hub id or "embedded"), in eval mode without gradients,
    in ``dtype``, after checking its tokenizer against ``student_tokenizer``.

    Raises:
        TokenizerMismatchError: the tokenizers differ (the first difference is named).
        ValueError, FileNotFoundError: as :func:`lightning_grpo.models.embedded.resolve_model_path`; an unknown
            ``dtype``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    path = resolve_model_path(name_or_path)
    check_same_tokenizer(student_tokenizer, AutoTokenizer.from_pretrained(path),
                         f"GRPOConfig.distillation.teacher={name_or_path!r}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPES[dtype]))
    return model.eval().requires_grad_(False)
