"""The HDF5 data files: their layout and the checks that fail early, in one line, on a bad file.

A split's file holds two float32 datasets over the same periodic N^3 box: ``Nbody`` (4, N, N, N),
the N-body (dark matter) input, and ``Hydro`` (5, N, N, N), the hydro (gas) target; channels 1-3
of both are velocity components. A file that stores normalisation constants (HDF5 attributes, as
utils/make_dataset.py writes them) must store utils/units.py's. Every failure is a ``DataError``
(utils/errors.py) whose message says what is wrong and what to do. Imports nothing of the data package.

``prepare_data(params, info, log)`` is what train.py calls before building its loaders: it generates files
(utils/make_dataset.py) only for configs that ask for it with ``generate_data``, never for configs that name
the user's files, and else says in one line which files are missing.
"""
import h5py
import torch.distributed as dist

from utils.config import resolve_path
from utils.errors import DataError, first_line
from utils.units import NORMALISATION_ATTRS, normalisation_mismatches


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
                        f"`python -m utils.make_dataset --box {box} --out {path}` or point "
                        f"train_path/val_path at the real files (see README, 'Data')")
    shapes = read_volume_shapes(path, {"Nbody": in_channels, "Hydro": out_channels})
    if shapes["Nbody"][1:] != shapes["Hydro"][1:]:
        raise DataError(f"{path}: Nbody box {shapes['Nbody'][1:]} differs from Hydro box {shapes['Hydro'][1:]}; the "
                        f"two volumes must cover the same cells: rewrite or regenerate the file")
    if shapes["Nbody"][1] != box:
        raise DataError(f"{path} holds a {shapes['Nbody'][1]}^3 box but the config's box_size says {box}; "
                        f"set box_size to match the files")
    check_normalisation(path)
    return path


def check_normalisation(path):
    """DataError, one line, when HDF5 file ``path`` stores normalisation constants other than utils/units.py's."""
    with h5py.File(path, "r") as f:
        wrong = normalisation_mismatches(f.attrs)
    if wrong:
        raise DataError(f"{path} was normalised with other constants than utils/units.py's ("
                        + ", ".join(f"{name} {stored:g} there, {ours:g} here" for name, stored, ours in wrong)
                        + "): the physical-unit metrics would misread it; renormalise the file or make the two agree")


def lacks_normalisation(path):
    """Whether HDF5 file ``path`` stores no normalisation constants (utils/make_dataset.py's files store them; a file
    made elsewhere may not, and its physical-unit metrics then assume utils/units.py's). False without a file
    (DALI can read the .npy twins alone)."""
    path = resolve_path(path)
    if not path.exists():
        return False
    with h5py.File(path, "r") as f:
        return not any(name in f.attrs for name in NORMALISATION_ATTRS)


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
