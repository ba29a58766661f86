"""On-policy distillation's tokenizer check (issue 33): a teacher with another vocabulary, or the same tokens under
other ids, is refused with the first difference named, before a local teacher is loaded."""

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_grpo.distillation.local_teacher import load_teacher
from lightning_grpo.distillation.tokenizer_check import TokenizerMismatchError, check_same_tokenizer


def _word_tokenizer(words):
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0], eos_token=words[1])


def test_a_mismatched_tokenizer_is_a_clear_error(tmp_path, tiny_llama_path):
    student = _word_tokenizer(["<unk>", "<eos>", "a", "b", "c"])
    check_same_tokenizer(student, _word_tokenizer(["<unk>", "<eos>", "a", "b", "c"]), "here")  # the same: fine
    with pytest.raises(TokenizerMismatchError, match=r"here: the teacher's tokenizer differs from the policy's "
                                                     r"\(token 'b' is id 3 in the policy's tokenizer and 4 in the"):
        check_same_tokenizer(student, _word_tokenizer(["<unk>", "<eos>", "a", "c", "b"]), "here")
    with pytest.raises(TokenizerMismatchError, match=r"vocabularies of 5 \(policy\) and 6 \(teacher\) tokens"):
        check_same_tokenizer(student, _word_tokenizer(["<unk>", "<eos>", "a", "b", "c", "d"]), "here")
    # a real teacher folder whose tokenizer is SmolLM2's (cut to the tiny Llama's vocabulary), for a student with
    # another tokenizer: refused before loading
    size = len(AutoTokenizer.from_pretrained(tiny_llama_path).get_vocab())
    with pytest.raises(TokenizerMismatchError, match=f"distillation.teacher=.*vocabularies of 5 .policy. and {size} "):
        load_teacher(tiny_llama_path, student)
