"""``benchmarks/distillation.py``'s comparison on hand-made run summaries: validation points as steps trained, the
first step that reaches RL's final held-out score, and the plot (the recorded run itself is the benchmark)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "distillation.py"
spec = importlib.util.spec_from_file_location("distillation_benchmark", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _summary(greedy, sampled, reward, kl=()):
    return {"val_curve": greedy, "val_pass@1_curve": sampled, "reverse_kl": list(kl),
            "curve": {"step": list(range(len(reward))), "reward": reward}}


def test_validation_points_are_counted_in_steps_trained():
    # logged at step 0 before training, then at global step - 1 after 5, 10 and 15 steps
    assert bench.trained_steps([[0, 0.7], [4, 0.72], [9, 0.8], [14, 0.86]]) == [(0, 0.7), (5, 0.72), (10, 0.8),
                                                                               (15, 0.86)]
    assert bench.steps_to_reach([(0, 0.7), (5, 0.8), (10, 0.9)], 0.8) == 5
    assert bench.steps_to_reach([(0, 0.7), (5, 0.79)], 0.8) is None


def test_compare_reports_rls_final_score_and_when_distillation_reaches_it(tmp_path):
    rl = _summary([[0, 0.71], [4, 0.75], [9, 0.86]], [[0, 0.34], [4, 0.6], [9, 0.85]], [0.4, 0.5])
    distill = _summary([[0, 0.71], [4, 0.86], [9, 0.88]], [[0, 0.34], [4, 0.7], [9, 0.84]], [0.4, 0.6],
                       kl=[(0, 0.2), (1, 0.1)])
    out = bench.compare(rl, distill)
    greedy, sampled = out["heldout_greedy_accuracy"], out["heldout_pass@1"]
    assert greedy["rl_final"] == 0.86 and greedy["rl_steps_to_final"] == 10
    assert greedy["distillation_steps_to_rl_final"] == 5 and greedy["distillation_final"] == 0.88
    assert sampled["distillation_steps_to_rl_final"] is None and sampled["before"] == 0.34
    png = tmp_path / "plot.png"
    bench.plot(rl, distill, out, "title", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_partial_record_without_the_distillation_stage(tmp_path):
    """``--partial`` before the distillation stage started: RL's curves, nothing claimed for distillation."""
    rl = _summary([[0, 0.69], [3, 0.75]], [[0, 0.34], [3, 0.5]], [0.3])
    out = bench.compare(rl, bench._NOT_RUN)
    assert out["heldout_pass@1"]["rl_final"] == 0.5 and out["heldout_pass@1"]["distillation_final"] is None
    assert out["heldout_pass@1"]["distillation_steps_to_rl_final"] is None
    bench.plot(rl, bench._NOT_RUN, out, "title", tmp_path / "plot.png")
    assert (tmp_path / "plot.png").exists()
