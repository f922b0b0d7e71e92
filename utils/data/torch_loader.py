"""The default data path, top to bottom: data file -> split settings -> sample plan -> sampler -> dataset -> loader.

A split's HDF5 file holds two float32 datasets over one periodic N^3 box: ``Nbody`` (4, N, N, N), the N-body (dark
matter) input, and ``Hydro`` (5, N, N, N), the hydro (gas) target. Sample ``(epoch, index)`` is a ``data_size``^3 crop
of both, moved by the same one of the 48 symmetries of the cube, velocity vectors included (utils/symmetry.py).

Reproducibility contract: sample ``index`` of ``epoch`` is a pure function of ``(seed, epoch, index)``
(``sample_plan``) whatever the world size, rank or workers, and step ``s`` uses indices ``[s * B, (s + 1) * B)`` of
global batch B on any number of ranks: a 2-rank run sees a 1-rank run's batches and a resumed run continues exactly.
The P ranks sharing a crop (spatial parallelism) are one data rank, each served its slab (``SplitSpec.planes``). The
faster loaders (fast.py, gpu.py, dali.py) build on ``SplitSpec``, ``sample_plan`` and the sampler: the same stream.
"""
import atexit
import hashlib
import multiprocessing.util  # registers its exit handler first, so that ours (below) runs before it
import os
import sys
import signal
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from utils import STOP_SIGNALS, DataError, first_line, symmetry
from utils.config import check_batch_split, resolve_path

SPLITS = {"train": 0, "val": 1}


# --- the data file ------------------------------------------------------------------------------------------------
def read_volume_shapes(path, channels, hint=""):
    """{key: shape} of the (C, N, N, N) datasets ``channels`` ({key: C}) names in HDF5 file ``path``, or a DataError."""
    try:
        with h5py.File(path, "r") as f:
            shapes = {}
            for key, num_channels in channels.items():
                if key not in f:
                    raise DataError(f"{path} has no dataset '{key}' (found: {', '.join(f.keys()) or 'none'}); "
                                    f"expected " + " and ".join(f"'{k}' ({c}, N, N, N)" for k, c in channels.items()))
                kind = f[key].dtype.kind if isinstance(f[key], h5py.Dataset) else None  # a group has no dtype
                if kind != "f":  # integers would be cast silently and trained against the tanh output's range
                    raise DataError(f"{path}: '{key}' is {f'of type {f[key].dtype}' if kind else 'not a dataset'}; "
                                    f"expected floats (C, N, N, N), normalised as utils/units.py says")
                shapes[key] = shape = f[key].shape
                if len(shape) != 4 or shape[0] != num_channels:
                    raise DataError(f"{path}: dataset '{key}' has shape {shape}, expected ({num_channels}, N, N, N)"
                                    f"{hint}")
                if not shape[1] == shape[2] == shape[3]:
                    raise DataError(f"{path}: dataset '{key}' is not a cubic box: shape {shape}")
    except OSError as err:
        raise DataError(f"cannot read {path} as HDF5: {first_line(err)}") from None
    return shapes


def check_data_file(path, box, in_channels, out_channels):
    """Fail early, with a one-line message, on anything that would break training later."""
    path = resolve_path(path)
    if path.is_dir():
        raise DataError(f"data path {path} is a directory; give the HDF5 file in it (train_path/val_path, e.g. "
                        f"{path / 'train.h5'})")
    if not path.exists():
        raise DataError(f"data file {path} does not exist; generate one with "
                        f"`python -m utils.make_dataset --box {box} --seed N --out {path}` (other seeds for training "
                        f"and validation) or point train_path/val_path at the real files (see README, 'Data')")
    shapes = read_volume_shapes(path, {"Nbody": in_channels, "Hydro": out_channels})
    if shapes["Nbody"][1:] != shapes["Hydro"][1:]:
        raise DataError(f"{path}: Nbody box {shapes['Nbody'][1:]} differs from Hydro box {shapes['Hydro'][1:]}; the "
                        f"two volumes must cover the same cells: rewrite or regenerate the file")
    if shapes["Nbody"][1] != box:
        raise DataError(f"{path} holds a {shapes['Nbody'][1]}^3 box but the config's box_size says {box}; "
                        f"set box_size to match the files")
    return path


def check_normalised(path, datasets=("Nbody", "Hydro")):
    """Fields in physical units, or a log of an empty cell (-inf), train to nonsense or to a NaN loss far from the
    cause; the tanh output cannot even reach values beyond +-1. One plane across the box's middle (every channel)
    shows either at the cost of one read (train.py's start-up check); a few bad cells elsewhere the NaN loss
    reports."""
    with h5py.File(path, "r") as f:
        for key in datasets:
            plane = f[key][:, f[key].shape[1] // 2]
            for channel, values in enumerate(plane):
                if not np.isfinite(values).all():
                    raise DataError(f"{path}: '{key}' channel {channel} holds NaN or Inf values; expected the "
                                    f"normalised fields in [-1, 1] (README 'Data': utils/units.py's normalize_*, which "
                                    f"floor empty cells before the log)")
                low, high = float(values.min()), float(values.max())
                if low < -1 or high > 1:
                    raise DataError(f"{path}: '{key}' channel {channel} holds values from {low:.4g} to {high:.4g}; "
                                    f"expected the normalised fields in [-1, 1] (README 'Data': utils/units.py's "
                                    f"normalize_*)")


def fingerprint(path, datasets=("Nbody", "Hydro")):
    """What a data file holds, for the price of a few KB read: the SHA-256 of each dataset's shape and dtype and of
    the line of cells through the box's centre (every channel). Checkpoints record it, so that a resume refuses a file
    regenerated or replaced in place (another seed changes every cell) and accepts the same file at a new path (a
    purged scratch copied back elsewhere, data staged to a job's own node-local folder). Every rank checks it before
    the data loads, so it reads little: an edit off that line goes unnoticed."""
    digest = hashlib.sha256()
    with h5py.File(path, "r") as f:
        for key in datasets:
            middle = f[key].shape[1] // 2
            line = np.ascontiguousarray(f[key][:, middle, middle, :])  # one contiguous read per channel
            digest.update(f"{key} {f[key].shape} {line.dtype.str}".encode())
            digest.update(line.tobytes())
    return f"sha256:{digest.hexdigest()}"


def volume_bytes(box, in_channels, out_channels):
    """Host bytes of one split's two volumes held whole in float32, as inmem holds them in every rank."""
    return 4 * (in_channels + out_channels) * box ** 3


def read_float32(dataset):
    """A whole dataset as float32, as every loader gives, whatever the file holds: HDF5 converts while reading, so a
    float64 file needs no second, float64 copy of the volume in memory."""
    out = np.empty(dataset.shape, np.float32)
    dataset.read_direct(out)
    return out


# --- what a split serves ------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def sample_plan(seed, split, epoch, num_samples, box, crop, augment=True):
    """Crop corners (num_samples, 3) and symmetry elements (num_samples,) of one epoch: a pure function of its
    arguments, so every worker and rank computes the same plan. Validation uses epoch 0 and no augmentation."""
    def stream(kind):  # one generator per quantity, so sample i does not depend on num_samples
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, SPLITS[split], epoch, kind])))
    corners = stream(0).integers(0, box - crop + 1, size=(num_samples, 3))
    elements = stream(1).integers(0, symmetry.NUM_ELEMENTS, size=num_samples)
    if not augment:
        elements[:] = symmetry.IDENTITY
    for array in (corners, elements):
        array.setflags(write=False)
    return corners, elements


@dataclass(frozen=True)
class SplitSpec:
    """What a loader needs to know about one split. ``box``: the edge of the box the crops come from
    (``synthetic``: a random box of ``min(box_size, 2 * crop)``)."""
    split: str                 # 'train' or 'val'
    mode: str                  # synthetic | inmem | lowmem | gpu | dali-lowmem
    path: Path
    box: int
    crop: int
    seed: int
    num_samples: int
    augment: bool              # random cube symmetries: training only, if enabled
    in_channels: int
    out_channels: int
    global_batch_size: int
    rank: int = 0              # the data rank: ranks sharing a crop (spatial parallelism) share it
    world_size: int = 1        # the number of data ranks
    num_workers: int = 0       # num_data_workers: worker processes or threads, by loader
    spatial_parallel: int = 1  # ranks sharing each crop, each served a slab of its depth
    spatial_index: int = 0     # which slab this rank gets

    @classmethod
    def from_params(cls, params, split, rank=0, world_size=1, mode=None):
        """``rank`` and ``world_size`` are global: the P = spatial_parallel ranks of one crop are consecutive
        (utils/spatial.py's mesh), so global rank r is data rank r // P and holds slab r % P. Validation batches are
        training's micro-batches: the memory that micro_batches asks for."""
        mode, size, train = mode or params.data_loader_config, params.spatial_parallel, split == "train"
        box, crop = params.box_size[SPLITS[split]], params.data_size
        return cls(split=split, mode=mode, path=resolve_path(params.train_path if train else params.val_path),
                   box=min(box, 2 * crop) if mode == "synthetic" else box, crop=crop, seed=params.seed,
                   num_samples=params.Nsamples if train else params.Nsamples_val,
                   augment=params.enable_augmentation and train, in_channels=params.N_in_channels,
                   out_channels=params.N_out_channels, rank=rank // size,
                   global_batch_size=params.global_batch_size // (1 if train else params.micro_batches),
                   world_size=world_size // size, num_workers=params.num_data_workers, spatial_parallel=size,
                   spatial_index=rank % size)

    @property
    def planes(self):
        """(start, stop): this rank's planes along each crop's depth, or None when it gets whole crops."""
        if self.spatial_parallel == 1:
            return None
        depth = self.crop // self.spatial_parallel
        return self.spatial_index * depth, (self.spatial_index + 1) * depth

    def plan(self, epoch):
        return sample_plan(self.seed, self.split, epoch, self.num_samples, self.box, self.crop, self.augment)


class ShardedSampler(Sampler):
    """Yields this rank's ``(epoch, index)`` keys after ``set_epoch(epoch, start_step=0)`` (a resumed run starts
    mid-epoch). Training: step s of global batch B gives rank r indices s*B + r*(B/W) ... + B/W - 1, so global batches
    do not depend on the world size W; the last Nsamples % B samples are dropped. Validation: every sample once, rank
    r taking r, r + W, ... ``plan`` (``SplitSpec.plan``) is where batches.py reads each sample's crop from."""

    def __init__(self, num_samples, global_batch_size, rank=0, world_size=1, split="train", plan=None):
        check_batch_split(global_batch_size, world_size)
        self.num_samples, self.global_batch_size, self.plan = num_samples, global_batch_size, plan
        self.rank, self.world_size, self.split = rank, world_size, split
        self.local_batch_size, self.steps_per_epoch = global_batch_size // world_size, num_samples // global_batch_size
        self.epoch = self.start_step = 0

    def set_epoch(self, epoch, start_step=0):
        self.epoch, self.start_step = epoch, start_step

    def indices(self):
        if self.split == "val":
            return range(self.rank, self.num_samples, self.world_size)
        offsets = self.rank * self.local_batch_size + np.arange(self.local_batch_size)
        steps = np.arange(self.start_step, self.steps_per_epoch)
        return (steps[:, None] * self.global_batch_size + offsets).ravel().tolist()

    def __iter__(self):
        return ((self.epoch, index) for index in self.indices())

    def __len__(self):
        """This rank's number of samples in the current epoch (from ``start_step`` on)."""
        return len(self.indices())


def build_sampler(spec):
    """This rank's ShardedSampler for ``spec``'s split, shared by every loader."""
    # at least one step per epoch: Nsamples >= global_batch_size is a config check (utils/config.py)
    return ShardedSampler(spec.num_samples, spec.global_batch_size, spec.rank, spec.world_size, spec.split,
                          plan=spec.plan)


# --- the dataset and its loader -----------------------------------------------------------------------------------
class RandomCropDataset(Dataset):
    """Sample ``(epoch, index)`` -> float32 (input (C_in, S, S, S), target (C_out, S, S, S)), or this rank's slab
    (C, S / spatial_parallel, S, S). ``lowmem`` reads each crop from the file; ``inmem`` loads both volumes once
    (shared with forked workers); ``synthetic`` crops random volumes: the same work with no file. Built from a
    ``SplitSpec``, or from ``params`` and ``split``."""

    def __init__(self, spec, split=None):
        if not isinstance(spec, SplitSpec):
            spec = SplitSpec.from_params(spec, split)
        self.spec, self.split, self.mode, self.box, self.crop = spec, spec.split, spec.mode, spec.box, spec.crop
        self.path = self._file = self._file_pid = None
        if self.mode == "synthetic":
            rng, cube = np.random.default_rng(spec.seed), (self.box,) * 3
            self.inp = rng.uniform(-1, 1, (spec.in_channels, *cube)).astype(np.float32)
            self.tar = rng.uniform(-1, 1, (spec.out_channels, *cube)).astype(np.float32)
        else:
            self.path = check_data_file(spec.path, self.box, spec.in_channels, spec.out_channels)
            if self.mode == "inmem":
                try:
                    with h5py.File(self.path, "r") as f:
                        self.inp, self.tar = (read_float32(f[key]) for key in ("Nbody", "Hydro"))
                except MemoryError:  # not a batch that is too large: the run's memory advice would not apply
                    size = volume_bytes(self.box, spec.in_channels, spec.out_channels) / 1e9
                    raise DataError(f"out of host memory loading {self.path} whole ({size:.3g} GB in float32, per "
                                    f"rank): use --data_loader_config lowmem (crops read from the file), or more "
                                    f"memory") from None
            elif self.mode != "lowmem":
                raise DataError(f"unknown data_loader_config '{self.mode}'")

    def __len__(self):
        return self.spec.num_samples

    def plan(self, epoch):
        return self.spec.plan(epoch)

    def _volumes(self):
        if self.mode != "lowmem":
            return self.inp, self.tar
        # h5py handles must not cross fork(): each worker process opens its own.
        if self._file is None or self._file_pid != os.getpid():
            self._file, self._file_pid = h5py.File(self.path, "r"), os.getpid()
        return self._file["Nbody"], self._file["Hydro"]

    def __getitem__(self, key):
        """Sample ``key`` = (epoch, index): its crop, moved by its symmetry element."""
        epoch, index = key
        corners, elements = self.plan(epoch)
        (x, y, z), s = corners[index], self.crop
        # One strided copy per channel moves the grid and rotates the velocity components together; under
        # spatial parallelism it copies only this rank's planes of the moved crop (lowmem still reads it whole).
        return tuple(torch.from_numpy(np.asarray(symmetry.transform(volume[:, x:x + s, y:y + s, z:z + s],
                                                                    int(elements[index]), planes=self.spec.planes),
                                                 dtype=np.float32))
                     for volume in self._volumes())

    def __getstate__(self):
        return {**self.__dict__, "_file": None, "_file_pid": None}


def ignore_stop_signals(worker_id=None):
    """Loader workers leave the stop signals (SIGTERM, SIGUSR1, Ctrl-C's SIGINT) to the main process, which stops
    cleanly (Slurm signals every process of a job step, Ctrl-C a terminal's process group)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@atexit.register
def _kill_workers_at_exit():
    """At exit multiprocessing SIGTERMs its daemonic children, then waits. A run ended by an error keeps its loaders
    alive in the traceback, and their workers ignore SIGTERM: kill them, PyTorch's SIGCHLD check for lost ones off."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def get_torch_loader(params, split, rank=0, world_size=1, device=torch.device("cpu")):
    """``(loader, sampler)``: the straightforward ``DataLoader`` of ``split`` (see ``get_data_loader``)."""
    spec = SplitSpec.from_params(params, split, rank, world_size)
    dataset, sampler, workers = RandomCropDataset(spec), build_sampler(spec), spec.num_workers
    # inmem's volumes reach forked workers as copy-on-write pages they only read; spawn or forkserver (macOS's
    # default, and Linux's from Python 3.14) would pickle a copy into every worker: 38.7 GB each at the base config.
    fork = spec.mode == "inmem" and workers > 0 and sys.platform == "linux"
    loader = DataLoader(dataset, batch_size=sampler.local_batch_size, sampler=sampler, num_workers=workers,
                        multiprocessing_context="fork" if fork else None,
                        pin_memory=device.type == "cuda",  # page-locked buffers: faster, async H2D copies
                        persistent_workers=workers > 0,    # no worker restart (and re-open) every epoch
                        prefetch_factor=2 if workers > 0 else None,
                        worker_init_fn=ignore_stop_signals if workers > 0 else None, drop_last=False)
    return loader, sampler
