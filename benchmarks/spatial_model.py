"""On paper: step time, efficiency and memory of spatial parallelism (S ranks sharing each crop, utils/spatial.py).

    python benchmarks/spatial_model.py --out benchmarks/results/spatial_model.md \
        --plot benchmarks/results/spatial_model.png
    python benchmarks/spatial_model.py --batch 1 --intra_bw 200 --overlap 0.5

One rank's training step, layer by layer, with utils/spatial.py's own plan (run on the meta device) saying which
layers exchange halos and which run whole:
- compute = the H100's measured kernel ms of the layer (native form, batch 64, 64^3, bf16, channels-last; read by
  roofline.py) x the shard's FLOPs / the measured FLOPs. A transposed layer computes only its own output planes
  (utils/spatial.py's two depth phases); a layer run whole costs its whole FLOPs, or 1/S of them where S divides
  the batch (each rank runs B / S crops; its output all-gathered, its gradient all-reduced). Plus the Adam update
  of all parameters on every rank (HBM roofline). Elementwise work is left out.
- halo: forward sends ``hi`` planes to the previous slab and ``lo`` to the next, backward the same volume back:
  alpha + bytes / bandwidth per exchange. A layer whose sharded input it must gather whole all-gathers it and
  all-reduces its gradient (ring collectives). exposed = comm - min(overlap x comm, the layer's compute).
- DDP all-reduces the gradients over all D x S ranks (comm_model.ring_allreduce_time, exposed_comm_time).
Efficiency = t(one GPU, whole crop) / (S x t(slab)). Memory: an analytic estimate (docstring of memory_bytes).
Slabs against grids of blocks (g_d x g_h x g_w, which utils/spatial.py does not implement): grid_layer_times.
"""
import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs, command_line  # noqa: E402
from utils.arguments import at_least, fraction, positive_float, positive_int  # noqa: E402
from benchmarks.comm_model import Network, exposed_comm_time, ring_allreduce_time  # noqa: E402
from benchmarks.roofline import (DEFAULT_CHANNELS, DTYPE_BYTES, GPUS, RESULTS, ConvLayer, measured_kernel_ms,  # noqa
                                 parameter_bytes)
from networks.UNet import UNet  # noqa: E402
from utils.spatial import SpatialGroup, shard_model, shares_crops  # noqa: E402

MEASURED = dict(path=RESULTS / "h100.json", batch=64, crop=64, dtype="bf16")  # the kernel times' setup
# An H100 SXM node: NVLink4 450 GB/s per direction, at comm_model's ~2/3 of peak; 8 x 400 Gb/s NICs per node.
H100_NODE = Network(intra_bw=300e9, node_bw=400e9, alpha=5e-6, gpus_per_node=8)
GPU_MEMORY = 80e9
CROPS, SPATIAL = (64, 128, 256), (1, 2, 4, 8)
GOAL = dict(crop=128, spatial=4, efficiency=0.85)


@dataclass
class ShardLayer:
    """One convolution as a rank of an S-way group runs it: whole shapes (B, C, D, H, W), utils/spatial.py's mode
    ("halo"; "gather": all-gathers its sharded input; "whole": its input is whole already; "plain": S = 1)."""
    name: str
    transposed: bool
    input_shape: tuple
    output_shape: tuple
    weight_shape: tuple
    mode: str
    halo: tuple  # (planes before, planes after) its own slab reads
    spatial: int
    reason: str = ""
    crops_shared: bool = False  # run whole, on B / S crops per rank (utils/spatial.py: S divides the batch)

    def planes(self):
        """(input planes this rank keeps, with its halo, and output planes it makes): a transposed layer makes only
        its own 2n (utils/spatial.py's depth phases), a convolution n / 2."""
        if self.mode == "plain":
            return self.input_shape[2], self.output_shape[2]
        n = self.input_shape[2] // self.spatial if self.mode == "halo" else self.input_shape[2]
        return n + sum(self.halo), (2 * n if self.transposed else n // 2)

    def shard_flops(self, recompute=False):
        """FLOPs of one pass on this rank; ``recompute``: as if transposed layers also computed the output planes their
        halo gives (a plain padding-free transposed convolution of the extended slab: utils/spatial.py avoids it)."""
        if self.crops_shared:
            return ConvLayer(self.name, self.transposed, self.input_shape, self.output_shape,
                             self.weight_shape).flops() // self.spatial
        depth_in = self.planes()[0]
        if self.transposed:  # FLOPs per input voxel
            if not recompute and self.mode != "plain":  # its own input planes, whole where it runs whole
                depth_in = self.input_shape[2] // (self.spatial if self.mode == "halo" else 1)
            x = self.input_shape[:2] + (depth_in,) + self.input_shape[3:]
            return ConvLayer(self.name, True, x, self.output_shape, self.weight_shape).flops()
        own_out = self.output_shape[2] // self.spatial if self.mode == "halo" else self.output_shape[2]
        y = self.output_shape[:2] + (own_out,) + self.output_shape[3:]
        return ConvLayer(self.name, False, self.input_shape, y, self.weight_shape).flops()

    def halo_bytes(self, dtype_bytes):
        """Bytes the busiest rank sends per step (forward, and the gradients back): both neighbours when S > 2."""
        b, c, _, h, w = self.input_shape
        planes = sum(self.halo) if self.spatial > 2 else max(self.halo)
        return 2 * planes * b * c * h * w * dtype_bytes if self.mode == "halo" else 0

    def gathered(self):
        """Shapes of the whole tensors it all-gathers: its sharded input ("gather"), its output (crops shared)."""
        return [self.input_shape] * (self.mode == "gather") + [self.output_shape] * self.crops_shared

    def gather_bytes(self, dtype_bytes):
        """Bytes a rank sends per step: for each gathered tensor a ring all-gather, (S - 1) / S of it, and a ring
        all-reduce of its gradient, 2 (S - 1) / S of it."""
        whole = sum(math.prod(shape) for shape in self.gathered())
        return 3 * (self.spatial - 1) * whole * dtype_bytes // self.spatial

    def kept_elements(self):
        """(input, output) elements kept for backward: the input with its halo (or padded whole) the convolution
        keeps, the output of its activation (for the last layer only its own planes, which tanh copies)."""
        (b, c_in, _, h, w), (_, c_out, depth_out, h_out, w_out) = self.input_shape, self.output_shape
        depth_in, kept_out = self.planes()
        b_in = b // self.spatial if self.crops_shared else b
        if self.name == "last":
            kept_out = depth_out // (1 if self.mode == "plain" else self.spatial)
        return b_in * c_in * depth_in * h * w, b * c_out * kept_out * h_out * w_out

    def saved_bytes(self, dtype_bytes):
        return sum(self.kept_elements()) * dtype_bytes


@functools.lru_cache(maxsize=None)
def plan_layers(crop, spatial, batch, channels=tuple(DEFAULT_CHANNELS)):
    """[ShardLayer] of the U-Net in forward order on a (batch, 4, crop, crop, crop) input, each with
    utils/spatial.py's own plan for an S-way group (S = 1: the plain, unsharded model)."""
    with torch.device("meta"):
        model = UNet(list(channels))
    if spatial > 1:
        shard_model(model, SpatialGroup(size=spatial, ranks=list(range(spatial))))
        context = model.conv_layers()[0][1].context  # shard_model's shape-only pass, without a process group
        context.crop_depth, context.probing = crop, True
    shapes = {}
    for name, layer in model.conv_layers():
        layer.register_forward_hook(lambda m, args, out, name=name: shapes.__setitem__(
            name, (tuple(args[0].shape), tuple(out.shape))))
    with torch.no_grad():
        model(torch.empty(batch, 4, crop, crop, crop, device="meta"))
    layers = []
    for name, layer in model.conv_layers():
        x, y = shapes[name]
        weight = tuple(layer.weight.shape)
        if spatial == 1:
            transposed = isinstance(layer, torch.nn.ConvTranspose3d)
            layers.append(ShardLayer(name, transposed, x, y, weight, "plain", (0, 0), 1))
            continue
        plan = layer.plans[crop]
        mode = plan.mode if plan.mode == "halo" else ("gather" if x[2] % spatial == 0 else "whole")
        layers.append(ShardLayer(name, layer.transposed, x, y, weight, mode, layer.halo(0), spatial, plan.reason,
                                 mode != "halo" and shares_crops(batch, spatial)))
    return tuple(layers)


def measured_layer_ms(channels=DEFAULT_CHANNELS):
    """{layer: (native kernel ms of forward + backward, that layer's FLOPs per pass)} at MEASURED's setup."""
    measured = measured_kernel_ms(MEASURED["path"], list(channels), MEASURED["batch"], MEASURED["crop"],
                                  MEASURED["dtype"])
    if not measured:
        raise SystemExit(f"{MEASURED['path']} has no native kernel times for {MEASURED}; run the GPU suite's part h")
    reference = plan_layers(MEASURED["crop"], 1, MEASURED["batch"], tuple(channels))
    return {layer.name: (measured[layer.name]["native"], layer.shard_flops()) for layer in reference}


def measured_peak_gb():
    """The H100 ladder's peak memory allocated at MEASURED's setup (channels-last bf16 rung), or None."""
    ladder = json.loads(Path(MEASURED["path"]).read_text()).get("ladder", [])
    return next((rung["peak_memory_gb"] for rung in ladder if rung.get("rung") == "channels_last"), None)


@dataclass
class Setup:
    """What one projection assumes: batch of crops per data rank (one spatial group), dtype, network, overlap. 32
    crops of 128³ per 4 ranks give each GPU the voxels of the tutorial's single-GPU batch, 64 crops of 64³."""
    batch: int = 32
    dtype: str = "bf16"
    network: Network = H100_NODE
    overlap: float = 0.0
    grad_bytes: int = 4  # DDP all-reduces fp32 gradients; 2 with a bf16 compression hook
    hbm_bw: float = GPUS["h100"][1] * 1e12
    recompute: bool = False  # True: transposed layers computing their halo's planes too (utils/spatial.py does not)


def layer_times(layer, setup, measured):
    """(compute s, communication s) of one layer per step on the busiest rank."""
    ms, flops = measured[layer.name]
    compute = ms * 1e-3 * layer.shard_flops(setup.recompute) / flops
    dtype_bytes, network, spatial = DTYPE_BYTES[setup.dtype], setup.network, layer.spatial
    if layer.mode == "halo":
        p2p_bw = network.intra_bw if spatial <= network.gpus_per_node else network.node_bw / network.gpus_per_node
        comm = 2 * network.alpha + layer.halo_bytes(dtype_bytes) / p2p_bw  # one exchange forward, one backward
    elif layer.gathered():  # 3 (S - 1) ring steps per gathered tensor, as ring_allreduce_time counts them
        comm = (3 * len(layer.gathered()) * (spatial - 1) * network.alpha
                + layer.gather_bytes(dtype_bytes) / network.bandwidth(spatial))
    else:
        comm = 0.0
    return compute, comm


def step_time(crop, spatial, setup, measured, data=1):
    """{compute, halo, ddp, step} seconds of one rank's training step (data x spatial ranks in all)."""
    costs = [layer_times(layer, setup, measured) for layer in plan_layers(crop, spatial, setup.batch)]
    return _step(costs, spatial, setup, data)


def _step(costs, spatial, setup, data):
    """The step from its layers' (compute s, communication s): plus Adam, minus the overlap, plus DDP's all-reduce."""
    adam = parameter_bytes(num_parameters(), DTYPE_BYTES[setup.dtype]) / setup.hbm_bw
    compute, exposed = adam, 0.0
    for layer_compute, comm in costs:
        compute += layer_compute
        exposed += comm - min(setup.overlap * comm, layer_compute)
    ranks = data * spatial
    t_ddp = ring_allreduce_time(setup.grad_bytes * num_parameters(), ranks, setup.network.bandwidth(ranks),
                                setup.network.alpha)
    ddp = exposed_comm_time(t_ddp, compute, setup.overlap)
    return {"compute": compute, "halo": exposed, "ddp": ddp, "step": compute + exposed + ddp}


def efficiency(crop, spatial, setup, measured, data=1, baseline_data=1):
    """Crops per second per GPU of S x D ranks against ``baseline_data`` data-parallel GPUs (default: one GPU)."""
    slab = step_time(crop, spatial, setup, measured, data)["step"]
    return step_time(crop, 1, setup, measured, baseline_data)["step"] / (spatial * slab)


# --- slabs or blocks? -------------------------------------------------------------------------------------------
# utils/spatial.py cuts the crop along depth only. Cutting it into a grid of blocks (g_d, g_h, g_w), g_d g_h g_w = S,
# sends less: a block's faces are smaller than a slab's whole planes. Modelled here with the same rules applied to
# every cut axis; not implemented in utils/spatial.py.
GRIDS = {4: ((4, 1, 1), (2, 2, 1)), 8: ((8, 1, 1), (4, 2, 1), (2, 2, 2))}


def grid_layer_times(layer, grid, setup, measured):
    """(compute s, communication s, mode, halo bytes) of one layer per step on the busiest rank of an S-way grid;
    ``layer``: its ShardLayer at S = 2 (the whole shapes and SpatialConv's halo). utils/spatial.py's rules on each
    cut axis: the input is sharded only where every cut divides its edge ("whole" otherwise); a sharded input is
    gathered where a block is thinner than the halo or, for a convolution, not a multiple of its stride. Halos go
    out one cut axis after another, each face including the halo planes of the axes before it (edges and corners
    travel with them); compute is 1/S of the whole layer's, or the whole layer's where it runs whole on all the
    crops (1/S of it where S divides the batch and the ranks share the crops)."""
    spatial, dtype_bytes, network = math.prod(grid), DTYPE_BYTES[setup.dtype], setup.network
    b, c, *edges = layer.input_shape
    lo, hi = layer.halo
    cut = [axis for axis in range(3) if grid[axis] > 1]
    if any(edges[axis] % grid[axis] for axis in cut):
        mode = "whole"
    else:
        local = [edges[axis] // grid[axis] for axis in range(3)]
        thin = any(local[axis] < max(lo, hi) or (not layer.transposed and local[axis] % 2) for axis in cut)
        mode = "gather" if thin else "halo"
    plain = replace(layer, mode="plain", spatial=1, halo=(0, 0), crops_shared=False)
    whole_compute = layer_times(plain, setup, measured)[0]
    shared = mode != "halo" and shares_crops(setup.batch, spatial)
    compute = whole_compute / spatial if mode == "halo" or shared else whole_compute
    if mode != "halo":
        sharded = replace(layer, mode=mode, spatial=spatial, crops_shared=shared)
        return (compute, layer_times(sharded, setup, measured)[1] if sharded.gathered() else 0.0, mode, 0)
    p2p_bw = network.intra_bw if spatial <= network.gpus_per_node else network.node_bw / network.gpus_per_node
    comm, sent = 0.0, 0
    for i, axis in enumerate(cut):
        face = math.prod(local[other] + (lo + hi if other in cut[:i] else 0) for other in range(3) if other != axis)
        planes = lo + hi if grid[axis] > 2 else max(lo, hi)
        sent_axis = 2 * planes * b * c * face * dtype_bytes  # forward, and the gradients back
        comm += 2 * network.alpha + sent_axis / p2p_bw
        sent += sent_axis
    return compute, comm, mode, sent


def grid_step_time(crop, grid, setup, measured, data=1):
    """step_time for the S ranks of a crop holding a grid of blocks: {compute, halo, ddp, step, halo_bytes}."""
    times = [grid_layer_times(layer, grid, setup, measured) for layer in plan_layers(crop, 2, setup.batch)]
    step = _step([(compute, comm) for compute, comm, _, _ in times], math.prod(grid), setup, data)
    return {**step, "halo_bytes": sum(sent for *_, sent in times)}


def grid_efficiency(crop, grid, setup, measured):
    """efficiency (against one GPU) of the S ranks of a crop holding a grid of blocks."""
    whole = step_time(crop, 1, setup, measured)["step"]
    return whole / (math.prod(grid) * grid_step_time(crop, grid, setup, measured)["step"])


def grid_lines(setup, measured, batches=(1, 32)):
    """Markdown: slabs against 2D and 3D grids inside one node."""
    batches = sorted({*batches, setup.batch})
    lines = [row("crop", "S", "grid (D x H x W)", "halo MB", "halo + gather ms",
                 *(f"efficiency, batch {b}" for b in batches)),
             row("---:", "---:", "---", *["---:"] * (2 + len(batches)))]
    for crop in CROPS:
        for spatial, grids in GRIDS.items():
            for grid in grids:
                t = grid_step_time(crop, grid, setup, measured)
                name = " x ".join(map(str, grid)) + (" (slabs)" if grid[1:] == (1, 1) else "")
                effs = [grid_efficiency(crop, grid, replace(setup, batch=b), measured) for b in batches]
                lines.append(row(f"{crop}³", spatial, name, f"{t['halo_bytes'] / 1e6:.1f}", f"{1e3 * t['halo']:.2f}",
                                 *(f"{100 * e:.1f}%" for e in effs)))
    return lines


@functools.lru_cache(maxsize=None)
def num_parameters(channels=tuple(DEFAULT_CHANNELS)):
    with torch.device("meta"):
        return sum(p.numel() for p in UNet(list(channels)).parameters())


def memory_bytes(crop, spatial, batch, dtype="bf16"):
    """Bytes of one rank's peak, an analytic estimate: activations saved for backward, the largest layer's again
    as gradients, the fp32 input and target with tanh's output and the loss's fp32 copy, per parameter 16 B
    (fp32 value, gradient, Adam moments), its bf16 copy and DDP's bucket (S > 1); ``largest_tensor``: elements."""
    dtype_bytes = DTYPE_BYTES[dtype]
    layers = plan_layers(crop, spatial, batch)
    saved = [layer.saved_bytes(dtype_bytes) for layer in layers]
    data = batch * crop ** 3 // spatial * (4 * 4 + 5 * 4 + 5 * dtype_bytes + 5 * 4)
    params = num_parameters() * (16 + dtype_bytes + (4 if spatial > 1 else 0))
    parts = {"activations": sum(saved), "transient": max(saved), "data": data, "parameters": params}
    largest = max(max(layer.kept_elements()) for layer in layers)
    return {**parts, "total": sum(parts.values()), "largest_tensor": largest}


def largest_crop(spatial, batch=1, limit=GPU_MEMORY, max_elements=None, step=64, max_crop=2048):
    """The largest crop (a multiple of ``step``) whose estimated step fits in ``limit`` bytes (and whose tensors
    have at most ``max_elements`` elements, when given), or 0. Memory grows with the crop: stop at the first miss."""
    largest = 0
    for crop in range(step, max_crop + 1, step):
        memory = memory_bytes(crop, spatial, batch)
        if memory["total"] > limit or (max_elements is not None and memory["largest_tensor"] > max_elements):
            break
        largest = crop
    return largest


# --- the report ------------------------------------------------------------------------------------------------
def row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def layer_table(crop, spatial, setup, measured):
    """Markdown: one rank's share of each layer per step."""
    dtype_bytes = DTYPE_BYTES[setup.dtype]
    whole = {layer.name: layer_times(layer, setup, measured)[0] for layer in plan_layers(crop, 1, setup.batch)}
    lines = [row("layer", "whole input (C, D, H, W)", "mode", "planes in (out)", "halo MB", "gather MB",
                 "compute ms", "x 1/S of unsharded", "comm ms", "saved MB"), row(*["---"] * 3 + ["---:"] * 7)]
    totals = [0.0] * 5
    for layer in plan_layers(crop, spatial, setup.batch):
        compute, comm = layer_times(layer, setup, measured)
        values = [layer.halo_bytes(dtype_bytes) / 1e6, layer.gather_bytes(dtype_bytes) / 1e6, compute * 1e3,
                  comm * 1e3, layer.saved_bytes(dtype_bytes) / 1e6]
        totals = [t + v for t, v in zip(totals, values)]
        mode = layer.mode + (f": {layer.reason}" if layer.mode != "halo" else "")
        lines.append(row(layer.name, layer.input_shape[1:], mode, "%d (%d)" % layer.planes(), f"{values[0]:.1f}",
                         f"{values[1]:.1f}", f"{values[2]:.3f}", f"{compute / (whole[layer.name] / spatial):.2f}",
                         f"{values[3]:.3f}", f"{values[4]:.0f}"))
    lines.append(row("**all**", "", "", "", *(f"**{v:.{d}f}**" for v, d in zip(totals, (1, 1, 2))), "",
                     f"**{totals[3]:.2f}**", f"**{totals[4]:.0f}**"))
    return lines


def efficiency_tables(setup, measured, batches=(1, 8, 32, 64)):
    batches = sorted({*batches, setup.batch})
    node = [row("crop", "S", "compute ms", "halo + gather ms", "DDP all-reduce ms", "step ms",
                *(f"efficiency, batch {b}" for b in batches), f"vs data parallel on S GPUs, batch {setup.batch}"),
            row(*["---:"] * (7 + len(batches)))]
    for crop in CROPS:
        for spatial in SPATIAL:
            t = step_time(crop, spatial, setup, measured)
            effs = [efficiency(crop, spatial, replace(setup, batch=b), measured) for b in batches]
            versus = efficiency(crop, spatial, setup, measured, baseline_data=spatial)
            node.append(row(f"{crop}³", spatial, *(f"{1e3 * t[k]:.2f}" for k in ("compute", "halo", "ddp", "step")),
                            *(f"{100 * e:.1f}%" for e in effs), f"{100 * versus:.1f}%"))
    gpus = (16, 128, 512)
    across = [row("crop", "S", *(f"{n} GPUs ({-(-n // setup.network.gpus_per_node)} nodes)" for n in gpus)),
              row(*["---:"] * (2 + len(gpus)))]
    for crop in CROPS[1:]:
        for s in SPATIAL:
            across.append(row(f"{crop}³", s, *(f"{100 * efficiency(crop, s, setup, measured, n // s):.1f}% "
                                               f"({100 * efficiency(crop, s, setup, measured, n // s, n):.1f}%)"
                                               for n in gpus)))
    return node, across


def losses(crop, spatial, setup, measured):
    """{part: seconds} of one rank's step: the ideal 1/S of one GPU's step, and what comes on top of it."""
    whole = {layer.name: layer_times(layer, setup, measured)[0] for layer in plan_layers(crop, 1, setup.batch)}
    adam = parameter_bytes(num_parameters(), DTYPE_BYTES[setup.dtype]) / setup.hbm_bw
    t = step_time(crop, spatial, setup, measured)
    parts = {"ideal: 1/S of one GPU's step": step_time(crop, 1, setup, measured)["step"] / spatial,
             "halo layers beyond 1/S of their work": 0.0, "deep layers run whole": 0.0,
             "Adam update of all parameters on every rank": adam * (1 - 1 / spatial),
             "halo exchanges and gathers (exposed)": t["halo"], "DDP gradient all-reduce (exposed)": t["ddp"]}
    for layer in plan_layers(crop, spatial, setup.batch):
        key = "halo layers beyond 1/S of their work" if layer.mode == "halo" else "deep layers run whole"
        parts[key] += layer_times(layer, setup, measured)[0] - whole[layer.name] / spatial
    return parts


def goal_lines(setup, measured):
    """Markdown: where the goal case's step goes, and what each change to the setup would give."""
    crop, spatial = GOAL["crop"], GOAL["spatial"]
    parts = losses(crop, spatial, setup, measured)
    total = sum(parts.values())
    lines = [row("one rank's step", "ms", "share"), row("---", "---:", "---:")]
    lines += [row(k, f"{1e3 * v:.2f}", f"{100 * v / total:.1f}%") for k, v in parts.items()]
    hidden = replace(setup, grad_bytes=2, overlap=1.0)
    variants = [("instead: transposed layers also computing their halo's planes (a plain padding-free layer)",
                 replace(setup, recompute=True)), ("as modelled", setup),
                ("+ bf16 gradients, all communication hidden behind compute (overlap 1)", hidden),
                ("+ batch 64 per data rank", replace(hidden, batch=64))]
    lines += ["", row("what if (below 'as modelled', each row adds to the one above)", "efficiency"),
              row("---", "---:")]
    lines += [row(label, f"{100 * efficiency(crop, spatial, v, measured):.1f}%") for label, v in variants]
    return lines


def report(setup, measured, command="python benchmarks/spatial_model.py"):
    n = setup.network
    node, across = efficiency_tables(setup, measured)
    crop, spatial, target = GOAL["crop"], GOAL["spatial"], GOAL["efficiency"]
    eff = efficiency(crop, spatial, setup, measured)
    check = memory_bytes(MEASURED["crop"], 1, MEASURED["batch"], setup.dtype)["total"]
    memory = [row("crop", *(f"S = {s}" for s in SPATIAL)), row(*["---:"] * (1 + len(SPATIAL)))]
    for c in (128, 256, 512):
        memory.append(row(f"{c}³", *(f"{memory_bytes(c, s, 1, setup.dtype)['total'] / 1e9:.1f}" for s in SPATIAL)))
    memory.append(row("largest crop in 80 GB", *(f"{largest_crop(s)}³" for s in SPATIAL)))
    memory.append(row("... with every tensor under 2³¹ elements", *(f"{largest_crop(s, max_elements=2 ** 31 - 1)}³"
                                                                   for s in SPATIAL)))
    return "\n".join([
        "# Spatial parallelism on paper: step time, efficiency and memory of S ranks sharing each crop", "",
        f"Generated by `{command}`; the model is in its docstring. **Projected, not "
        "measured**: per-shard compute is estimated from the H100's measured per-layer kernel times (native form, "
        "batch 64, 64³ crops, bf16, channels-last, `h100.json` part h), scaled by the shard's FLOPs; not measured "
        "at these shapes. Which layers exchange halos and which gather comes from utils/spatial.py's own plan.", "",
        f"Setup: batch {setup.batch} crops per data rank, {setup.dtype}, {n.gpus_per_node} GPUs per node, "
        f"NVLink {n.intra_bw / 1e9:g} GB/s, {n.node_bw / 1e9:g} GB/s per node between nodes, alpha "
        f"{n.alpha * 1e6:g} us, overlap {setup.overlap:g}, DDP gradients {8 * setup.grad_bytes}-bit, Adam update "
        f"{1e3 * parameter_bytes(num_parameters(), DTYPE_BYTES[setup.dtype]) / setup.hbm_bw:.2f} ms on every rank.",
        "", f"## Goal: efficiency >= {target:.0%} at S = {spatial} over NVLink for {crop}³ crops: "
        f"{'met' if eff >= target else 'not met'} ({100 * eff:.1f}%)", "", *goal_lines(setup, measured), "",
        f"## One rank's layers at {crop}³, S = {spatial}, batch {setup.batch}", "",
        "Halo and gather MB: sent per step by the busiest rank, forward + backward. x 1/S: the shard's compute over "
        "1/S of the unsharded layer's (1: no waste; layers that run whole cost S, or 1 when the ranks share the "
        "batch's crops).", "", *layer_table(crop, spatial, setup, measured), "",
        "## Inside one node (NVLink): efficiency = t(1 GPU, whole crop) / (S x t(slab))"
        + (f"; S above {n.gpus_per_node} spans nodes, its halos at the node's bandwidth"
           if max(SPATIAL) > n.gpus_per_node else ""), "",
        f"Times for batch {setup.batch}.", "", *node, "",
        "## S x D across nodes: efficiency against one GPU (in brackets: against data parallelism on the same "
        "GPUs)", "", *across, "",
        "## Slabs or blocks? (inside one node)", "",
        "utils/spatial.py cuts each crop into S slabs along depth. A grid of blocks sends less (halo MB: the busiest "
        "rank per step, forward + backward), in more messages, and keeps more of the deep layers sharded; modelled "
        "with the same rules on every cut axis (`grid_layer_times`), **not implemented**. The slab rows are the "
        "tables' above.", "", *grid_lines(setup, measured), "",
        "## Memory of one rank's training step (GB, batch 1): analytic estimate, not measured", "",
        f"Check: at {MEASURED['crop']}³, batch {MEASURED['batch']}, S = 1 the estimate is {check / 1e9:.2f} GB; "
        f"the H100 ladder's channels-last bf16 rung measured a peak of {measured_peak_gb()} GB allocated.", "",
        *memory, "", "2³¹ elements: the limit of 32-bit indexing, which some of PyTorch's convolution paths need (a "
        "batch of one cannot be split further); not checked on a GPU here.", ""])


def plot(setup, measured, path):
    """PNG: efficiency against S inside a node, one line per crop, at the setup's batch and at batch 64."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(6, 4))
    for crop, colour in zip(CROPS, ("tab:blue", "tab:orange", "tab:green")):
        for batch, style in ((setup.batch, "-"), (64, "--")):
            effs = [100 * efficiency(crop, s, replace(setup, batch=batch), measured) for s in SPATIAL]
            axes.plot(SPATIAL, effs, style, color=colour, marker="o", label=f"{crop}³, batch {batch}")
    axes.axhline(100 * GOAL["efficiency"], color="grey", linestyle=":", label="goal (128³, S = 4)")
    axes.set(xlabel="S (ranks sharing a crop, NVLink)", ylabel="projected efficiency (%)", xticks=SPATIAL,
             ylim=(0, 105), title="Spatial parallelism, projected from H100 kernel times")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--batch", type=positive_int, default=Setup.batch,
                        help="crops per data rank (one spatial group)")
    parser.add_argument("--dtype", choices=DTYPE_BYTES, default=Setup.dtype, help="activations and halos")
    parser.add_argument("--intra_bw", type=positive_float, default=H100_NODE.intra_bw / 1e9,
                        help="GB/s, NVLink per GPU")
    parser.add_argument("--node_bw", type=positive_float, default=H100_NODE.node_bw / 1e9, help="GB/s per node")
    parser.add_argument("--alpha_us", type=at_least(0.0, float), default=H100_NODE.alpha * 1e6,
                        help="latency per message, us")
    parser.add_argument("--gpus_per_node", type=positive_int, default=H100_NODE.gpus_per_node)
    parser.add_argument("--overlap", type=fraction, default=0.0, help="share of communication hidden by compute")
    parser.add_argument("--bf16_gradients", action="store_true", help="DDP all-reduces bf16 gradients")
    parser.add_argument("--out", type=Path, help="markdown file to write (e.g. benchmarks/results/spatial_model.md)")
    parser.add_argument("--plot", type=Path, help="PNG of efficiency against S")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out, "--plot": args.plot})
    if args.plot:
        from science.plots import figure_path  # a format matplotlib cannot write: one line before the work
        args.plot = figure_path(args.plot, "spatial_model.png", "--plot")
    network = Network(args.intra_bw * 1e9, args.node_bw * 1e9, args.alpha_us * 1e-6, args.gpus_per_node)
    setup = Setup(args.batch, args.dtype, network, args.overlap, 2 if args.bf16_gradients else 4)
    measured = measured_layer_ms()
    text = report(setup, measured, command_line(__file__, argv))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.plot:
        plot(setup, measured, args.plot)


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
