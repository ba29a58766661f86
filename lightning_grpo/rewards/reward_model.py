"""A sequence-classification reward model as a reward function (TRL's reward-model path, ``GRPOTrainer`` with a
model id in ``reward_funcs``).

The reward of a completion is the model's single logit on prompt + completion, rendered with the reward model's own
tokenizer and chat template (not the policy's): for a conversational prompt (a list of messages) the text is
``rm_tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}], tokenize=False)``, for a
string prompt ``prompt + completion``; tokenized without special tokens (the template has them), padded on the right,
and scored by ``AutoModelForSequenceClassification`` (``num_labels=1``), whose head reads the last non-pad token
(the model's ``pad_token_id`` is set to the tokenizer's; a tokenizer without one pads with its EOS), exactly as
TRL 1.16's ``GRPOTrainer._calculate_rewards`` does. The model is loaded on first use (in each process, so under DDP
and FSDP each process scores its own rollouts with its own copy), frozen (``eval()``, no gradients, under
``torch.inference_mode``), and never part of the policy's checkpoints.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence, Union

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lightning_grpo.rewards.pool import PooledReward, RewardChunk

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_reward_model_spec(spec: Any) -> bool:
    """A reward spec that names a reward model: a string with a ``/`` (a folder or a hub id ``owner/name``) or an
    existing folder, and no ``:`` (``"pkg.module:function"`` is an import path)."""
    return isinstance(spec, str) and ":" not in spec and ("/" in spec or os.path.isdir(spec))


def resolve_reward_models(specs: Sequence[Any], device: str = "auto") -> list[Any]:
    """``specs`` with every reward-model spec (:func:`is_reward_model_spec`) replaced by a :class:`RewardModel`
    on ``device``; the other specs unchanged (resolved later by the registry)."""
    return [RewardModel(spec, device=device) if is_reward_model_spec(spec) else spec for spec in specs]


def resolve_device(device: str, process_device: Optional[torch.device] = None) -> torch.device:
    """``"auto"``: ``process_device`` (the trainer's device of this process, from :meth:`RewardModel.setup`), else
    the calling thread's current CUDA device when CUDA is available, else the CPU; anything else as
    ``torch.device(device)``."""
    if device == "auto":
        if process_device is not None:
            return process_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class RewardModel(PooledReward):
    """A classifier reward model (``AutoModelForSequenceClassification``, one label) as a reward function.

    Args:
        model: a local folder or hub id, or a loaded ``PreTrainedModel`` (a sequence classifier with one label).
        tokenizer: its tokenizer (or folder/id); default: loaded from ``model``.
        device: where it runs: ``"auto"`` (the trainer's device of this process, which ``GRPOModule`` passes to
            :meth:`setup`: each rank's own GPU; used alone, the current CUDA device, else the CPU), ``"cpu"``,
            ``"cuda:1"``, ...
        dtype: the weights' dtype when loading: ``"float32"``, ``"bfloat16"``, ``"float16"``, or ``"auto"``: the
            dtype the trainer computes its policy in (:attr:`~lightning_grpo.rewards.pool.PooledReward.compute_dtype`:
            bfloat16 under ``Trainer(precision="bf16-mixed")`` or ``"bf16-true"``; the rewards are the logit in that
            dtype, as TRL's under ``bf16=True`` autocast), float32 used alone.
        batch_size: sequences per forward pass (>= 1).
        max_length: truncate each text to its last ``max_length`` tokens (None: no truncation, as TRL).
        name: the metric name; default: the model's folder or id after its last ``/`` (TRL's naming).

    Rewards: the logit, unbounded (float32), one per completion; the whole rollout is one call of the reward pool
    (its forward passes go one batch at a time).

    Raises:
        ValueError: a bad ``dtype``, ``batch_size`` or ``max_length``; at first use, a model with more than one label.
    """

    chunk_size = None

    def __init__(self, model: Union[str, PreTrainedModel], tokenizer: Union[str, PreTrainedTokenizerBase, None] = None,
                 device: str = "auto", dtype: str = "auto", batch_size: int = 16, max_length: Optional[int] = None,
                 name: Optional[str] = None) -> None:
        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"RewardModel dtype={dtype!r} is unknown; choose from {sorted(_DTYPES) + ['auto']}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"RewardModel batch_size={batch_size!r} must be an integer >= 1")
        if max_length is not None and max_length < 1:
            raise ValueError(f"RewardModel max_length={max_length!r} must be >= 1 or None")
        source = model if isinstance(model, str) else model.config._name_or_path
        super().__init__(name or str(source).rstrip("/").split("/")[-1] or "reward_model")
        self.source, self.tokenizer_source = model, tokenizer
        self.device, self.dtype, self.batch_size, self.max_length = device, dtype, batch_size, max_length
        self._model: Optional[PreTrainedModel] = None
        self._tokenizer: Optional[PreTrainedTokenizerBase] = None
        self._process_device: Optional[torch.device] = None
        self._lock = threading.Lock()

    def setup(self, device: object) -> None:
        """The trainer's device of this process, where ``device="auto"`` loads the model (a pool thread's current
        CUDA device is device 0 whatever the rank)."""
        self._process_device = torch.device(str(device))

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the weights are loaded in: ``dtype``, "auto" resolved (the trainer's compute dtype if it is one
        of ``dtype``'s choices, else float32)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        chosen = [d for d in _DTYPES.values() if d == self.compute_dtype]
        return chosen[0] if chosen else torch.float32

    def load(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """The frozen model on its device and its tokenizer (loaded on the first call)."""
        with self._lock:
            if self._model is None:
                model = self.source
                if isinstance(model, str):
                    model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1,
                                                                               dtype=self.weights_dtype)
                if model.config.num_labels != 1:
                    raise ValueError(f"reward model {self.__name__!r} has num_labels={model.config.num_labels}; a "
                                     "reward model has one (AutoModelForSequenceClassification(num_labels=1))")
                tokenizer = self.tokenizer_source
                if tokenizer is None or isinstance(tokenizer, str):
                    tokenizer = AutoTokenizer.from_pretrained(tokenizer or model.config._name_or_path)
                if tokenizer.pad_token_id is None:
                    tokenizer.pad_token = tokenizer.eos_token
                if self.max_length:
                    tokenizer.truncation_side = "left"  # keep the completion
                model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad
                model.requires_grad_(False)
                device = resolve_device(self.device, self._process_device)
                self._model, self._tokenizer = model.eval().to(device), tokenizer
            assert self._tokenizer is not None
            return self._model, self._tokenizer

    def texts(self, prompts: list, completions: list[str]) -> list[str]:
        """Prompt + completion of each row, rendered with the reward model's chat template (see the module
        docstring)."""
        _, tokenizer = self.load()
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, str):
                out.append(prompt + completion)
            else:
                messages = [*prompt, {"role": "assistant", "content": completion}]
                out.append(str(tokenizer.apply_chat_template(messages, tokenize=False)))
        return out

    def score_chunk(self, prompts: list, completions: list[str], columns: dict[str, list]) -> RewardChunk:
        model, tokenizer = self.load()
        texts = self.texts(prompts, completions)
        values: list[float] = []
        truncate = {"truncation": True, "max_length": self.max_length} if self.max_length else {}
        for start in range(0, len(texts), self.batch_size):
            batch = texts[start:start + self.batch_size]
            inputs = tokenizer(text=batch, return_tensors="pt", padding=True, padding_side="right",
                               add_special_tokens=False, **truncate).to(model.device)
            with self._lock, torch.inference_mode():
                values += model(**inputs).logits[:, 0].float().tolist()
        return RewardChunk(values)

    def __getstate__(self) -> dict[str, Any]:  # picklable (DDP spawn): each process loads its own copy
        state = self.__dict__.copy()
        state["_lock"] = None
        if isinstance(self.source, str):
            state["_model"], state["_tokenizer"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
