"""benchmarks/gpu_suite.py's CPU smoke mode, so the one-command GPU suite cannot rot between GPU sessions."""
import json
import subprocess
import sys

import pytest
import torch

from utils.config import REPO_ROOT

pytestmark = pytest.mark.slow  # integration: run with --full (CI does)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the small mode is the CPU smoke test")
def test_small_mode_runs_every_cpu_part_and_skips_the_gpu_parts(tmp_path):
    out = tmp_path / "suite"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_suite.py"), str(out), "--small"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    failed = {name: c["detail"] for name, c in checks.items() if c["status"] == "FAIL"}
    assert result.returncode == 0 and not failed, (failed, result.stdout[-3000:], result.stderr[-3000:])
    # At most 8 files, all of them the documented ones.
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and set(files) <= {"summary.json", "summary.md", "probe.json", "ladder.json", "ladder.md",
                                               "ladder.png", "suite.log", "pytest.log"}, files
    # The results file's contract (benchmarks/results/h100.json has the same keys).
    assert summary["device"] == "cpu" and summary["versions"]["torch"] == torch.__version__
    rows = {row["rung"]: row for row in summary["ladder"]}
    assert {"fp32", "bf16", "fused_adam", "channels_last"} <= {r for r, row in rows.items() if row["status"] == "ok"}
    for row in (rows["fp32"], rows["channels_last"]):
        assert row["samples_per_s"] > 0 and row["loss"] < row["loss_first"]  # it trains on the generated batch
    assert rows["cuda_graph"]["status"] == "skipped"
    (name, benchy), = summary["benchy"].items()
    assert name.startswith("fast inmem") and all(benchy[mode] > 0 for mode in ("IO", "SYNTHETIC", "FULL"))
    # Every GPU-only part reports itself skipped, with the reason, and prints a status line.
    for skipped in ("cuDNN for every convolution", "benchmark mode, GPU-resident loader", "train_graph.py vs train.py",
                    "cuDNN kernels in the trace; copy/compute overlap"):
        assert checks[skipped]["status"] == "SKIP" and checks[skipped]["detail"] == "no GPU", skipped
        assert f"SKIP {skipped}: no GPU" in result.stdout
    assert checks["profiler trace of the window"]["status"] == "PASS"
    assert summary["checkpoint"]["checkpoints"] >= 1 and summary["checkpoint"]["max_stall_s"] >= 0
    assert "| status | check | detail |" in (out / "summary.md").read_text()
    # Part h: every convolution of the tiny model timed in each of its forms.
    assert checks["convolution forms compute the native result"]["status"] == "PASS"
    assert len(summary["conv_forms"]["layers"]) == 4 and "## Convolution forms" in (out / "summary.md").read_text()


def test_a_part_that_would_overrun_the_budget_is_skipped_with_its_command(tmp_path, capsys):
    from benchmarks import gpu_suite
    assert gpu_suite.main([str(tmp_path), "--small", "--parts", "h", "--budget_s", "0"]) == 0
    skipped = json.loads((tmp_path / "summary.json").read_text())["checks"][-1]
    assert skipped["name"] == "h. convolution forms" and skipped["status"] == "SKIP"
    assert "budget spent" in skipped["detail"] and "`python benchmarks/gpu_suite.py OUT --parts h`" in skipped["detail"]
    assert "SKIP h. convolution forms: not started" in capsys.readouterr().out
