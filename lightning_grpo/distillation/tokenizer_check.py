"""On-policy distillation's tokenizer check: a teacher (local or served) must share the policy's tokenizer.

The teacher scores the student's own token ids, so both must map every id to the same token. TRL's
``DistillationTrainer`` checks the vocabulary sizes only; here the whole vocabulary and the special tokens are
compared, and the first difference is named (a different tokenizer needs cross-tokenizer distillation, TRL's GOLD).
"""

from __future__ import annotations

from typing import Any, Optional


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
