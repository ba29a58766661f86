"""The reward model reward: equal to the same model run by hand with its own chat template, and to TRL 1.16's own
reward-model path (``GRPOTrainer._calculate_rewards`` with the model's folder in ``reward_funcs``), on a tiny random
``LlamaForSequenceClassification`` with SmolLM2's tokenizer; composed with rule rewards in a training step."""

import csv
import glob

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from lightning_grpo.rewards import RewardPool, score_completions
from lightning_grpo.rewards.reward_model import (
    RewardModel,
    is_reward_model_spec,
    resolve_device,
    resolve_reward_models,
)

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
PROMPTS = [[SYSTEM, {"role": "user", "content": "What is 2 + 2?"}]] * 3 + [[{"role": "user", "content": "Name a cat."}]]
COMPLETIONS = ["4", "The answer is 4, because 2 + 2 = 4.", "five", "Tom. Or maybe Felix, a longer name for a cat."]


def _by_hand(path: str, prompts, completions) -> list[float]:
    """Each sequence alone (no padding): the RM's own template, its own tokenizer, logit 0 of the last token."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": completion}], tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            scores.append(float(model(**ids).logits[0, 0]))
    return scores


def test_scores_equal_the_model_run_by_hand_with_its_own_template(tiny_reward_model_path):
    expected = _by_hand(tiny_reward_model_path, PROMPTS, COMPLETIONS)
    assert max(expected) - min(expected) > 0.1  # the completions score differently
    for batch_size in (1, 3, 16):  # padded batches (right padding) score as each sequence alone
        rm = RewardModel(tiny_reward_model_path, device="cpu", batch_size=batch_size)
        assert rm(PROMPTS, COMPLETIONS) == pytest.approx(expected, abs=1e-5)
    assert rm.__name__ == tiny_reward_model_path.rstrip("/").split("/")[-1]  # TRL's naming: the folder's name


def test_the_reward_models_template_is_used_not_the_policys(tiny_reward_model_path, tmp_path):
    """A reward model whose tokenizer has another chat template scores another text: its own template's."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_path)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    rm = RewardModel(tiny_reward_model_path, tokenizer=tokenizer, device="cpu")
    assert rm.texts(PROMPTS[:1], ["4"]) == ["[system] You are a careful assistant.\n[user] What is 2 + 2?\n"
                                            "[assistant] 4\n"]
    default = RewardModel(tiny_reward_model_path, device="cpu")
    assert rm(PROMPTS[:1], ["4"])[0] != pytest.approx(default(PROMPTS[:1], ["4"])[0], abs=1e-3)


def test_string_prompts_are_prompt_plus_completion(tiny_reward_model_path):
    rm = RewardModel(tiny_reward_model_path, device="cpu")
    assert rm.texts(["Question: 2 + 2 = "], ["4"]) == ["Question: 2 + 2 = 4"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_path, num_labels=1).eval()
    with torch.no_grad():
        expected = float(model(**tokenizer("Question: 2 + 2 = 4", return_tensors="pt",
                                           add_special_tokens=False)).logits[0, 0])
    assert rm(["Question: 2 + 2 = "], ["4"]) == pytest.approx([expected], abs=1e-5)


def test_equal_to_trls_reward_model_path(tiny_reward_model_path, tiny_llama_path, tmp_path):
    """TRL loads the reward model from the same folder itself (``AutoModelForSequenceClassification``,
    ``num_labels=1``, its tokenizer) and scores the same batch with its own ``_calculate_rewards`` (in float32:
    ``bf16=False``, TRL's default being bf16 autocast, which rounds the scores to bf16)."""
    trl = pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[test]' (pins trl==1.16.0)")
    if not trl.__version__.startswith("1.16."):
        pytest.skip(f"this test pins TRL's 1.16 code; trl {trl.__version__} is installed")
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    args = TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], save_strategy="no",
                     per_device_train_batch_size=4, num_generations=2, max_completion_length=8, bf16=False)
    trainer = GRPOTrainer(model=tiny_llama_path, reward_funcs=[tiny_reward_model_path], args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}))
    inputs = [{"prompt": p} for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]  # TRL's conversational completions
    theirs = trainer._calculate_rewards(inputs, PROMPTS, completions, [[0]] * len(PROMPTS))[:, 0].tolist()
    ours = score_completions([RewardModel(tiny_reward_model_path, device="cpu")], PROMPTS, COMPLETIONS, {},
                             pool=RewardPool(2))
    assert ours.names == [trainer.reward_func_names[0]]  # the same metric name
    assert ours.per_function[:, 0].tolist() == pytest.approx(theirs, abs=1e-5)
    assert ours.per_function[:, 0].tolist() == pytest.approx(_by_hand(tiny_reward_model_path, PROMPTS, COMPLETIONS),
                                                            abs=1e-5)


def test_specs_with_a_slash_are_reward_models(tiny_reward_model_path):
    assert is_reward_model_spec(tiny_reward_model_path) and is_reward_model_spec("OpenAssistant/reward-model")
    assert not is_reward_model_spec("gsm8k_accuracy") and not is_reward_model_spec("pkg.module:fn")
    resolved = resolve_reward_models(["gsm8k_accuracy", tiny_reward_model_path], device="cpu")
    assert resolved[0] == "gsm8k_accuracy" and isinstance(resolved[1], RewardModel)


def test_device_auto_is_the_device_the_module_gives():
    """``GRPOModule.setup`` passes each rank's device: a pool thread's current CUDA device would be 0 on every rank."""
    assert resolve_device("auto", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", torch.device("cpu")) == torch.device("cuda", 1)  # an explicit device wins
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
    rm = RewardModel("unused/folder")
    rm.setup(torch.device("cuda", 2))
    assert rm._process_device == torch.device("cuda", 2)


def test_bad_arguments_raise_clear_errors(tiny_reward_model_path, tmp_path):
    with pytest.raises(ValueError, match="dtype='int8'"):
        RewardModel(tiny_reward_model_path, dtype="int8")
    with pytest.raises(ValueError, match="batch_size=0"):
        RewardModel(tiny_reward_model_path, batch_size=0)
    config = AutoConfig.from_pretrained(tiny_reward_model_path)
    config.num_labels = 2
    two = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel(two, tokenizer=tiny_reward_model_path, device="cpu")(PROMPTS[:1], ["4"])


def test_a_training_step_with_the_reward_model_and_a_rule_reward(tmp_path, tiny_llama_path, tiny_reward_model_path):
    """The reward model composes with a rule reward: both are logged, the weighted sum is the reward, and the
    per-function reward time is logged."""
    L.seed_everything(0, verbose=False)
    module = GRPOModule(tiny_llama_path, reward_funcs=[tiny_reward_model_path, "gsm8k_format"],
                        reward_weights=[0.5, 1.0], config=GRPOConfig(num_generations=2, max_new_tokens=6,
                                                                     max_prompt_length=128, reward_num_workers=2),
                        export_dir="")
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=CSVLogger(str(tmp_path), name="logs"),
                        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=PromptDataModule("arithmetic", prompts_per_step=2, val_size=0))
    (path,) = glob.glob(str(tmp_path / "logs" / "**" / "metrics.csv"), recursive=True)
    (row,) = [r for r in csv.DictReader(open(path)) if r.get("loss")]
    name = tiny_reward_model_path.rstrip("/").split("/")[-1]
    rm_mean, fmt_mean = float(row[f"rewards/{name}/mean"]), float(row["rewards/gsm8k_format/mean"])
    assert abs(rm_mean) > 1.0  # the tiny model's logits (~14): the reward model scored every completion
    assert float(row["reward"]) == pytest.approx(0.5 * rm_mean + fmt_mean, rel=1e-5)
    assert float(row[f"timing/reward_{name}_s"]) > 0 and float(row["timing/reward_gsm8k_format_s"]) >= 0
