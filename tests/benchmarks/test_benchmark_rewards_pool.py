"""``benchmarks/rewards_pool.py`` with tiny settings runs end to end and reports every width (timings are not
asserted: they depend on the machine; the script itself asserts that every width gives the sequential rewards)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rewards_pool.py"


def test_tiny_rewards_pool_benchmark_reports_every_width(tmp_path):
    spec = importlib.util.spec_from_file_location("rewards_pool", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--completions", "4", "--sleep", "0.01", "--widths", "1,2,4", "--repeats", "1",
                         "--out", str(tmp_path / "pool.json")])
    scoring = report["scoring"]
    assert sorted(scoring) == ["pool_1", "pool_2", "pool_4", "sequential"]
    assert [scoring[f"pool_{w}"]["ideal_ratio"] for w in (1, 2, 4)] == [1.0, 2.0, 4.0]
    assert all(row["seconds"] > 0 for row in scoring.values())
    assert (tmp_path / "pool.json").exists()
