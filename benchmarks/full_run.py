"""A full training run on one GPU, end to end in one command: the data, train.py, the science report, the record.

    python benchmarks/full_run.py OUT                        # bs64_opt (10 epochs of 65,536 crops) on 512^3/256^3 boxes
    python benchmarks/full_run.py OUT --box_size 1024 512    # the reference's box sizes (a 38.7 GB training file)
    python benchmarks/full_run.py OUT --small                # CPU: the quickstart model, a few steps (the mechanics)
    python benchmarks/full_run.py OUT -- --num_epochs 2      # after --: more train.py flags

It generates the two boxes (utils/make_dataset.py, on the GPU when there is one) into a temporary folder, runs
train.py on them, draws the trained model's science report (science/report.py) and writes into OUT, flat, what a
device call brings back (at most 8 files, no subfolders): ``full_run.json`` (the record for
benchmarks/results/<gpu>.json's ``full_training``), ``full_run.log`` (everything run, in order), and the run's
``out.log``, ``config.yaml``, TensorBoard events and ``science_report.png``: what ``example_logs/<config>/`` keeps.

The script keeps to a time budget (``--budget_s``, on a clock started with the script: a device call ends after
600 s). If training would outrun it, train.py gets SIGUSR1 ``--grace_s`` before the end, checkpoints and stops as on
a preemption (exit code 3), and the record says how far it got (``finished: false``) instead of nothing coming back.
``wall_minutes`` is train.py's own run, start-up and compilation included (the figure to set against the
reference's 2 h 18 min on an A100); data generation is timed apart (``generation_s``).
"""
import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STARTED = time.monotonic()  # the budget's clock
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import at_least, positive_float  # noqa: E402
from benchmarks.reference_side_by_side import EPOCH_LINE, parse_epoch_rates, steady_rate  # noqa: E402

# --small: the quickstart model on small boxes for a few steps, to check the mechanics on a CPU in seconds
SMALL = {"config": "quickstart", "box_size": [64, 32],
         "flags": ["--num_epochs", "2", "--Nsamples", "64", "--Nsamples_val", "16", "--log_every_n_steps", "4"]}
GOAL_MINUTES = 8  # the time-to-solution goal for bs64_opt on one H100
RUN_LINE = re.compile(r"Config '[^']*': (\d+) rank\(s\) on (\w+)(?: \(([^)]*)\))?, global batch (\d+) .*?, "
                      r"(\d+) steps/epoch x (\d+) epochs")
MFU = re.compile(r"MFU ([0-9.]+)%")
VAL_LOSS = re.compile(r"Avg val loss=([0-9.eE+-]+)")
PROGRESS = re.compile(r"\(global (\d+)/\d+\)")
FINAL_L1 = re.compile(r"Final validation L1 ([0-9.]+) vs ([0-9.]+) for the mean predictor")
MAX_EVENT_FILES = 3  # with full_run.json, full_run.log, out.log, config.yaml and the report: 8 files


class Failure(Exception):
    """One line for the user: what went wrong and what to do."""


def remaining(deadline):
    return deadline - time.monotonic()


def run_streamed(argv, log, stop_at=None, kill_at=None):
    """Run ``argv`` in the repository, its output echoed and appended to ``log``. At monotonic time ``stop_at`` it
    gets SIGUSR1 (train.py checkpoints and stops); at ``kill_at`` its process group is killed. Returns (exit code,
    output, seconds)."""
    log.write(f"$ {shlex.join(argv)}\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def stop():  # train.py alone: torch.compile's worker processes would die of SIGUSR1
        if proc.poll() is None:
            print(f"full_run: the budget's end is near; SIGUSR1 to train.py (pid {proc.pid})", flush=True)
            proc.send_signal(signal.SIGUSR1)

    def kill():
        if proc.poll() is None:
            print(f"full_run: out of time; killing {argv[1]}", flush=True)
            os.killpg(proc.pid, signal.SIGKILL)

    timers = [threading.Timer(max(at - time.monotonic(), 0.0), action)
              for at, action in ((stop_at, stop), (kill_at, kill)) if at is not None]
    for timer in timers:
        timer.daemon = True
        timer.start()
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        log.write(line)
        lines.append(line)
    code = proc.wait()
    for timer in timers:
        timer.cancel()
    log.flush()
    return code, "".join(lines), time.monotonic() - start


def summarise(out_log, output, exit_code, seconds):
    """The record's training figures from train.py's out.log; ``output``, ``exit_code`` and ``seconds``: its
    process's (its output, stdout and stderr, holds a stop's ``stopped: ...`` line even where out.log is missing)."""
    run = RUN_LINE.search(out_log)
    if run is None:
        raise Failure(f"train.py logged no start-up line (exit {exit_code}); read full_run.log")
    _, device, device_name, batch, steps_per_epoch, epochs = run.groups()
    epoch_times = {int(m.group(1)): float(m.group(2)) for m in EPOCH_LINE.finditer(out_log)}
    rates = parse_epoch_rates(out_log)
    samples = len(epoch_times) * int(steps_per_epoch) * int(batch)
    final = FINAL_L1.search(out_log)
    val_losses = [float(loss) for loss in VAL_LOSS.findall(out_log)]
    mfu = [float(value) for value in MFU.findall(out_log)]
    stopped = [line for line in output.splitlines() if line.startswith("stopped: ")]
    progress = PROGRESS.findall(out_log)
    return {"device": device_name or device, "global_batch_size": int(batch), "epochs_done": len(epoch_times),
            "epochs": int(epochs), "steps_per_epoch": int(steps_per_epoch),
            "steps_logged": int(progress[-1]) if progress else 0,
            "finished": exit_code == 0 and final is not None, "exit_code": exit_code,
            "wall_minutes": round(seconds / 60, 2),
            "training_minutes": round(sum(epoch_times.values()) / 60, 2),
            "samples_per_s": round(samples / sum(epoch_times.values()), 1) if epoch_times else None,
            "steady_samples_per_s": steady_rate(rates), "epoch_samples_per_s": rates,
            "last_epoch_mfu_percent": mfu[-1] if mfu else None,
            "final_val_loss": val_losses[-1] if val_losses else None,
            "mean_predictor_l1": float(final.group(2)) if final else None,
            "stopped": stopped[-1] if stopped else None}


def generate(boxes, data_dir, log, deadline):
    """(train path, val path, {file: seconds}) of the boxes, made where missing."""
    paths, seconds = [], {}
    for split, box, seed in (("train", boxes[0], 1), ("val", boxes[1], 2)):
        path = data_dir / f"{split}_{box}.h5"
        paths.append(path)
        if path.exists():
            print(f"full_run: {path} exists; reusing it", flush=True)
            continue
        code, text, took = run_streamed([sys.executable, "-m", "utils.make_dataset", "--box", str(box), "--seed",
                                         str(seed), "--out", str(path)], log, kill_at=deadline)
        if code != 0:
            raise Failure(f"generating the {box}^3 {split} box failed (exit {code}): {last_line(text)}; "
                          f"read full_run.log, or give smaller --box_size")
        seconds[path.name] = round(took, 1)
    return paths[0], paths[1], seconds


def last_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


def collect(run_dir, out):
    """Copy the run's record into ``out``, flat; returns the names copied."""
    events = sorted((run_dir / "logs").glob("events.out.tfevents.*"))
    if len(events) > MAX_EVENT_FILES:
        print(f"full_run: {len(events)} TensorBoard event files; keeping the last {MAX_EVENT_FILES}", flush=True)
    copied = []
    for path in [run_dir / "out.log", run_dir / "config.yaml"] + events[-MAX_EVENT_FILES:]:
        if path.exists():
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
    return copied


def full_run(args, out, work, log, record):
    """Generate, train, report; fills ``record`` as it goes, so that a failure keeps what was done."""
    deadline = STARTED + args.budget_s
    config, boxes = (SMALL["config"], SMALL["box_size"]) if args.small else (args.config, args.box_size)
    record.update(config=config, boxes=boxes)
    train_path, val_path, record["generation_s"] = generate(
        boxes, Path(args.data_dir) if args.data_dir else work / "data", log, deadline)
    expdir = work / "runs"
    argv = ([sys.executable, "train.py", f"--config={config}", "--train_path", str(train_path), "--val_path",
             str(val_path), "--box_size", *map(str, boxes), "--expdir", str(expdir), "--run_num", "full"]
            + (SMALL["flags"] if args.small else []) + args.train_args)
    record["command"] = shlex.join(["python"] + argv[1:])
    if remaining(deadline) < args.grace_s:
        raise Failure(f"data generation left {remaining(deadline):.0f} s of the {args.budget_s:.0f} s budget; raise "
                      f"--budget_s or give smaller --box_size")
    code, output, seconds = run_streamed(argv, log, stop_at=deadline - args.grace_s, kill_at=deadline)
    run_dir = expdir / config / "1GPU" / "full"
    record["files"] = collect(run_dir, out)
    out_log = (run_dir / "out.log").read_text() if (run_dir / "out.log").exists() else output
    record.update(summarise(out_log, output, code, seconds))
    if record["finished"] and not args.no_report:
        report = out / "science_report.png"
        code, text, took = run_streamed([sys.executable, "-m", "science.report", str(run_dir), "--output",
                                         str(report)], log, kill_at=deadline)
        record["report_s"] = round(took, 1)
        if code == 0:
            record["files"].append(report.name)
        else:
            record["report_error"] = last_line(text)


def print_summary(record, small):
    print(f"full_run: {record['config']} on {record['device']}: {record['epochs_done']}/{record['epochs']} epochs in "
          f"{record['wall_minutes']:.1f} min, {record['samples_per_s']} samples/s while training, final val loss "
          f"{record['final_val_loss']}" + ("" if record["finished"] else
                                           f" (not finished: exit {record['exit_code']}; "
                                           f"{record['stopped'] or 'see out.log'})"))
    if record["config"] == "bs64_opt" and not small:
        met = record["finished"] and record["wall_minutes"] <= GOAL_MINUTES
        print(f"GOAL bs64_opt end to end <= {GOAL_MINUTES} min on one H100: {'met' if met else 'not met'} "
              f"({record['wall_minutes']:.1f} min on {record['device']})")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     usage="%(prog)s OUT [options] [-- train.py flags]")
    parser.add_argument("out", help="folder for the record and the run's files (created)")
    parser.add_argument("--config", default="bs64_opt", help="named config of config/UNet.yaml (default %(default)s)")
    parser.add_argument("--box_size", type=at_least(2), nargs=2, default=[512, 256], metavar=("TRAIN", "VAL"),
                        help="edges of the generated boxes (default 512 256)")
    parser.add_argument("--small", action="store_true", help="the quickstart model on 64^3/32^3 boxes, 2 short epochs")
    parser.add_argument("--budget_s", type=positive_float, default=560,
                        help="the whole script's time (default %(default)s)")
    parser.add_argument("--grace_s", type=at_least(0.0, float), default=45,
                        help="SIGUSR1 this long before the budget's end, for the checkpoint (default %(default)s)")
    parser.add_argument("--data_dir", help="where the boxes are (or are made); default: the temporary folder")
    parser.add_argument("--no_report", action="store_true", help="skip the science report")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (data, checkpoints)")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)  # after --: more train.py flags
    args = parser.parse_args(argv[:split])
    check_outputs(parser, folders={"OUT": args.out})
    args.train_args, args.argv = argv[split + 1:], argv
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch  # versions and the device check only: no CUDA context here, the GPU's memory is train.py's
    if not (args.small or torch.cuda.is_available()):
        print("full_run: error: no CUDA GPU visible; the full run needs one (--small checks the mechanics on a CPU)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="full_run_"))
    record = {"script": shlex.join(["python", "benchmarks/full_run.py", *args.argv]),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}}
    try:
        with open(out / "full_run.log", "w") as log:
            full_run(args, out, work, log, record)
    except Failure as err:
        record["error"] = str(err)
        print(f"full_run: error: {err}", file=sys.stderr)
    finally:
        (out / "full_run.json").write_text(json.dumps({"full_training": record}, indent=2) + "\n")
        if args.keep:
            print(f"full_run: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if "wall_minutes" in record:
        print_summary(record, args.small)
    print(f"full_run: wrote {out / 'full_run.json'}")
    return 0 if record.get("finished") else 1


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
