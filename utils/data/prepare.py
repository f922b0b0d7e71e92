"""Before a run: make the quickstart data on first use, or say in one line which data files are missing.

``prepare_data(params, info, log)`` is what train.py calls before building its loaders; it
generates files (utils/make_dataset.py) only for configs that ask for it with ``generate_data``,
never for configs that name the user's files.
"""
import torch.distributed as dist

from utils.config import resolve_path
from utils.errors import DataError


def missing_data_message(params):
    """One line for a config whose data files are missing: both files, commands that make them at the config's
    box sizes (with the memory and disk they need), and the laptop path. None when nothing is missing."""
    files = [(resolve_path(path), box, seed) for path, box, seed in
             ((params.train_path, params.box_size[0], 1), (params.val_path, params.box_size[1], 2))]
    missing = [(path, box, seed) for path, box, seed in files if not path.exists()]
    if not missing:
        return None
    largest = max(box for _, box, _ in missing)
    make = " && ".join(f"python -m utils.make_dataset --box {box} --seed {seed} --out {path}"
                       for path, box, seed in missing)
    return (f"missing data: {' and '.join(f'{path} ({box}^3)' for path, box, _ in missing)}; make "
            f"{'it' if len(missing) == 1 else 'them'} with `{make}` (the {largest}^3 box needs about "
            f"{14 * largest ** 3 / 2 ** 30:.1f} GiB of memory and {36 * largest ** 3 / 1e9:.1f} GB of disk), or point "
            f"--train_path/--val_path at your files and set --box_size to their sizes; on a laptop, "
            f"`python train.py --config=quickstart` makes small data of its own")


def prepare_data(params, info, log):
    """Generate the quickstart dataset on first use; never generate for configs that name user files.

    ``info``: the run's DistInfo (rank 0 generates, every rank waits for it); ``log``: a callable
    that reports one line (train.py's ``logger.info``).
    """
    if params.data_loader_config == "synthetic":
        return
    if params.generate_data is None:
        message = missing_data_message(params)
        if message:
            raise DataError(message)
        return
    if info.is_main:
        from utils.make_dataset import ensure_dataset
        for path, box, seed in ((params.train_path, params.box_size[0], params.generate_data["train_seed"]),
                                (params.val_path, params.box_size[1], params.generate_data["val_seed"])):
            path = resolve_path(path)
            if not path.exists():
                log(f"Generating {box}^3 dataset {path} (seed {seed}), first use only")
            # writes only what is missing (for DALI also the .npy twins of an existing file), on the run's
            # device: a run with device cpu leaves the GPU alone
            ensure_dataset(path, box, seed, npy=params.data_loader_config == "dali-lowmem", device=info.device)
    if info.enabled:
        dist.barrier()
