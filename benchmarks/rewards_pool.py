"""The reward pool's speed-up: a reward that sleeps per completion, scored sequentially vs in pools of several widths.

Scoring part (always): a rollout of ``--completions`` completions is scored by a reward that sleeps ``--sleep``
seconds per completion, (a) as a plain reward function (one call, on the caller's thread: the sequential baseline,
``completions x sleep`` seconds) and (b) as a pooled reward (:func:`lightning_grpo.rewards.pool.pooled`,
``chunk_size=1``) in a :class:`~lightning_grpo.rewards.pool.RewardPool` of each ``--widths`` width (ideal:
``ceil(completions / width) x sleep``). Each is timed ``--repeats`` times; the median is reported with the ratio
sequential / pooled (ideal: ``completions / ceil(completions / width)``, about the width).

Training part (``--train``): GRPO steps on a tiny random Llama (HF engine, ``prompts-per-step x G`` = the same
completions per rollout) with the sleeping reward, pool width 1 vs the largest width: the medians of the logged
``timing/scoring_s`` (what the trainer waited for its rewards) and ``timing/reward_sleepy_s``.

    python benchmarks/rewards_pool.py                              # 16 completions x 1 s, widths 1 2 4 8 16
    python benchmarks/rewards_pool.py --train --out rewards_pool.json

Sleeping does not use the CPU, so the ratios hold on a busy machine too (the training part's other timings do not).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_grpo.rewards import RewardPool, pooled, score_completions  # noqa: E402


def make_sleepy(seconds: float):
    def sleepy(prompts, completions, **kwargs):
        time.sleep(seconds * len(completions))
        return [float(len(c) % 2) for c in completions]

    return sleepy


def time_scoring(args) -> dict:
    prompts = [f"prompt {i // 4}" for i in range(args.completions)]
    completions = [f"completion {i}" for i in range(args.completions)]
    sleepy = make_sleepy(args.sleep)

    def median_seconds(funcs, pool) -> tuple[float, list[float]]:
        times, rewards = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            scores = score_completions(funcs, prompts, completions, {}, pool=pool)
            times.append(time.perf_counter() - start)
            values = scores.rewards.tolist()
            assert rewards is None or values == rewards, "the rewards changed between repeats"
            rewards = values
        return statistics.median(times), rewards

    sequential, expected = median_seconds([sleepy], None)
    rows = {"sequential": {"seconds": sequential}}
    print(f"{args.completions} completions x {args.sleep} s of reward each")
    print(f"{'scoring':>14} {'seconds':>9} {'ideal':>7} {'ratio':>7} {'ideal ratio':>12}")
    print(f"{'sequential':>14} {sequential:9.3f} {args.completions * args.sleep:7.3f} {1.0:7.2f} {1.0:12.2f}")
    for width in args.widths:
        pool = RewardPool(width)
        seconds, rewards = median_seconds([pooled(sleepy, chunk_size=1)], pool)
        pool.close()
        assert rewards == expected, f"width {width} gave other rewards than sequential scoring"
        ideal = math.ceil(args.completions / width) * args.sleep
        ratio, ideal_ratio = sequential / seconds, args.completions * args.sleep / ideal
        rows[f"pool_{width}"] = {"width": width, "seconds": seconds, "ideal_seconds": ideal, "ratio": ratio,
                                 "ideal_ratio": ideal_ratio}
        print(f"{'pool ' + str(width):>14} {seconds:9.3f} {ideal:7.3f} {ratio:7.2f} {ideal_ratio:12.2f}")
    return rows


def time_training(args) -> dict:
    import lightning as L

    from lightning_grpo import GRPOConfig, GRPOModule
    from lightning_grpo.data import PromptDataModule
    from lightning_grpo.demos.tiny_models import save_tiny_llama
    from lightning_grpo.models.embedded import default_model_path

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("timing/")})

    work = Path(tempfile.mkdtemp(prefix="rewards_pool_"))
    model = save_tiny_llama(work / "tiny", default_model_path(), hidden_size=64, intermediate_size=128,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    g = 4
    results = {}
    for width in (1, max(args.widths)):
        L.seed_everything(0, verbose=False)
        reward = pooled(make_sleepy(args.sleep), chunk_size=1, name="sleepy")
        config = GRPOConfig(num_generations=g, max_new_tokens=8, max_prompt_length=128, reward_num_workers=width)
        module = GRPOModule(model, reward_funcs=[reward], config=config, export_dir="")
        recorder = Recorder()
        trainer = L.Trainer(max_steps=args.train_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, callbacks=[recorder],
                            default_root_dir=str(work / f"run_{width}"))
        trainer.fit(module, datamodule=PromptDataModule("arithmetic", prompts_per_step=args.completions // g,
                                                        val_size=0))
        rows = recorder.rows[1:] or recorder.rows  # the first step warms up
        results[f"pool_{width}"] = {key: statistics.median(r[key] for r in rows)
                                    for key in ("timing/scoring_s", "timing/reward_sleepy_s", "timing/step_s")}
        print(f"training, pool width {width}: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                          results[f"pool_{width}"].items()))
    one, wide = results["pool_1"], results[f"pool_{max(args.widths)}"]
    results["scoring_ratio"] = one["timing/scoring_s"] / wide["timing/scoring_s"]
    print(f"training: scoring_s width 1 / width {max(args.widths)} = {results['scoring_ratio']:.2f}")
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=1.0, help="seconds of reward per completion")
    parser.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train", action="store_true", help="also time GRPO steps with the sleeping reward")
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    report = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "scoring": time_scoring(args)}
    if args.train:
        report["training"] = time_training(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
