"""The data package: random crops of periodic boxes with random cube-symmetry augmentation.

Vocabulary of the tutorial:
- ``RandomCropDataset`` serves sample ``(epoch, index)``: a ``data_size``^3 crop of the N-body
  input (4 channels) and the matching hydro target (5 channels).
  Both are moved by the same one of the 48 symmetries of the cube, velocity vectors included
  (``utils.symmetry``).
- ``get_data_loader`` is the factory that builds a ``DataLoader`` for a config.

Reproducibility contract: the crop corner and symmetry element of sample ``index`` in ``epoch``
are a pure function of ``(seed, epoch, index)`` (see ``sample_plan``), independent of world size,
rank and loader workers. Ranks take disjoint shares of the indices; step ``s`` of an epoch uses
indices ``[s * global_batch, (s + 1) * global_batch)`` whatever the world size, so a 2-rank run
sees the same global batches as a 1-rank run and a resumed run continues exactly.

Layers (a module imports only from the layers below it, never from this package's namespace):

- ``spec``: ``SplitSpec`` (a split's settings, read from the config once), ``sample_plan``, the
  ``ShardedSampler`` and its ``BatchPlan``s, ``PlannedLoader`` (the batch loaders' ``len``);
  ``files``: ``read_volume_shapes``, ``check_data_file``, ``check_normalisation``, ``lacks_normalisation``
  (errors are ``utils.errors.DataError``);
- ``torch_loader``: ``RandomCropDataset``, the straightforward ``DataLoader``;
  ``gpu``: the GPU-resident loader; ``dali``: the NVIDIA DALI pipeline (optional extra);
- ``fast``: the fast CPU loader (threads, reusable pinned batches, ``DevicePrefetcher``);
- ``factory``: ``get_data_loader``, the only module that knows every loader.

``prepare`` (``prepare_data``, ``missing_data_message``) makes or checks the data files before a run.
"""
from utils.data.factory import get_data_loader
from utils.data.files import check_data_file, check_normalisation, lacks_normalisation, read_volume_shapes
from utils.data.spec import (SPLITS, VECTOR_CHANNELS, BatchPlan, ShardedSampler, SplitSpec, build_sampler,
                             sample_plan)
from utils.data.torch_loader import RandomCropDataset
from utils.errors import DataError

__all__ = ["SPLITS", "VECTOR_CHANNELS", "BatchPlan", "DataError", "RandomCropDataset", "ShardedSampler",
           "SplitSpec", "build_sampler", "check_data_file", "check_normalisation", "get_data_loader",
           "lacks_normalisation", "read_volume_shapes", "sample_plan"]
