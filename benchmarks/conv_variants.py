"""Does rewriting the U-Net's stride-2 convolutions as stride-1 kernel-2 ones (networks/conv_forms.py) pay on this GPU?

    python benchmarks/conv_variants.py [--batch 64] [--out results.json]

Per layer of the reference U-Net (bf16 autocast, channels-last-3d, batch 64, 64^3 crops): the
forward and backward time of nn.Conv3d / nn.ConvTranspose3d against its rewritten form
(space-to-depth for Conv3d, sub-pixel for ConvTranspose3d), and then whole training steps (model,
L1 loss, backward, fused Adam) with every layer native, every layer rewritten, and each layer in
its faster form. Median of CUDA-event timings after warm-up (cuDNN autotuning, cudnn.benchmark).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from networks.UNet import UNet  # noqa: E402
from networks.conv_forms import conv3d_s2d, conv_transpose3d_subpixel  # noqa: E402


def timed(function, repeats=10, warmup=3):
    for _ in range(warmup):
        function()
    times = []
    if not torch.cuda.is_available():  # CPU smoke test of this script
        import time
        for _ in range(repeats):
            begin = time.perf_counter()
            function()
            times.append(1e3 * (time.perf_counter() - begin))
        return statistics.median(times)
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def rewrite(module):
    """Make ``module`` (a U-Net Conv3d or ConvTranspose3d) run its rewritten form; parameters unchanged."""
    form = conv3d_s2d if isinstance(module, nn.Conv3d) else conv_transpose3d_subpixel
    module.forward = lambda x, m=module: form(x, m.weight, m.bias)


def layers(model):
    """The model's convolutions in forward order, with names."""
    found = [(f"down{i}", block[0]) for i, block in enumerate(model.down)]
    found += [(f"up{i}", block[0]) for i, block in enumerate(model.up)] + [("last", model.conv_last)]
    return found


def layer_inputs(model, batch, crop, device):
    """The input each convolution sees on a crop^3 batch (recorded by forward pre-hooks)."""
    inputs, handles = {}, []
    for name, module in layers(model):
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(
            name, args[0].detach().clone())))
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        model(torch.randn(batch, 4, crop, crop, crop, device=device).to(memory_format=torch.channels_last_3d))
    for handle in handles:
        handle.remove()
    return inputs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--crop", type=int, default=64)
    parser.add_argument("--channels", type=lambda text: [int(c) for c in text.split(",")],
                        default=[64, 128, 256, 512, 512, 512], help="U-Net widths (default: the reference's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = UNet(args.channels).to(device, memory_format=torch.channels_last_3d)
    inputs = layer_inputs(model, args.batch, args.crop, device)
    results = {"layers": [], "steps": {}}
    faster = {}
    for name, module in layers(model):
        x = inputs[name].requires_grad_(name != "down0")  # training never needs the input gradient of the first layer
        form = conv3d_s2d if isinstance(module, nn.Conv3d) else conv_transpose3d_subpixel

        def run(use_form):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = form(x, module.weight, module.bias) if use_form else module(x)
            y.backward(torch.ones_like(y))

        with torch.autocast(device.type, dtype=torch.bfloat16):
            reference, rewritten = module(x), form(x, module.weight, module.bias)
        error = ((rewritten.float() - reference.float()).norm() / reference.float().norm()).item()
        native_ms, form_ms = timed(lambda: run(False)), timed(lambda: run(True))
        faster[name] = form_ms < native_ms
        row = {"layer": name, "shape": list(x.shape), "native_ms": round(native_ms, 3), "rewritten_ms": round(form_ms, 3),
               "relative_error_bf16": error}
        results["layers"].append(row)
        print(f"{name:5s} {str(tuple(x.shape)):28s} native {native_ms:7.3f} ms  rewritten {form_ms:7.3f} ms  "
              f"({native_ms / form_ms:4.2f}x)  rel. error {error:.1e}", flush=True)
        model.zero_grad(set_to_none=True)

    batch = (torch.rand(args.batch, 4, args.crop, args.crop, args.crop, device=device) * 2 - 1,
             torch.rand(args.batch, 5, args.crop, args.crop, args.crop, device=device) * 2 - 1)
    batch = tuple(t.contiguous(memory_format=torch.channels_last_3d) for t in batch)
    for variant in ("native", "rewritten", "best"):
        torch.manual_seed(0)
        model = UNet(args.channels).to(device, memory_format=torch.channels_last_3d)
        for name, module in layers(model):
            if variant == "rewritten" or (variant == "best" and faster[name]):
                rewrite(module)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                prediction = model(batch[0])
            F.l1_loss(prediction.float(), batch[1]).backward()
            optimizer.step()

        ms = timed(step, repeats=15, warmup=5)
        results["steps"][variant] = {"ms": round(ms, 2), "samples_per_s": round(args.batch * 1e3 / ms, 1),
                                     "rewritten_layers": [n for n, _ in layers(model) if variant == "rewritten" or
                                                          (variant == "best" and faster[n])]}
        print(f"train step, {variant:9s}: {ms:6.2f} ms = {args.batch * 1e3 / ms:6.0f} samples/s "
              f"(rewritten: {', '.join(results['steps'][variant]['rewritten_layers']) or 'none'})", flush=True)
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
