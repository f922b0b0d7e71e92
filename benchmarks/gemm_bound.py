"""How fast could a custom convolution kernel be? Each layer's passes as plain matrix products of the same FLOPs.

    python benchmarks/gemm_bound.py                      # a GPU: batch 64, 64^3 crops, bf16, beside <gpu>.json
    python benchmarks/gemm_bound.py --tiny               # a CPU smoke test (small model, batch 2, 16^3 crops)

An implicit-GEMM convolution is a matrix product whose operands are gathered on the fly: a stride-2 kernel-4
Conv3d is M = B x output voxels, N = C_out, K = C_in x 4^3; a ConvTranspose3d in its sub-pixel form (eight
phases of a kernel-2 convolution, networks/conv_forms.py) is M = B x input voxels, N = 8 C_out, K = 8 C_in.
Training runs three products of that size per layer: forward X W, input gradient dY W^T and weight gradient
X^T dY (down0 needs no input gradient). Timing them with the vendor's GEMM (cuBLAS through torch.matmul, dense
operands, no gathering) gives what a custom kernel that reached the GEMM's own rate would take. So ``conv ms -
gemm ms`` is about the most such a kernel could save per layer; where it is small, cuDNN is already there.

Beside each layer stand the convolution kernel times a results file measured (conv_variants.py, fastest form;
roofline.py reads them), when it measured the same setup on this GPU kind.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs, command_line  # noqa: E402
from utils.arguments import positive_int  # noqa: E402
from benchmarks.conv_variants import timed  # noqa: E402
from benchmarks.roofline import DEFAULT_CHANNELS, RESULTS, measured_kernel_ms, model_layers  # noqa: E402

TINY = dict(channels=[4, 8], batch=2, crop=16)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gemm_shape(layer):
    """(M, N, K) of the layer's implicit GEMM: 2 M N K is the FLOPs of one pass (roofline.ConvLayer.flops)."""
    (batch, c_in, *grid_in), (_, c_out, *grid_out) = layer.input_shape, layer.output_shape
    taps = math.prod(layer.weight_shape[2:])
    if layer.transposed:  # sub-pixel: a kernel-2 convolution per phase (taps / 8 of them), 8 phases side by side
        return batch * math.prod(grid_in), 8 * c_out, c_in * taps // 8
    return batch * math.prod(grid_out), c_out, c_in * taps


def gemm_times(layer, dtype, device, repeats):
    """{pass: median ms} of the layer's three products (no input gradient for the first layer)."""
    m, n, k = gemm_shape(layer)
    x, w, dy = (torch.randn(shape, device=device, dtype=dtype) for shape in ((m, k), (k, n), (m, n)))
    passes = {"forward": lambda: x @ w, "input_grad": lambda: dy @ w.T, "weight_grad": lambda: x.T @ dy}
    if not layer.needs_input_grad:
        del passes["input_grad"]
    return {name: timed(fn, device, repeats) for name, fn in passes.items()}  # the operands die on return


def gpu_kind(device):
    """'h100' or 'h200' from the CUDA device's name (the results files' names), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((kind for kind in ("h100", "h200") if kind in name), None)


def analyse(args, device):
    layers = model_layers(args.channels, args.batch, args.crop)[1]
    kind = gpu_kind(device)
    measured_path = args.measured or (RESULTS / f"{kind}.json" if kind else None)
    measured = measured_kernel_ms(measured_path, args.channels, args.batch, args.crop, args.dtype) \
        if measured_path else {}
    rows = []
    for layer in layers:
        m, n, k = gemm_shape(layer)
        times = gemm_times(layer, DTYPES[args.dtype], device, args.repeats)
        gemm_ms = sum(times.values())
        conv = measured.get(layer.name) or {}
        rows.append({"layer": layer.name, "mnk": [m, n, k], "gemm_ms": times,
                     "total_gemm_ms": gemm_ms, "gemm_tflops": 2 * m * n * k * len(times) / gemm_ms / 1e9,
                     "conv_ms": conv.get("best"), "conv_form": conv.get("best_form"),
                     "at_most_saved_ms": None if conv.get("best") is None else max(conv["best"] - gemm_ms, 0.0)})
        print(f"{layer.name}: M {m} N {n} K {k}: {gemm_ms:.3f} ms", file=sys.stderr, flush=True)
    conv_rows = [row for row in rows if row["conv_ms"] is not None]
    return {"setup": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "dtype": args.dtype, "batch": args.batch, "crop": args.crop,
                      "channels": args.channels, "repeats": args.repeats,
                      "measured_from": Path(measured_path).name if measured else None},
            "layers": rows, "total_gemm_ms": sum(row["total_gemm_ms"] for row in rows),
            "total_conv_ms": sum(row["conv_ms"] for row in conv_rows) if len(conv_rows) == len(rows) else None}


def markdown(result):
    s = result["setup"]
    lines = [f"# The U-Net's convolutions as plain matrix products: {s['device']}, torch {s['torch']}, "
             f"batch {s['batch']}, {s['crop']}³ crops, {s['dtype']}", "",
             f"`{s['command']}` "
             f"(median of {s['repeats']} per product). Conv: the fastest form's kernel ms"
             + (f" from `{s['measured_from']}`" if s["measured_from"] else ": none measured for this setup") + ".",
             "", "| layer | M × N × K | GEMM ms (its passes) | GEMM TFLOP/s | conv ms (form) | at most saved ms |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for row in result["layers"]:
        conv = f"{row['conv_ms']:.3f} ({row['conv_form']})" if row["conv_ms"] is not None else ""
        saved = f"{row['at_most_saved_ms']:.3f}" if row["at_most_saved_ms"] is not None else ""
        lines.append(f"| {row['layer']} | {' × '.join(map(str, row['mnk']))} | {row['total_gemm_ms']:.3f} | "
                     f"{row['gemm_tflops']:.3g} | {conv} | {saved} |")
    lines += ["", f"All layers: GEMM **{result['total_gemm_ms']:.2f} ms**"
              + (f" against **{result['total_conv_ms']:.2f} ms** of convolution kernels"
                 if result["total_conv_ms"] is not None else "") + "."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="small model, batch 2, 16^3 crops: a CPU smoke test")
    parser.add_argument("--batch", type=positive_int, help="default 64")
    parser.add_argument("--crop", type=positive_int, help="default 64")
    parser.add_argument("--channels", type=positive_int, nargs="+", help="the widths (default: the reference model's)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--repeats", type=positive_int, default=10,
                        help="timed runs of each product; the median counts")
    parser.add_argument("--measured", type=Path, help="results JSON with conv_variants.py's kernel times "
                                                       "(default: benchmarks/results/<gpu>.json on an H100/H200)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--json": args.json})
    given = [f"--{key}" for key in ("batch", "crop", "channels") if getattr(args, key) is not None]
    if args.tiny and given:
        parser.error(f"--tiny sets the batch, crop and widths itself; drop {', '.join(given)} or --tiny")
    defaults = TINY if args.tiny else {"channels": DEFAULT_CHANNELS, "batch": 64, "crop": 64}
    for key, value in defaults.items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if args.crop % 2 ** len(args.channels):
        parser.error(f"--crop {args.crop} must be divisible by 2^{len(args.channels)} (one halving per level)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("the full model's products take minutes on a CPU and say nothing about a GPU; use --tiny")
    result = analyse(args, device)
    result["setup"]["command"] = command_line(__file__, argv)  # what reproduces it, --tiny and all
    print(markdown(result), end="")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
