"""The before/after report (lightning_grpo.evaluation.report) and its use at the end of ``lightning-grpo fit``."""

import math

import pytest

from lightning_grpo.evaluation.report import before_after, format_table

# A CSVLogger metrics.csv: validation before training (step 0), 7 training steps, validation after (step 6).
CSV = """epoch,step,reward,rewards/acc/mean,rewards/fmt/mean,val/accuracy,val/pass@1,val/mean_length
,0,,,,0.25,0.10,40.0
0,0,0.1,0.1,0.5,,,
0,1,0.2,0.2,0.5,,,
0,2,0.3,0.3,0.5,,,
0,3,0.4,0.4,1.0,,,
0,4,0.5,0.5,1.0,,,
0,5,0.6,0.6,1.0,,,
0,6,0.7,0.7,1.0,,,
0,6,,,,0.75,0.55,20.0
"""


def test_before_after_hand_worked(tmp_path):
    (tmp_path / "metrics.csv").write_text(CSV)
    rows = before_after(tmp_path, window=3)
    assert list(rows) == ["train reward (first/last 3 steps)", "train rewards/acc/mean (first/last 3 steps)",
                          "train rewards/fmt/mean (first/last 3 steps)", "held-out val/accuracy",
                          "held-out val/pass@1"]
    assert rows["train reward (first/last 3 steps)"] == pytest.approx({"before": 0.2, "after": 0.6})
    assert rows["train rewards/fmt/mean (first/last 3 steps)"] == pytest.approx({"before": 0.5, "after": 1.0})
    assert rows["held-out val/accuracy"] == {"before": 0.25, "after": 0.75}
    assert rows["held-out val/pass@1"] == {"before": 0.10, "after": 0.55}
    text = format_table(rows)
    assert text.splitlines()[1].split()[-3:] == ["0.200", "0.600", "+0.400"]
    assert text.splitlines()[4].split()[-3:] == ["0.250", "0.750", "+0.500"]


def test_before_after_single_validation_has_no_after(tmp_path):
    (tmp_path / "metrics.csv").write_text(CSV.rsplit("0,6,,", 1)[0])
    rows = before_after(tmp_path / "metrics.csv")
    assert rows["held-out val/accuracy"]["before"] == 0.25 and math.isnan(rows["held-out val/accuracy"]["after"])
    assert rows["train reward (first/last 5 steps)"] == pytest.approx({"before": 0.3, "after": 0.5})
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        before_after(tmp_path, window=0)
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        before_after(tmp_path / "absent")
