"""The fast CPU data path: threads write each crop, transformed, straight into a reusable batch buffer.

Same samples in the same order as the straightforward loader (``RandomCropDataset`` through a
torch ``DataLoader``, utils/data/torch_loader.py): both follow the sampler's batch plans; only the
copies differ. Per sample, the straightforward path does

    read the crop (h5py) -> transform copy -> collate copy into the batch -> hand-over from the
    worker process through shared memory -> pin-memory copy (CUDA only)

and the fast path writes each sample from the volume straight into its slot of a (pinned, for
CUDA) batch buffer with ``transform_staged``, whose per-thread scratch buffer lets it read memory the
way the hardware likes.

Why threads, not worker processes: numpy releases the GIL in its copy loops, so threads copy in
parallel with no pickling, no shared-memory hand-over and no per-batch allocation, and can write
into page-locked memory that a process pool could not share. (The measurements are in
benchmarks/results/loaders_cpu.md.) HDF5 is the exception: h5py serialises every call under one
global lock, so ``lowmem`` does not go through h5py when it can avoid it: a contiguous,
uncompressed dataset (what h5py and utils.make_dataset write by default) is read through a
read-only memory map of the file, which threads copy from in parallel and which keeps nothing
resident but the page cache (a file truncated under it, by ``cp`` over it, ends the process with
SIGBUS). Chunked or compressed datasets are read with one ``read_direct`` call per crop into a
per-thread buffer; ``FastLoader.description`` says which path is in use.
"""
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import torch

from utils import symmetry
from utils.data.batches import PlannedLoader, batch_plans
from utils.data.torch_loader import RandomCropDataset, ShardedSampler, SplitSpec, build_sampler

# Batches being filled ahead of the one the consumer is using.
PREFETCH_BATCHES = 2


def memory_map(dataset):
    """A read-only ``np.memmap`` of an h5py dataset, or None if its layout cannot be mapped.

    Only a contiguous dataset with no filters (compression, checksums) and no external storage
    has its elements laid out in the file exactly as in a C-ordered array.
    """
    plist = dataset.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count():
        return None
    offset = dataset.id.get_offset()  # None until the data has been written
    if offset is None:
        return None
    return np.memmap(dataset.file.filename, dtype=dataset.dtype, mode="r", offset=offset, shape=dataset.shape)


def transform_staged(volume, g, out, scratch, planes=None):
    """``symmetry.transform(volume, g, out=out, planes=planes)``, the same bits, about 40% faster with ``scratch``, a
    (2, S, S, S) float32 buffer per thread: a strided copy is fast only while it reads the volume's rows (last axis)
    forward, which the hardware prefetcher streams. Elements that keep rows as unreversed rows (and slabs) take the
    strided copy; for the others each channel is first streamed into a compact copy and moved from there, in cache."""
    perm, flips = symmetry.element(g)
    if planes is not None or (perm[2] == 2 and not flips[2]):
        return symmetry.transform(volume, g, out=out, planes=planes)
    source, sign = symmetry.channel_map(g, volume.shape[0])
    compact, move = _staged_move(g, scratch)
    for c in range(volume.shape[0]):
        symmetry.signed_copy(volume[source[c]], compact, sign[c])  # rows read forward: streamed from memory
        move(out[c])
    return out


def _staged_move(g, scratch):
    """``(compact, move)``: ``move(destination)`` writes ``compact`` (S, S, S), moved by ``g``, to ``destination``: by
    numpy, or for the 3 axis orders that turn rows into columns, (1,2,0), (2,0,1), (2,1,0), by one 2D transpose,
    which torch's copy does in cache-sized blocks after numpy has applied the flips."""
    perm, flips = symmetry.element(g)
    compact, staged = scratch
    if perm[0] == 0 or perm[2] == 2:
        moved = symmetry.transform_view(compact[None], g)[0]
        return compact, lambda destination: np.copyto(destination, moved)
    s = compact.shape[0]
    # axes ordered so that moving the last to the front (perm[0] == 2) or the first to the back gives the output's
    order = (perm[1], perm[2], 2) if perm[0] == 2 else (perm[2], perm[0], 2)
    flipped = np.flip(compact, [perm[k] for k in range(3) if flips[k]]).transpose(order)
    transposed = torch.from_numpy(staged).view((s * s, s) if perm[0] == 2 else (s, s * s)).t()

    def move(destination):
        np.copyto(staged, flipped)
        torch.from_numpy(destination).view(transposed.shape).copy_(transposed)
    return compact, move


class ArrayCrops:
    """Crops as views of (C, N, N, N) arrays: in-memory volumes or memory maps of the file."""

    def __init__(self, inp, tar, crop, description):
        self.inp, self.tar, self.crop, self.description = inp, tar, crop, description

    def __call__(self, x, y, z):
        s = self.crop
        return self.inp[:, x:x + s, y:y + s, z:z + s], self.tar[:, x:x + s, y:y + s, z:z + s]


class HDF5Crops:
    """Crops read with h5py ``read_direct`` into per-thread buffers (one lock-serialised call per crop)."""

    description = "HDF5 crops through h5py (chunked or filtered datasets: reads are serialised)"

    def __init__(self, path, crop):
        self.file = h5py.File(path, "r")
        self.inp, self.tar = self.file["Nbody"], self.file["Hydro"]
        self.crop = crop
        self.local = threading.local()

    def __call__(self, x, y, z):
        s = self.crop
        if not hasattr(self.local, "buffers"):  # a thread's buffers are overwritten by its next crop only
            self.local.buffers = tuple(np.empty((d.shape[0], s, s, s), np.float32) for d in (self.inp, self.tar))
        region = np.s_[:, x:x + s, y:y + s, z:z + s]
        for volume, buffer in zip((self.inp, self.tar), self.local.buffers):
            volume.read_direct(buffer, region)
        return self.local.buffers


def crop_reader(dataset):
    """The fastest way to read the crops of a ``RandomCropDataset`` (see the module docstring)."""
    if dataset.mode in ("inmem", "synthetic"):
        return ArrayCrops(dataset.inp, dataset.tar, dataset.crop, f"{dataset.mode} volumes")
    with h5py.File(dataset.path, "r") as f:
        maps = memory_map(f["Nbody"]), memory_map(f["Hydro"])
    if any(m is None for m in maps):
        return HDF5Crops(dataset.path, dataset.crop)
    return ArrayCrops(*maps, dataset.crop, "memory-mapped HDF5 file")


class BatchBuffers:
    """Batch buffers that are handed out again only once no tensor made from them is alive.

    ``take(n)`` returns fresh numpy views ``[:n]`` of a free (inp, tar) buffer pair. A tensor made
    with ``torch.from_numpy(view)`` holds the view until its storage -- shared by every tensor
    derived from it -- is freed, so a weak reference to each view says when the pair is free. A
    consumer that keeps batches (``list(loader)``) therefore gets correct data and a growing pool;
    one that drops each batch before asking for the next cycles through PREFETCH_BATCHES + 2 pairs.
    """

    def __init__(self, shapes, pin_memory):
        self.shapes, self.pin_memory = shapes, pin_memory
        self.pool = []  # [arrays, weak references to the views handed out]

    def take(self, n):
        entry = next((e for e in self.pool if all(ref() is None for ref in e[1])), None)
        if entry is None:
            entry = [tuple(self._allocate(shape) for shape in self.shapes), ()]
            self.pool.append(entry)
        views = tuple(array[:n] for array in entry[0])
        entry[1] = tuple(weakref.ref(view) for view in views)
        return views

    def _allocate(self, shape):
        if self.pin_memory:  # page-locked memory: host-to-device copies run asynchronously, by DMA
            return torch.empty(shape, dtype=torch.float32, pin_memory=True).numpy()
        return np.empty(shape, np.float32)


class FastLoader(PlannedLoader):
    """This rank's batches of the sampler's current epoch: (inp (B, C_in, S, S, S), tar (B, C_out, S, S, S)).

    ``num_workers`` threads fill the samples of the next PREFETCH_BATCHES batches while the
    consumer uses the current one; with 0 each batch is filled in the calling thread on demand.
    Batches are float32 CPU tensors, page-locked with ``pin_memory``: copy those to the GPU with
    :class:`DevicePrefetcher`, which keeps a batch alive until its copy has landed (a bare
    ``.to(device, non_blocking=True)`` followed by dropping the batch would let its buffer be
    refilled while the copy still reads it).
    """

    def __init__(self, dataset: RandomCropDataset, sampler: ShardedSampler, num_workers: int, pin_memory=False):
        super().__init__(sampler)
        self.dataset, self.num_workers = dataset, num_workers
        self.read_crops = crop_reader(dataset)
        self.local = threading.local()  # each thread's scratch crop for transform_staged
        size, crop = sampler.local_batch_size, dataset.crop
        self.planes = dataset.spec.planes  # under spatial parallelism: this rank's slab of each crop's depth
        depth = crop if self.planes is None else self.planes[1] - self.planes[0]
        self.buffers = BatchBuffers([(size, volume.shape[0], depth, crop, crop)
                                     for volume in (self.read_crops.inp, self.read_crops.tar)], pin_memory)
        self.description = (f"fast {dataset.mode}: {self.read_crops.description}, "
                            f"{num_workers} thread{'s' * (num_workers != 1)}{', pinned' * pin_memory}")

    def __iter__(self):
        batches = batch_plans(self.sampler)
        if self.num_workers == 0:
            for batch in batches:
                yield self._fill_here(batch)
            return
        pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="fast_loader")
        try:
            pending = deque()  # (views, futures) of the batches being filled, oldest first
            for batch in batches:
                views = self.buffers.take(len(batch))
                samples = enumerate(zip(batch.corners, batch.elements))
                pending.append((views, [pool.submit(self._fill_sample, views, slot, corner, element)
                                        for slot, (corner, element) in samples]))
                if len(pending) > PREFETCH_BATCHES:
                    yield self._collect(*pending.popleft())
            while pending:
                yield self._collect(*pending.popleft())
        finally:  # also when the consumer stops early: drop queued samples, let running ones finish
            pool.shutdown(wait=True, cancel_futures=True)

    def _fill_here(self, batch):
        views = self.buffers.take(len(batch))
        for slot, (corner, element) in enumerate(zip(batch.corners, batch.elements)):
            self._fill_sample(views, slot, corner, element)
        return tuple(map(torch.from_numpy, views))

    def _fill_sample(self, views, slot, corner, element):
        """Sample ``slot`` of a batch: the crop at ``corner`` (3,) under symmetry ``element``."""
        inp, tar = self.read_crops(*corner)
        element, scratch = int(element), self._scratch()
        transform_staged(inp, element, views[0][slot], scratch, self.planes)
        transform_staged(tar, element, views[1][slot], scratch, self.planes)

    def _scratch(self):
        if not hasattr(self.local, "scratch"):
            s = self.dataset.crop
            self.local.scratch = np.empty((2, s, s, s), np.float32)
        return self.local.scratch

    @staticmethod
    def _collect(views, futures):
        for future in futures:
            future.result()  # waits for the worker; re-raises its exception here
        return tuple(map(torch.from_numpy, views))


def hand_over(batch, ready, device):
    """``batch``, made on a side stream up to the event ``ready``, for use on ``device``'s current stream (the
    consumer's, at this call): that stream waits for ``ready``, and the tensors are marked used there, or the
    caching allocator could hand their memory to the next side-stream batch while the consumer still reads it."""
    stream = torch.cuda.current_stream(device)
    stream.wait_event(ready)
    for tensor in batch:
        tensor.record_stream(stream)
    return batch


class DevicePrefetcher:
    """Copies batch i+1 to ``device`` on a side CUDA stream while step i runs; on CPU, a passthrough.

    Wraps any iterable of (inp, tar) CPU batches, ideally pinned (only page-locked memory copies
    asynchronously), and yields them on the device, optionally in ``memory_format``.
    """

    def __init__(self, loader, device, memory_format=torch.contiguous_format):
        self.loader, self.device, self.memory_format = loader, torch.device(device), memory_format
        self.copy_stream = None  # made once (see utils/data/gpu.py: the pool of streams is shared with NCCL)

    def __len__(self):
        return len(self.loader)

    @property
    def description(self):
        inner = getattr(self.loader, "description", type(self.loader).__name__)
        return f"{inner}, copied to {self.device} a batch ahead on a side stream" if self.device.type == "cuda" \
            else inner

    def __iter__(self):
        if self.device.type != "cuda":
            yield from self.loader
            return
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.device)
        copy_stream = self.copy_stream
        host_batches = iter(self.loader)
        pending = self._copy(next(host_batches, None), copy_stream)
        while pending is not None:
            host, batch, copied, ready = pending
            hand_over(batch, ready, self.device)  # the step queued after this yield reads the batch
            pending = self._copy(next(host_batches, None), copy_stream)  # overlaps with this step
            copied.synchronize()  # only now may the host buffer be refilled (long done: queued a step ago)
            del host
            yield batch

    def _copy(self, host, stream):
        """(host, batch, copied, ready): ``copied`` marks the end of the host-to-device copy, which is all the
        host buffer waits for; ``ready`` the batch in its memory format. A change of layout is a kernel after the
        copy (torch copies into a temporary in the host's layout, then converts), which may wait for free SMs
        behind the step: the host does not wait for it."""
        if host is None:
            return None
        with torch.cuda.stream(stream):
            staged = tuple(t.to(self.device, non_blocking=True) for t in host)
            copied = torch.cuda.Event()
            copied.record(stream)
            batch = tuple(t.contiguous(memory_format=self.memory_format) for t in staged)
            ready = torch.cuda.Event()
            ready.record(stream)
        return host, batch, copied, ready


def get_fast_loader(params, split, rank=0, world_size=1, device=torch.device("cpu"),
                    memory_format=torch.contiguous_format):
    """``(loader, sampler)`` like ``utils.data.get_data_loader``, with the fast path.

    On CUDA the loader yields device tensors (already copied, ahead of time, on a side stream).
    """
    device = torch.device(device)
    spec = SplitSpec.from_params(params, split, rank, world_size)
    dataset = RandomCropDataset(spec)
    sampler = build_sampler(spec)
    loader = FastLoader(dataset, sampler, spec.num_workers, pin_memory=device.type == "cuda")
    return DevicePrefetcher(loader, device, memory_format), sampler
