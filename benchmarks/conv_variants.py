"""Where does a training step's time go, layer by layer, and do other forms of the same convolutions run faster?

    python benchmarks/conv_variants.py [--batch 64] [--out results.json]
    python benchmarks/conv_variants.py --tiny          # CPU smoke test: widths [8, 16], batch 2, 16^3 crops

Per convolution of the reference U-Net (bf16 autocast, channels-last-3d, batch 64, 64^3 crops), the
forward + backward time of each form of it (networks/conv_forms.py; all compute the same thing), the
forward pass's time alone, on a GPU the kernel time (the profiler's GPU events, summed: a small layer timed
alone also counts the gaps in which the GPU waits for the host to launch its short kernels, which a whole
step's queue hides) and its longest kernels (for the slowest layers: which pass, or which copy, to make
faster), and the rate in TFLOP/s from the kernel time (the wall time on a CPU) and the layer's
forward FLOPs three times (forward, input gradient, weight gradient; twice for down0, whose input needs no
gradient), to hold against the GPU's peak:

- ``native``: nn.Conv3d / nn.ConvTranspose3d (kernel 4, stride 2, padding 1), as the model runs;
- ``rewritten``: as a stride-1 kernel-2 convolution (space-to-depth for Conv3d, sub-pixel for
  ConvTranspose3d);
- ``padded`` (first and last layer only, where it differs from native): the 4 input / 5 output
  channels zero-padded to 8;
- ``matmul`` (down5 and up0 only, on a 2^3 and a 1^3 input): one matrix product over the kernel's
  central taps, the only ones that see data there;
- ``unfold`` (the convolutions): every output voxel's window copied into a row (im2col), times the weight;
- ``overlap_add`` (the transposed layers): one matrix product to every tap's contribution, added where each
  lands. Timed eager here; its passes over the products are what torch.compile may fuse, so time it compiled
  too (``benchmarks/ladder.py --rungs compile_conv_forms,compile_overlap_add``);
- ``fused``: the rewritten form with, on a GPU, its pad and depth-to-space (transposed layers) or pad and
  space-to-depth (convolutions) as one Triton kernel each way instead of strided copies.

Then whole training steps (model, L1 loss, backward, fused Adam) with every layer native, every layer
rewritten, every layer in its fastest form (by kernel time on a GPU, by wall time on a CPU), the ``*_opt``
configs' forms (``opt``) and those with the last layer fused (``opt_fused``), set as
training sets them (``apply_conv_forms``, the config key ``conv_forms``), and the share of the native
step the convolutions take. The last line prints the ``--conv_forms`` value of the fastest step, to pass
to train.py. Median of CUDA-event timings after warm-up (cuDNN autotuning on). The GPU suite runs this as its part h
(benchmarks/gpu_suite.py); ``measure`` returns what it prints.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import positive_int, widths  # noqa: E402
from networks.UNet import UNet  # noqa: E402
from networks.conv_forms import (FORMS, apply_conv_forms, describe_conv_forms, form_computes, matmul_fits,  # noqa: E402
                                 stride2_conv)
from utils.metrics import conv_flops  # noqa: E402

REFERENCE_CHANNELS = [64, 128, 256, 512, 512, 512]


def timed(function, device, repeats=10, warmup=3):
    """Median milliseconds of ``function()`` (CUDA events on a GPU, the wall clock on a CPU)."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            begin = time.perf_counter()
            function()
            times.append(1e3 * (time.perf_counter() - begin))
            continue
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


KERNELS_KEPT = 6  # per layer and form, the longest kernels recorded in the results
# The *_opt configs' forms (config/UNet.yaml), and the same with the last layer fused: the eager side-by-side of
# the Triton depth-to-space against the sub-pixel form's strided copies, in one process.
OPT_STEPS = {"opt": "down0=rewritten,last=rewritten,up0=rewritten",
             "opt_fused": "down0=rewritten,last=fused,up0=rewritten"}


def kernel_rows(events, repeats):
    """[{"kernel", "ms", "calls"}] per call of the profiled function, longest first, from its GPU events ((name,
    microseconds) pairs; one row per distinct name, shown without "void " and cut to 110 characters)."""
    totals, counts = {}, {}
    for name, microseconds in events:
        totals[name] = totals.get(name, 0.0) + microseconds
        counts[name] = counts.get(name, 0) + 1
    rows = []
    for name in sorted(totals, key=totals.get, reverse=True):
        shown = name.removeprefix("void ")
        rows.append({"kernel": shown if len(shown) <= 110 else shown[:109] + "…",
                     "ms": totals[name] / 1e3 / repeats, "calls": counts[name] / repeats})
    return rows


def kernel_times(function, repeats=5):
    """``kernel_rows`` of ``function`` on the GPU: its kernels, copies and memsets, from the profiler."""
    function()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            function()
        torch.cuda.synchronize()
    return kernel_rows([(e.name, e.time_range.elapsed_us()) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA], repeats)


def kernel_ms(function, repeats=5):
    """GPU milliseconds per call of ``function``: the durations of its kernels, copies and memsets, summed."""
    return sum(row["ms"] for row in kernel_times(function, repeats))


def forms(module, input_edge):
    """{form name: function(x, weight, bias)} of one convolution whose input has edge ``input_edge``: native,
    rewritten, padded where its channel counts are not multiples of 8 (elsewhere padded is the native form),
    matmul where it fits (a 2^3 input, or 1^3 for a transposed convolution), and unfold for a convolution,
    overlap_add for a transposed one."""
    transposed = isinstance(module, nn.ConvTranspose3d)
    ragged = (module.out_channels if transposed else module.in_channels) % 8
    return {form: lambda x, w, b, form=form: stride2_conv(x, w, b, transposed, form) for form in FORMS
            if form_computes(form, transposed) and (form != "padded" or ragged)
            and (form != "matmul" or matmul_fits(transposed, input_edge))}


def layer_inputs(model, batch, crop, device):
    """The input each convolution sees on a crop^3 batch (recorded by forward pre-hooks)."""
    inputs, handles = {}, []
    for name, module in model.conv_layers():
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(
            name, args[0].detach().clone())))
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        model(torch.randn(batch, 4, crop, crop, crop, device=device).to(memory_format=torch.channels_last_3d))
    for handle in handles:
        handle.remove()
    return inputs


def train_step_ms(channels, spec, data, device, repeats):
    """(median ms, the forms chosen) of one bf16 training step of a fresh model with ``--conv_forms spec``."""
    torch.manual_seed(0)
    model = UNet(channels).to(device, memory_format=torch.channels_last_3d)
    chosen = apply_conv_forms(model, spec)  # as train.py's --conv_forms sets them
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            prediction = model(data[0])
        F.l1_loss(prediction.float(), data[1]).backward()
        optimizer.step()

    return timed(step, device, repeats=max(3, repeats + 5), warmup=5), chosen


def measure(batch=64, crop=64, channels=None, device=None, log=print, repeats=10):
    """Per-layer form timings and whole-step timings; returns {"layers": [...], "steps": {...}, ...}."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    channels = list(channels or REFERENCE_CHANNELS)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = UNet(channels).to(device, memory_format=torch.channels_last_3d)
    inputs = layer_inputs(model, batch, crop, device)
    flops = conv_flops(model, crop)
    results = {"setup": {"batch": batch, "crop": crop, "model_channels": channels, "device": str(device),
                         "precision": "bf16 autocast, channels-last-3d"}, "layers": [], "steps": {}}
    best = {}
    for name, module in model.conv_layers():
        x = inputs[name].requires_grad_(name != "down0")  # training never needs the first layer's input gradient
        candidates = forms(module, x.shape[-1])
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            reference = candidates["native"](x, module.weight, module.bias).float()
        passes = 3 if x.requires_grad else 2
        row = {"layer": name, "input_shape": list(x.shape), "forward_gflop": flops[name] * batch / 1e9, "ms": {},
               "forward_ms": {}, "kernel_ms": {}, "kernels": {}, "tflops": {}, "relative_error_bf16": {}}
        for form, function in candidates.items():
            def forward(function=function):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return function(x, module.weight, module.bias)

            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                y = function(x, module.weight, module.bias)
            row["relative_error_bf16"][form] = float((y.float() - reference).norm() / reference.norm())
            upstream = torch.ones_like(y)  # made once: its fill is not the layer's work

            def run(forward=forward, upstream=upstream):
                x.grad = None  # fresh gradients, as after training's zero_grad: no accumulation pass is timed
                module.zero_grad(set_to_none=True)
                forward().backward(upstream)

            row["ms"][form] = round(timed(run, device, repeats), 3)
            row["forward_ms"][form] = round(timed(forward, device, repeats), 3)
            kernels = kernel_times(run) if device.type == "cuda" else None
            row["kernel_ms"][form] = None if kernels is None else round(sum(k["ms"] for k in kernels), 3)
            row["kernels"][form] = None if kernels is None else [
                {**k, "ms": round(k["ms"], 4)} for k in kernels[:KERNELS_KEPT]]
            busy = row["kernel_ms"][form] or row["ms"][form]
            row["tflops"][form] = float(f"{passes * row['forward_gflop'] / busy:.3g}")  # GFLOP/ms = TFLOP/s
            module.zero_grad(set_to_none=True)
            x.grad = None
        cost = row["ms"] if device.type != "cuda" else row["kernel_ms"]  # in a step, the GPU's work is what counts
        best[name] = row["best"] = min(cost, key=cost.get)
        results["layers"].append(row)
        speedup = cost["native"] / cost[row["best"]]
        log(f"{name:5s} {str(tuple(x.shape)):28s} " + "  ".join(
            f"{form} {ms:7.3f} ms (forward {row['forward_ms'][form]:.3f}"
            + ("" if row["kernel_ms"][form] is None else f", kernels {row['kernel_ms'][form]:.3f}")
            + f", {row['tflops'][form]:g} TFLOP/s)" for form, ms in row["ms"].items())
            + f"  -> {row['best']} ({speedup:.2f}x)")
    del inputs
    for name, form, total, kernels in slowest_layers(results):
        log(f"{name} ({form}), {total:.3f} ms of kernels: " + "; ".join(
            f"{k['ms']:.3f} ms {k['kernel'][:60]}" for k in kernels[:3]))

    data = (torch.rand(batch, 4, crop, crop, crop, device=device) * 2 - 1,
            torch.rand(batch, 5, crop, crop, crop, device=device) * 2 - 1)
    data = tuple(t.contiguous(memory_format=torch.channels_last_3d) for t in data)
    variants = {"native": "native", "rewritten": "rewritten", "best": describe_conv_forms(best), **OPT_STEPS}
    for variant, spec in variants.items():
        ms, chosen = train_step_ms(channels, spec, data, device, repeats)
        results["steps"][variant] = {"ms": round(ms, 2), "samples_per_s": round(batch * 1e3 / ms, 1),
                                     "conv_forms": spec,
                                     "forms": {name: form for name, form in chosen.items() if form != "native"}}
        log(f"train step, {variant:10s}: {ms:7.2f} ms = {batch * 1e3 / ms:6.0f} samples/s (not native: "
            f"{', '.join(f'{n} {f}' for n, f in results['steps'][variant]['forms'].items()) or 'none'})")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the variant's model and optimizer state, freed on train_step_ms's return
    native_sum = sum(row["ms"]["native"] for row in results["layers"])
    results["conv_share_of_native_step"] = round(native_sum / results["steps"]["native"]["ms"], 3)
    log(f"the convolutions (forward + backward, timed alone) add up to {native_sum:.2f} ms, "
        f"{100 * results['conv_share_of_native_step']:.0f}% of the native step")
    fastest = min(results["steps"], key=lambda variant: results["steps"][variant]["ms"])
    results["fastest_step"], results["fastest_conv_forms"] = fastest, results["steps"][fastest]["conv_forms"]
    log(f"fastest step: {fastest} ({results['steps']['native']['ms'] / results['steps'][fastest]['ms']:.2f}x native); "
        f"train with --conv_forms {results['fastest_conv_forms']}")
    return results


def slowest_layers(results, count=3):
    """[(layer, form, kernel ms, its longest kernels)] of the ``count`` layers whose fastest form has the most
    kernel time (none on a CPU, which records no kernels)."""
    timed_layers = [row for row in results["layers"] if (row.get("kernels") or {}).get(row["best"]) is not None]
    timed_layers.sort(key=lambda row: row["kernel_ms"][row["best"]], reverse=True)
    return [(row["layer"], row["best"], row["kernel_ms"][row["best"]], row["kernels"][row["best"]])
            for row in timed_layers[:count]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--batch", type=positive_int, default=None, help="default 64 (2 with --tiny)")
    parser.add_argument("--crop", type=positive_int, default=None, help="default 64 (16 with --tiny)")
    parser.add_argument("--channels", type=widths, default=None,
                        help="U-Net widths, comma-separated (default: the reference's; 8,16 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke test of this script")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    tiny = dict(batch=2, crop=16, channels=[8, 16]) if args.tiny else dict(batch=64, crop=64, channels=None)
    settings = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in tiny.items()}
    levels = len(settings["channels"] or REFERENCE_CHANNELS)
    if settings["crop"] % 2 ** levels:
        parser.error(f"--crop {settings['crop']} must be divisible by 2^{levels} (one halving per level)")
    results = measure(**settings, repeats=3 if args.tiny else 10)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
