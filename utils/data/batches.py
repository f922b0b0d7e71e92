"""Whole batches from the sampler, for the loaders that build a batch at once (fast, GPU-resident, DALI).

The straightforward loader asks the sampler for one ``(epoch, index)`` key at a time; these loaders take this
rank's share of an epoch cut into ``BatchPlan``s -- the indices, crop corners and symmetry elements of each
batch -- read from the sampler's ``plan`` (``SplitSpec.plan``), so they serve the same samples in the same order.
"""
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchPlan:
    """One batch of a rank: global sample indices (B,), crop corners (B, 3) and symmetry elements (B,)."""
    indices: np.ndarray
    corners: np.ndarray
    elements: np.ndarray

    def __len__(self):
        return len(self.indices)


def epoch_plan(sampler):
    """All of ``sampler``'s samples of its current epoch, in order, as one ``BatchPlan``."""
    corners, elements = sampler.plan(sampler.epoch)
    indices = np.asarray(sampler.indices(), dtype=np.int64)
    return BatchPlan(indices, corners[indices], elements[indices])


def batch_slices(sampler, num_samples=None):
    """``slice``s of the epoch plan, one per batch of ``local_batch_size`` (the last may be short)."""
    num_samples = len(sampler) if num_samples is None else num_samples
    size = sampler.local_batch_size
    return [slice(start, min(start + size, num_samples)) for start in range(0, num_samples, size)]


def batch_plans(sampler):
    """``sampler``'s batches of its current epoch, in order: one ``BatchPlan`` each."""
    plan = epoch_plan(sampler)
    return [BatchPlan(plan.indices[s], plan.corners[s], plan.elements[s]) for s in batch_slices(sampler, len(plan))]


class PlannedLoader:
    """Base of the batch loaders: their ``len``, this rank's number of batches in the current epoch (the last one
    may be short, in validation). Iterating one yields those batches; call ``sampler.set_epoch`` before ``iter``."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __len__(self):
        return math.ceil(len(self.sampler) / self.sampler.local_batch_size)
