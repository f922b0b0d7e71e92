"""summary.md: the GPU suite's results (summary.json's) as Markdown tables, one section per part that ran."""
from benchmarks import conv_variants
from networks.conv_forms import FORMS


def markdown(results):
    lines = [f"# GPU suite: {results.get('device', '?')}", "", f"Command: `{results['command']}` "
             f"({results['mode']}, {results.get('suite_seconds', '?')} s)", ""]
    versions = results.get("versions")
    if versions:
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    lines += ["| status | check | detail |", "| --- | --- | --- |"]
    lines += [f"| {'GOAL ' if c['kind'] == 'goal' else ''}{c['status']} | {c['name']} | {c['detail']} |"
              for c in results.get("checks", [])]
    if results.get("ladder"):
        lines += ["", "## Optimisation ladder (compute only)", "",
                  "| rung | settings | samples/s | MFU | peak memory (GB) | loss after the check steps |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for r in results["ladder"]:
            if r["status"] != "ok":
                lines.append(f"| {r['label']} | {r['status']}: {r.get('reason')} | | | | |")
                continue
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            memory = "n/a" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f}"
            lines.append(f"| {r['label']} | {r['settings']} | {r['samples_per_s']:.1f} | {mfu} | {memory} | "
                         f"{r['loss']:.6f} |")
    if results.get("benchy"):
        batch = results.get("setup", {}).get("global_batch_size")
        lines += ["", "## Benchmark mode (samples/s, mean of 3 trials)", "",
                  "The loader's cost per step is batch/FULL - batch/SYNTHETIC: the time a step loses to its data.", "",
                  "| loader | IO | SYNTHETIC | FULL | FULL/SYNTHETIC | loader cost per step (ms) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {name} | {v['IO']:.0f} | {v['SYNTHETIC']:.0f} | {v['FULL']:.0f} | "
                  f"{v['FULL'] / v['SYNTHETIC']:.3f} | "
                  + (f"{1e3 * batch * (1 / v['FULL'] - 1 / v['SYNTHETIC']):.2f} |" if batch else "n/a |")
                  for name, v in results["benchy"].items()]
    if results.get("io_threads"):
        lines += ["", "Fast loader IO by thread count: " + ", ".join(
            f"{t} threads {r:.0f} samples/s" for t, r in results["io_threads"].items())]
    graph = results.get("graph_vs_eager")
    if graph:
        lines += ["", "## train.py vs train_graph.py", "",
                  f"{graph['steps_compared']} steps: eager {graph['eager_samples_per_s']:.0f} samples/s, graph "
                  f"{graph['graph_samples_per_s']:.0f} samples/s ({graph['speedup']:.3f}x); max relative loss "
                  f"difference " + ("n/a" if graph["max_loss_diff"] is None else f"{graph['max_loss_diff']:.2e}")]
    checkpoint = results.get("checkpoint")
    if checkpoint and checkpoint.get("stall_s"):
        lines += ["", "## Checkpoints", "", f"{checkpoint['checkpoints']} checkpoints: stall (s) "
                  f"{', '.join(f'{s:.3f}' for s in checkpoint['stall_s'])}; background write (s) "
                  f"{', '.join(f'{s:.1f}' for s in checkpoint['write_s'])}"]
    forms = results.get("conv_forms")
    if forms:
        names = sorted({form for row in forms["layers"] for form in row["ms"]}, key=FORMS.index)
        lines += ["", "## Convolution forms (forward + backward ms per layer; networks/conv_forms.py)", "",
                  "The fastest form's forward share, its kernels' time (GPU work without the waits for launches) "
                  "and its rate: FLOPs (forward, input and weight gradients) per second of kernel time.", "",
                  "| layer | input | " + " | ".join(names) + " | fastest | forward share | kernels (ms) | TFLOP/s |",
                  "| --- | --- |" + " ---: |" * len(names) + " --- | ---: | ---: | ---: |"]
        for row in forms["layers"]:
            best, kernels = row["best"], row["kernel_ms"][row["best"]]
            lines.append(f"| {row['layer']} | {tuple(row['input_shape'])} | "
                         + " | ".join(f"{row['ms'][n]:.3f}" if n in row["ms"] else "" for n in names)
                         + f" | {best} | {row['forward_ms'][best] / row['ms'][best]:.0%} | "
                         + ("n/a" if kernels is None else f"{kernels:.3f}") + f" | {row['tflops'][best]:g} |")
        lines += ["", "Whole steps: " + ", ".join(f"{variant} {step['samples_per_s']:.0f} samples/s"
                                                for variant, step in forms["steps"].items())
                  + f"; the convolutions alone are {100 * forms['conv_share_of_native_step']:.0f}% of the native step. "
                  f"Fastest: `--conv_forms {forms['fastest_conv_forms']}`"]
        slowest = conv_variants.slowest_layers(forms)
        if slowest:
            lines += ["", "Where the slowest layers' kernel time goes (fastest form, per forward + backward):", "",
                      "| layer | kernel | calls | ms | share |", "| --- | --- | ---: | ---: | ---: |"]
            lines += [f"| {name} ({form}) | `{k['kernel']}` | {k['calls']:g} | {k['ms']:.3f} | {k['ms'] / total:.0%} |"
                      for name, form, total, kernels in slowest for k in kernels]
    levers = results.get("levers")
    if levers and levers["samples_per_s"]:
        lines += ["", f"## More levers (fresh ladder processes, --conv_forms {levers['conv_forms']})", "",
                  "| run | rung | samples/s |", "| --- | --- | ---: |"]
        lines += [f"| {run} | {rung} | {rate:.1f} |" for run, rates in levers["samples_per_s"].items()
                  for rung, rate in rates.items()]
    profile = results.get("profile")
    if profile and profile.get("top_kernels"):
        lines += ["", f"## Top kernels in the profiled steps {profile['window']}", "", "| share | ms | kernel |",
                  "| ---: | ---: | --- |"]
        lines += [f"| {100 * k['share']:.1f}% | {k['ms']:.2f} | `{k['name']}` |" for k in profile["top_kernels"]]
    return "\n".join(lines) + "\n"
