"""megatron-core models converted from HF, in this process at TP=1 (a one-process gloo group): logits, completion
logprobs and their gradients against transformers, the CPU shim, HF weight sync and export."""

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule, functional  # noqa: E402
from lightning_grpo.strategies.megatron import convert, cpu_shims  # noqa: E402
from lightning_grpo.strategies.megatron.policy import score_completions  # noqa: E402
from lightning_grpo.training.experience import Experience  # noqa: E402
from support.megatron_worker import save_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("megatron_tiny")
    return {name: save_tiny_model(str(root / name), smollm2_path, tied=name == "tied", model_type=kind)
            for name, kind in (("tied", "llama"), ("untied", "llama"), ("qwen2", "qwen2"))}


@pytest.fixture(scope="module")
def model_parallel():
    """A one-process gloo group with megatron-core's parallel state at TP=1 and the CPU shim; all undone after."""
    from megatron.core import parallel_state

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    cpu_shims.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()
    cpu_shims.remove()
    torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy(path):
    from lightning_grpo.strategies.megatron.policy import MegatronPolicy

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf, MegatronPolicy.from_hf(hf, tensor_model_parallel_size=1)


def _experience(pad_id):
    """3 rows, left-padded prompts of lengths 5, 3, 4 (pad = the model's pad/eos token, which also occurs inside
    row 2's prompt), right-padded completions of lengths 4, 2, 3."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(200, 2000, (3, 5), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    prompt_ids[prompt_mask == 0] = pad_id
    prompt_ids[2, 2] = pad_id  # a real <|im_end|> inside the prompt
    completion_ids = torch.randint(200, 2000, (3, 4), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    completion_ids[completion_mask == 0] = pad_id
    return Experience(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(3))


@pytest.mark.parametrize("name", ["tied", "untied", "qwen2"])
def test_logits_match_transformers(model_parallel, tiny_models, name):
    hf, policy = _policy(tiny_models[name])
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids).logits
        logits = policy(input_ids)
    assert logits.shape == expected.shape == (2, 13, 49152)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert expected.abs().max() > 0.5  # not a degenerate comparison


def test_completion_logprobs_and_gradients_match_the_hf_path(model_parallel, tiny_models):
    """GRPOModule.completion_logprobs with the Megatron backend's scorer (``GRPOModels.scorer``, the policy's own
    vocab-parallel logprobs): same logprobs, entropy and weight gradients on the completion tokens as the HF path
    with left padding (incl. the HF embedding's padding_idx rule for the pad token that also occurs inside
    prompts)."""
    hf, policy = _policy(tiny_models["tied"])
    module = GRPOModule(hf, tokenizer=tiny_models["tied"], reward_funcs=[lambda p, c, **k: [0.0] * len(c)],
                        config=GRPOConfig(temperature=0.7, num_generations=2))
    batch = _experience(hf.config.pad_token_id)
    mask = batch.completion_mask.bool()
    expected, expected_entropy = module.completion_logprobs(hf, batch, with_entropy=True)
    module.logprobs.use(score_completions, sharded=False)  # what MegatronStrategy.configure tells the module
    logprobs, entropy = module.completion_logprobs(policy, batch, with_entropy=True)
    torch.testing.assert_close(logprobs[mask], expected[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], atol=1e-5, rtol=0)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    (expected * weights).sum().backward()
    (logprobs * weights).sum().backward()
    grads = convert.mcore_to_hf([{n: p.grad for n, p in policy.model.named_parameters()}], policy.arch)
    pad_row = hf.model.embed_tokens.weight.grad[hf.config.pad_token_id]
    assert pad_row.abs().max() > 0  # the tied output layer still trains the pad row
    for name, param in hf.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=2e-5, rtol=1e-4, msg=name)


def test_activation_recompute_gives_the_same_gradients(model_parallel, tiny_models):
    """megatron-core's full per-layer recompute (GRPOModule(gradient_checkpointing=True) under MegatronStrategy):
    the same logprobs and weight gradients, with fewer bytes saved for backward."""
    from lightning_grpo.strategies.megatron.model import recompute_settings
    from lightning_grpo.strategies.megatron.policy import MegatronPolicy

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["untied"], dtype=torch.float32)
    batch = _experience(hf.config.pad_token_id)
    weights = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for recompute in (False, True):
        policy = MegatronPolicy.from_hf(hf, tensor_model_parallel_size=1, **recompute_settings(recompute))
        assert policy.model.config.recompute_granularity == ("full" if recompute else None)
        saved: list[int] = []

        def pack(tensor, saved=saved):
            saved.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logprobs, _ = policy.completion_logprobs(batch, 0.7)
        (logprobs * weights * batch.completion_mask).sum().backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in policy.model.named_parameters()}, sum(saved)))
    (plain, grads, saved), (recomputed, grads_recomputed, saved_recomputed) = results
    torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert saved_recomputed < saved
    assert recompute_settings(False) == {}


def test_vocab_parallel_logprobs_equal_token_logprobs_at_tp1(model_parallel):
    from lightning_grpo.strategies.megatron.vocab_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 3, 50, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 50, (2, 3), generator=g)
    expected, expected_entropy = functional.token_logprobs(logits, labels, 0.5, with_entropy=True)
    (grad_expected,) = torch.autograd.grad(expected.sum(), logits)
    logprobs, entropy = vocab_parallel_logprobs(logits, labels, 0.5, with_entropy=True)
    (grad,) = torch.autograd.grad(logprobs.sum(), logits)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, grad_expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="temperature=0"):
        vocab_parallel_logprobs(logits, labels, 0.0)


def test_sync_hf_model_and_save_pretrained(model_parallel, tiny_models, tmp_path):
    hf, policy = _policy(tiny_models["untied"])
    assert policy.hf_model is hf and policy.hf_model_is_current()
    with torch.no_grad():
        policy.model.decoder.final_layernorm.weight.add_(1.0)  # an in-place update, as an optimizer step
    assert not policy.hf_model_is_current()
    with pytest.raises(RuntimeError, match="stale"):
        policy.save_pretrained(str(tmp_path / "stale"))
    policy.sync_hf_model()
    assert policy.hf_model_is_current()
    policy.save_pretrained(str(tmp_path / "export"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).state_dict()
    gathered = dict(policy.iter_hf_weights())
    assert sorted(reloaded) == sorted(gathered)
    for name, value in gathered.items():
        assert torch.equal(reloaded[name], value), name
    assert torch.equal(reloaded["model.norm.weight"], hf.model.norm.weight)


def test_cpu_shims_are_reference_counted_and_restore_torch():
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    original_device, original_fork = torch.cuda.current_device, CudaRNGStatesTracker.fork
    original_states = mcore_random._get_all_rng_states
    was_applied = cpu_shims.is_applied()
    with cpu_shims.cpu_shims():
        with cpu_shims.cpu_shims():
            assert torch.cuda.current_device() == torch.device("cpu")
            with CudaRNGStatesTracker().fork("never-added"):  # the CUDA tracker would raise: state not added
                pass
        assert cpu_shims.is_applied()
    assert cpu_shims.is_applied() == was_applied
    if not was_applied:
        assert torch.cuda.current_device is original_device and CudaRNGStatesTracker.fork is original_fork
        assert mcore_random._get_all_rng_states is original_states
