"""The data package: random crops of periodic boxes with random cube-symmetry augmentation.

Vocabulary of the tutorial:
- ``RandomCropDataset`` serves sample ``(epoch, index)``: a ``data_size``^3 crop of the N-body
  input (4 channels) and the matching hydro target (5 channels).
  Both are moved by the same one of the 48 symmetries of the cube, velocity vectors included
  (``utils.symmetry``).
- ``get_data_loader`` (below) is the factory that builds the loader a config asks for. Every loader but the
  straightforward one is an extra, imported only when asked for: ``data_loader_config: dali-lowmem`` the
  NVIDIA DALI pipeline (dali.py), ``gpu`` the GPU-resident loader (gpu.py), ``fast_loader: true`` the fast
  CPU loader (fast.py). Each serves the same sample stream, so the choice changes speed, never results.

Reproducibility contract: the crop corner and symmetry element of sample ``index`` in ``epoch``
are a pure function of ``(seed, epoch, index)`` (see ``sample_plan``), independent of world size,
rank and loader workers. Ranks take disjoint shares of the indices; step ``s`` of an epoch uses
indices ``[s * global_batch, (s + 1) * global_batch)`` whatever the world size, so a 2-rank run
sees the same global batches as a 1-rank run and a resumed run continues exactly.

Layers (a module imports only from the layers below it, never from this package's namespace):

- ``spec``: ``SplitSpec`` (a split's settings, read from the config once), ``sample_plan``, the
  ``ShardedSampler`` and its ``BatchPlan``s, ``PlannedLoader`` (the batch loaders' ``len``);
  ``files``: ``read_volume_shapes``, ``check_data_file``, ``check_normalisation``, ``lacks_normalisation``
  (errors are ``utils.errors.DataError``), and ``prepare_data``, which makes or checks the files before a run;
- ``torch_loader``: ``RandomCropDataset``, the straightforward ``DataLoader``;
  ``gpu``: the GPU-resident loader; ``dali``: the NVIDIA DALI pipeline (optional extra);
- ``fast``: the fast CPU loader (threads, reusable pinned batches, ``DevicePrefetcher``);
- this package's ``get_data_loader``, the only code that knows every loader.
"""
import torch

from utils.data.files import check_data_file, check_normalisation, lacks_normalisation, read_volume_shapes
from utils.data.spec import (SPLITS, VECTOR_CHANNELS, BatchPlan, ShardedSampler, SplitSpec, build_sampler,
                             sample_plan)
from utils.data.torch_loader import RandomCropDataset, get_torch_loader
from utils.errors import DataError

__all__ = ["SPLITS", "VECTOR_CHANNELS", "BatchPlan", "DataError", "RandomCropDataset", "ShardedSampler",
           "SplitSpec", "build_sampler", "check_data_file", "check_normalisation", "get_data_loader",
           "lacks_normalisation", "read_volume_shapes", "sample_plan"]


def get_data_loader(params, split, rank=0, world_size=1, device=torch.device("cpu")):
    """The loader factory: returns ``(loader, sampler)`` for ``split`` ('train' or 'val').

    Every loader yields batches ``(input (B, 4, S, S, S), target (B, 5, S, S, S))`` of the same
    sample stream, in the sampler's order, after ``sampler.set_epoch(epoch)``; with ``spatial_parallel`` P, each
    rank's slab (B, C, S/P, S, S) of the crops its data rank gets (``rank`` is global). With ``channels_last``
    the fast loader (on its copy stream) and the GPU-resident loader (in its gather) already lay the
    batches out channels-last, so the training step's own conversion has nothing left to do.
    """
    memory_format = torch.channels_last_3d if params.channels_last else torch.contiguous_format
    if params.data_loader_config == "dali-lowmem":
        from utils.data.dali import get_dali_loader  # optional extra: DALI and utils.make_dataset only when used
        return get_dali_loader(params, split, rank, world_size, device)
    if params.data_loader_config == "gpu":
        from utils.data.gpu import get_gpu_loader
        return get_gpu_loader(params, split, rank, world_size, device, memory_format=memory_format)
    if params.fast_loader:
        from utils.data.fast import get_fast_loader
        return get_fast_loader(params, split, rank, world_size, device, memory_format=memory_format)
    return get_torch_loader(params, split, rank, world_size, device)
