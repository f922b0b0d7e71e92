"""What a loader serves, decided once per split: the spec, the sample plan and the sampler (bottom layer).

``SplitSpec.from_params(params, split, rank, world_size)`` gathers every per-split setting a loader
needs -- data file, box and crop sizes, number of samples, augmentation, seed, channel counts,
global and per-rank batch sizes -- so no loader reads them from the config again.

Reproducibility contract: the crop corner and symmetry element of sample ``index`` in ``epoch``
are a pure function of ``(seed, epoch, index)`` (see ``sample_plan``), independent of world size,
rank and loader workers. Ranks take disjoint shares of the indices (``ShardedSampler``); step ``s``
of an epoch uses indices ``[s * global_batch, (s + 1) * global_batch)`` whatever the world size, so
a 2-rank run sees the same global batches as a 1-rank run and a resumed run continues exactly.
Under spatial parallelism (``spatial_parallel: S``) the S ranks sharing a crop are one data rank: they get
the same indices, and each loader serves each of them its slab of every crop (``SplitSpec.planes``).

The sampler also cuts this rank's share of an epoch into ``BatchPlan``s -- the indices, crop
corners and symmetry elements of each batch -- in the one place every loader that builds whole
batches (fast, GPU-resident, DALI) takes them from; ``PlannedLoader`` gives those loaders their
``len``. Imports nothing of the data package: every other data module builds on this one.
"""
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from torch.utils.data import Sampler

from utils import symmetry
from utils.config import check_batch_split, resolve_path
from utils.errors import DataError
from utils.units import VECTOR_CHANNELS  # noqa: F401 (the velocity channels of both volumes, re-exported)

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


@dataclass(frozen=True)
class SplitSpec:
    """Everything about one split that the loaders need, read from the config once.

    ``box`` is the edge of the box the crops are drawn from: the config's ``box_size`` of the
    split, except in ``synthetic`` mode, whose random in-memory box is ``min(box_size, 2 * crop)``
    (big enough for distinct crops). ``path`` is the split's HDF5 file, resolved (unused by
    ``synthetic``); ``mode`` is ``data_loader_config`` unless a loader asks for another.
    """
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
        """``rank`` and ``world_size`` are global: the S = spatial_parallel ranks of one crop are consecutive
        (utils/spatial.py's mesh), so global rank r is data rank r // S and holds slab r % S."""
        mode = mode or params.data_loader_config
        size = params.spatial_parallel
        train = split == "train"
        box, crop = params.box_size[SPLITS[split]], params.data_size
        if mode == "synthetic":
            box = min(box, 2 * crop)
        return cls(split=split, mode=mode, path=resolve_path(params.train_path if train else params.val_path),
                   box=box, crop=crop, seed=params.seed,
                   num_samples=params.Nsamples if train else params.Nsamples_val,
                   augment=params.enable_augmentation and train,
                   in_channels=params.N_in_channels, out_channels=params.N_out_channels,
                   global_batch_size=params.global_batch_size, rank=rank // size, world_size=world_size // size,
                   num_workers=params.num_data_workers, spatial_parallel=size, spatial_index=rank % size)

    @property
    def local_batch_size(self):
        """This rank's share of a global batch (``ShardedSampler`` checks that it divides evenly)."""
        return self.global_batch_size // self.world_size

    @property
    def planes(self):
        """(start, stop): this rank's planes along each crop's depth, or None when it gets whole crops."""
        if self.spatial_parallel == 1:
            return None
        depth = self.crop // self.spatial_parallel
        return self.spatial_index * depth, (self.spatial_index + 1) * depth

    def plan(self, epoch):
        """``sample_plan`` of this split: crop corners and symmetry elements of every sample of ``epoch``."""
        return sample_plan(self.seed, self.split, epoch, self.num_samples, self.box, self.crop, self.augment)

    def check_crop_fits(self):
        if self.crop > self.box:
            raise DataError(f"crop size {self.crop} is larger than the {self.split} box ({self.box})")


@dataclass(frozen=True)
class BatchPlan:
    """One batch of a rank: global sample indices (B,), crop corners (B, 3) and symmetry elements (B,)."""
    indices: np.ndarray
    corners: np.ndarray
    elements: np.ndarray

    def __len__(self):
        return len(self.indices)


class ShardedSampler(Sampler):
    """Yields this rank's ``(epoch, index)`` keys; call ``set_epoch`` before each epoch.

    training: step s of global batch B gives rank r the indices s*B + r*(B/W) ... + B/W - 1, so
    global batches do not depend on the world size W; the last Nsamples % B samples are dropped.
    ``set_epoch(epoch, start_step)`` starts mid-epoch, as a resumed run does.
    validation: every sample once, rank r taking indices r, r + W, ... (shares may differ by one).

    With ``plan`` (``SplitSpec.plan``, as ``build_sampler`` gives it), ``epoch_plan`` and
    ``batch_plans`` also say which crop and symmetry element each of those samples is.
    """

    def __init__(self, num_samples, global_batch_size, rank=0, world_size=1, split="train", plan=None):
        check_batch_split(global_batch_size, world_size)
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.world_size, self.split = rank, world_size, split
        self.local_batch_size = global_batch_size // world_size
        self.steps_per_epoch = num_samples // global_batch_size
        self.epoch = self.start_step = 0
        self.plan = plan

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

    def num_batches(self):
        """This rank's number of batches in the current epoch: the last one may be short (validation)."""
        return math.ceil(len(self) / self.local_batch_size)

    def epoch_plan(self):
        """All of this rank's samples of the current epoch, in order, as one ``BatchPlan``."""
        corners, elements = self.plan(self.epoch)
        indices = np.asarray(self.indices(), dtype=np.int64)
        return BatchPlan(indices, corners[indices], elements[indices])

    def batch_slices(self, num_samples=None):
        """``slice``s of the epoch plan, one per batch of ``local_batch_size`` (the last may be short)."""
        num_samples = len(self) if num_samples is None else num_samples
        size = self.local_batch_size
        return [slice(start, min(start + size, num_samples)) for start in range(0, num_samples, size)]

    def batch_plans(self):
        """This rank's batches of the current epoch, in order: one ``BatchPlan`` each."""
        plan = self.epoch_plan()
        return [BatchPlan(plan.indices[s], plan.corners[s], plan.elements[s]) for s in self.batch_slices(len(plan))]


def build_sampler(spec):
    """This rank's ShardedSampler for ``spec``'s split, shared by every loader."""
    sampler = ShardedSampler(spec.num_samples, spec.global_batch_size, spec.rank, spec.world_size, spec.split,
                             plan=spec.plan)
    if spec.split == "train" and sampler.steps_per_epoch == 0:
        raise DataError(f"Nsamples={spec.num_samples} is smaller than global_batch_size={spec.global_batch_size}: "
                        f"an epoch would have no step")
    return sampler


class PlannedLoader:
    """Base of the loaders that make whole batches from ``sampler.batch_plans()``: their ``len``.

    Iterating one yields this rank's batches of the sampler's current epoch; call
    ``sampler.set_epoch`` before ``iter``.
    """

    def __init__(self, sampler):
        self.sampler = sampler

    def __len__(self):
        return self.sampler.num_batches()
