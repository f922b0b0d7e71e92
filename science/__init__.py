"""Science metrics at validation: is the predicted gas physically right, not only close in L1?

- ``metrics``: L1 in physical units, the gas power spectrum, the temperature-density relation;
- ``lyman_alpha``: the Lyman-alpha forest along skewers (flux PDF, 1D flux power), the observable the emulator
  is for;
- ``plots``: their figures and TensorBoard logging (``metrics`` and ``lyman_alpha`` import no matplotlib);
- ``report``: ``python -m science.report RUN_DIR``, the one-page report of a run or a prediction.

train.py imports this package only when there is physics to measure (not on synthetic data) and talks to it
through the hook below: ``ValidationScience`` per validation pass, ``check_settings`` at start-up and
``mean_predictor_l1`` at the end. The physical units these metrics read the data in are utils/units.py's:
``check_normalisation`` refuses a data file normalised with other constants (predict.py, the report and the DALI
loader call it too).
"""
from pathlib import Path

import h5py
import numpy as np
import torch

from science.metrics import ScienceMetrics, format_summary, lyman_alpha_settings
from utils import DataError
from utils.config import resolve_path
from utils.distributed import all_reduce_sum
from utils.units import NORMALISATION_ATTRS, normalisation_mismatches


def check_settings(params, info, warn):
    """Stop at start-up, not after an epoch, when a data file was normalised with other constants than
    utils/units.py's or does not say what the Lyman-alpha forest needs. On rank 0 (``info.is_main``), ``warn``
    (a callable taking one line) flags a file that stores no normalisation constants: its units are assumed."""
    for path in dict.fromkeys((params.train_path, params.val_path)):
        if check_normalisation(resolve_path(path)) is False and info.is_main:
            warn(f"WARNING: {path} stores no normalisation constants (not a utils/make_dataset.py file): the "
                 f"physical-unit metrics assume utils/units.py's, rho/mean = exp(14 x), v = 500 x km/s, "
                 f"T = 10^(4.5 + 2.5 x) K")
    lyman_alpha_settings(params)


def check_normalisation(path):
    """Whether HDF5 file ``path`` stores normalisation constants (utils/make_dataset.py's files do; a file made
    elsewhere may not); a one-line DataError when they are not utils/units.py's. None without a file (DALI can
    read the .npy twins alone)."""
    path = Path(path)
    if not path.exists():
        return None
    with h5py.File(path, "r") as f:
        wrong = normalisation_mismatches(f.attrs)
        stores_constants = any(name in f.attrs for name in NORMALISATION_ATTRS)
    if wrong:
        raise DataError(f"{path} was normalised with other constants than utils/units.py's ("
                        + ", ".join(f"{name} {stored:g} there, {ours:g} here" for name, stored, ours in wrong)
                        + "): the physical-unit metrics would misread it; renormalise the file or make the two agree")
    return stores_constants


class ValidationScience:
    """One validation pass: ``update`` per batch (no host sync), then ``report`` once on every rank."""

    def __init__(self, params, device):
        self.metrics = ScienceMetrics.for_validation(params, device)  # with the Lyman-alpha flux statistics
        self.example = None  # (input, prediction, target) of the first crop, for the pictures

    def update(self, inp, prediction, target):
        self.metrics.update(prediction, target)
        if self.example is None:  # clones: a view would keep the whole batch alive
            self.example = (inp[0].clone(), prediction[0].clone(), target[0].clone())

    def report(self, info, writer, step, log, figures=True):
        """Sum over ranks (a collective: every rank calls it), log the summary, and on rank 0 (``writer``) write the
        scalars, and the ``figures``, to TensorBoard."""
        self.metrics.all_reduce(info)
        scalars = self.metrics.compute()
        log(f"  Science: {format_summary(scalars)}")
        if self.metrics.flux is not None:
            log(f"  Lyman-alpha: {self.metrics.flux.summary(scalars)}")
        if writer:
            from science.plots import write_tensorboard  # matplotlib only where figures are drawn
            write_tensorboard(writer, step, self.metrics, scalars, self.example, figures=figures)


def _channel_means(hydro):
    """Per-channel means of a (C, N, N, N) volume; of an even sub-grid for boxes above 256^3."""
    stride = max(1, hydro.shape[1] // 256)
    return np.stack([hydro[c, ::stride, ::stride, ::stride].mean(dtype=np.float64) for c in range(hydro.shape[0])])


@torch.no_grad()
def mean_predictor_l1(params, val_loader, val_sampler, state):
    """Validation L1 of the trivial predictor that always outputs the training-set mean per channel."""
    path = resolve_path(params.train_path)
    if path.exists():
        with h5py.File(path, "r") as f:
            mean = _channel_means(f["Hydro"])
    else:  # a DALI run on the .npy twins alone: the (N, N, N, C) label twin, mapped (not read whole), as (C, N, N, N)
        from utils.make_dataset import npy_paths
        mean = _channel_means(np.load(npy_paths(path)[1], mmap_mode="r").transpose(3, 0, 1, 2))
    mean = torch.from_numpy(mean).float().to(state.info.device).view(1, -1, 1, 1, 1)
    total, count = 0.0, 0
    val_sampler.set_epoch(0)
    for _, tar in val_loader:
        tar = state.to_device(tar)
        total += (tar.float() - mean).abs().mean().item() * tar.shape[0]
        count += tar.shape[0]
    total, count = all_reduce_sum([total, count], state.info)
    return total / count
