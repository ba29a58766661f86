"""``GRPOModule(gradient_checkpointing=...)`` (issue 24 item 3) on one device: the same loss and gradients as without
it, with fewer bytes saved for backward (counted with ``saved_tensors_hooks``). The distributed backends are checked
against this one-device run: DDP and FSDP1 in tests/strategies/test_fsdp.py (``*_checkpointed`` cases), FSDP2 there
too (``fsdp2_dapo``), megatron-core's recompute in tests/strategies/test_megatron_model.py."""

import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.training.experience import Experience


def _batch(vocab_size):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1] * 9 + [0] * 3, [1] * 12, [1] * 5 + [0] * 7, [1] * 12])
    return Experience(prompt_ids=torch.randint(0, vocab_size, (4, 6), generator=g),
                      prompt_mask=torch.ones(4, 6, dtype=torch.long),
                      completion_ids=torch.randint(0, vocab_size, (4, 12), generator=g), completion_mask=mask,
                      advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def _step(path, checkpointing):
    module = GRPOModule(path, reward_funcs=["gsm8k_accuracy"], gradient_checkpointing=checkpointing,
                        config=GRPOConfig(entropy_coef=0.01, shared_prefix=False))
    assert module.policy.is_gradient_checkpointing == bool(checkpointing)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    batch = _batch(module.policy.config.vocab_size)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = module.compute_loss(batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in module.policy.named_parameters()}, sum(saved)


@pytest.mark.parametrize("checkpointing", [True, pytest.param("offload", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="offload keeps GPU activations in CPU memory"))])
def test_checkpointed_gradients_equal_the_plain_ones(tiny_tied_llama_path, checkpointing):
    loss, grads, saved = _step(tiny_tied_llama_path, False)
    loss_ckpt, grads_ckpt, saved_ckpt = _step(tiny_tied_llama_path, checkpointing)
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-6, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert saved_ckpt < saved  # the decoder layers' activations are recomputed, not kept


def test_an_unknown_checkpointing_mode_is_an_error(tiny_llama_path):
    with pytest.raises(ValueError, match=r"gradient_checkpointing='cpu': choose False, True or 'offload'"):
        GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], gradient_checkpointing="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"gradient_checkpointing='offload' .* without CUDA"):
            GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], gradient_checkpointing="offload")
