"""Which convolution kernels does this PyTorch really run for the U-Net's layers, and how fast?

    python benchmarks/kernel_probe.py                 # GPU: every layer shape x math mode, batch 8
    python benchmarks/kernel_probe.py --batch 64 --modes bf16,bf16_cl     # training's batch, two modes

For each Conv3d and ConvTranspose3d of the reference U-Net (at the shape it sees on a ``crop``^3
input; ``batch`` samples, 8 by default) and each math mode -- fp32 (TF32 off), TF32, bf16, fp16, and bf16,
fp32 and TF32 channels-last-3d -- one forward and backward pass runs under ``torch.profiler``. The case is
classified from the profiler's op and kernel names:

- ``cudnn``: an ``aten::cudnn_convolution*`` op, or cuDNN/CUTLASS-style kernels, and no slow op;
- ``slow``: ``aten::slow_conv3d*`` / ``aten::slow_conv_transpose3d*`` or PyTorch's ``vol2col``/
  ``col2vol``/``im2col`` kernels (``at::native::``; cuDNN's own im2col kernels are cuDNN): PyTorch's
  native fallback, 4-20x slower and memory hungry. PyTorch 2.9 disabled cuDNN for 3D bf16/fp16
  convolutions with cuDNN in [9.8, 9.15) (pytorch issues 163539, 166122), so this is checked, not
  assumed;
- ``unknown``: neither (reported, counted as a failure: look at the kernel names).

Then the pass is timed with CUDA events (median of ``--repeats``), giving TFLOP/s per case. By
default cuDNN picks its algorithms by heuristics: whether PyTorch calls cuDNN or its slow fallback
does not depend on that, and autotuning every case (``--benchmark``, what train.py's
``cudnn.benchmark`` does) costs about a second per case on an H100 (84 cases by default: 12 layers, 7 modes). On a
CPU the same code runs (``--batch 1 --crop 16 --channels 4,8`` is a smoke test) and reports which CPU
ops ran as information only: the slow-path check is about the GPU (cuDNN expected), while the CPU's
kernel depends on its instruction set (without AVX-512, PyTorch runs bf16 channels-last Conv3d in
``slow_conv3d``). Off the GPU only a case that crashes fails the probe.
"""
import argparse
import json
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import positive_int, widths  # noqa: E402
from utils.profiling import quiet_profiler  # noqa: E402

# PyTorch's own fallback ops and kernels. Plain "im2col" would also match cuDNN's GEMM engine (im2col4d_kernel):
# only PyTorch's at::native::im2col/col2im kernels count.
SLOW_MARKERS = ("slow_conv3d", "slow_conv_transpose3d", "slow_conv_dilated3d", "vol2col", "col2vol", "native::im2col",
                "native::col2im")
CUDNN_MARKERS = ("cudnn", "xmma", "cutlass", "implicit_convolve", "fprop", "dgrad", "wgrad", "sm90_", "sm80_",
                 "conv2d_grouped", "convolve")
MODES = ("fp32", "tf32", "bf16", "fp16", "bf16_cl", "fp32_cl", "tf32_cl")
REFERENCE_CHANNELS = (64, 128, 256, 512, 512, 512)


def layer_shapes(channels=REFERENCE_CHANNELS, in_channels=4, out_channels=5, crop=64):
    """[(name, module class, c_in, c_out, input edge)] of every convolution of the U-Net."""
    layers, size, widths = [], crop, [in_channels, *channels]
    for i in range(len(channels)):
        layers.append((f"down{i}", nn.Conv3d, widths[i], widths[i + 1], size))
        size //= 2
    levels = len(channels)
    for j, level in enumerate(range(levels - 1, 0, -1)):
        skip = 0 if level == levels - 1 else channels[level]
        layers.append((f"up{j}", nn.ConvTranspose3d, channels[level] + skip, channels[level - 1], size))
        size *= 2
    layers.append(("last", nn.ConvTranspose3d, 2 * channels[0], out_channels, size))
    return layers


def mode_settings(mode):
    """(autocast dtype or None, allow TF32, memory format) of a math mode."""
    return {"fp32": (None, False, torch.contiguous_format), "tf32": (None, True, torch.contiguous_format),
            "bf16": (torch.bfloat16, False, torch.contiguous_format),
            "fp16": (torch.float16, False, torch.contiguous_format),
            "bf16_cl": (torch.bfloat16, False, torch.channels_last_3d),
            # fp32 with channels-last (a *_opt config with --amp_mode none) logged 7.9 samples/s on the H100 (a 12-step
            # epoch, most likely cuDNN's autotuning; benchmarks/results/h100.md): these two modes check for a slow path.
            "fp32_cl": (None, False, torch.channels_last_3d), "tf32_cl": (None, True, torch.channels_last_3d)}[mode]


def conv_flops(cls, c_in, c_out, size, batch):
    """Forward FLOPs (2 x MACs) of one kernel-4, stride-2 layer, as utils/metrics.py's flops_per_sample counts them."""
    out_size = size // 2 if cls is nn.Conv3d else size * 2
    per_output = 64 if cls is nn.Conv3d else 8  # a stride-2 transposed conv: kernel^3 / 8 MACs per output
    return 2 * c_in * c_out * per_output * out_size ** 3 * batch


def classify(names):
    lowered = [name.lower() for name in names]
    if any(marker in name for name in lowered for marker in SLOW_MARKERS):
        return "slow"
    if any(marker in name for name in lowered for marker in CUDNN_MARKERS):
        return "cudnn"
    return "unknown"


def probe_case(cls, c_in, c_out, size, batch, mode, device, repeats):
    amp_dtype, tf32, memory_format = mode_settings(mode)
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    layer = cls(c_in, c_out, kernel_size=4, stride=2, padding=1).to(device, memory_format=memory_format)
    x = torch.randn(batch, c_in, size, size, size, device=device).to(memory_format=memory_format)
    x.requires_grad_(True)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()

    with torch.no_grad(), autocast:
        upstream = torch.randn_like(layer(x))  # an upstream gradient in the output's dtype and layout, made once

    def step():  # the layer's forward and backward only: no loss, no fill, no accumulation into old gradients
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with autocast:
            y = layer(x)
        y.backward(upstream)

    for _ in range(2):  # autotuning (if on) and workspace allocation stay out of the profile and timings
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    ops = sorted({e.name for e in events if e.name.startswith("aten::") and "conv" in e.name})
    kernels = sorted({e.name for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA})
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            import time
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    seconds = statistics.median(times)
    flops = 3 * conv_flops(cls, c_in, c_out, size, batch)  # forward + input grad + weight grad
    path = classify(ops + kernels)
    if device.type != "cuda" and path == "unknown":
        path = "cpu"  # oneDNN or native CPU kernels; off the GPU the path is information only (judge)
    return {"ops": ops, "kernels": kernels[:40], "path": path, "ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}


def judge(cases, on_gpu):
    """(passed, one-line detail) of a probe's ``cases``. On a GPU every case must be on cuDNN. On a CPU the
    kernel PyTorch picks depends on the CPU's instruction set, so the paths are information and only a case
    that crashed (or no case at all) fails."""
    if on_gpu:
        bad = [case for case in cases if case["path"] != "cudnn"]
        detail = f"{len(cases) - len(bad)}/{len(cases)} cases on cuDNN"
        if bad:
            detail += "; not cuDNN: " + ", ".join(f"{case_name(c)}={c['path']}" for c in bad)
        return bool(cases) and not bad, detail
    errors = [case_name(c) for c in cases if c["path"] == "error"]
    slow = [case_name(c) for c in cases if c["path"] == "slow"]
    detail = (f"{len(cases)} cases ran on the CPU; PyTorch's slow fallback (information only: the check is "
              f"for GPUs) for {', '.join(slow) or 'none'}")
    return bool(cases) and not errors, detail + (f"; crashed: {', '.join(errors)}" if errors else "")


def case_name(case):
    return f"{case['layer']}/{case['mode']}"


def run_probe(batch=8, crop=64, modes=MODES, repeats=5, device=None, log=print, channels=REFERENCE_CHANNELS,
              benchmark=False):
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = benchmark
    cases = []
    try:
        for name, cls, c_in, c_out, size in layer_shapes(channels, crop=crop):
            for mode in modes:
                if device.type != "cuda" and mode in ("tf32", "fp16"):
                    continue
                case = {"layer": name, "kind": cls.__name__, "c_in": c_in, "c_out": c_out, "size": size,
                        "mode": mode}
                try:
                    case.update(probe_case(cls, c_in, c_out, size, batch, mode, device, repeats))
                except Exception as err:  # a case that crashes is a finding, not the end of the probe
                    case.update(path="error", error=f"{type(err).__name__}: {err}".splitlines()[0])
                log(f"  {name:5s} {cls.__name__:15s} {c_in:4d}->{c_out:4d} @{size:3d}^3 {mode:8s} "
                    f"{case['path']:7s} {case.get('ms', float('nan')):8.2f} ms {case.get('tflops', 0):7.1f} TFLOP/s")
                cases.append(case)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    return cases


def environment():
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(sm_count=props.multi_processor_count, memory_gb=round(props.total_memory / 1e9, 1),
                   capability=f"{props.major}.{props.minor}")
        try:
            import subprocess
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--batch", type=positive_int, default=8,
                        help="samples per pass (the kernels are chosen per shape; "
                             "8 keeps the probe under a minute)")
    parser.add_argument("--crop", type=positive_int, default=64)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--benchmark", action="store_true", help="autotune each case as training does (slower)")
    parser.add_argument("--channels", type=widths, default=list(REFERENCE_CHANNELS),
                        help="U-Net widths, comma-separated (default: the reference model's)")
    parser.add_argument("--out", type=Path, help="write the cases as JSON here")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    on_gpu = torch.cuda.is_available()
    quiet_profiler(on_gpu)
    env = environment()
    print(json.dumps(env), flush=True)
    channels = args.channels
    if args.crop % 2 ** len(channels):
        parser.error(f"--crop {args.crop} must be divisible by 2^{len(channels)} for {len(channels)} levels")
    cases = run_probe(args.batch, args.crop, modes, args.repeats, channels=channels, benchmark=args.benchmark)
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "batch": args.batch, "crop": args.crop,
                                        "cases": cases}, indent=1) + "\n")
    passed, detail = judge(cases, on_gpu)
    print(f"{'PASS' if passed else 'FAIL'} kernel probe: {detail}")
    return 0 if passed else 1


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
