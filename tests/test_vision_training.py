"""Vision-language GRPO through ``GRPOModule`` and the Trainer (tiny random Qwen2.5-VL and LLaVA, images drawn here):

* accumulation and token-budget micro-batches never change the gradient with images (each row keeps its own
  pixels whatever the cut: the "pixel_values split wrongly across gradient accumulation" failure), in every layout;
* 2 processes (DDP, FSDP2) give the 1-process step (loss, post-clip gradients, weights);
* a run stopped in the middle of a rollout and resumed from its checkpoint ends bitwise where the uninterrupted run
  ends (the rollout's images are in the checkpoint);
* LoRA adapts the language model only: the vision tower is frozen and untouched, the projector trains in full with
  ``modules_to_save``, and the adapters-off reference is the base model.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from support.algorithm import Recorder, quiet_trainer
from support.fixtures import make_cpu_trainer
from support.vision import picture


@pytest.fixture(scope="module")
def image_data(tmp_path_factory):
    """8 rows: a shape of a colour (pictures of different sizes as PNG files), the question, the answer."""
    root = tmp_path_factory.mktemp("images")
    rows = []
    for i, (colour, size) in enumerate([("red", (64, 48)), ("green", (40, 90)), ("blue", (56, 56)),
                                        ("red", (90, 60)), ("green", (48, 48)), ("blue", (70, 40)),
                                        ("red", (30, 80)), ("green", (60, 60))]):
        path = root / f"{i}.png"
        picture(colour, size).save(path)
        rows.append({"question": "What colour is the shape?", "answer": colour, "image": str(path)})
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(data)


def by_position(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


def _fit(path, root, data, accumulate=1, steps=2, callbacks=(), ckpt_path=None, lora=None, **knobs):
    L.seed_everything(0)
    config = GRPOConfig(**{"num_generations": 4, "max_new_tokens": 6, "num_iterations": 2, **knobs})
    module = GRPOModule(path, reward_funcs=[by_position], config=config, learning_rate=1e-3, export_dir="",
                        lora=lora)
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = make_cpu_trainer(root, steps, accumulate_grad_batches=accumulate, callbacks=list(callbacks),
                               logger=False, enable_checkpointing=checkpointing, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=PromptDataModule(dataset=data, image_field="image", prompts_per_step=2,
                                                    val_size=0, system_prompt=None), ckpt_path=ckpt_path)
    return module


LAYOUTS = {"shared_prefix": {}, "packed": dict(shared_prefix=False), "padded": dict(padding_free=False)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("cut", ["accumulate_4", "token_budget"])
def test_gradient_does_not_depend_on_the_micro_batches(tiny_qwen_vl_path, image_data, tmp_path, layout, cut):
    whole = Recorder(grads=True)
    _fit(tiny_qwen_vl_path, tmp_path / "one", image_data, callbacks=[whole], **LAYOUTS[layout])
    split = Recorder(grads=True)
    knobs = dict(LAYOUTS[layout])
    if cut == "token_budget":
        knobs["max_tokens_per_microbatch"] = 60  # about one sequence per micro-batch
    _fit(tiny_qwen_vl_path, tmp_path / "split", image_data, accumulate=4 if cut == "accumulate_4" else 1,
         callbacks=[split], **knobs)
    assert [len(b) for b in whole.batches] == [8, 8] and len(split.batches) > 2
    assert all(b.images is not None and len(b.images) == len(b) for b in split.batches)
    for step, (g1, g2) in enumerate(zip(whole.grads, split.grads, strict=True)):
        vision = [k for k in g1 if "visual" in k]
        assert vision and max(g1[k].abs().max().item() for k in vision) > 0, step  # the pixels get gradients
        for key in g1:
            torch.testing.assert_close(g2[key], g1[key], atol=1e-5, rtol=0, msg=f"step {step}: {key}")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "grpo_fsdp2"])
def test_two_processes_take_the_one_process_step(tiny_qwen_vl_path, tmp_path, strategy):
    from pathlib import Path

    from support.dist import assert_same_step, load, run_worker

    worker = Path(__file__).resolve().parent / "support" / "vision_worker.py"
    base = {"scenario": "image_step", "model": tiny_qwen_vl_path}
    run_worker({**base, "devices": 1, "strategy": {"name": "auto"}}, tmp_path / "one", timeout=600, worker=worker)
    run_worker({**base, "devices": 2, "strategy": {"name": strategy}}, tmp_path / "two", timeout=900, worker=worker)
    reference = load(tmp_path / "one", "image_step", 1)[0]
    ranks = load(tmp_path / "two", "image_step", 2)
    assert any("visual" in k and g is not None and g.abs().max() > 0 for k, g in reference["grads"].items())
    # the logged grad_norm is a float32 reduction over ~200k gradient entries: on either side it is off the float64
    # norm of its own gradients by up to ~2e-5 relative (measured), more than assert_same_step's 1e-5 allows; the
    # gradients themselves agree to ~1e-7. Each norm is checked against its gradients, then the rest as usual.
    for run in (reference, *ranks):
        exact = torch.sqrt(sum(g.double().pow(2).sum() for g in run["grads"].values() if g is not None))
        assert abs(run["metrics"]["grad_norm"] - float(exact)) <= 1e-4 * float(exact)
        run["metrics"]["grad_norm"] = reference["metrics"]["grad_norm"]
    assert_same_step(reference, ranks)


def test_a_resumed_run_ends_where_the_uninterrupted_one_ends(tiny_qwen_vl_path, image_data, tmp_path):
    """4 steps = 2 rollouts of 2 mini-batches; the run is cut after step 1 (inside the first rollout, whose
    images the checkpoint holds) and resumed."""
    knobs = dict(mini_batch_size=4, num_iterations=1)
    whole = _fit(tiny_qwen_vl_path, tmp_path / "whole", image_data, steps=4, **knobs)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    _fit(tiny_qwen_vl_path, tmp_path / "cut", image_data, steps=1, callbacks=[checkpoint], **knobs)
    (path,) = (tmp_path / "ckpt").glob("*step=1*.ckpt")
    state = torch.load(path, weights_only=True)  # plain data, images included
    (cursor,) = state["loops"]["fit_loop"]["state_dict"]["rollout_cursors"]
    assert cursor["partial_rollout"]["experience"]["images"] is not None
    resumed = _fit(tiny_qwen_vl_path, tmp_path / "resumed", image_data, steps=4, ckpt_path=str(path), **knobs)
    for (name, a), (_, b) in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_lora_adapts_the_language_model_only(tiny_llava_path, image_data, tmp_path):
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["multi_modal_projector"])
    module = GRPOModule(tiny_llava_path, reward_funcs=[by_position], lora=lora, export_dir="",
                        config=GRPOConfig(num_generations=4, max_new_tokens=4, beta=0.1))
    adapted = [n for n, _ in module.policy.named_modules() if n.endswith(".lora_A")]
    assert adapted and all("language_model" in n for n in adapted)  # CLIP's q_proj / v_proj are left alone
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert any("multi_modal_projector" in n for n in trainable) and not any("vision_tower" in n for n in trainable)
    L.seed_everything(0)
    trainer = quiet_trainer(tmp_path, 1)
    trainer.fit(module, datamodule=PromptDataModule(dataset=image_data, image_field="image", prompts_per_step=2,
                                                    val_size=0, system_prompt=None))
    after = dict(module.policy.named_parameters())
    moved = {n for n, p in after.items() if not torch.equal(p.detach(), before[n])}
    assert moved and moved <= trainable
    assert any("multi_modal_projector" in n for n in moved) and any("lora_" in n for n in moved)


def test_an_image_column_with_a_causal_lm_is_refused_at_setup_naming_the_column(tiny_llama_path, image_data,
                                                                                tmp_path):
    """A causal LM (no vision tower) and a dataset with an image column: ``trainer.fit`` stops at setup with an error
    naming the column, before an engine is made or anything sampled (not inside the chat template, and never one
    optimizer step on the prompts without their pictures)."""
    scored = []

    def reward(prompts, completions, **kwargs):
        scored.append(len(completions))
        return [0.0] * len(completions)

    module = GRPOModule(tiny_llama_path, reward_funcs=[reward], config=GRPOConfig(num_generations=2,
                                                                                  max_new_tokens=4), export_dir="")
    trainer = make_cpu_trainer(tmp_path, 1, logger=False, enable_checkpointing=False, num_sanity_val_steps=0)
    data = PromptDataModule(dataset=image_data, image_field="image", prompts_per_step=2, val_size=0)
    with pytest.raises(ValueError, match=r"image column 'image' .*not a vision-language model"):
        trainer.fit(module, datamodule=data)
    assert scored == [] and module.rollout.engine is None and trainer.global_step == 0
