"""Part b: benchmarks/ladder.py, the optimisation ladder on the full model at batch 64, up to the *_opt
configs' settings (channels-last, the fastest convolution forms, torch.compile), with its plot (ladder.png).
"""
import json

from benchmarks.suite.settings import COMPUTE_GOAL


class LadderPart:
    def ladder(self):
        from benchmarks import ladder
        flags = self.size["ladder"]  # the tutorial's ladder whatever --conv_forms says: its last rungs add the forms
        self.log("$ benchmarks/ladder.py " + " ".join(flags))
        with self.quiet():
            rc = ladder.main(["--out", str(self.out / "ladder.json"), *flags])
        report = json.loads((self.out / "ladder.json").read_text())
        rows = []
        for row in report["rungs"]:
            entry = {"rung": row["name"], "label": row["label"], "status": row["status"]}
            if row["status"] == "ok":
                entry.update(settings=row["settings"], samples_per_s=round(row["samples_per_sec"], 1),
                             mfu=None if row["mfu"] is None else round(row["mfu"], 4),
                             peak_memory_gb=None if row["peak_memory_gb"] is None else round(row["peak_memory_gb"], 2),
                             peak_memory_reserved_gb=None if row.get("peak_memory_reserved_gb") is None
                             else round(row["peak_memory_reserved_gb"], 2),
                             loss=round(row["loss_last"], 6), loss_first=round(row["loss_first"], 6),
                             seconds=row.get("seconds"))
            else:
                entry["reason"] = row.get("reason") or row.get("error")
            rows.append(entry)
        self.results["ladder"] = rows
        self.results["ladder_setup"] = report["setup"]
        failed = [r["rung"] for r in rows if r["status"] == "failed"]
        self.check("ladder: every rung runs", not failed and rc == 0,
                   f"{sum(r['status'] == 'ok' for r in rows)} ok, {sum(r['status'] == 'skipped' for r in rows)} "
                   f"skipped" + (f", failed: {', '.join(failed)}" if failed else ""))
        ok = [r for r in rows if r["status"] == "ok"]
        if ok:
            base = next((r for r in ok if r["rung"] == "fp32"), ok[0])
            far = [r["rung"] for r in ok if abs(r["loss"] - base["loss"]) > 0.05 * base["loss"]]
            self.check("ladder: every rung's loss tracks fp32 (5%)", not far,
                       "loss after the check steps: " + ", ".join(f"{r['rung']} {r['loss']:.5f}" for r in ok))
            best = max(ok, key=lambda r: r["samples_per_s"])
            self.results["best_rung"] = best["rung"]
            if self.cuda:
                self.check(f"compute-only throughput >= {COMPUTE_GOAL} samples/s",
                           best["samples_per_s"] >= COMPUTE_GOAL,
                           f"best rung {best['rung']}: {best['samples_per_s']:.0f} samples/s, MFU "
                           f"{100 * (best['mfu'] or 0):.1f}%", kind="goal")
            rates = {r["rung"]: r["samples_per_s"] for r in ok}
            if {"compile_conv_forms", "compile_overlap_add"} <= set(rates):  # the candidate against the *_opt step
                ratio = rates["compile_overlap_add"] / rates["compile_conv_forms"]
                self.results["overlap_add_vs_opt"] = round(ratio, 3)
                self.log(f"last as an overlap-add: {self.results['overlap_add_vs_opt']}x the *_opt step")
            plot_ladder(rows, self.out / "ladder.png", self.results.get("device", "?"))


def plot_ladder(rows, path, device):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(9, 4.2))
    bars = ax.bar(range(len(ok)), [r["samples_per_s"] for r in ok], color="tab:blue")
    for bar, row in zip(bars, ok):
        mfu = f"\nMFU {100 * row['mfu']:.0f}%" if row.get("mfu") is not None else ""
        ax.annotate(f"{row['samples_per_s']:.0f}{mfu}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ok)), [r["label"].replace(", ", ",\n") for r in ok], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("training samples/s (compute only)")
    ax.set_title(f"U-Net optimisation ladder, batch 64, 64$^3$ crops, {device}", fontsize=10)
    ax.set_ylim(0, max(r["samples_per_s"] for r in ok) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
