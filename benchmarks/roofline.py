"""How fast could a training step of the U-Net be? A roofline of its twelve stride-2 convolutions.

    python benchmarks/roofline.py                          # H100 SXM, batch 64, 64^3 crops, bf16
    python benchmarks/roofline.py --gpu h200 --out benchmarks/results/roofline_h200.md   # keeps its notes
    python benchmarks/roofline.py --gpu h200 --batch 128 --json roofline.json
    python benchmarks/roofline.py --peak_tflops 312 --bandwidth_tbs 2.0 --gpu a100   # any other GPU

Per layer (down0..down5: Conv3d, up0..up4 and last: ConvTranspose3d; kernel 4, stride 2, padding 1) and per
pass of a training step (forward, input gradient, weight gradient; down0's input needs no gradient, so it
has two passes):

- FLOPs: 2 x multiply-adds. A convolution does C_in C_out k^3 of them per output voxel, a transposed one per
  input voxel; each of the three passes is a matrix product of the same size, so the same FLOPs.
- minimum bytes: each pass reads its two operands and writes its result once, in ``--dtype``: forward x and
  w -> y, input gradient dy and w -> dx, weight gradient x and dy -> dw (biases are negligible and left out).
- roofline time: max(FLOPs / peak, bytes / bandwidth) per pass, summed over the passes.

The shapes come from the model itself, built on the meta device: no memory, seconds on a CPU. Beside each
layer stand the kernel times that a results file measured (``conv_variants.py``, as the GPU suite's part h or
run by hand: ``conv_forms``, GPU time of forward + backward with fresh gradients, native form and fastest
form), when it measured the same setup.

The ceiling adds, to the convolutions' roofline, memory traffic they do not do (see ``elementwise_bytes`` and
``parameter_bytes``): samples/s = batch / step time.
"""
import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs, write_keeping_notes  # noqa: E402
from utils.arguments import positive_float, positive_int  # noqa: E402
from networks.UNet import UNet  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GPUS = {"h100": (989.0, 3.35), "h200": (989.0, 4.8)}  # dense bf16 TFLOP/s, HBM TB/s (SXM data sheets)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_CHANNELS = [64, 128, 256, 512, 512, 512]
PASSES = ("forward", "input_grad", "weight_grad")
REALISTIC_SHARES = (0.6, 0.7)  # share of the roofline a tuned kernel reaches: the "realistic" band


@dataclass
class ConvLayer:
    """One stride-2 layer of a training step: shapes (B, C, D, H, W) and weight shape as the module holds it."""
    name: str
    transposed: bool
    input_shape: tuple
    output_shape: tuple
    weight_shape: tuple
    needs_input_grad: bool = True

    def flops(self):
        """FLOPs of one pass (forward, input gradient and weight gradient are equal)."""
        c_in, c_out = self.input_shape[1], self.output_shape[1]
        kernel_volume = math.prod(self.weight_shape[2:])
        grid = self.input_shape if self.transposed else self.output_shape  # where the MACs are counted per voxel
        voxels = grid[0] * math.prod(grid[2:])
        return 2 * c_in * c_out * kernel_volume * voxels

    def pass_bytes(self, dtype_bytes):
        """{pass: minimum bytes}: its two operands read once and its result written once."""
        x, y, w = (math.prod(s) * dtype_bytes for s in (self.input_shape, self.output_shape, self.weight_shape))
        all_passes = {"forward": x + w + y, "input_grad": y + w + x, "weight_grad": x + y + w}
        return {p: b for p, b in all_passes.items() if p != "input_grad" or self.needs_input_grad}


def model_layers(channels, batch, crop):
    """[ConvLayer] of the U-Net in forward order, shapes read from a forward pass on the meta device."""
    with torch.device("meta"):
        model = UNet(channels)
        seen = {}
        hooks = [module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(
            name, (tuple(args[0].shape), tuple(out.shape), tuple(m.weight.shape), bool(m.transposed))))
            for name, module in model.conv_layers()]
        model(torch.empty(batch, 4, crop, crop, crop))
    for hook in hooks:
        hook.remove()
    first = next(iter(seen))
    return model, [ConvLayer(name, transposed, x, y, w, needs_input_grad=name != first)
                   for name, (x, y, w, transposed) in seen.items()]


def roofline(layer, peak_flops, bandwidth, dtype_bytes):
    """One table row: FLOPs, bytes and roofline seconds per pass, their sums, intensity and the bound."""
    passes = layer.pass_bytes(dtype_bytes)
    flops = layer.flops()
    times = {p: max(flops / peak_flops, b / bandwidth) for p, b in passes.items()}
    total_flops, total_bytes = flops * len(passes), sum(passes.values())
    intensity = total_flops / total_bytes
    return {"layer": layer.name, "input_shape": list(layer.input_shape), "output_shape": list(layer.output_shape),
            "gflop": {p: (flops / 1e9 if p in passes else 0.0) for p in PASSES},
            "mbytes": {p: passes.get(p, 0) / 1e6 for p in PASSES},
            "roofline_ms": {p: times.get(p, 0.0) * 1e3 for p in PASSES},
            "total_gflop": total_flops / 1e9, "total_mbytes": total_bytes / 1e6,
            "total_roofline_ms": sum(times.values()) * 1e3,
            "intensity_flop_per_byte": intensity,
            "bound": "compute" if intensity >= peak_flops / bandwidth else "memory"}


def elementwise_bytes(layers, dtype_bytes):
    """{'separate', 'fused'}: bytes per step of the work around the convolutions, in ``dtype``.

    separate: each operation its own pass over its tensors. Forward: LeakyReLU / ReLU in place on each layer's
    output (read + write), each concatenation reads its two parts and writes the whole, tanh (read + write),
    the L1 loss with its gradient (read prediction and target, write the gradient). Backward: each activation's
    gradient (read upstream gradient and saved output, write) and the sum of each skip's two gradients
    (read 2, write 1). fused: activations in the convolutions' epilogues, the concatenation as the two layers
    writing into one buffer, the activation gradients and skip sums in the input-gradient epilogues; what is
    left is one tanh + loss + gradient kernel (read the last output and the target, write the gradient).
    """
    size = {layer.name: math.prod(layer.output_shape) * dtype_bytes for layer in layers}
    last = layers[-1]
    activated = [layer.name for layer in layers[:-1]]                  # LeakyReLU (down) and ReLU (up)
    concatenations = [math.prod(layer.input_shape) * dtype_bytes for layer in layers
                      if layer.transposed][1:]                         # up1.., last: inputs are concatenations
    skips = [layer.name for layer in layers if not layer.transposed][:-1]  # every down output but the bottom
    tanh_and_loss = (2 + 3 + 3) * size[last.name]                     # tanh, its gradient, loss + gradient
    separate = (sum(2 * size[n] + 3 * size[n] for n in activated) + sum(2 * c for c in concatenations)
                + sum(3 * size[n] for n in skips) + tanh_and_loss)
    return {"separate": separate, "fused": 3 * size[last.name]}


def parameter_bytes(num_params, dtype_bytes):
    """Bytes per step for the fp32 parameters: Adam, fused (read parameter, gradient and both moments, write
    parameter and moments: 28 B each), plus under autocast the cast of each weight to ``dtype`` and of its
    gradient back to the fp32 ``.grad`` (read 4 + write 2 B and back)."""
    casts = 0 if dtype_bytes == 4 else 2 * (4 + dtype_bytes)
    return num_params * (28 + casts)


def _kernel_table(node):
    """{layer: {form: kernel ms}} and {layer: fastest form} of a ``conv_forms`` table, or None. Two shapes:
    conv_variants.py's own (``layers``: rows with ``kernel_ms`` and ``best``, as the GPU suite's part h stores
    them) and the condensed one a results file may keep (``kernel_ms``: {layer: {form: ms}}, ``fastest``)."""
    layers = node.get("layers")
    if isinstance(layers, list) and layers and isinstance(layers[0], dict) and "kernel_ms" in layers[0]:
        return {row["layer"]: row["kernel_ms"] for row in layers}, {row["layer"]: row["best"] for row in layers}
    if isinstance(node.get("kernel_ms"), dict) and isinstance(node.get("fastest"), dict):
        return node["kernel_ms"], node["fastest"]
    return None


def measured_kernel_ms(path, channels, batch, crop, dtype="bf16"):
    """{layer: {'native', 'best', 'best_form'}} kernel ms from a results file's latest ``conv_forms`` table with
    kernel times, when it measured these widths, batch, crop and dtype; {} otherwise."""
    path = Path(path)
    if not path.is_file():
        return {}
    tables = []

    def collect(node):
        if isinstance(node, dict):
            if _kernel_table(node):
                tables.append(node)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(json.loads(path.read_text()))
    for table in reversed(tables):  # later entries of a results file are later runs
        setup = table.get("setup", {})
        same_shapes = (setup.get("batch"), setup.get("crop"), list(setup.get("model_channels", []))) == (
            batch, crop, channels)
        if same_shapes and dtype in setup.get("precision", ""):
            kernel_ms, fastest = _kernel_table(table)
            return {layer: {"native": ms.get("native"), "best_form": fastest[layer], "best": ms.get(fastest[layer])}
                    for layer, ms in kernel_ms.items()}
    return {}


def analyse(args):
    """Everything the table and the JSON show, as one dict."""
    peak_tflops, bandwidth_tbs = GPUS.get(args.gpu, (None, None))
    peak_tflops = args.peak_tflops or peak_tflops
    bandwidth_tbs = args.bandwidth_tbs or bandwidth_tbs
    if peak_tflops is None or bandwidth_tbs is None:
        raise SystemExit(f"--gpu {args.gpu} has no preset ({', '.join(GPUS)}); give --peak_tflops and --bandwidth_tbs")
    peak, bandwidth, dtype_bytes = peak_tflops * 1e12, bandwidth_tbs * 1e12, DTYPE_BYTES[args.dtype]
    model, layers = model_layers(args.channels, args.batch, args.crop)
    rows = [roofline(layer, peak, bandwidth, dtype_bytes) for layer in layers]
    measured_path = args.measured or RESULTS / f"{args.gpu}.json"
    measured = measured_kernel_ms(measured_path, args.channels, args.batch, args.crop, args.dtype)
    for row in rows:
        row["measured"] = measured.get(row["layer"])
        if row["measured"] and row["measured"]["best"]:
            row["measured"]["best_over_roofline"] = row["measured"]["best"] / row["total_roofline_ms"]
            row["measured"]["best_tflops"] = row["total_gflop"] / row["measured"]["best"]  # GFLOP/ms = TFLOP/s

    conv_ms = sum(row["total_roofline_ms"] for row in rows)
    elementwise = elementwise_bytes(layers, dtype_bytes)
    num_params = sum(p.numel() for p in model.parameters())
    param_ms = parameter_bytes(num_params, dtype_bytes) / bandwidth * 1e3
    steps = {"convolutions": conv_ms, "+ parameter update": conv_ms + param_ms,
             "+ elementwise, fused": conv_ms + param_ms + elementwise["fused"] / bandwidth * 1e3,
             "+ elementwise, separate": conv_ms + param_ms + elementwise["separate"] / bandwidth * 1e3}
    ceiling_ms = steps["+ elementwise, fused"]
    realistic = {f"{share:.0%} of roofline": ceiling_ms / share for share in REALISTIC_SHARES}
    measured_rows = [row["measured"]["best"] for row in rows if row["measured"] and row["measured"]["best"]]
    return {"setup": {"gpu": args.gpu, "peak_tflops": peak_tflops, "bandwidth_tbs": bandwidth_tbs,
                      "batch": args.batch, "crop": args.crop, "dtype": args.dtype, "channels": args.channels,
                      "num_params": num_params, "measured_from": Path(measured_path).name if measured else None},
            "layers": rows,
            "forward_gflop_per_sample": sum(row["gflop"]["forward"] for row in rows) / args.batch,
            "measured_best_kernel_ms": sum(measured_rows) if len(measured_rows) == len(rows) else None,
            "elementwise_mbytes": {k: v / 1e6 for k, v in elementwise.items()},
            "parameter_update_ms": param_ms,
            "step_ms": steps, "realistic_step_ms": realistic,
            "samples_per_s": {k: args.batch / ms * 1e3 for k, ms in {**steps, **realistic}.items()}}


def markdown(result):
    """The report: per-layer table, then the ceilings."""
    s = result["setup"]
    lines = [f"# Roofline of the U-Net's convolutions: {s['gpu'].upper()} ({s['peak_tflops']:g} TFLOP/s, "
             f"{s['bandwidth_tbs']:g} TB/s), batch {s['batch']}, {s['crop']}³ crops, {s['dtype']}", "",
             f"`python benchmarks/roofline.py --gpu {s['gpu']} --peak_tflops {s['peak_tflops']:g} --bandwidth_tbs "
             f"{s['bandwidth_tbs']:g} --batch {s['batch']} --crop {s['crop']} --dtype {s['dtype']}`", "",
             "GFLOP per pass (forward = input gradient = weight gradient; down0 has no input gradient), minimum "
             "MB per pass, roofline ms summed over the passes, intensity in FLOP/byte. Measured: kernel ms of "
             "forward + backward" + (f" from `{s['measured_from']}` (`conv_variants.py`), native and fastest form; "
                                     "best TFLOP/s: the layer's FLOPs over the fastest form's kernel time"
                                     if s["measured_from"] else ": none for this setup") + ".", "",
             "| layer | input | GFLOP/pass | MB fwd | MB dgrad | MB wgrad | roofline ms | FLOP/B | bound "
             "| native ms | best ms (form) | best / roofline | best TFLOP/s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for row in result["layers"]:
        m, mb = row["measured"] or {}, row["mbytes"]
        cells = [row["layer"], str(tuple(row["input_shape"][1:])), f"{row['gflop']['forward']:.1f}",
                 f"{mb['forward']:.0f}", f"{mb['input_grad']:.0f}" if mb["input_grad"] else "—",
                 f"{mb['weight_grad']:.0f}", f"{row['total_roofline_ms']:.3f}",
                 f"{row['intensity_flop_per_byte']:.0f}", row["bound"],
                 f"{m['native']:.3f}" if m.get("native") else "",
                 f"{m['best']:.3f} ({m['best_form']})" if m.get("best") else "",
                 f"{m['best_over_roofline']:.1f}x" if m.get("best_over_roofline") else "",
                 f"{m['best_tflops']:.0f}" if m.get("best_tflops") else ""]
        lines.append("| " + " | ".join(cells) + " |")
    steps, realistic, rates = result["step_ms"], result["realistic_step_ms"], result["samples_per_s"]
    measured = result["measured_best_kernel_ms"]
    lines += ["", f"All twelve: roofline **{steps['convolutions']:.2f} ms**"
              + (f", measured (fastest forms' kernels) **{measured:.2f} ms**, {measured / steps['convolutions']:.1f}x"
                 if measured else "") + f"; forward {result['forward_gflop_per_sample']:.2f} GFLOP/sample.", "",
              "| step time at the roofline | ms | samples/s |", "| --- | ---: | ---: |"]
    for name, ms in {**steps, **realistic}.items():
        label = f"realistic: everything at {name}" if name in realistic else name
        lines.append(f"| {label} | {ms:.2f} | {rates[name]:,.0f} |")
    e = result["elementwise_mbytes"]
    lines += ["", f"Parameter update: {s['num_params']:,} fp32 parameters, fused Adam (28 B each)"
              + (" plus the autocast casts of weights and gradients" if s["dtype"] != "fp32" else "")
              + f": {result['parameter_update_ms']:.2f} ms. Elementwise work "
              f"(`elementwise_bytes`): each LeakyReLU/ReLU/cat/tanh/loss (and backward) its own pass, "
              f"{e['separate']:,.0f} MB; fused into the convolutions, only tanh + L1 loss + its gradient left, "
              f"{e['fused']:,.0f} MB. **Ceiling: the fused line, {rates['+ elementwise, fused']:,.0f} samples/s.**"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--gpu", default="h100", help=f"preset ({', '.join(GPUS)}) or a name with both flags below")
    parser.add_argument("--peak_tflops", type=positive_float,
                        help="dense peak for --dtype (default: the preset's bf16)")
    parser.add_argument("--bandwidth_tbs", type=positive_float, help="memory bandwidth, TB/s (default: the preset's)")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--crop", type=positive_int, default=64)
    parser.add_argument("--channels", type=positive_int, nargs="+", default=DEFAULT_CHANNELS, help="the model's widths")
    parser.add_argument("--dtype", choices=DTYPE_BYTES, default="bf16", help="activations' and weights' dtype")
    parser.add_argument("--measured", type=Path, help="results JSON with part h's kernel times "
                                                       "(default: benchmarks/results/<gpu>.json)")
    parser.add_argument("--json", type=Path, help="also write the table and ceilings here")
    parser.add_argument("--out", type=Path, help="also write the report here, keeping the notes written by hand "
                                                 "below its marker (benchmarks/results_file.py)")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--json": args.json, "--out": args.out})
    if args.crop % 2 ** len(args.channels):
        parser.error(f"--crop {args.crop} must be divisible by 2^{len(args.channels)} (one halving per level)")
    if args.measured is not None:  # named: a typo must not read as "nothing measured"
        try:
            json.loads(args.measured.read_text())
        except (OSError, ValueError) as err:
            parser.error(f"--measured {args.measured} is not a readable results JSON ({type(err).__name__}); give "
                         f"one such as benchmarks/results/h100.json")
    result = analyse(args)
    report = markdown(result)
    print(report, end="")
    if args.out:
        write_keeping_notes(args.out, report)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
