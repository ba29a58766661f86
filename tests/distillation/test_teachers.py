"""On-policy distillation's teachers (issue 33): a frozen model in GRPOModule training (plain and LoRA), a rollout
server and vLLM's OpenAI-compatible server scoring the same tokens as the local teacher, the tokenizer checks, and
the answer formats a served teacher may return."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.config.distillation import DistillationConfig
from lightning_grpo.data import PromptDataModule
from lightning_grpo.distillation.local_teacher import ModelTeacher
from lightning_grpo.distillation.served_teachers import (
    OpenAITeacher,
    RolloutServerTeacher,
    _prompt_logprobs,
    scored_sequences,
)
from lightning_grpo.distillation.tokenizer_check import TokenizerMismatchError
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from support.algorithm import FixedRolloutEngine, Recorder, fixed_completions, quiet_trainer, write_prompts
from support.checkpoint_generation import trainer_logprobs
from support.openai_server import vllm_openai_server


class _Recorder(Recorder):
    """Also a copy of the policy before each optimizer step (its first micro-batch)."""

    def __init__(self):
        super().__init__()
        self.policies = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        super().on_train_batch_start(trainer, module, batch, batch_idx)
        if batch.step_start:
            self.policies.append(copy.deepcopy(module.policy).eval())


def _fit(student: str, teacher: str, root, prompt_file, **module_kwargs):
    config = GRPOConfig(num_generations=4, max_new_tokens=8, loss_type="dapo",
                        distillation=DistillationConfig(teacher=teacher))
    module = GRPOModule(student, reward_funcs=[lambda prompts, completions, **k: [0.0] * len(completions)],
                        config=config, learning_rate=1e-3, export_dir="", **module_kwargs)
    eos = module.tokenizer.eos_token_id
    module.rollout_engine = FixedRolloutEngine(fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos), eos)
    recorder = _Recorder()
    trainer = quiet_trainer(root, 2, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    return module, recorder


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.mark.parametrize("lora", [None, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}])
def test_a_teacher_model_scores_every_rollout_and_its_reverse_kl_trains(tiny_llama_path, tiny_tied_llama_path,
                                                                         prompt_file, tmp_path, lora):
    """The student (tiny Llama, plain or LoRA) distils the tied tiny Llama (same tokenizer): every micro-batch
    carries the teacher's logprobs of its tokens (equal to a plain teacher forward), the logged
    ``distillation/reverse_kl`` is the mean of log pi - log pi_teacher over the step's tokens, and the policy
    moves; the teacher is frozen, outside the module's state dict, and unchanged."""
    module, recorder = _fit(tiny_llama_path, tiny_tied_llama_path, tmp_path, prompt_file, lora=lora)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_tied_llama_path).eval()
    assert not any(p.requires_grad for p in module.teacher_model.parameters())
    assert not any(k.startswith("teacher") for k in module.state_dict())
    for name, param in teacher.state_dict().items():  # the teacher did not train
        torch.testing.assert_close(module.teacher_model.state_dict()[name], param)
    assert len(recorder.metrics) == 2
    for step, batch in enumerate(recorder.batches):
        mask = batch.completion_mask.bool()
        with torch.no_grad():
            expected = trainer_logprobs(teacher, batch, temperature=1.0)
            student = trainer_logprobs(recorder.policies[step], batch, temperature=1.0)
        torch.testing.assert_close(batch.teacher_logprobs[mask], expected[mask], atol=1e-5, rtol=0)
        kl = float((student - expected)[mask].mean())
        assert recorder.metrics[step]["distillation/reverse_kl"] == pytest.approx(kl, abs=1e-5)
        assert abs(kl) > 1e-3
    assert recorder.metrics[0]["loss"] == pytest.approx(recorder.metrics[0]["distillation/reverse_kl"], abs=1e-5)


def test_a_teacher_with_another_tokenizer_is_refused_when_the_module_is_made(tiny_llama_path, tmp_path):
    """A teacher folder whose tokenizer differs from the policy's (one token's id changed) is refused with the
    token named, before any training."""
    folder = tmp_path / "other_teacher"
    AutoModelForCausalLM.from_pretrained(tiny_llama_path).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    tokenizer.add_tokens(["<an_extra_token>"])
    tokenizer.save_pretrained(folder)
    config = GRPOConfig(distillation=DistillationConfig(teacher=str(folder)))
    policy_vocab = len(AutoTokenizer.from_pretrained(tiny_llama_path).get_vocab())
    with pytest.raises(TokenizerMismatchError, match=rf"distillation.teacher=.*vocabularies of {policy_vocab} "
                                                     rf"\(policy\) and {policy_vocab + 1} \(teacher\) tokens, e.g. "
                                                     r"\['<an_extra_token>'\]"):
        GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_format"], config=config)


def _experience() -> Experience:
    """Three rows: a plain completion, one whose last tokens are an environment's (multi-turn context) and one
    without loss tokens; left-padded prompts of different lengths."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(100, 1000, (3, 4), generator=g)
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    completion_ids = torch.randint(100, 1000, (3, 6), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]])
    env_mask = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    return Experience(prompt_ids=prompt_ids * prompt_mask, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=completion_mask, advantages=torch.zeros(3), env_mask=env_mask)


def test_scored_sequences_hold_the_prompt_and_every_attended_token():
    exp = _experience()
    rows = scored_sequences(exp)
    assert [r for r, _, _ in rows] == [0, 1]  # the row without loss tokens is not sent
    assert rows[1][1] == exp.prompt_ids[1].tolist() + exp.completion_ids[1, :5].tolist() and rows[1][2] == 5
    assert rows[0][1] == exp.prompt_ids[0, 1:].tolist() + exp.completion_ids[0, :4].tolist() and rows[0][2] == 4


def test_prompt_logprob_answers_of_both_formats():
    ids = [5, 7, 9]
    vllm_style = {"index": 0, "prompt_logprobs": [None, {"7": {"logprob": -1.5, "rank": 2}, "3": {"logprob": -0.1}},
                                                  {"9": {"logprob": -0.25}}]}
    assert _prompt_logprobs(vllm_style, ids) == [-1.5, -0.25]
    echo_style = {"index": 0, "logprobs": {"token_logprobs": [None, -1.5, -0.25, -3.0]}}  # + the generated token
    assert _prompt_logprobs(echo_style, ids) == [-1.5, -0.25]
    with pytest.raises(RuntimeError, match="neither prompt_logprobs nor echoed"):
        _prompt_logprobs({"index": 0, "text": "x"}, ids)
    with pytest.raises(RuntimeError, match="no entry for token 9"):
        _prompt_logprobs({"prompt_logprobs": [None, {"7": {"logprob": -1.5}}, {"8": {"logprob": -0.2}}]}, ids)


def _local_scores(path: str, experience: Experience) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    teacher = ModelTeacher(model, CompletionLogprobs(GRPOConfig()))
    import contextlib

    with torch.no_grad():
        return teacher.score(experience, 8, contextlib.nullcontext)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.engine
def test_a_rollout_server_teacher_scores_like_the_local_model(tiny_tied_llama_path, tmp_path):
    """``lightning-grpo serve`` of the teacher: its ``/probe_logprobs`` of the same rows (multi-turn context
    included) equal the local teacher's logprobs to 1e-4 (float32 vLLM on CPU); its model folder's tokenizer is
    checked, and a policy with another tokenizer is refused."""
    pytest.importorskip("vllm")
    from support.rollout_server import Server

    server = Server(tiny_tied_llama_path, tmp_path / "teacher.log")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tiny_tied_llama_path)
        exp = _experience()
        teacher = RolloutServerTeacher(DistillationConfig(teacher_url=server.url, teacher_timeout=120), tokenizer)
        served = teacher.score(exp, 8, None)
        mask = exp.completion_mask.bool()
        torch.testing.assert_close(served[mask], _local_scores(tiny_tied_llama_path, exp)[mask], atol=1e-4, rtol=0)
        assert (served[2] == 0).all() and (served[0, 4:] == 0).all()  # no loss tokens, padding: not scored
        other = copy.deepcopy(tokenizer)
        other.add_tokens(["<an_extra_token>"])
        served_vocab = AutoConfig.from_pretrained(tiny_tied_llama_path).vocab_size  # what vLLM reports
        assert served_vocab < len(other)
        with pytest.raises(TokenizerMismatchError, match=f"teacher_url=.*a vocabulary of {served_vocab} ids, fewer "
                                                         f"than the policy's tokenizer's {len(other)}"):
            RolloutServerTeacher(DistillationConfig(teacher_url=server.url), other).score(exp, 8, None)
    finally:
        server.kill()


@pytest.fixture(scope="module")
def vllm_teacher(tiny_tied_llama_path, tmp_path_factory):
    """vLLM's OpenAI-compatible server (``vllm serve``) on the tied tiny Llama, on 127.0.0.1."""
    pytest.importorskip("vllm")
    log = tmp_path_factory.mktemp("vllm_teacher") / "server.log"
    with vllm_openai_server(tiny_tied_llama_path, "teacher", log, "--max-model-len", "512",
                            "--max-num-batched-tokens", "512", "--dtype", "float32") as url:
        yield url


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.engine
def test_an_openai_compatible_teacher_scores_like_the_local_model(vllm_teacher, tiny_tied_llama_path):
    """vLLM's ``/v1/completions`` with ``prompt_logprobs``: the same logprobs as the local teacher to 1e-4; the
    tokenizer is checked through ``/tokenize``, and a policy whose tokenizer encodes differently is refused."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tied_llama_path)
    config = DistillationConfig(teacher_url=vllm_teacher, teacher_api="openai", teacher_model_name="teacher",
                                teacher_timeout=120)
    exp = _experience()
    served = OpenAITeacher(config, tokenizer).score(exp, 8, None)
    mask = exp.completion_mask.bool()
    torch.testing.assert_close(served[mask], _local_scores(tiny_tied_llama_path, exp)[mask], atol=1e-4, rtol=0)
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["Let's"])  # encodes the probe text "... Let's think ..." differently
    with pytest.raises(TokenizerMismatchError, match="the teacher's tokenizer differs from the policy's: .What is 13"):
        OpenAITeacher(config, other).score(exp, 8, None)
