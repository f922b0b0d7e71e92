"""The data package: ``get_data_loader`` builds the loader a config asks for, ``prepare_data`` makes or checks
the data files before a run.

torch_loader.py holds the sample stream every loader serves (``sample_plan``) and the straightforward loader, the
``base`` config's. The others are imported only when a config asks for them: ``fast_loader: true`` (fast.py, CPU
worker threads; quickstart's loader, and the ``*_opt`` configs' for inmem/lowmem), ``data_loader_config: gpu``
(gpu.py, GPU-resident: the ``*_opt`` configs'), ``dali-lowmem`` (dali.py, NVIDIA DALI). They serve the same sample
stream, so the choice changes speed, never results. No module of the package imports from here.
"""
import math

import torch
import torch.distributed as dist

from utils import DataError
from utils.config import resolve_path
from utils.distributed import env_ranks_per_node
from utils.data.torch_loader import (RandomCropDataset, ShardedSampler, check_data_file, check_normalised, fingerprint,
                                     get_torch_loader, read_volume_shapes, sample_plan, volume_bytes)

__all__ = ["DataError", "RandomCropDataset", "ShardedSampler", "check_data", "check_host_memory", "get_data_loader",
           "prepare_data", "read_volume_shapes", "sample_plan"]


def get_data_loader(params, split, rank=0, world_size=1, device=torch.device("cpu")):
    """``(loader, sampler)`` of ``split`` ('train' or 'val'), yielding after ``sampler.set_epoch(epoch)`` batches
    (input (B, 4, S, S, S), target (B, 5, S, S, S)) in the sampler's order; with ``spatial_parallel`` P, each rank's
    slab (B, C, S/P, S, S) (``rank`` is global). With ``channels_last`` the fast and GPU-resident loaders lay batches
    out channels-last already (in their copy or gather), so the training step's own conversion has nothing to do."""
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


def data_files(params):
    """[(path, box, seed)] of the training and validation files (seed: the generator's, or the one a message
    suggests); for DALI only those whose .npy twins are not all there (it reads the twins, alone if need be)."""
    if params.data_loader_config == "synthetic":
        return []
    seeds = params.generate_data or {"train_seed": 1, "val_seed": 2}
    files = [(resolve_path(params.train_path), params.box_size[0], seeds["train_seed"]),
             (resolve_path(params.val_path), params.box_size[1], seeds["val_seed"])]
    if params.data_loader_config == "dali-lowmem":
        from utils.make_dataset import npy_paths
        files = [file for file in files if not all(twin.exists() for twin in npy_paths(file[0]))]
    return files


def data_fingerprints(config):
    """{key: fingerprint} of the config's training and validation files that exist (none for synthetic data): what a
    checkpoint records of its data, and what a resume compares it with (utils/checkpoint.py's check_compatible)."""
    if config["data_loader_config"] == "synthetic":
        return {}
    return {key: fingerprint(path) for key in ("train_path", "val_path")
            if (path := resolve_path(config[key])).is_file()}


def check_data(params):
    """Every rank, before the run folder is made: a data file missing (where the config generates none) or not what
    the config says stops the command in one line, leaving no empty run behind. A config naming user files never
    generates; train.py turns generation off for paths given as flags."""
    files = data_files(params)
    missing = [(path, box, seed) for path, box, seed in files if not path.exists()]
    if missing and params.generate_data is None:
        largest = max(box for _, box, _ in missing)
        make = " && ".join(f"python -m utils.make_dataset --box {box} --seed {seed} --out {path}"
                           + " --npy" * (params.data_loader_config == "dali-lowmem") for path, box, seed in missing)
        raise DataError(f"missing data: {' and '.join(f'{path} ({box}^3)' for path, box, _ in missing)}; make "
                        f"{'it' if len(missing) == 1 else 'them'} with `{make}` (the {largest}^3 box needs "
                        f"about {14 * largest ** 3 / 2 ** 30:.1f} GiB of memory and {36 * largest ** 3 / 1e9:.1f} "
                        f"GB of disk), or point --train_path/--val_path at your files and set --box_size to "
                        f"their sizes; on a laptop, `python train.py --config=quickstart` makes small data of "
                        f"its own")
    for path, box, _ in files:
        if path.exists():
            check_normalised(check_data_file(path, box, params.N_in_channels, params.N_out_channels))


def check_host_memory(params, info):
    """inmem reads both splits' volumes whole into every rank: past a node's memory (or the job's limit) the kernel
    kills its ranks mid-read, with no message. Refuse first, before anything is loaded, so that what is free now is
    what the node's ranks will share. Every rank decides the same (one collective): free memory differs from node to
    node and moment to moment, and ranks stopping alone would leave the others waiting in a collective."""
    if params.data_loader_config != "inmem":
        return
    from utils.make_dataset import memory_available  # MemAvailable and the cgroup's limit, as generation checks
    per_rank = sum(volume_bytes(box, params.N_in_channels, params.N_out_channels)
                   for path, box, _ in data_files(params) if path.exists())
    available = memory_available()
    shortfall = torch.tensor(-math.inf if available is None else env_ranks_per_node() * per_rank - available,
                             dtype=torch.float64, device=info.device)
    if info.enabled:
        dist.all_reduce(shortfall, op=dist.ReduceOp.MAX)  # the worst node's
    if shortfall.item() > 0:
        raise DataError(f"data_loader_config inmem loads the training and validation volumes whole into every rank "
                        f"({per_rank / 2 ** 30:.1f} GiB each): a node's ranks need {shortfall.item() / 2 ** 30:.1f} "
                        f"GiB more than it has available (MemAvailable, or the job's memory limit); use "
                        f"--data_loader_config lowmem (crops read from the file), fewer ranks per node, or more "
                        f"memory")


def prepare_data(params, info, log):
    """Generate the quickstart dataset on first use (``generate_data``: rank 0 of DistInfo ``info`` writes the files
    check_data let pass as missing, every rank waits; ``log`` reports one line)."""
    if params.generate_data is None:
        return
    if info.is_main:
        from utils.make_dataset import ensure_dataset
        for path, box, seed in data_files(params):
            if not path.exists():
                log(f"Generating {box}^3 dataset {path} (seed {seed}), first use only")
            # only what is missing (for DALI also the .npy twins of an existing file), on the run's device
            ensure_dataset(path, box, seed, npy=params.data_loader_config == "dali-lowmem", device=info.device)
    if info.enabled:
        dist.barrier()
