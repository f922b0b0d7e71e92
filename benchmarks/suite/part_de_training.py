"""Parts d and e, whole training runs of train.py on the generated boxes.

d. train.py and train_graph.py on the same run (2 epochs, same seed, bf16, fused Adam, channels-last,
   GPU-resident data): the loss at every step compared, and the second epoch's samples/s;
e. train.py with checkpoints every few seconds against the eager run of d: the training stall per checkpoint (the
   goal counts the copy to host memory; time spent waiting for the previous write, which saves minutes apart never
   do, is reported beside it) and the throughput with checkpointing on.
"""
import re
import statistics
from pathlib import Path

from benchmarks.suite.settings import GRAPH_SPEEDUP_GOAL, LOSS_TOLERANCE, STALL_GOAL_S


class TrainingParts:
    def graph_vs_eager(self):
        flags = ["--data_loader_config", "gpu", "--gpu_storage_dtype", "fp16"] if self.cuda else []
        runs = {"eager": self.train("eager", *flags)}
        if self.cuda:
            runs["graph"] = self.train("graph", *flags, graph=True)
        else:
            self.skip("train_graph.py vs train.py", "no GPU")
        summary = {}
        for name, (rc, message, run_dir) in runs.items():
            if rc != 0:
                self.check(f"{name} run", False, f"exit code {rc}: {message}")
                continue
            summary[name] = {"samples_per_s": epoch_rate(run_dir / "out.log", 2),
                             "losses": step_losses(run_dir / "logs")}
        if "eager" in summary:  # saved even if the graph run failed: part e compares against it
            self.eager_rate = summary["eager"]["samples_per_s"]
            self.results["eager_run"] = {"samples_per_s": self.eager_rate, "steps": len(summary["eager"]["losses"])}
        if "eager" not in summary or "graph" not in summary:
            return
        eager, graph = summary["eager"]["losses"], summary["graph"]["losses"]
        steps = sorted(set(eager) & set(graph))
        diffs = [abs(graph[s] - eager[s]) / abs(eager[s]) for s in steps]
        result = {"eager_samples_per_s": summary["eager"]["samples_per_s"],
                  "graph_samples_per_s": summary["graph"]["samples_per_s"],
                  "max_loss_diff": max(diffs) if diffs else None, "steps_compared": len(steps),
                  "loss_tolerance": LOSS_TOLERANCE,
                  "eager_losses": [eager[s] for s in steps], "graph_losses": [graph[s] for s in steps]}
        result["speedup"] = result["graph_samples_per_s"] / result["eager_samples_per_s"]
        self.results["graph_vs_eager"] = result
        self.check("train_graph.py tracks train.py", bool(steps) and max(diffs) <= LOSS_TOLERANCE,
                   f"{len(steps)} steps, max relative loss difference {max(diffs, default=float('nan')):.2e} "
                   f"(tolerance {LOSS_TOLERANCE})")
        self.check(f"train_graph.py >= {GRAPH_SPEEDUP_GOAL} x train.py", result["speedup"] >= GRAPH_SPEEDUP_GOAL,
                   f"{result['graph_samples_per_s']:.0f} vs {result['eager_samples_per_s']:.0f} samples/s "
                   f"({result['speedup']:.3f}x)", kind="goal")

    def checkpoint_stall(self):
        flags = ["--data_loader_config", "gpu", "--gpu_storage_dtype", "fp16"] if self.cuda else []
        rc, message, run_dir = self.train("checkpoints", *flags, "--checkpoint_every_minutes",
                                          self.size["checkpoint_minutes"])
        if rc != 0:
            self.check("checkpointing run", False, f"exit code {rc}: {message}")
            return
        text = (run_dir / "out.log").read_text()
        saves = checkpoint_stalls(text)
        periodic = [(stall, waited) for reason, stall, waited in saves if reason == "periodic"]
        copies = [stall - waited for stall, waited in periodic]  # what a save minutes after the last one costs
        writes = [float(x) for x in re.findall(r"Checkpoint \([^)]*\) written: \S+ \(([0-9.]+) s", text)]
        rate = epoch_rate(run_dir / "out.log", 2)
        result = {"checkpoints": len(saves), "stall_s": [stall for _, stall, _ in saves],
                  "waited_for_previous_write_s": [waited for _, _, waited in saves],
                  "reasons": [reason for reason, _, _ in saves], "periodic_stall_s": [stall for stall, _ in periodic],
                  "periodic_copy_s": copies, "write_s": writes,
                  "max_stall_s": max((stall for _, stall, _ in saves), default=None),
                  "samples_per_s_with_checkpoints": rate, "samples_per_s_without": getattr(self, "eager_rate", None),
                  "interval_minutes": self.size["checkpoint_minutes"]}
        self.results["checkpoint"] = result
        if not periodic:
            self.check("periodic checkpoints", False, f"no periodic 'state copied to host' lines in out.log "
                                                      f"({len(saves)} checkpoints in all)")
            return
        without = result["samples_per_s_without"]
        waits = [waited for _, waited in periodic if waited > 0]
        self.check(f"checkpoint stall < {STALL_GOAL_S} s", max(copies) < STALL_GOAL_S,
                   f"{len(periodic)} periodic checkpoints, copy to host median {statistics.median(copies):.3f} s, max "
                   f"{max(copies):.3f} s; waited for the previous write in {len(waits)} of them"
                   + (f" (up to {max(waits):.2f} s: saves {60 * self.size['checkpoint_minutes']:.0f} s apart)" if waits
                      else "")
                   + f"; writes {', '.join(f'{w:.1f}' for w in writes)} s; {rate:.0f} samples/s with checkpoints vs "
                   f"{without or float('nan'):.0f} without", kind="goal")  # a time: never a check, CPU or GPU


def epoch_rate(out_log, epoch):
    """samples/s of ``epoch`` from train.py's 'Time taken for epoch N is X sec, avg Y samples/sec' line."""
    match = re.search(rf"Time taken for epoch {epoch} is [0-9.]+ sec, avg ([0-9.]+) samples/sec",
                      Path(out_log).read_text())
    if not match:
        raise RuntimeError(f"no epoch {epoch} summary line in {out_log}")
    return float(match.group(1))


def checkpoint_stalls(text):
    """[(reason, stall s, of it waiting for the previous write s)] of train.py's 'Checkpoint (REASON) at step N:
    state copied to host in X s[ (W s of it waiting for the previous write)], ...' lines."""
    pattern = (r"Checkpoint \(([^)]*)\) at step \d+: state copied to host in ([0-9.]+) s"
               r"(?: \(([0-9.]+) s of it waiting for the previous write\))?")
    return [(reason, float(stall), float(waited or 0)) for reason, stall, waited in re.findall(pattern, text)]


def step_losses(log_dir):
    """{step: loss} of TensorBoard's Loss/train_step (rank 0's loss at every step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    losses = {}
    for events in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "Loss/train_step" in accumulator.Tags()["scalars"]:
            losses.update({e.step: e.value for e in accumulator.Scalars("Loss/train_step")})
    return losses
