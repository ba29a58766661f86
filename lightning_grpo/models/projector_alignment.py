"""LLaVA's stage 1 for a vision-language checkpoint whose projector is new: the projector alone learns, on captions,
to turn the vision tower's features into embeddings the language model reads (Liu et al., "Visual Instruction
Tuning", 2023, section 4.2: "Stage 1: pre-training for feature alignment", vision tower and language model frozen).

GRPO cannot start from a random projector: its image tokens carry nothing the language model can use, so every
completion of a prompt is as likely whatever the picture, and the policy collapses onto its prior before the projector
learns (docs/vision.md, the recorded runs). After this stage the image tokens carry what the captions name and GRPO
starts from a model that looks::

    align = ProjectorAlignment("outputs/my_llava")
    L.Trainer(max_steps=150).fit(align, train_dataloaders=caption_loader(rows, batch_size=8))
    align.save("outputs/my_llava_aligned")          # then GRPOModule(model="outputs/my_llava_aligned", ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

#: The instruction of the captioning turn (LLaVA's stage-1 prompts are brief-description requests).
DESCRIBE = "Describe the picture."


class ProjectorAlignment(L.LightningModule):
    """Train the named modules of a vision-language checkpoint (by default its projector) on image captions, every
    other weight frozen.

    Args:
        model: folder of the checkpoint (``AutoModelForImageTextToText``) and its processor (``AutoProcessor``: the
            image processor, the tokenizer and a chat template whose user content may hold image parts).
        trainable: module names whose parameters are trained (a parameter is trained when one of the dot-separated
            parts of its name is one of these); default LLaVA's ``multi_modal_projector``.
        instruction: the user turn's text after the image.
        learning_rate: AdamW's learning rate (LLaVA's stage 1: 1e-3; no weight decay).

    Raises:
        ValueError: ``trainable`` names no parameter of the model (the names it looked for are in the message), or
            ``learning_rate`` is not positive.

    ``training_step(batch)`` takes ``{"images": [PIL image, ...], "captions": [str, ...]}`` (:func:`caption_loader`)
    and returns :meth:`loss`, the mean cross-entropy of the caption tokens (nats per token, float32 scalar): the
    prompt (system turn, image tokens, instruction) and the padding are not scored; the caption's end-of-turn token
    is. Logged as ``alignment/loss``.
    """

    def __init__(self, model: str, trainable: Sequence[str] = ("multi_modal_projector",),
                 instruction: str = DESCRIBE, learning_rate: float = 1e-3) -> None:
        super().__init__()
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if not learning_rate > 0:
            raise ValueError(f"learning_rate={learning_rate!r}: must be positive")
        self.save_hyperparameters()
        self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).train()
        self.processor = AutoProcessor.from_pretrained(model)
        if not train_only(self.model, trainable):
            raise ValueError(f"trainable={list(trainable)!r}: no parameter of {model!r} is in such a module")
        self.instruction = instruction

    def _prompt(self, caption: str | None) -> str:
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.instruction}]}]
        if caption is None:
            return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": caption}]})
        return self.processor.apply_chat_template(messages, tokenize=False)

    def encode(self, images: list[Any], captions: list[str]) -> dict[str, torch.Tensor]:
        """The batch's model inputs: ``input_ids``, ``attention_mask`` and ``labels`` ([B, T] int64, right-padded;
        ``labels`` -100 on the prompt and the padding) and the processor's ``pixel_values``. The caption's ids are
        the tokens the conversation with the caption adds after the generation prompt (its end-of-turn included)."""
        prompt = self._prompt(None)
        tokenizer = self.processor.tokenizer
        suffixes = []
        for caption in captions:
            full = self._prompt(caption)
            if not full.startswith(prompt):
                raise ValueError(f"the chat template does not write the caption {caption!r} after the prompt")
            suffixes.append(tokenizer(full[len(prompt):].rstrip("\n"), add_special_tokens=False)["input_ids"])
        encoded = self.processor(text=[prompt] * len(images), images=images, return_tensors="pt", padding=True)
        prompts = [ids[mask.bool()] for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)]
        rows = [torch.cat([p, torch.tensor(s, dtype=p.dtype)]) for p, s in zip(prompts, suffixes, strict=True)]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, prompt_ids) in enumerate(zip(rows, prompts, strict=True)):
            input_ids[i, :len(row)] = row
            attention_mask[i, :len(row)] = 1
            labels[i, len(prompt_ids):len(row)] = row[len(prompt_ids):]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "pixel_values": encoded["pixel_values"]}

    def loss(self, images: list[Any], captions: list[str]) -> torch.Tensor:
        """The mean cross-entropy of the captions' tokens given their images (nats per token, float32 scalar)."""
        return self.model(**self.encode(images, captions)).loss

    def training_step(self, batch: dict[str, list], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch["images"], batch["captions"])
        self.log("alignment/loss", loss, prog_bar=True, batch_size=len(batch["captions"]))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                 lr=self.hparams.learning_rate, weight_decay=0.0)

    def save(self, dest: str) -> str:
        """Save the checkpoint and its processor into ``dest`` (a folder ``GRPOModule(model=dest)`` loads);
        returns ``dest``."""
        self.model.save_pretrained(dest)
        self.processor.save_pretrained(dest)
        return dest


def train_only(model: torch.nn.Module, modules: Sequence[str]) -> int:
    """Freeze every parameter of ``model`` but those of the named modules (a parameter is trained when one of the
    dot-separated parts of its name is in ``modules``); returns how many parameter tensors are trained."""
    names = set(modules)
    trained = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(bool(names & set(name.split("."))))
        trained += parameter.requires_grad
    return trained


def caption_loader(rows: Sequence[dict[str, Any]], batch_size: int, seed: int = 0) -> DataLoader:
    """Batches ``{"images": [...], "captions": [...]}`` of ``rows`` (each ``{"image": <PIL image>, "caption": str}``),
    shuffled with ``seed``, the last incomplete batch dropped."""
    generator = torch.Generator().manual_seed(seed)

    def collate(batch: list[dict[str, Any]]) -> dict[str, list]:
        return {"images": [r["image"] for r in batch], "captions": [r["caption"] for r in batch]}

    return DataLoader(list(rows), batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=collate,
                      generator=generator)


__all__ = ["DESCRIBE", "ProjectorAlignment", "caption_loader", "train_only"]
