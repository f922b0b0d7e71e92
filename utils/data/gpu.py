"""The GPU-resident loader (``data_loader_config: gpu``): whole boxes in device memory, crops by gathers.

The training and validation volumes are copied once into device memory as (C, N, N, N) tensors,
read from HDF5 in slabs so the host never holds more than one slab. ``gpu_storage_dtype`` halves
that memory with fp16 or bf16: the real 1024^3 training box (9 channels) takes 38.7 GB in fp32 and
19.3 GB in 16 bits. fp16 is the better 16-bit choice for this data: every stored value lies in
(-1, 1), far inside fp16's range, where it keeps 3 more mantissa bits than bf16. Measured on the
quickstart validation box: mean rounding error of the targets 1.1e-5 in fp16 and 8.9e-5 in bf16
(2.7e-4 on temperature, about 1.5% of a trained model's validation L1 there); bf16 also rounds the
stored clip value 0.999, and everything above 0.998, to exactly 1, which the tanh output never reaches.

Each batch is then made on the device by a handful of batched kernels, with no host traffic (this
rank's crop plan of the epoch, ``epoch_plan(sampler)``, is copied to the device once per epoch and
cut into the sampler's batches there). With ``prefetch`` (``gpu_prefetch: true``, the default) the
next batch is made on a side CUDA stream while the consumer's step runs: the gathers are
memory-bound and the convolutions compute-bound, so the two can share the GPU.

Crop and symmetry transform are one call per volume, ``transform_torch`` (symmetry_torch.py): a gather of
the crops' positions, moved by each sample's element, from the flattened volume, then the velocity
components' channel gather and sign. With fp32 storage the batches equal those of the CPU loaders bit
for bit; with 16-bit storage they equal them rounded to that dtype. Under spatial parallelism only this rank's
slab of each crop is gathered (``planes``).

Batches are always float32, whatever the storage dtype: the model and loss see what the other
loaders give them (under autocast too), and the cast is fused into the sign multiply.

``gather`` (``gpu_gather``) chooses how a batch is made: ``eager`` runs ``make_crops`` as PyTorch
kernels (per volume: the positions, an index_select of them, an index_select of the rotated channel rows,
then sign, cast and layout in one multiply: several passes over the batch); ``compiled`` runs it through
``torch.compile``, which can compute the positions and do all of it in one kernel per volume; ``triton``
(utils/data/triton_gather.py, CUDA only) copies each crop in tiles read along the volume's rows and
transposed in registers, where the other two read a rotated crop one scattered value at a time. All give the
same batches bit for bit (only copies and multiplications by +-1). The compiled form compiles at its first
batch, and once more for another batch size or box.
"""
import math
from contextlib import contextmanager

import h5py
import numpy as np
import torch
from tqdm import tqdm

from utils import DataError
from utils.data.batches import PlannedLoader, batch_slices, epoch_plan
from utils.data.fast import hand_over
from utils.data.symmetry_torch import element_table, transform_torch
from utils.data.torch_loader import ShardedSampler, SplitSpec, build_sampler, check_data_file

STORAGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GATHERS = ("eager", "compiled", "triton")
SLAB_BYTES = 256 * 2**20       # host staging buffer per read while loading a volume
PROGRESS_BYTES = 2**30         # show a progress bar for volumes larger than this


def load_volume(path, key, dtype, device, progress=True):
    """The HDF5 dataset ``key`` (C, N, N, N) as a ``dtype`` tensor on ``device``, read in slabs of planes."""
    with h5py.File(path, "r") as f:
        dataset = f[key]
        num_channels, n = dataset.shape[:2]
        volume = torch.empty(dataset.shape, dtype=dtype, device=device)
        planes = max(1, SLAB_BYTES // (num_channels * n * n * 4))
        staging = np.empty((num_channels, planes, n, n), np.float32)
        plane_bytes = num_channels * n * n * volume.element_size()
        with tqdm(total=n * plane_bytes, unit="B", unit_scale=True, desc=f"{key} -> {device}",
                  disable=not progress or n * plane_bytes < PROGRESS_BYTES) as bar:
            for start in range(0, n, planes):
                stop = min(start + planes, n)
                dataset.read_direct(staging, np.s_[:, start:stop], np.s_[:, :stop - start])
                slab = torch.from_numpy(staging[:, :stop - start]).to(device)  # fp32 onto the device...
                volume[:, start:stop].copy_(slab)                                # ...and cast there
                bar.update((stop - start) * plane_bytes)
    return volume


def check_device_memory(path, dtype, device, split):
    """Fail before allocating if the split's two volumes cannot fit in the device's free memory."""
    if device.type != "cuda":
        return
    with h5py.File(path, "r") as f:
        shapes = [f[key].shape for key in ("Nbody", "Hydro")]
    needed = sum(math.prod(shape) for shape in shapes) * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    if needed > free:
        name = next(k for k, v in STORAGE_DTYPES.items() if v == dtype)
        smaller = "set gpu_storage_dtype: fp16 (half the memory) or " if dtype == torch.float32 else ""
        raise DataError(f"the {split} box ({shapes[0][1]}^3, {shapes[0][0] + shapes[1][0]} channels) needs "
                        f"{needed / 1e9:.3g} GB of device memory in {name}, but {free / 1e9:.3g} GB are free; "
                        f"{smaller}use data_loader_config: lowmem")


class GPUResidentLoader(PlannedLoader):
    """This rank's batches of the sampler's epoch: (inp (B, C_in, S, S, S), tar (B, C_out, S, S, S)).

    float32 tensors on ``device``, made from volumes kept there in ``storage_dtype``. ``spec``'s
    file must have passed ``check_data_file``.
    """

    def __init__(self, spec: SplitSpec, sampler: ShardedSampler, device, storage_dtype="fp32", progress=True,
                 memory_format=torch.contiguous_format, prefetch=True, gather="eager"):
        if storage_dtype not in STORAGE_DTYPES:
            raise DataError(f"gpu_storage_dtype must be one of {', '.join(STORAGE_DTYPES)}, got {storage_dtype!r}")
        if gather not in GATHERS:
            raise DataError(f"gpu_gather must be one of {', '.join(GATHERS)}, got {gather!r}")
        if gather == "triton" and torch.device(device).type != "cuda":
            raise DataError(f"gpu_gather triton runs a Triton kernel on a CUDA GPU, and this loader is on {device}; "
                            f"use gpu_gather eager or compiled")
        super().__init__(sampler)
        self.spec, self.device, self.memory_format = spec, torch.device(device), memory_format
        self.prefetch = prefetch and self.device.type == "cuda"
        # One side stream for the loader's life: torch.cuda.Stream() hands out a fixed pool round robin (NCCL
        # draws from it too), so a new one per epoch would, after a few dozen, share a stream with all-reduces.
        self.side = torch.cuda.Stream(self.device) if self.prefetch else None
        dtype = STORAGE_DTYPES[storage_dtype]
        check_device_memory(spec.path, dtype, self.device, spec.split)
        self.inp = load_volume(spec.path, "Nbody", dtype, self.device, progress)  # (C_in, N, N, N)
        self.tar = load_volume(spec.path, "Hydro", dtype, self.device, progress)  # (C_out, N, N, N)
        # Each volume's symmetry tables, copied to the device once: every batch looks its elements up there.
        self.tables = tuple(element_table(volume.shape[0]).to(self.device)
                            for volume in (self.inp, self.tar))
        if gather == "triton":  # imports Triton: only when asked for
            from utils.data.triton_gather import make_crops_triton
            self.make_crops = make_crops_triton
        else:
            self.make_crops = torch.compile(make_crops, dynamic=False) if gather == "compiled" else make_crops
        self.description = f"gpu-resident {storage_dtype} volumes on {self.device}" + (
            {"compiled": ", crops by a compiled gather", "triton": ", crops by a Triton kernel"}.get(gather, "")) + (
            ", next batch made on a side stream" if self.prefetch else "")

    def __iter__(self):
        plan = epoch_plan(self.sampler)
        corners, elements = (torch.tensor(a, device=self.device) for a in (plan.corners, plan.elements))
        slices = batch_slices(self.sampler, len(plan))
        if not self.prefetch:
            for batch in slices:
                yield self.make_batch(corners[batch], elements[batch])
            return
        side = self.side
        side.wait_stream(torch.cuda.current_stream(self.device))  # the plan's copies above
        for table in (corners, elements):
            table.record_stream(side)  # read there; freed here if the consumer stops early

        def start(batch):
            with torch.cuda.stream(side):
                made = self.make_batch(corners[batch], elements[batch])
                ready = torch.cuda.Event()
                ready.record(side)
            return made, ready

        pending = None
        for batch in slices:
            upcoming = start(batch)  # queued before the consumer queues the step of the batch handed over now
            if pending is not None:
                yield hand_over(*pending, self.device)
            pending = upcoming
        if pending is not None:
            yield hand_over(*pending, self.device)

    def make_batch(self, corners, elements):
        """(inp, tar) of the crops at ``corners`` (B, 3) moved by the symmetry ``elements`` (B,)."""
        return self.make_crops(self.inp, self.tar, corners, elements, *self.tables, self.spec.crop,
                               self.memory_format, self.spec.planes)


def make_crops(inp, tar, corners, elements, inp_table, tar_table, crop, memory_format, planes=None):
    """(inp, tar): (B, C, S, S, S) float32 crops of the (C, N, N, N) volumes ``inp`` and ``tar`` at ``corners``
    (B, 3), moved by the symmetry ``elements`` (B,); each volume's ``element_table`` on its device.
    ``planes`` (spatial parallelism): only this rank's slab of each crop's depth is gathered."""
    return tuple(transform_torch(volume, elements, corners, crop, table, memory_format, planes)
                 for volume, table in ((inp, inp_table), (tar, tar_table)))


def get_gpu_loader(params, split, rank=0, world_size=1, device=torch.device("cpu"), storage_dtype=None,
                   memory_format=torch.contiguous_format, prefetch=None, gather=None):
    """``(loader, sampler)`` like ``utils.data.get_data_loader``, with the volumes on ``device``.

    ``storage_dtype``: 'fp32' | 'fp16' | 'bf16'; None takes ``params.gpu_storage_dtype``. ``memory_format``:
    the batches' layout. ``prefetch``: make the next batch on a side stream (CUDA only); None takes
    ``params.gpu_prefetch``. ``gather``: 'eager' | 'compiled' | 'triton'; None takes ``params.gpu_gather``.
    """
    spec = SplitSpec.from_params(params, split, rank, world_size, mode="gpu")
    check_data_file(spec.path, spec.box, spec.in_channels, spec.out_channels)
    sampler = build_sampler(spec)
    storage_dtype = storage_dtype or params.gpu_storage_dtype
    prefetch = params.gpu_prefetch if prefetch is None else prefetch
    return GPUResidentLoader(spec, sampler, device, storage_dtype, progress=rank == 0, memory_format=memory_format,
                             prefetch=prefetch, gather=gather or params.gpu_gather), sampler


@contextmanager
def high_priority_stream(device):
    """Run the block's CUDA work on a high-priority stream (``stream_priority: high``; train.py's ``training_stream``).

    CUDA's block scheduler hands free SMs to the pending blocks of the highest-priority stream first. PyTorch's
    default stream has the lowest priority, the same as the GPU-resident loader's side stream, so the loader's
    gathers for the next batch share the SMs with the step's convolutions and slow them down. With the step on a
    high-priority stream they take only what it leaves idle (kernel tails, gaps between kernels); what is not
    done when the next step starts runs then, as without the side stream. Everything the run queues goes to
    ``torch.cuda.current_stream()`` (loaders, checkpoints, DDP, CUDA graph replays, compiled kernels), so this
    block is the whole change. Build the model inside it too: autograd runs each parameter's gradient
    accumulation on the stream that was current when its accumulator was made, which DDP does at construction.
    Work queued before the block is ordered before it, and the block's work before what follows it.
    """
    outer = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device, priority=-1)  # lower numbers are higher; PyTorch clamps to the device's range
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        outer.wait_stream(stream)
