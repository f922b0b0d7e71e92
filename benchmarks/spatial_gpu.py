"""Spatial parallelism on a GPU: the memory wall, one rank's share of a crop, and two ranks under CUDA.

    python benchmarks/spatial_gpu.py memory --out spatial_memory.json   # one GPU: crops, then one rank's slabs
    python benchmarks/spatial_gpu.py check --out spatial_check.json     # two gloo ranks sharing the one GPU
    python benchmarks/spatial_gpu.py memory --tiny                       # CPU smoke test of the same code

``memory`` trains the reference U-Net (116,977,029 parameters) for a few steps at batch 1 (``--batch``), bf16
autocast, fused Adam (on a GPU), the contiguous layout the sharded layers use, and reports each case's peak memory
and median step time:
- S = 1: whole crops of growing edge (64, 128, 192, ...) until one does not fit: the memory wall;
- one rank's slab of a crop shared by S ranks (``--slabs 128:2,...``: crop edge and S). It runs in this one
  process: utils/spatial.py's collectives are swapped for ``Loopback``, which gives every received halo and
  gathered slab its real shape (zeros, copies) and moves no bytes. The figures are then one rank's own compute and
  memory, with its halos and the layers it runs whole; the communication is benchmarks/spatial_model.py's to
  project. The rank measured holds the middle slab (index S // 2), with halos on both faces.
Compute-only efficiency = t(whole crop) / (S x t(slab)). cuDNN picks its algorithms by heuristics (benchmark off):
autotuning every new shape would take most of a device call, and it is the same for every case.

``check`` runs two ranks on the one GPU through gloo, which takes CUDA tensors (NCCL refuses two ranks on one
device), and compares, each within its tolerance:
- ``spatial``: the quickstart model on 16³ crops at S = 2 (1 data x 2 spatial ranks, DDP over the mesh, as train.py
  builds it; its two deepest layers run whole, sharing the crops) against the same model unsharded, fp32 with TF32
  off: the first step's gradients and the per-step losses (relative 1e-5 of each tensor's largest value), the
  final weights (1e-4);
- ``spatial_compile``: the same with the sharded model compiled (torch.compile; the halo exchanges are custom
  operators in its graph) against the eager unsharded one, within the same tolerances;
- ``ddp_compile``: the ``bs64_opt`` step (bf16, fused Adam, channels-last, torch.compile, the tuned conv forms)
  as 2 data-parallel ranks against one eager process on the same global batch: per-step losses (bf16 rounding,
  relative 2e-2) and the two ranks' weights identical.
It checks correctness under CUDA, not speed.
"""
import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import positive_int  # noqa: E402
import utils.spatial as spatial_module  # noqa: E402
from networks.UNet import build_model, loss_func  # noqa: E402
from utils.config import load_config  # noqa: E402
from utils.spatial import SpatialConv, SpatialGroup, shard_model, spatial_loss  # noqa: E402

WHOLE_CROPS = (64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768)
SLABS = "128:2,128:4,128:8,256:2,256:4,256:8,384:8,512:8"
TINY = dict(channels=[4, 8], crops=(8, 16), slabs="16:2,16:4")
CHECK_PARTS = ("spatial", "spatial_compile", "ddp_compile")


class Loopback:
    """The torch.distributed calls of utils/spatial.py for one rank alone: receives stay zeros, a gather repeats
    this rank's slab, reductions leave their tensor as it is. Shapes, copies and memory are a real rank's."""
    isend = irecv = None

    @staticmethod
    def get_backend(group=None):
        return "loopback"

    @staticmethod
    def P2POp(*args, **kwargs):
        return None

    @staticmethod
    def batch_isend_irecv(ops):
        return []

    @staticmethod
    def all_gather(pieces, tensor, group=None):
        for piece in pieces:
            piece.copy_(tensor)

    @staticmethod
    def all_reduce(tensor, group=None):
        return None


@contextmanager
def loopback():
    real = spatial_module.dist
    spatial_module.dist = Loopback
    try:
        yield
    finally:
        spatial_module.dist = real


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_case(channels, crop, size, device, steps, batch=1):
    """{peak memory, step ms, ...} of one rank training its (batch, C, crop / size, crop, crop) slabs."""
    params = load_config("base", overrides={"model_channels": channels, "data_size": crop,
                                            "box_size": [max(1024, crop), max(512, crop)]})
    torch.manual_seed(0)
    model = build_model(params).to(device)
    spatial = SpatialGroup(size, size // 2, list(range(size))) if size > 1 else None
    if spatial:
        shard_model(model, spatial)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    inp = torch.randn(batch, params.N_in_channels, crop // size, crop, crop, device=device)
    tar = torch.randn(batch, params.N_out_channels, crop // size, crop, crop, device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            prediction = model(inp)
        loss = spatial_loss(prediction, tar, spatial) if spatial else loss_func(prediction, tar)
        loss.backward()
        optimizer.step()

    for _ in range(2):  # the plan's meta pass, cuDNN's first calls, Adam's state
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    row = {"crop": crop, "spatial_parallel": size, "batch": batch, "slab": [crop // size, crop, crop], "status": "ok",
           "step_ms": round(statistics.median(times), 2),
           "parameters": sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    if spatial:
        row["gathered_layers"] = [module.name for module in model.modules() if isinstance(module, SpatialConv)
                                  and module.plans[crop].mode == "gather"]
    return row


def run_case(channels, crop, size, device, steps, batch=1):
    """step_case, or {"status": "out of memory"} or {"status": "error: ..."} (a kernel's limit at a large crop, say:
    the slabs after it are still measured); frees the device either way."""
    try:
        with loopback():
            return step_case(channels, crop, size, device, steps, batch)
    except torch.OutOfMemoryError as error:
        return {"crop": crop, "spatial_parallel": size, "status": "out of memory", "error": str(error).split("\n")[0]}
    except RuntimeError as error:
        first = str(error).strip().split("\n")[0]
        return {"crop": crop, "spatial_parallel": size, "status": f"error: {type(error).__name__}: {first}"}
    finally:
        gc.collect()
        if device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # a broken CUDA context: the row has the error, the sweep goes on
                torch.cuda.empty_cache()


def measure_memory(channels, crops, slabs, device, steps, log=print, finished=lambda results: None, batch=1):
    """The whole crops, then the slabs, ``batch`` crops per step; ``finished(results)`` after each case, so a run
    stopped at a time limit keeps the cases it finished."""
    torch.backends.cudnn.benchmark = False
    results = {"setup": {"model_channels": channels, "batch": batch, "precision": "bf16 autocast, fused Adam",
                         "layout": "contiguous", "cudnn_benchmark": False, "steps_timed": steps,
                         "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                         "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
                         if device.type == "cuda" else None},
               "whole": [], "slabs": []}
    for crop in crops:  # S = 1 up the crop sizes, until one does not fit
        row = run_case(channels, crop, 1, device, steps, batch)
        results["whole"].append(row)
        fits = [row["crop"] for row in results["whole"] if row["status"] == "ok"]
        results["largest_whole_crop"] = max(fits) if fits else None
        # else the largest crop that fits is larger still (or the sweep stopped at an error, not at the wall)
        results["memory_wall_found"] = row["status"] == "out of memory"
        log(describe(row))
        finished(results)
        if row["status"] != "ok":
            break
    whole_ms = {row["crop"]: row["step_ms"] for row in results["whole"] if row["status"] == "ok"}
    for crop, size in slabs:
        row = run_case(channels, crop, size, device, steps, batch)
        if row["status"] == "ok" and crop in whole_ms:
            row["compute_efficiency"] = round(whole_ms[crop] / (size * row["step_ms"]), 3)
        results["slabs"].append(row)
        log(describe(row))
        finished(results)
    return results


def describe(row):
    text = f"crop {row['crop']}^3, S = {row['spatial_parallel']}: "
    if row["status"] != "ok":
        return text + row["status"]
    text += f"{row['step_ms']:.1f} ms per step"
    if "peak_allocated_gib" in row:
        text += f", peak {row['peak_allocated_gib']:.2f} GiB allocated ({row['peak_reserved_gib']:.2f} reserved)"
    if "compute_efficiency" in row:
        text += f", compute-only efficiency {row['compute_efficiency']:.2f}"
    if row.get("gathered_layers"):
        text += f", run whole: {', '.join(row['gathered_layers'])}"
    return text


# --- two ranks on one GPU ---------------------------------------------------------------------------------------
def relative_difference(actual, expected):
    return (actual - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)


def train_steps(state, batches):
    import train
    return [train.eager_step(state, inp, tar).item() for inp, tar in batches]


def flat_weights(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def fixed_batches(count, batch, crop, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, crop, crop, crop, generator=generator).to(device),
             torch.randn(batch, 5, crop, crop, crop, generator=generator).to(device) * 0.5) for _ in range(count)]


def check_spatial(info, device, steps=4, compile=False):
    """S = 2 on the mesh (DDP over both ranks) against the unsharded model, fp32 with TF32 off: the first step's
    gradients and every step's loss (relative 1e-5), and the final weights (1e-4: Adam divides each gradient by
    its own running scale, so a weight whose gradient nearly vanishes moves by rounding's share). ``compile``:
    the sharded model compiled (its halo exchanges custom operators in the graph), the unsharded one eager."""
    import train
    from utils.distributed import DistInfo
    from utils.spatial import split_depth
    # 16^3 crops: down3's 1-plane slab and up0's 1-plane input run whole, each rank on 1 of the 2 crops
    overrides = {"device": device.type, "data_size": 16, "global_batch_size": 2, "amp_mode": "none",
                 "enable_tf32": False}
    state = train.build_training(load_config("quickstart", overrides={**overrides, "spatial_parallel": 2,
                                                                      "enable_jit": compile}), info)
    single = train.build_training(load_config("quickstart", overrides=overrides), DistInfo(device=device))
    batches = fixed_batches(steps, 2, 16, device)
    sharded, whole, gradient_difference = [], [], None
    for inp, tar in batches:
        sharded.append(train.eager_step(state, split_depth(inp, state.spatial), split_depth(tar, state.spatial)).item())
        whole.append(train.eager_step(single, inp, tar).item())
        if gradient_difference is None:  # the grads of the step just taken (zero_grad comes with the next)
            gradient_difference = max(relative_difference(a.grad, b.grad)
                                      for a, b in zip(state.model.parameters(), single.model.parameters()))
    loss_difference = max(abs(a - b) / abs(b) for a, b in zip(sharded, whole))
    weight_difference = max(relative_difference(a.detach(), b.detach())
                            for a, b in zip(state.model.parameters(), single.model.parameters()))
    return {"losses_sharded": sharded, "losses_whole": whole, "loss_relative_difference": loss_difference,
            "gradient_relative_difference": gradient_difference, "weight_relative_difference": weight_difference,
            "notes": state.notes,
            "ok": loss_difference <= 1e-5 and gradient_difference <= 1e-5 and weight_difference <= 1e-4}


def check_ddp_compile(info, device, steps=3, batch=4):
    """bs64_opt's compiled step as 2 DDP ranks against one eager process on the same global batch."""
    import train
    from utils.distributed import DistInfo
    overrides = {"device": device.type, "global_batch_size": 2 * batch}
    if device.type != "cuda":  # the CPU smoke test: a small model, no compile
        overrides.update(model_channels=[8, 16], data_size=16, enable_jit=False, channels_last=False,
                         conv_forms="native", enable_fused=False)
    params = load_config("bs64_opt", overrides=overrides)
    batches = fixed_batches(steps, 2 * batch, params.data_size, device, seed=1)
    memory_format = torch.channels_last_3d if params.channels_last else torch.contiguous_format
    batches = [(inp.contiguous(memory_format=memory_format), tar.contiguous(memory_format=memory_format))
               for inp, tar in batches]
    start = time.perf_counter()
    state = train.build_training(params, info)
    mine = [(inp[info.rank * batch:(info.rank + 1) * batch], tar[info.rank * batch:(info.rank + 1) * batch])
            for inp, tar in batches]
    local = torch.tensor(train_steps(state, mine), dtype=torch.float64)
    dist.all_reduce(local)
    ddp_losses = (local / info.world_size).tolist()
    seconds = time.perf_counter() - start
    weights = flat_weights(state.model)
    other = weights.clone()
    dist.broadcast(other, src=0)
    identical = torch.tensor([float(torch.equal(weights, other))])
    dist.all_reduce(identical, op=dist.ReduceOp.MIN)  # every rank reports the same verdict
    ranks_identical = bool(identical.item())
    eager = train.build_training(load_config("bs64_opt", overrides={**overrides, "enable_jit": False}),
                                 DistInfo(device=device))
    eager_losses = train_steps(eager, batches)
    loss_difference = max(abs(a - b) / abs(b) for a, b in zip(ddp_losses, eager_losses))
    return {"settings": {key: getattr(params, key) for key in ("amp_mode", "enable_fused", "enable_jit",
                                                                 "channels_last", "conv_forms", "bucket_cap_mb")},
            "notes": state.notes, "losses_ddp_compiled": ddp_losses, "losses_one_process_eager": eager_losses,
            "loss_relative_difference": loss_difference, "ranks_weights_identical": ranks_identical,
            "build_and_train_seconds": round(seconds, 1), "ok": ranks_identical and loss_difference <= 2e-2}


def check_worker(rank, port, out_dir, parts):
    from utils.distributed import DistInfo
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    # longer than a rank's compile, which the other waits out in a collective; short enough that one rank's failure
    # does not hold the GPU machine's scarce minutes for long (the other then waits in vain)
    dist.init_process_group("gloo", timeout=timedelta(seconds=240))
    info = DistInfo(rank=rank, local_rank=0, world_size=2, device=device)  # both ranks on the one device
    results = {}
    for part in parts:
        check = {"spatial": check_spatial, "spatial_compile": functools.partial(check_spatial, compile=True),
                 "ddp_compile": check_ddp_compile}[part]  # CHECK_PARTS
        try:
            results[part] = check(info, device)
        except Exception as error:  # recorded: the other part still runs
            results[part] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


def run_check(parts, out_dir):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(check_worker, args=(port, str(out_dir), parts), nprocs=2)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(2)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("mode", choices=("memory", "check"))
    parser.add_argument("--tiny", action="store_true", help="memory: a small model and crops (CPU smoke test)")
    parser.add_argument("--crops", help="memory: comma-separated whole-crop edges, tried in order until one does "
                                        f"not fit (default {','.join(map(str, WHOLE_CROPS))})")
    parser.add_argument("--slabs", help=f"memory: comma-separated crop:S (default {SLABS})")
    parser.add_argument("--steps", type=positive_int, default=5, help="memory: timed steps per case (median)")
    parser.add_argument("--batch", type=positive_int, default=1,
                        help="memory: crops per step (the layers a slab runs whole "
                             "share them between the S ranks when S divides it)")
    parser.add_argument("--parts", default=",".join(CHECK_PARTS), help=f"check: {', '.join(CHECK_PARTS)}")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    if args.batch < 1:
        parser.error(f"--batch is a number of crops, at least 1; got {args.batch}")
    parts = args.parts.split(",")
    unknown = [part for part in parts if part not in CHECK_PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(CHECK_PARTS)}")
    crops = slabs = None
    try:  # before any work: a typo must not cost a GPU session's sweep
        crops = [positive_int(c) for c in args.crops.split(",")] if args.crops else None
        slabs = [tuple(map(positive_int, item.split(":"))) for item in args.slabs.split(",")] if args.slabs else None
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(f"--crops takes edges such as 128,256 and --slabs crop:S pairs such as 128:2,256:8 ({error})")
    if slabs and any(len(pair) != 2 for pair in slabs):
        parser.error(f"--slabs takes crop:S pairs such as 128:2,256:8; got {args.slabs}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode == "memory":
        channels = TINY["channels"] if args.tiny else None
        crops = crops or (TINY["crops"] if args.tiny else WHOLE_CROPS)
        slabs = slabs or [tuple(int(v) for v in item.split(":")) for item in
                          (TINY["slabs"] if args.tiny else SLABS).split(",")]
        channels = channels or load_config("base").model_channels
        def save(results):
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))
        results = measure_memory(channels, crops, slabs, device, args.steps, finished=save, batch=args.batch)
        ok = results["largest_whole_crop"] is not None
    else:
        import tempfile
        with tempfile.TemporaryDirectory() as out_dir:
            per_rank = run_check(args.parts.split(","), out_dir)
        results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "backend": "gloo", "ranks": per_rank}
        ok = all(part.get("ok") for rank in per_rank for part in rank.values())
        for part in per_rank[0]:
            rows = [rank[part] for rank in per_rank]
            print(f"{part}: " + ("PASS" if all(row.get("ok") for row in rows) else "FAIL") + "  " + "; ".join(
                f"rank {i}: " + (row.get("error") or f"loss rel diff {row['loss_relative_difference']:.2e}")
                for i, row in enumerate(rows)))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
