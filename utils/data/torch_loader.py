"""The PyTorch data path: random crops of periodic boxes with random cube-symmetry augmentation.

Vocabulary of the tutorial:
- ``RandomCropDataset`` serves sample ``(epoch, index)``: a ``data_size``^3 crop of the N-body
  input (4 channels) and the matching hydro target (5 channels).
  Both are moved by the same one of the 48 symmetries of the cube, velocity vectors included
  (``symmetry.transform``, utils/symmetry.py).
- ``get_torch_loader`` builds the straightforward ``DataLoader`` of a split: worker processes
  read and transform one sample each, the default collate stacks them into a batch.
  (``utils.data.get_data_loader``, the factory, picks it or one of the faster loaders.)

Which crop and symmetry sample ``index`` of ``epoch`` gets is ``sample_plan``'s (utils/data/spec.py);
``ShardedSampler`` gives each rank its share of the indices.
"""
import os
import signal

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from utils import symmetry
from utils.data.files import check_data_file
from utils.data.spec import SplitSpec, build_sampler
from utils.errors import DataError


class RandomCropDataset(Dataset):
    """Sample ``(epoch, index)`` -> (input (C_in, S, S, S), target (C_out, S, S, S)) float32 tensors; under
    spatial parallelism this rank's slab of them, (C, S / spatial_parallel, S, S) (``spec.planes``).

    mode ``lowmem`` reads each crop straight from the HDF5 file; ``inmem`` loads both volumes into
    memory once (shared with forked workers); ``synthetic`` crops random in-memory volumes, so the
    copy and augmentation pattern is the same with no file at all.

    Built from a ``SplitSpec``, or from ``params`` and ``split`` (and optionally another ``mode``),
    which make one.
    """

    def __init__(self, spec, split=None, mode=None):
        if not isinstance(spec, SplitSpec):
            spec = SplitSpec.from_params(spec, split, mode=mode)
        self.spec = spec
        self.split, self.mode, self.box, self.crop = spec.split, spec.mode, spec.box, spec.crop
        self.path = None
        self._file = self._file_pid = None
        if self.mode == "synthetic":
            # A small random box (spec.box): same crop + transform work, no I/O.
            side = self.box
            rng = np.random.default_rng(spec.seed)
            self.inp = rng.uniform(-1, 1, (spec.in_channels, side, side, side)).astype(np.float32)
            self.tar = rng.uniform(-1, 1, (spec.out_channels, side, side, side)).astype(np.float32)
        else:
            self.path = check_data_file(spec.path, self.box, spec.in_channels, spec.out_channels)
            if self.mode == "inmem":
                with h5py.File(self.path, "r") as f:  # float32 whatever the file holds, as every loader gives
                    self.inp, self.tar = (f[key][...].astype(np.float32, copy=False) for key in ("Nbody", "Hydro"))
            elif self.mode != "lowmem":
                raise DataError(f"unknown data_loader_config '{self.mode}'")
        spec.check_crop_fits()

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
        # One strided copy per channel moves the grid and rotates the velocity components together; under
        # spatial parallelism it copies only this rank's planes of the moved crop (lowmem still reads it whole).
        return tuple(torch.from_numpy(np.asarray(symmetry.transform(volume, element, planes=self.spec.planes),
                                                 dtype=np.float32))
                     for volume in (inp, tar))

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_file"] = state["_file_pid"] = None
        return state


def ignore_stop_signals(worker_id=None):
    """Loader workers leave SIGTERM/SIGUSR1 to the main process, which checkpoints and stops cleanly.

    Slurm signals every process of a job step; a worker killed by the signal would crash the run.
    """
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


def get_torch_loader(params, split, rank=0, world_size=1, device=torch.device("cpu")):
    """``(loader, sampler)``: the straightforward ``DataLoader`` of ``split`` ('train' or 'val').

    It yields batches ``(input (B, 4, S, S, S), target (B, 5, S, S, S))`` in the sampler's order,
    after ``sampler.set_epoch(epoch)``.
    """
    spec = SplitSpec.from_params(params, split, rank, world_size)
    dataset = RandomCropDataset(spec)
    sampler = build_sampler(spec)
    workers = spec.num_workers
    loader = DataLoader(
        dataset, batch_size=sampler.local_batch_size, sampler=sampler, num_workers=workers,
        pin_memory=device.type == "cuda",         # page-locked buffers: faster, async H2D copies
        persistent_workers=workers > 0,           # no worker restart (and re-open) every epoch
        prefetch_factor=2 if workers > 0 else None,
        worker_init_fn=ignore_stop_signals if workers > 0 else None,
        drop_last=False,
    )
    return loader, sampler
