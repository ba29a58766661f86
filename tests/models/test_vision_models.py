"""Vision-language checkpoints (lightning_grpo.models.vision_loading): which configs are ones and their image facts,
loading through ``GRPOModule(model=...)`` with the processor beside them (PIL image processors, no torchvision), the
processor's resize rule, and the errors for a processor without images or images without a processor."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.models.vision_loading import load_image_processor, load_vision_policy, qwen_size
from lightning_grpo.protocols.vision import vision_spec
from lightning_grpo.rollout.image_prompts import ImagePrompts


def test_image_facts_of_each_family(tiny_qwen_vl_path, tiny_qwen3_vl_path, tiny_llava_path, tiny_llama_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen_vl_path)
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    for path, model_type in ((tiny_qwen_vl_path, "qwen2_5_vl"), (tiny_qwen3_vl_path, "qwen3_vl")):
        spec = vision_spec(AutoConfig.from_pretrained(path))
        assert (spec.family, spec.model_type, spec.mrope, spec.merge_size) == ("qwen_vl", model_type, True, 2)
        assert spec.placeholder_id == ids[2] and spec.banned_token_ids == tuple(sorted(ids))
    llava = vision_spec(AutoConfig.from_pretrained(tiny_llava_path))
    image = AutoTokenizer.from_pretrained(tiny_llava_path).convert_tokens_to_ids("<image>")
    assert (llava.family, llava.mrope, llava.placeholder_id, llava.banned_token_ids) == ("llava", False, image,
                                                                                         (image,))
    assert vision_spec(AutoConfig.from_pretrained(tiny_llama_path)) is None


@pytest.mark.parametrize("height,width", [(48, 64), (90, 40), (10, 2000), (500, 500), (28, 28), (13, 900), (7, 7)])
def test_the_resize_is_the_processors(tiny_qwen_vl_path, height, width):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    processor = load_image_processor(tiny_qwen_vl_path)
    size = processor.size
    assert qwen_size(processor, height, width) == smart_resize(height, width, 28, size["shortest_edge"],
                                                               size["longest_edge"])


@pytest.mark.parametrize("which", ["qwen2_5_vl", "qwen3_vl", "llava"])
def test_grpo_module_takes_a_vision_language_checkpoint(request, which):
    path = request.getfixturevalue({"qwen2_5_vl": "tiny_qwen_vl_path", "qwen3_vl": "tiny_qwen3_vl_path",
                                    "llava": "tiny_llava_path"}[which])
    module = GRPOModule(path, reward_funcs=["gsm8k_accuracy"], config=GRPOConfig(beta=0.1), export_dir="")
    assert module.policy.config.model_type == which and module.policy.training
    assert isinstance(module.rollout.prompts, ImagePrompts)
    assert module.logprobs.vision == module.rollout.prompts.spec
    assert module.rollout.banned_token_ids == module.rollout.prompts.spec.banned_token_ids
    assert module.ref_model is not None and not any(p.requires_grad for p in module.ref_model.parameters())


def test_a_processor_without_images_or_images_without_a_processor_is_refused(tiny_llama_path, tiny_qwen_vl_path):
    with pytest.raises(ValueError, match="processor=...\\) was given, but the policy .* is not a vision-language"):
        GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], processor=tiny_qwen_vl_path)
    model = load_vision_policy(tiny_qwen_vl_path, torch.float32)
    model.config._name_or_path = ""  # a module with no folder to find its processor in
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen_vl_path)
    with pytest.raises(ValueError, match="given as a module: pass its image processor"):
        GRPOModule(model, tokenizer=tokenizer, reward_funcs=["gsm8k_accuracy"])
    module = GRPOModule(model, tokenizer=tokenizer, reward_funcs=["gsm8k_accuracy"],
                        processor=load_image_processor(tiny_qwen_vl_path))
    assert isinstance(module.rollout.prompts, ImagePrompts)
    with pytest.raises(ValueError, match="holds no image processor"):
        load_image_processor(tiny_llama_path)


def test_an_agent_with_a_vision_language_policy_is_refused(tiny_llama_path, tiny_qwen_vl_path):
    """The agent gateway serves text and would not keep the image placeholders out of the sampled tokens."""
    def agent(base_url, api_key, row):
        return 0.0

    for model, processor in ((tiny_qwen_vl_path, None), (tiny_llama_path, tiny_qwen_vl_path)):
        with pytest.raises(ValueError, match=r"GRPOModule\(agent=...\) trains text policies"):
            GRPOModule(model, reward_funcs=["gsm8k_accuracy"], agent=agent, processor=processor)


def test_an_engine_checkpoint_of_a_module_holds_its_image_processor(tiny_qwen_vl_path, monkeypatch):
    """A vision-language policy given as a module has no folder: the checkpoint an engine with its own weights is
    loaded from is saved, and it holds the image processor too (so the engine processes the pictures alike)."""
    import shutil

    from transformers import AutoConfig

    from lightning_grpo.config import EngineConfig
    from lightning_grpo.rollout import engine_registry
    from support.algorithm import FixedRolloutEngine

    monkeypatch.setattr(engine_registry, "_REGISTERED", {})
    folders = []

    def factory(spec):
        folders.append(spec.checkpoint())
        return FixedRolloutEngine(torch.tensor([[1]]), 0)

    engine_registry.register_engine("saved", factory)
    policy = load_vision_policy(tiny_qwen_vl_path, torch.float32)
    policy.config._name_or_path = ""  # as a module built in code: no folder to load an engine from
    module = GRPOModule(policy, tokenizer=tiny_qwen_vl_path, processor=tiny_qwen_vl_path,
                        reward_funcs=["gsm8k_accuracy"], config=GRPOConfig(engine=EngineConfig(name="saved")),
                        export_dir="")
    module.make_rollout_engine()
    (folder,) = folders
    try:
        assert folder != tiny_qwen_vl_path
        assert load_image_processor(folder).to_dict() == load_image_processor(tiny_qwen_vl_path).to_dict()
        assert vision_spec(AutoConfig.from_pretrained(folder)) == vision_spec(policy.config) is not None
    finally:
        shutil.rmtree(folder)


def test_distillation_of_a_vision_language_policy_is_refused(tiny_qwen_vl_path, tiny_llama_path):
    """A teacher scores token ids: it would score the image placeholders without their pixels (a wrong reverse KL)."""
    from lightning_grpo.config import DistillationConfig

    for distillation in (DistillationConfig(teacher=tiny_llama_path),
                         DistillationConfig(teacher_url="http://127.0.0.1:9")):
        with pytest.raises(ValueError, match="distillation with a vision-language policy is not supported"):
            GRPOModule(tiny_qwen_vl_path, reward_funcs=["gsm8k_accuracy"],
                       config=GRPOConfig(distillation=distillation))
