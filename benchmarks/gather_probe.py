"""Faster crops for the GPU-resident loader? Its eager gather against one-pass candidates, checked and timed.

    python benchmarks/gather_probe.py                     # GPU: the reference's 1024^3 box in fp16, batch 64
    python benchmarks/gather_probe.py --device cpu --box 32 --batch 4 --crop 8 --repeats 1   # CPU: checks only

On the H100 the GPU-resident loader costs 1.3-1.65 ms per training step (benchmarks/results/h100.md): 6% of the
*_opt configs' step, and the gap between FULL and SYNTHETIC in benchmark mode. Its eager batch
(utils/data/gpu.make_crops) makes several passes over the batch, where about 0.9 GB must move. Each candidate
makes a whole batch (both volumes: the 4 input and 5 target channels) from the crop corners and symmetry elements:

- ``current``: ``make_crops`` in eager PyTorch (``gpu_gather: eager``), per volume: the flat positions
  (B, S^3), an index_select of them (C, B*S^3), an index_select of the rows that rotate the vector channels,
  then sign, cast to float32 and layout in one multiply;
- ``two_index``: the positions, then one advanced-indexing gather with broadcast (B, C, 1) channel and
  (B, 1, S^3) position indices, then the same multiply;
- ``channels_last_order``: the same gather in (B, S, S, S, C) order, which is the memory of a channels-last
  batch, then the multiply with contiguous writes;
- ``compiled``: ``make_crops`` through ``torch.compile`` (``gpu_gather: compiled``), where Inductor can compute
  the positions and do the rest in one kernel (on the CPU it makes one kernel of all but the symmetry tables);
- ``triton`` (CUDA only): utils/data/triton_gather.py (``gpu_gather: triton``), tiles read along the volume's
  rows and transposed in registers, where the others read a rotated crop one scattered 2-byte value per 32-byte
  memory sector.

On CUDA, advanced indexing with index tensors of different (broadcast) strides first makes every index
contiguous at the broadcast size (PyTorch's AdvancedIndex): ``two_index`` and ``channels_last_order`` write
and read two int64 tensors of B*C*S^3 elements (about 2.4 GB per batch here) besides the gather. They are
timed as they are, since that is what the one-pass form costs in eager PyTorch.

Every round draws fresh random crops and symmetry elements, and each candidate's batches must equal the
current ones bit for bit, strides included. Then each is timed (median of ``--repeats`` rounds) in the batch
layout of ``--memory_format`` (channels_last: the *_opt configs'). The volumes are random values (the gather's
time does not depend on them). The last line is PASS (every candidate equal) or FAIL, with the fastest; if
``compiled`` is the fastest by a margin, ``gpu_gather: compiled`` is the loader setting to measure in benchmark
mode (the suite's part c does). On the H100 it was: current 1.866 ms, two_index 3.249, channels_last_order
3.293, compiled 1.073 ms per batch; at the *_opt step benchmark mode's FULL/SYNTHETIC went from 0.940 to 0.964
with it, which is why the *_opt configs set it (benchmarks/results/h100.md).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import positive_int  # noqa: E402
from utils import symmetry  # noqa: E402
from utils.data.gpu import STORAGE_DTYPES, make_crops  # noqa: E402
from utils.data.symmetry_torch import crop_index, element_table  # noqa: E402
from utils import first_line  # noqa: E402

CHANNELS = (4, 5)  # N-body input, hydro target


def two_index(volume, index, source, sign, memory_format):
    num_channels, batch, s = volume.shape[0], index.shape[0], index.shape[1]
    moved = volume.view(num_channels, -1)[source[:, :, None], index.view(batch, 1, -1)]  # (B, C, S^3)
    out = torch.empty((batch, num_channels, s, s, s), dtype=torch.float32, device=volume.device,
                      memory_format=memory_format)
    torch.mul(moved.view(out.shape), sign[..., None, None, None], out=out)
    return out


def channels_last_order(volume, index, source, sign, memory_format):
    if memory_format != torch.channels_last_3d:
        return two_index(volume, index, source, sign, memory_format)
    num_channels, batch, s = volume.shape[0], index.shape[0], index.shape[1]
    moved = volume.view(num_channels, -1)[source[:, None, None, None, :], index[..., None]]  # (B, S, S, S, C)
    out = torch.empty((batch, s, s, s, num_channels), dtype=torch.float32, device=volume.device)
    torch.mul(moved, sign[:, None, None, None, :], out=out)
    return out.permute(0, 4, 1, 2, 3)  # (B, C, S, S, S), channels-last strides


def per_volume(gather):
    """A whole-batch candidate (make_crops' arguments) from a gather of one volume at given flat positions.

    Advanced indexing converts an int32 index to int64 at its broadcast size, (B, C, S^3) per volume: these
    candidates get int64 positions from the start, once per batch."""
    def make(inp, tar, corners, elements, inp_table, tar_table, crop, memory_format):
        index = crop_index(corners, inp_table.perm[elements], inp_table.flips[elements], inp.shape[1], crop,
                           torch.int64)
        return tuple(gather(volume, index, table.source[elements], table.sign[elements], memory_format)
                     for volume, table in ((inp, inp_table), (tar, tar_table)))
    return make


CANDIDATES = {"current": make_crops, "two_index": per_volume(two_index),
              "channels_last_order": per_volume(channels_last_order),
              "compiled": torch.compile(make_crops, dynamic=False)}  # compiles at its first call, per shape


def random_crops(batch, n, s, device, generator):
    """(corners (B, 3), elements (B,)) of random crops and symmetry elements."""
    corners = torch.randint(0, n - s + 1, (batch, 3), generator=generator).to(device)
    elements = torch.randint(0, symmetry.NUM_ELEMENTS, (batch,), generator=generator).to(device)
    return corners, elements


def timed(function, device):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(10_000_000)  # about 5 ms of queued work: the host's launches are not timed
        start.record()
        function()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    function()
    return 1e3 * (time.perf_counter() - begin)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--box", type=positive_int, default=1024, help="volume edge N (default 1024, the reference's)")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--crop", type=positive_int, default=64)
    parser.add_argument("--dtype", default="fp16", choices=sorted(STORAGE_DTYPES), help="storage dtype (default fp16)")
    parser.add_argument("--memory_format", default="channels_last", choices=("channels_last", "contiguous"))
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; pass --device cpu for the equality checks alone")
    if args.crop > args.box or min(args.box, args.crop, args.batch, args.repeats) < 1:
        parser.error("need 1 <= --crop <= --box, and --batch, --repeats >= 1")
    memory_format = torch.channels_last_3d if args.memory_format == "channels_last" else torch.contiguous_format
    generator = torch.Generator().manual_seed(0)
    dtype = STORAGE_DTYPES[args.dtype]
    volumes = [torch.empty((c, args.box, args.box, args.box), device=device, dtype=dtype).uniform_(-1, 1)
               for c in CHANNELS]  # filled where they live: 1024^3 in seconds
    tables = [element_table(c).to(device) for c in CHANNELS]

    def batch_of(candidate, corners, chosen):
        return candidate(*volumes, corners, chosen, *tables, args.crop, memory_format)

    candidates = dict(CANDIDATES)
    if device.type == "cuda":  # the tiled Triton kernel (gpu_gather: triton) compiles for CUDA only
        from utils.data.triton_gather import make_crops_triton
        candidates["triton"] = make_crops_triton
    equal, times, errors = {name: True for name in candidates}, {name: [] for name in candidates}, {}
    for round_number in range(args.repeats + 1):  # round 0 warms up (allocations, kernels)
        corners, chosen = random_crops(args.batch, args.box, args.crop, device, generator)
        reference = batch_of(make_crops, corners, chosen)
        for name, candidate in candidates.items():
            if name in errors:
                continue
            # A candidate this torch cannot run (mixed index dtypes on this device; Triton's compile errors, which
            # are no RuntimeError) is reported, not fatal
            try:
                made = batch_of(candidate, corners, chosen)
            except Exception as err:
                errors[name], equal[name] = first_line(err), False
                continue
            equal[name] &= all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(made, reference))
            del made
            milliseconds = timed(lambda: batch_of(candidate, corners, chosen), device)
            if round_number:
                times[name].append(milliseconds)
    medians = {name: statistics.median(t) for name, t in times.items() if t}
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "box": args.box, "batch": args.batch, "crop": args.crop,
              "dtype": args.dtype, "memory_format": args.memory_format, "repeats": args.repeats,
              "ms_per_batch": {k: round(v, 3) for k, v in medians.items()}, "equal": equal, "errors": errors}
    for name, ms in medians.items():
        print(f"{name:20s} {ms:8.3f} ms per batch  {medians['current'] / ms:5.2f}x  equal: {equal[name]}")
    for name, error in errors.items():
        print(f"{name:20s} failed: {error}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    fastest = min(medians, key=medians.get)
    ok = all(equal.values())
    print(f"{'PASS' if ok else 'FAIL'} gather candidates equal the loader's batches; fastest: {fastest} "
          f"({medians[fastest]:.3f} ms against {medians['current']:.3f} ms current, batch {args.batch}, "
          f"{args.box}^3 {args.dtype}, {args.memory_format}, {result['device']})")
    return 0 if ok else 1


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
