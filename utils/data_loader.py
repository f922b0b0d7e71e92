"""The PyTorch data path: random crops of periodic boxes with random cube-symmetry augmentation.

Vocabulary of the tutorial:
- ``RandomCropDataset`` serves sample ``(epoch, index)``: a ``data_size``^3 crop of the N-body
  input (4 channels) and the matching hydro target (5 channels).
- ``RandomRotator`` applies one of the 48 symmetries of the cube to both, velocity vectors included.
- ``get_data_loader`` is the factory that builds a ``DataLoader`` for a config.

Reproducibility contract: the crop corner and symmetry element of sample ``index`` in ``epoch``
are a pure function of ``(seed, epoch, index)`` (see ``sample_plan``), independent of world size,
rank and loader workers. Ranks take disjoint shares of the indices; step ``s`` of an epoch uses
indices ``[s * global_batch, (s + 1) * global_batch)`` whatever the world size, so a 2-rank run
sees the same global batches as a 1-rank run and a resumed run continues exactly.
"""
import os
import signal
from functools import lru_cache

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from utils import symmetry
from utils.config import resolve_path
from utils.errors import DataError

# Velocity channels of both the N-body (4 channels) and hydro (5 channels) volumes.
VECTOR_CHANNELS = (1, 2, 3)
SPLITS = {"train": 0, "val": 1}


@lru_cache(maxsize=8)
def sample_plan(seed, split, epoch, num_samples, box, crop, augment=True):
    """Crop corners (num_samples, 3) and symmetry elements (num_samples,) of one epoch.

    A pure function of its arguments: every worker and rank computes the same plan and indexes it.
    Validation always uses epoch 0 and no augmentation, so its crops are the same every epoch.
    """
    def stream(kind):  # one generator per quantity, so sample i does not depend on num_samples
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, SPLITS[split], epoch, kind])))
    corners = stream(0).integers(0, box - crop + 1, size=(num_samples, 3))
    elements = stream(1).integers(0, symmetry.NUM_ELEMENTS, size=num_samples)
    if not augment:
        elements[:] = symmetry.IDENTITY
    for array in (corners, elements):
        array.setflags(write=False)
    return corners, elements


def read_volume_shapes(path, channels, hint=""):
    """Shapes of the (C, N, N, N) datasets ``channels`` names ({key: C}) in HDF5 file ``path``.

    DataError, one line, for an unreadable file, a missing dataset, a wrong channel count or a
    non-cubic box; ``hint`` ends the channel-count message.
    """
    try:
        with h5py.File(path, "r") as f:
            shapes = {}
            for key, num_channels in channels.items():
                if key not in f:
                    raise DataError(f"{path} has no dataset '{key}' (found: {', '.join(f.keys()) or 'none'}); "
                                    f"expected " + " and ".join(f"'{k}' ({c}, N, N, N)" for k, c in channels.items()))
                shape = f[key].shape
                if len(shape) != 4 or shape[0] != num_channels:
                    raise DataError(f"{path}: dataset '{key}' has shape {shape}, expected ({num_channels}, N, N, N)"
                                    f"{hint}")
                if not shape[1] == shape[2] == shape[3]:
                    raise DataError(f"{path}: dataset '{key}' is not a cubic box: shape {shape}")
                shapes[key] = shape
    except OSError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"cannot read {path} as HDF5: {first_line}") from None
    return shapes


def check_data_file(path, box, in_channels, out_channels):
    """Fail early, with a one-line message, on anything that would break training later."""
    path = resolve_path(path)
    if path.is_dir():
        raise DataError(f"data path {path} is a directory; give the HDF5 file in it (train_path/val_path, e.g. "
                        f"{path / 'train.h5'})")
    if not path.exists():
        raise DataError(f"data file {path} does not exist; generate one with "
                        f"`python -m utils.make_dataset --box {box} --out {path}` or point "
                        f"train_path/val_path at the real files (see README, 'Data')")
    shapes = read_volume_shapes(path, {"Nbody": in_channels, "Hydro": out_channels})
    if shapes["Nbody"][1:] != shapes["Hydro"][1:]:
        raise DataError(f"{path}: Nbody box {shapes['Nbody'][1:]} differs from Hydro box {shapes['Hydro'][1:]}")
    if shapes["Nbody"][1] != box:
        raise DataError(f"{path} holds a {shapes['Nbody'][1]}^3 box but the config's box_size says {box}; "
                        f"set box_size to match the files")
    return path


class RandomRotator:
    """Applies a cube-group element to a (C, X, Y, Z) volume, vector channels included."""

    def __init__(self, vector_channels=VECTOR_CHANNELS):
        self.vector_channels = vector_channels

    def __call__(self, volume, element):
        # One strided copy: moves the grid and rotates the velocity components together.
        return symmetry.transform(volume, element, self.vector_channels)


class RandomCropDataset(Dataset):
    """Sample ``(epoch, index)`` -> (input (C_in, S, S, S), target (C_out, S, S, S)) float32 tensors.

    mode ``lowmem`` reads each crop straight from the HDF5 file; ``inmem`` loads both volumes into
    memory once (shared with forked workers); ``synthetic`` crops random in-memory volumes, so the
    copy and augmentation pattern is the same with no file at all.
    """

    def __init__(self, params, split, mode=None):
        self.split = split
        self.mode = mode or params.data_loader_config
        self.box = params.box_size[SPLITS[split]]
        self.crop = params.data_size
        self.seed = params.seed
        self.num_samples = params.Nsamples if split == "train" else params.Nsamples_val
        self.augment = params.enable_augmentation and split == "train"
        self.rotator = RandomRotator()
        self.path = None
        self._file = self._file_pid = None
        if self.mode == "synthetic":
            # A small random box: same crop + transform work, no I/O. Big enough for distinct crops.
            side = min(self.box, 2 * self.crop)
            rng = np.random.default_rng(self.seed)
            self.inp = rng.uniform(-1, 1, (params.N_in_channels, side, side, side)).astype(np.float32)
            self.tar = rng.uniform(-1, 1, (params.N_out_channels, side, side, side)).astype(np.float32)
            self.box = side
        else:
            path = params.train_path if split == "train" else params.val_path
            self.path = check_data_file(path, self.box, params.N_in_channels, params.N_out_channels)
            if self.mode == "inmem":
                with h5py.File(self.path, "r") as f:
                    self.inp, self.tar = f["Nbody"][...], f["Hydro"][...]
            elif self.mode != "lowmem":
                raise DataError(f"unknown data_loader_config '{self.mode}'")
        if self.crop > self.box:
            raise DataError(f"crop size {self.crop} is larger than the {split} box ({self.box})")

    def __len__(self):
        return self.num_samples

    def plan(self, epoch):
        return sample_plan(self.seed, self.split, epoch, self.num_samples, self.box, self.crop, self.augment)

    def _volumes(self):
        if self.mode != "lowmem":
            return self.inp, self.tar
        # h5py handles must not cross fork(): each worker process opens its own.
        if self._file is None or self._file_pid != os.getpid():
            self._file, self._file_pid = h5py.File(self.path, "r"), os.getpid()
        return self._file["Nbody"], self._file["Hydro"]

    def read_crop(self, epoch, index):
        """The untransformed crop and the symmetry element of sample (epoch, index)."""
        corners, elements = self.plan(epoch)
        x, y, z = corners[index]
        s = self.crop
        inp, tar = self._volumes()
        return (inp[:, x:x + s, y:y + s, z:z + s], tar[:, x:x + s, y:y + s, z:z + s]), int(elements[index])

    def __getitem__(self, key):
        epoch, index = key
        (inp, tar), element = self.read_crop(epoch, index)
        return torch.from_numpy(self.rotator(inp, element)), torch.from_numpy(self.rotator(tar, element))

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_file"] = state["_file_pid"] = None
        return state


class ShardedSampler(Sampler):
    """Yields this rank's ``(epoch, index)`` keys; call ``set_epoch`` before each epoch.

    training: step s of global batch B gives rank r the indices s*B + r*(B/W) ... + B/W - 1, so
    global batches do not depend on the world size W; the last Nsamples % B samples are dropped.
    ``set_epoch(epoch, start_step)`` starts mid-epoch, as a resumed run does.
    validation: every sample once, rank r taking indices r, r + W, ... (shares may differ by one).
    """

    def __init__(self, num_samples, global_batch_size, rank=0, world_size=1, split="train"):
        if global_batch_size % world_size:
            raise DataError(f"global batch size {global_batch_size} is not divisible by the world size "
                            f"{world_size}; choose a multiple of {world_size} or change the number of ranks")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.world_size, self.split = rank, world_size, split
        self.local_batch_size = global_batch_size // world_size
        self.steps_per_epoch = num_samples // global_batch_size
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
        return len(self.indices())


def ignore_stop_signals(worker_id=None):
    """Loader workers leave SIGTERM/SIGUSR1 to the main process, which checkpoints and stops cleanly.

    Slurm signals every process of a job step; a worker killed by the signal would crash the run.
    """
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


def build_sampler(params, split, rank=0, world_size=1):
    """This rank's ShardedSampler for ``split``, shared by every loader."""
    num_samples = params.Nsamples if split == "train" else params.Nsamples_val
    sampler = ShardedSampler(num_samples, params.global_batch_size, rank, world_size, split)
    if split == "train" and sampler.steps_per_epoch == 0:
        raise DataError(f"Nsamples={num_samples} is smaller than global_batch_size={params.global_batch_size}: "
                        f"an epoch would have no step")
    return sampler


def get_data_loader(params, split, rank=0, world_size=1, device=torch.device("cpu")):
    """The loader factory: returns ``(loader, sampler)`` for ``split`` ('train' or 'val').

    Every loader yields batches ``(input (B, 4, S, S, S), target (B, 5, S, S, S))`` of the same
    sample stream, in the sampler's order, after ``sampler.set_epoch(epoch)``.
    """
    # The other loaders import this module, so they are imported here, when asked for.
    if params.data_loader_config == "dali-lowmem":
        from utils.dali_loader import get_dali_loader  # optional extra
        return get_dali_loader(params, split, rank, world_size, device)
    if params.data_loader_config == "gpu":
        from utils.gpu_loader import get_gpu_loader
        return get_gpu_loader(params, split, rank, world_size, device)
    if params.fast_loader:
        from utils.fast_loader import get_fast_loader
        return get_fast_loader(params, split, rank, world_size, device)
    dataset = RandomCropDataset(params, split)
    sampler = build_sampler(params, split, rank, world_size)
    workers = params.num_data_workers
    loader = DataLoader(
        dataset, batch_size=sampler.local_batch_size, sampler=sampler, num_workers=workers,
        pin_memory=device.type == "cuda",         # page-locked buffers: faster, async H2D copies
        persistent_workers=workers > 0,           # no worker restart (and re-open) every epoch
        prefetch_factor=2 if workers > 0 else None,
        worker_init_fn=ignore_stop_signals if workers > 0 else None,
        drop_last=False,
    )
    return loader, sampler
