"""The tools' numeric flags are refused out of range in argparse's one line, before any work (utils/arguments.py).

Unchecked, such a value fails late or lies: ``comm_model.py --samples_per_sec 0`` divides by zero and ``-5`` prints
efficiencies of 300%; ``bench_loaders.py --trials 0`` ends, after the work, in statistics' "no median for empty
data"; ``make_dataset --box_length 0`` in a ValueError traceback.
"""
import argparse
import ast
import contextlib
import io
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from conftest import project_files
from utils.arguments import at_least, fraction, positive_float, positive_int

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_the_types_accept_their_range_and_say_what_they_want():
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5 and fraction("1") == 1.0 and at_least(2)("2") == 2
    assert at_least(0.0, float)("0") == 0.0
    for convert, text, wants in ((positive_int, "0", "positive"), (positive_float, "-1.5", "positive"),
                                 (fraction, "1.01", "a fraction in [0, 1]"), (fraction, "nan", "a fraction in [0, 1]"),
                                 (at_least(2), "1", "at least 2"), (at_least(0.0, float), "-0.1", "at least 0.0")):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"^must be {wants.replace('[', '.').replace(']', '.')}, "
                                                             rf"got {text}$"):
            convert(text)
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--batch", type=positive_int)
    parser.add_argument("--widths", type=positive_int, nargs="+")
    for argv, message in ((["--batch", "x"], "argument --batch: invalid int value: 'x'"),
                          (["--batch", "0"], "argument --batch: must be positive, got 0"),
                          (["--widths", "8", "-8"], "argument --widths: must be positive, got -8")):
        err = io.StringIO()
        with pytest.raises(SystemExit) as stop, contextlib.redirect_stderr(err):
            parser.parse_args(argv)
        assert stop.value.code == 2 and err.getvalue().endswith(f"tool: error: {message}\n")


def run_script(script, argv):
    """(exit code, stdout, stderr) of ``python script argv``, run in this process; the script must exit."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", [script] + argv), mock.patch.object(sys, "path", list(sys.path)), \
            pytest.raises(SystemExit) as stop, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        runpy.run_path(str(REPO_ROOT / script), run_name="__main__")
    return stop.value.code, out.getvalue(), err.getvalue()


# (script or module, arguments, the refusal); each would otherwise fail late, print nonsense or run twice
REFUSED = [
    ("benchmarks/comm_model.py", ["--samples_per_sec", "0"], "argument --samples_per_sec: must be positive, got 0"),
    ("benchmarks/comm_model.py", ["--samples_per_sec", "-5"], "argument --samples_per_sec: must be positive, got -5"),
    ("benchmarks/comm_model.py", ["--overlap", "2"], "argument --overlap: must be a fraction in [0, 1], got 2"),
    ("benchmarks/comm_model.py", ["--node_bw", "0"], "argument --node_bw: must be positive, got 0"),
    ("benchmarks/spatial_model.py", ["--batch", "0"], "argument --batch: must be positive, got 0"),
    ("benchmarks/spatial_model.py", ["--overlap", "1.5"], "argument --overlap: must be a fraction in [0, 1], got 1.5"),
    ("benchmarks/bench_loaders.py", ["--trials", "0"], "argument --trials: must be positive, got 0"),
    ("benchmarks/bench_make_dataset.py", ["--repeats", "0"], "argument --repeats: must be positive, got 0"),
    ("benchmarks/ladder.py", ["--tiny", "--windows", "0"], "argument --windows: must be positive, got 0"),
    ("benchmarks/ladder.py", ["--model_channels", "4", "0"], "argument --model_channels: must be positive, got 0"),
    ("benchmarks/scaling_study.py", ["--ranks", "1", "0"], "argument --ranks: must be positive, got 0"),
    ("benchmarks/scaling_study.py", ["--ranks", "1", "2", "1", "2"], "--ranks repeats 1 2; give each once"),
    ("benchmarks/crop_science.py", ["--seeds", "3", "3"], "--seeds repeats 3; give each once"),
    ("benchmarks/reference_side_by_side.py", ["--epochs", "1"], "argument --epochs: must be at least 2, got 1"),
    ("benchmarks/full_run.py", ["OUT", "--budget_s", "0"], "argument --budget_s: must be positive, got 0"),
    ("utils/make_dataset.py", ["--out", "x.h5", "--box_length", "0"], "argument --box_length: must be positive, got 0"),
    ("utils/make_dataset.py", ["--out", "x.h5", "--smoothing", "-1"],
     "argument --smoothing: must be at least 0.0, got -1"),
    ("utils/make_dataset.py", ["--out", "x.h5", "--box", "1"], "argument --box: must be at least 2, got 1"),
    ("science/report.py", ["run", "--dpi", "0"], "argument --dpi: must be positive, got 0"),
    ("benchmarks/conv_variants.py", ["--tiny", "--channels", "0,8"],
     "argument --channels: must be positive widths, comma-separated (such as 8,16,32), got 0,8"),
    ("benchmarks/conv_variants.py", ["--tiny", "--crop", "18"], "--crop 18 must be divisible by 2^2 (one halving "
                                                                 "per level)"),
    ("benchmarks/kernel_probe.py", ["--channels", "4,x"],
     "argument --channels: must be positive widths, comma-separated (such as 8,16,32), got 4,x"),
    ("benchmarks/bench_loaders.py", ["--device", "gpu"], "--device is cpu or cuda (cuda:N), got gpu"),
    ("benchmarks/bench_checkpoint.py", ["--dir", "missing"], "--dir missing is not a folder; give an existing one "
                                                             "(on the file system to measure)"),
    ("benchmarks/spatial_gpu.py", ["check", "--parts", "spatail"],
     "--parts: unknown spatail; choose from spatial, spatial_compile, ddp_compile"),
]


@pytest.mark.parametrize("script, argv, message", REFUSED, ids=[f"{s} {' '.join(a)}" for s, a, _ in REFUSED])
def test_a_value_out_of_range_is_one_line_before_any_work(script, argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative outputs (OUT, x.h5) would land here: nothing may
    code, _, err = run_script(script, argv)
    assert code == 2 and err.endswith(f"error: {message}\n"), err
    assert not any(tmp_path.iterdir())


def test_a_benchmarks_own_error_is_one_line_too(tmp_path, monkeypatch):
    """The benchmarks end through utils.run, as train.py does: a ReportedError (here the config's) is its one line and
    exit status 2, not a traceback."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_script("benchmarks/bench_checkpoint.py", ["--config", "nosuch"])
    assert code == 2 and err.startswith("error: unknown config 'nosuch' in ") and err.count("\n") == 1, err


# Numeric flags left as plain int or float, each with its own check (a reason in the message) or none needed
PLAIN = {
    ("predict.py", "--tile"), ("predict.py", "--overlap"), ("predict.py", "--batch_size"),  # ConfigErrors naming
    ("predict.py", "--spatial_parallel"), ("predict.py", "--lya_stride"),  # the checkpoint's limits (test_predict)
    ("benchmarks/prefetch_probe.py", "--steps"),  # at least 3: the first copy has no step to hide under
    ("utils/make_dataset.py", "--seed"),  # at least 0: numpy's generators take no negative seeds
}


def test_every_numeric_flag_of_the_tools_is_bounded():
    """A new `type=int` flag is a new 1 / 0 waiting: each tool's numeric flags use utils/arguments.py's types, or are
    in PLAIN with their reason."""
    plain = set()
    for path in project_files("*.py"):
        name = path.relative_to(REPO_ROOT).as_posix()
        for call in ast.walk(ast.parse(path.read_text())):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument" and call.args \
                    and isinstance(call.args[0], ast.Constant):
                kind = next((k.value for k in call.keywords if k.arg == "type"), None)
                if isinstance(kind, ast.Name) and kind.id in ("int", "float"):
                    plain.add((name, call.args[0].value))
    assert plain == PLAIN, f"unbounded: {sorted(plain - PLAIN)}; no longer plain: {sorted(PLAIN - plain)}"


def test_every_script_answers_help_with_its_usage_and_takes_no_abbreviation():
    """`--help` of every script and module with a command line prints its usage and exits 0, on any machine: a
    GPU-only script that imported a GPU-only package at the top, or parsed after its work began, fails here.

    `--hel` is refused (exit 2), as every abbreviated flag is (allow_abbrev=False): a pasted `--budget` must not
    stand for `--budget_s` today and fail as ambiguous once a `--budget_gb` exists, and the commands the
    documentation shows are checked spelt out (test_readme_commands.py)."""
    scripts = [path.relative_to(REPO_ROOT).as_posix() for path in project_files("*.py")
               if '__name__ == "__main__"' in path.read_text()]
    assert len(scripts) >= 25, scripts
    for script in scripts:
        code, out, _ = run_script(script, ["--help"])
        assert code == 0 and "usage:" in out, (script, code, out[-300:])
        code, _, err = run_script(script, ["--hel"])
        assert code == 2 and "error:" in err, (script, code, err[-300:])


def test_a_study_writes_into_the_repository_only_where_git_ignores_it_unless_told():
    """A trial run with the defaults cannot add to, or replace, the committed benchmarks/results/ (nor can a test
    that runs a study with its defaults)."""
    from benchmarks import large_batch_study, scaling_study, science_compare
    outs = [scaling_study.parse_args([]).out.with_suffix(".md"),
            large_batch_study.parse_args(["--arm", "8:none:1"]).out.with_suffix(".md"),
            Path(science_compare.parse_args([]).out)]  # crop_science's: in its --expdir, /tmp/crop_science
    for out in outs:
        inside = out.resolve().is_relative_to(REPO_ROOT)
        assert not inside or subprocess.run(["git", "check-ignore", "-q", str(out)], cwd=REPO_ROOT).returncode == 0, \
            f"{out} is in the repository and not git-ignored"
    assert outs[0] == REPO_ROOT / "logs" / "scaling.md" and outs[1] == REPO_ROOT / "logs" / "large_batch.md"
