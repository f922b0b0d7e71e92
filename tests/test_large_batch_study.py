"""benchmarks/large_batch_study.py: arms, the table read from run folders, and (with --full) real train.py arms."""
import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from benchmarks import large_batch_study as study
from utils.config import load_config

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_arms_parse_and_bad_ones_say_the_form():
    assert study.parse_arm("64:sqrt:16") == {"batch": 64, "scaling": "sqrt", "epochs": 16, "ranks": 1}
    assert study.parse_arm("256:linear:20:4") == {"batch": 256, "scaling": "linear", "epochs": 20, "ranks": 4}
    for bad in ("64:cubic:4", "64:sqrt", "64:sqrt:4:2:1", "x:none:4"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCH:SCALING:EPOCHS"):
            study.parse_arm(bad)
    for bad in ("0:none:4", "64:none:0", "6:none:4:4"):
        with pytest.raises(argparse.ArgumentTypeError, match="divide by the ranks"):
            study.parse_arm(bad)


@pytest.mark.parametrize("argv, message", [
    ([], "give either --arm"), (["--arm", "8:none:1", "--runs", "x"], "give either --arm"),
    (["--runs", "x", "--", "--lr_schedule.start_lr", "1"], "--runs trains nothing"),
    (["--arm", "8:none:1", "--", "--num_epochs=2", "--seed", "1"], "--num_epochs=2, --seed after -- would override"),
    (["--arm", "8:none:1", "--seeds", "1", "1"], "--seeds repeats 1; give each once"),
    (["--arm", "8:none:1", "--arm", "8:sqrt:1", "--arm", "8:none:1:1"], "--arm repeats 8:none:1:1; give each once"),
    (["--runs", "logs/a", "logs/b", "logs/a/"], "--runs repeats "),  # one folder, however it is written
])
def test_bad_command_lines_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        study.parse_args(argv)
    assert message in capsys.readouterr().err


def fake_run(run_dir, batch, scaling, epochs, val_points, rates=(100.0, 120.0, 110.0), seed=0):
    """A run folder as train.py leaves it: the resolved config and TensorBoard events with validation losses
    at (step, seconds after the start, loss) and per-epoch throughputs."""
    params = load_config("quickstart", overrides={"global_batch_size": batch, "lr_schedule.scaling": scaling,
                                                  "lr_schedule.warmup_steps": 16, "num_epochs": epochs,
                                                  "seed": seed})
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dict(params)))
    writer = SummaryWriter(str(run_dir / "logs"))  # its file's header is the run's first event: now
    start = time.time()  # after it, so that a stall between the two cannot shift every wall time
    for step, seconds, loss in val_points:
        writer.add_scalar("Loss/valid", loss, step, walltime=start + seconds)
    for epoch, rate in enumerate(rates, 1):
        writer.add_scalar("Perf/samples_per_sec", rate, epoch, walltime=start + epoch)
    writer.close()
    return run_dir


def test_table_from_run_folders_reads_schedule_losses_and_the_target(tmp_path):
    # quickstart: Nsamples 2048, base batch 8, start_lr 2e-3
    small = fake_run(tmp_path / "quickstart" / "1GPU" / "a", 8, "none", 2,
                     [(0, 1, 0.06), (256, 60, 0.02), (512, 120, 0.010)])
    large = fake_run(tmp_path / "quickstart" / "4GPU" / "b", 64, "sqrt", 4,
                     [(0, 1, 0.06), (32, 30, 0.03), (64, 60, 0.015), (96, 90, 0.012)])
    out = tmp_path / "out" / "study"
    study.main(["--runs", str(small), str(large), "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    first, second = result["rows"]
    assert result["target_val_loss"] == pytest.approx(0.012)  # the highest final loss: every run reached it
    assert (first["run"], first["ranks"], second["run"], second["ranks"]) == ("quickstart/1GPU/a", 1,
                                                                              "quickstart/4GPU/b", 4)
    assert (first["initial_lr"], first["warmup_steps"]) == (pytest.approx(2e-3), 0)  # not scaled: no warm-up
    assert (second["initial_lr"], second["warmup_steps"]) == (pytest.approx(2e-3 * math.sqrt(8)), 16)
    assert (first["planned_steps"], first["steps"], first["samples_seen"]) == (512, 512, 4096)
    assert (second["planned_steps"], second["steps"], second["samples_seen"]) == (128, 96, 6144)
    assert (first["final_val_loss"], first["best_val_loss"]) == (pytest.approx(0.010), pytest.approx(0.010))
    assert first["target_samples"] == 4096 and second["target_samples"] == 6144  # 0.02 > 0.012 >= 0.010
    # minutes count from the run's first event (the writer opening), a moment before the step-0 validation
    assert first["target_minutes"] - first["curve"]["minutes"][0] == pytest.approx(119 / 60, abs=1e-4)
    assert second["target_minutes"] - second["curve"]["minutes"][0] == pytest.approx(89 / 60, abs=1e-4)
    assert second["wall_minutes"] == second["target_minutes"]
    assert first["samples_per_s"] == pytest.approx(110.0)  # median of the epochs
    assert first["gamma_pred"] is None  # no science scalars in these runs
    text = out.with_suffix(".md").read_text()
    assert "| quickstart/4GPU/b | 4 | 0 | 64 | sqrt | 0.00566 | 16 | 4 | 96 | 6,144 | 0.01200 | 6,144 | 1.5 |" in text
    assert "| batch 64, sqrt, 4 ep, 4 ranks | 1 | 0.01200 | 6,144 | 1.5 | 1.5 | 110.0 |" in text
    assert "Not finished (fewer steps than planned): quickstart/4GPU/b." in text
    assert out.with_suffix(".png").stat().st_size > 10_000

    study.main(["--runs", str(small), str(large), "--out", str(out), "--target", "0.025"])
    first, second = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert first["target_samples"] == 2048 and second["target_samples"] == 4096  # 0.02 at step 256; 0.015 at 64
    study.main(["--runs", str(small), str(large), "--out", str(out), "--target", "0.001"])
    first, _ = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert first["target_samples"] is None and "| n/a | n/a |" in out.with_suffix(".md").read_text()


def test_runs_of_one_setting_are_one_arm_with_median_and_range(tmp_path):
    runs = [fake_run(tmp_path / "q" / "1GPU" / f"s{seed}", 64, "sqrt", 1, [(0, 1, 0.06), (32, 30, loss)],
                     rates=(rate,), seed=seed)
            for seed, loss, rate in ((0, 0.02, 100.0), (1, 0.04, 90.0), (2, 0.03, 95.0))]
    runs.append(fake_run(tmp_path / "q" / "1GPU" / "other", 8, "none", 1, [(0, 1, 0.06), (256, 60, 0.01)]))
    out = tmp_path / "study"
    study.main(["--runs", *map(str, runs), "--out", str(out), "--target", "0.025"])
    arms = json.loads(out.with_suffix(".json").read_text())["arms"]
    assert list(arms) == ["batch 64, sqrt, 1 ep", "batch 8, none, 1 ep"]
    arm = arms["batch 64, sqrt, 1 ep"]
    assert (arm["runs"], arm["seeds"]) == (3, [0, 1, 2])
    assert arm["final_val_loss"] == {"median": pytest.approx(0.03), "min": pytest.approx(0.02),
                                     "max": pytest.approx(0.04)}
    assert arm["target_samples"] is None  # seeds 1 and 2 never reached 0.025: no median over the ones that did
    assert arm["samples_per_s"]["median"] == pytest.approx(95.0)
    assert arms["batch 8, none, 1 ep"]["target_samples"]["median"] == 2048
    text = out.with_suffix(".md").read_text()
    assert "| batch 64, sqrt, 1 ep | 3 | 0.03000 (0.02000-0.04000) | n/a | n/a | 0.5 | 95.0 (90.0-100.0) |" in text


def test_a_folder_that_is_no_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(study.StudyError, match="config.yaml does not exist; pass run directories"):
        study.main(["--runs", str(tmp_path), "--out", str(tmp_path / "out")])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(dict(load_config("quickstart"))))
    with pytest.raises(study.StudyError, match="no TensorBoard event files"):
        study.main(["--runs", str(tmp_path), "--out", str(tmp_path / "out")])


@pytest.mark.slow
def test_arms_train_continue_and_read_back(tiny_argv, tmp_path):
    """Two real arms on the tiny files, the second on 2 ranks: the schedule and the losses in the table are
    train.py's own; running the same study again trains nothing more; a folder of other settings is refused; a
    failing arm stops the study with train.py's own one line, also under torchrun."""
    yaml_args = tiny_argv[:2]  # --yaml_config PATH; the study names --config and --expdir itself
    expdir, out = tmp_path / "runs", tmp_path / "out"
    command = [sys.executable, "benchmarks/large_batch_study.py", "--config", "tiny", "--expdir", str(expdir),
               "--out", str(out), "--arm", "4:none:2", "--arm", "8:sqrt:3:2", "--", *yaml_args,
               "--lr_schedule.warmup_steps", "2"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    # tiny: Nsamples 32, base batch 4, quickstart's start_lr 2e-3; the second arm on 2 ranks (torchrun, gloo)
    assert [(r["global_batch"], r["scaling"], r["steps"], r["warmup_steps"], r["ranks"]) for r in rows] == [
        (4, "none", 16, 0, 1), (8, "sqrt", 12, 2, 2)]
    assert rows[1]["initial_lr"] == pytest.approx(2e-3 * math.sqrt(2))
    for row, folder in zip(rows, ("1GPU/lb4_none_2ep_s0", "2GPU/lb8_sqrt_3ep_s0")):
        log = (expdir / "tiny" / folder / "out.log").read_text()
        assert row["final_val_loss"] == pytest.approx(float(re.findall(r"Avg val loss=([\d.]+)", log)[-1]), abs=1e-6)
        assert len(row["curve"]["val_loss"]) == 1 + len(re.findall(r"Time taken for epoch", log))  # + step 0

    again = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == rows  # read, not trained again

    other = command[:command.index("--")] + ["--", *yaml_args, "--lr_schedule.warmup_steps", "3"]
    result = subprocess.run(other, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "lb4_none_2ep_s0 holds a run of other settings" in result.stderr, result.stderr

    # under torchrun: the reason is the ranks' one line, not torchrun's report that follows it
    failing = command[:command.index("--arm")] + ["--arm", "4:none:1:2", "--", *yaml_args,
                                                   "--model_channels", "4", "8", "16", "32"]
    result = subprocess.run(failing, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert re.match(r"error: lb4_none_1ep_s0 exited with \d+: error: data_size 8 must be divisible by 2\^4 .*"
                    r"\(whole output: ", result.stderr), result.stderr
