"""Science metrics at validation: is the predicted gas physically right, not only close in L1?

- ``metrics``: L1 in physical units, the gas power spectrum, the temperature-density relation;
- ``lyman_alpha``: the Lyman-alpha forest along skewers (flux PDF, 1D flux power), the observable the emulator
  is for;
- ``plots``: their figures and TensorBoard logging (the only module here that imports matplotlib);
- ``report``: ``python -m science.report RUN_DIR``, the one-page report of a run or a prediction.

train.py imports this package only when there is physics to measure (not on synthetic data) and talks to it
through the hook below: ``ValidationScience`` per validation pass, ``check_settings`` at start-up and
``mean_predictor_l1`` at the end.
"""
import h5py
import numpy as np
import torch

from science.metrics import ScienceMetrics, format_summary, lyman_alpha_settings
from utils.config import resolve_path
from utils.distributed import all_reduce_sum


def check_settings(params):
    """Stop at start-up, not after an epoch, when the data file does not say what the Lyman-alpha forest needs."""
    lyman_alpha_settings(params)


class ValidationScience:
    """One validation pass: ``update`` per batch (no host sync), then ``report`` once on every rank."""

    def __init__(self, params, device):
        self.metrics = ScienceMetrics.for_validation(params, device)  # with the Lyman-alpha flux statistics
        self.example = None  # (input, prediction, target) of the first crop, for the pictures

    def update(self, inp, prediction, target):
        self.metrics.update(prediction, target)
        if self.example is None:  # clones: a view would keep the whole batch alive
            self.example = (inp[0].clone(), prediction[0].clone(), target[0].clone())

    def report(self, info, writer, step, log):
        """Sum over ranks (a collective: every rank calls it), log the summary, and on rank 0 (``writer``) write the
        scalars and figures to TensorBoard."""
        self.metrics.all_reduce(info)
        scalars = self.metrics.compute()
        log(f"  Science: {format_summary(scalars)}")
        if self.metrics.flux is not None:
            log(f"  Lyman-alpha: {self.metrics.flux.summary(scalars)}")
        if writer:
            from science.plots import write_tensorboard  # matplotlib only where figures are drawn
            write_tensorboard(writer, step, self.metrics, self.example)


@torch.no_grad()
def mean_predictor_l1(params, val_loader, val_sampler, state):
    """Validation L1 of the trivial predictor that always outputs the training-set mean per channel."""
    with h5py.File(resolve_path(params.train_path), "r") as f:
        hydro = f["Hydro"]  # (C, N, N, N)
        stride = max(1, hydro.shape[1] // 256)  # boxes above 256^3: the mean of an even sub-grid
        mean = np.stack([hydro[c, ::stride, ::stride, ::stride].mean(dtype=np.float64) for c in range(hydro.shape[0])])
    mean = torch.from_numpy(mean).float().to(state.info.device).view(1, -1, 1, 1, 1)
    total, count = 0.0, 0
    val_sampler.set_epoch(0)
    for _, tar in val_loader:
        tar = state.to_device(tar)
        total += (tar.float() - mean).abs().mean().item() * tar.shape[0]
        count += tar.shape[0]
    total, count = all_reduce_sum([total, count], state.info)
    return total / count
