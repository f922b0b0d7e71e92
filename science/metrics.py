"""Science metrics at validation: does the predicted gas have the right physics?

The loss (mean L1 of normalised fields) says how close the numbers are. A cosmologist asks more:
on the (prediction, target) batches of normalised hydro fields (B, 5, S, S, S), this module measures

- L1 per field, in normalised units (what the loss averages) and in physical units: gas density in
  units of the mean, velocities in km/s, temperature in K (dominated by the densest and hottest
  cells: that is what an absolute error in those units means);
- the ratio of predicted to true gas-density power spectrum per k shell: the clustering amplitude
  of the prediction scale by scale (1: right; below 1 at high k: too smooth);
- the temperature-density relation T = T0 (rho/mean)^(gamma - 1) of the photo-ionised IGM, fitted
  on the predicted and on the true fields;
- with ``lyman_alpha`` settings, the Lyman-alpha forest: flux PDF and 1D flux power spectrum along
  skewers through the crops (science/lyman_alpha.py), the observable the emulator is meant for.

    science = ScienceMetrics.for_validation(params, info.device)   # crops of data_size, Lyman-alpha as configured
    for inp, tar in loader:
        science.update(model(inp), tar)       # no host sync
    science.all_reduce(info)                  # one collective under DDP (plus the flux statistics' few)
    scalars = science.compute()               # {"L1/gas_density": ..., "T_rho/gamma_pred": ...}

Every statistic is a sum over cells or crops held in one float64 device tensor (``sums``), so
``update`` never waits for the device, ranks combine with one all-reduce, and the result does not
depend on how the crops were split into batches or ranks.
The figures of these metrics and their TensorBoard logging (``write_tensorboard``) are in
science/plots.py: this module imports no matplotlib.

Power spectrum. A crop is not periodic, but the FFT treats it as if it were: the jump between
opposite faces leaks power to high k along the axes. The gas is smoothed on ~1.5 cells, so its true
power falls by orders of magnitude towards the Nyquist, and for raw 64^3 crops of a generated box
that leakage is 7x the real power at 4-cell wavelengths and 10^7x near 2 cells. So each crop's
contrast delta = rho/mean - 1, less its crop average, is multiplied by a 3D Hann window (normalised
to mean(w^2) = 1). Measured on 64^3 crops of a generated 256^3 box against the periodic box's own
P(k): within 10% at wavelengths 32-5 cells, 1.1-1.2x at 5-3.4 cells, up to 1.6x at 2.3 cells and
2-9x on the last three shells (where the real power is 1e-13 of its peak); the window smears the
lowest shell (|k| = 1 reads 0.56 of the box's). Prediction and target are measured the same way,
so the ratio compares like with like, and a prediction rho_pred = a rho gives a ratio of a^2 at
every k. A whole periodic box (``periodic=True``: predict.py's output, the science report) is measured
without the window. |delta_k|^2 is summed over spherical shells of integer |k| in units of the crop's
fundamental mode 2 pi / S, from 1 to the axis Nyquist S/2. The scalars group the shells into
octaves of wavelength S/|k| in cells: ``power_ratio/wavelength_4-8_cells`` is the summed predicted
power over the summed true power at wavelengths in [4, 8) cells, and
``cross_correlation/wavelength_4-8_cells`` is r = P_cross / sqrt(P_pred P_true) there: 1 when the
prediction's structures at those scales are the true ones, near 0 when they are noise. Together they
give the error power: P_err / P_true = ratio + 1 - 2 r sqrt(ratio).

Temperature-density relation. The generator (utils/make_dataset.py) sets T = T0 (rho/mean)^(gamma-1)
and adds shock heating where the gas converges; underdense gas mostly expands, so there the relation
holds, with a hot tail of converging cells. A least-squares fit over all underdense cells is pulled
up by that tail (slope 0.54-0.58 over rho/mean < 1 on generated boxes, for the generator's 0.50);
the median log T of each density bin is not. So the accumulated 2D histogram of (log rho, log T)
gives the median log10 T of each 0.05-dex density column with log10(rho/mean) in
FIT_LOG_DENSITY_RANGE (rho/mean 0.1 to 0.8), and a straight line fitted to those medians, weighted
by cell counts, gives log10 T0 (intercept) and gamma - 1 (slope). On 32^3 and 64^3 crops of
generated 64^3 to 256^3 boxes this recovers gamma 1.502-1.504 and T0 within 0.8% of the
generator's 1.5 and 1e4 K.
"""
import math

import numpy as np
import torch

from science.lyman_alpha import FluxStatistics, LymanAlphaSettings, cell_size_for, format_bands, wavelength_octaves
from utils.distributed import sum_over_ranks
from utils.units import (DENSITY_LOG_SCALE, HYDRO_CHANNELS, TEMPERATURE_LOG10_OFFSET, TEMPERATURE_LOG10_SCALE,
                         to_physical)

DENSITY, TEMPERATURE = 0, 4                  # hydro channel indices
PHYSICAL_NAMES = ("gas_density_over_mean", "gas_vx_km_s", "gas_vy_km_s", "gas_vz_km_s", "temperature_K")
L1_TAGS = tuple(f"L1/{name}" for name in HYDRO_CHANNELS)
L1_PHYSICAL_TAGS = tuple(f"L1_physical/{name}" for name in PHYSICAL_NAMES)
T_RHO_TAGS = ("T_rho/gamma_pred", "T_rho/gamma_true", "T_rho/T0_pred_K", "T_rho/T0_true_K")

# (log rho, log T) histogram over the whole normalised range (-1, 1) of both channels, so no cell
# falls outside: 243 bins of 0.05 dex in density (log10 rho/mean in (-6.08, 6.08)), 200 bins of
# 0.025 dex in temperature (log10 T in (2, 7)).
NUM_DENSITY_BINS, NUM_TEMPERATURE_BINS = 243, 200
FIT_LOG_DENSITY_RANGE = (-1.0, -0.1)         # log10(rho/mean) of the columns the T-rho line is fitted on
_LOG10_DENSITY_PER_UNIT = DENSITY_LOG_SCALE / math.log(10)  # normalised density -> log10(rho/mean)


def log_density_edges():
    """Bin edges of the T-rho histogram in log10(rho/mean), (NUM_DENSITY_BINS + 1,)."""
    return np.linspace(-1, 1, NUM_DENSITY_BINS + 1) * _LOG10_DENSITY_PER_UNIT


def log_temperature_edges():
    """Bin edges of the T-rho histogram in log10(T / K), (NUM_TEMPERATURE_BINS + 1,)."""
    return np.linspace(-1, 1, NUM_TEMPERATURE_BINS + 1) * TEMPERATURE_LOG10_SCALE + TEMPERATURE_LOG10_OFFSET


def _histogram_bin(x, num_bins):
    """Bin index of normalised values on (-1, 1) split into num_bins; tanh's exact +-1 go to the edge bins."""
    return ((x + 1) * (num_bins / 2)).floor().long().clamp_(0, num_bins - 1)


def fit_temperature_density(histogram):
    """(gamma, T0 in K) from a (NUM_DENSITY_BINS, NUM_TEMPERATURE_BINS) histogram of cell counts.

    The median log10 T of each density column in FIT_LOG_DENSITY_RANGE (interpolated inside its
    temperature bin), then a count-weighted straight line through the medians at the column
    centres. NaN when fewer than two columns hold cells. The binning limits the accuracy: exact
    relations with gamma 1.2 to 2.0 on generated 32^3 boxes come back within 0.007 in gamma and
    0.4% in T0.
    """
    density_edges, temperature_edges = log_density_edges(), log_temperature_edges()
    centres = 0.5 * (density_edges[1:] + density_edges[:-1])
    columns = (centres >= FIT_LOG_DENSITY_RANGE[0]) & (centres <= FIT_LOG_DENSITY_RANGE[1])
    counts = histogram[columns]                                  # (columns, T)
    totals = counts.sum(axis=1)
    occupied = totals > 0
    if occupied.sum() < 2:
        return math.nan, math.nan
    counts, totals, x = counts[occupied], totals[occupied], centres[columns][occupied]
    cumulative = counts.cumsum(axis=1)
    half = totals / 2
    median_bin = (cumulative < half[:, None]).sum(axis=1)        # first bin whose cumulative count reaches half
    rows = np.arange(len(counts))
    below = np.where(median_bin > 0, cumulative[rows, median_bin - 1], 0.0)
    width = temperature_edges[1] - temperature_edges[0]
    medians = temperature_edges[median_bin] + (half - below) / counts[rows, median_bin] * width
    # np.polyfit weights multiply the residuals: sqrt(count) weighs each squared residual by its cells.
    slope, intercept = np.polyfit(x, medians, 1, w=np.sqrt(totals))
    return 1.0 + slope, 10.0 ** intercept


class ScienceMetrics:
    """Accumulates science metrics over validation batches of (B, 5, S, S, S) normalised hydro fields.

    ``lyman_alpha``: a ``LymanAlphaSettings`` to add the Lyman-alpha flux statistics
    (science/lyman_alpha.py: flux PDF, P1D) on skewers through the same fields; None leaves them out.
    ``periodic``: the "crops" are whole periodic boxes (predict.py, the science report): no Hann window
    on the 3D power spectrum nor on the flux P1D.
    """

    def __init__(self, crop_size, device, lyman_alpha=None, periodic=False):
        self.crop_size = crop_size
        self.device = torch.device(device)
        self.periodic = periodic
        self.flux = (FluxStatistics(crop_size, lyman_alpha, self.device, periodic=periodic)
                     if lyman_alpha is not None else None)
        num_shells = crop_size // 2                              # |k| = 1 .. S/2 in units of 2 pi / S
        num_hist = NUM_DENSITY_BINS * NUM_TEMPERATURE_BINS
        self._sizes = dict(num_crops=1, l1=5, l1_physical=5, power_pred=num_shells, power_true=num_shells,
                           hist_pred=num_hist, hist_true=num_hist, power_cross=num_shells)
        # The whole state, one flat tensor (what all_reduce sums); the attributes below are views of it.
        self.sums = torch.zeros(sum(self._sizes.values()), dtype=torch.float64, device=self.device)
        for name, view in zip(self._sizes, self.sums.split(list(self._sizes.values()))):
            setattr(self, name, view)
        self._host = None                                        # numpy copy of sums, made once per compute

        # rfftn modes (S, S, S//2 + 1): integer wavenumbers, shell = round(|k|), and the weight of each
        # stored mode (2: it stands for itself and its conjugate, 1 for the kz = 0 and kz = S/2 planes).
        k_full = torch.fft.fftfreq(crop_size, 1 / crop_size)
        k_half = torch.fft.rfftfreq(crop_size, 1 / crop_size)
        k_norm = (k_full[:, None, None] ** 2 + k_full[None, :, None] ** 2 + k_half[None, None, :] ** 2).sqrt()
        shell = k_norm.round().long().flatten()
        weight = torch.full(k_norm.shape, 2.0)
        weight[..., 0] = 1.0
        if crop_size % 2 == 0:
            weight[..., -1] = 1.0
        weight = weight.flatten()
        used = (shell >= 1) & (shell <= num_shells)
        self._mode_index = used.nonzero().squeeze(1).to(self.device)  # flat positions of the modes kept
        self._mode_shell = (shell[used] - 1).to(self.device)          # their shell, 0 .. S/2 - 1
        self._mode_weight = weight[used].to(self.device)
        self.modes_per_shell = torch.zeros(num_shells, dtype=torch.float64).index_add_(
            0, shell[used] - 1, weight[used].double()).numpy()
        if periodic:
            self._window = torch.ones((crop_size,) * 3, device=self.device)
        else:
            hann = torch.hann_window(crop_size, periodic=False, dtype=torch.float64)
            window = hann[:, None, None] * hann[None, :, None] * hann[None, None, :]
            self._window = (window / (window ** 2).mean().sqrt()).float().to(self.device)  # (S, S, S)

    @torch.no_grad()
    def update(self, prediction, target):
        """Add a batch; prediction and target are normalised (B, 5, S, S, S), any float dtype."""
        expected = (5,) + (self.crop_size,) * 3
        if prediction.shape != target.shape or tuple(prediction.shape[1:]) != expected:
            raise ValueError(f"science metrics expect prediction and target of shape (B, "
                             f"{', '.join(map(str, expected))}), got {tuple(prediction.shape)} and "
                             f"{tuple(target.shape)}")
        prediction, target = prediction.float(), target.float()  # autocast outputs may be bf16/fp16
        self._host = None
        self.num_crops += prediction.shape[0]
        self.l1 += (prediction - target).abs().sum(dim=(0, 2, 3, 4), dtype=torch.float64)
        physical_pred = to_physical(prediction, "hydro", channel_axis=1)
        physical_true = to_physical(target, "hydro", channel_axis=1)
        self.l1_physical += (physical_pred - physical_true).abs().sum(dim=(0, 2, 3, 4), dtype=torch.float64)
        density_modes = []
        for power, physical in ((self.power_pred, physical_pred), (self.power_true, physical_true)):
            density = physical[:, DENSITY]                                    # rho/mean (B, S, S, S)
            # delta = rho/mean - 1 (mean of the box: the data's unit) less its crop average, which the
            # window would otherwise spread into the lowest shells
            contrast = density - density.mean(dim=(1, 2, 3), keepdim=True)
            modes = torch.fft.rfftn(contrast * self._window, dim=(1, 2, 3))    # (B, S, S, S//2+1) complex
            modes_power = (modes.real ** 2 + modes.imag ** 2).sum(0).flatten()  # summed over the batch
            power.index_add_(0, self._mode_shell, (modes_power[self._mode_index] * self._mode_weight).double())
            density_modes.append(modes)
        cross = (density_modes[0] * density_modes[1].conj()).real.sum(0).flatten()   # Re(pred true*)
        self.power_cross.index_add_(0, self._mode_shell, (cross[self._mode_index] * self._mode_weight).double())
        for histogram, fields in ((self.hist_pred, prediction), (self.hist_true, target)):
            density_bin = _histogram_bin(fields[:, DENSITY], NUM_DENSITY_BINS)            # (B, S, S, S)
            temperature_bin = _histogram_bin(fields[:, TEMPERATURE], NUM_TEMPERATURE_BINS)
            flat = (density_bin * NUM_TEMPERATURE_BINS + temperature_bin).flatten()
            # index_add_, not bincount: CUDA's bincount reads the bins' min and max on the host (two waits)
            histogram.index_add_(0, flat, torch.ones_like(flat, dtype=histogram.dtype))
        if self.flux is not None:
            self.flux.update(prediction, target)

    def all_reduce(self, info):
        """Sum the state over ranks (one collective; a no-op in a single process), and finalize the flux
        statistics over ranks (a fixed number of small collectives). Call on every rank."""
        sum_over_ranks(self.sums, info)
        if self.flux is not None:
            self.flux.finalize(info)
        self._host = None

    def _state(self):
        """The state as numpy arrays by name (one device -> host copy, cached until the next update)."""
        if self._host is None:
            host = self.sums.cpu().numpy()  # the one host sync
            if not host[0] > 0:  # num_crops
                raise RuntimeError("ScienceMetrics has no data: call update() with validation batches before "
                                   "reading it")
            self._host = dict(zip(self._sizes, np.split(host, np.cumsum(list(self._sizes.values()))[:-1])))
        return self._host

    def compute(self):
        """The scalars (floats by TensorBoard tag): L1 per field (normalised and physical), the power ratio and the
        cross-correlation r per octave, the T-rho fits, and the Lyman-alpha statistics when configured."""
        state = self._state()
        num_cells = state["num_crops"][0] * self.crop_size ** 3
        scalars = {}
        for tag, l1 in zip(L1_TAGS, state["l1"] / num_cells):
            scalars[tag] = float(l1)
        for tag, l1 in zip(L1_PHYSICAL_TAGS, state["l1_physical"] / num_cells):
            scalars[tag] = float(l1)
        octaves = self.wavelength_octaves().items()
        for (low, high), shells in octaves:
            ratio = state["power_pred"][shells].sum() / state["power_true"][shells].sum()
            scalars[f"power_ratio/wavelength_{low}-{high}_cells"] = float(ratio)
        for (low, high), shells in octaves:
            pred, true, cross = (state[name][shells].sum() for name in ("power_pred", "power_true", "power_cross"))
            # NaN where a field has no power at all; a constant float32 prediction keeps rounding's, so r is noise
            r = cross / math.sqrt(pred * true) if pred * true > 0 else math.nan
            scalars[f"cross_correlation/wavelength_{low}-{high}_cells"] = float(r)
        (gamma_pred, t0_pred), (gamma_true, t0_true) = (fit_temperature_density(self.histogram(which))
                                                        for which in ("pred", "true"))
        scalars.update(zip(T_RHO_TAGS, map(float, (gamma_pred, gamma_true, t0_pred, t0_true))))
        if self.flux is not None:
            scalars.update(self.flux_statistics().compute())
        return scalars

    @classmethod
    def for_validation(cls, params, device):
        """The metrics train.py's validation accumulates: crops of params.data_size, Lyman-alpha as configured."""
        return cls(params.data_size, device, lyman_alpha=lyman_alpha_settings(params))

    def flux_statistics(self):
        """The finalized FluxStatistics (finalized here, in this process alone, if all_reduce was not called)."""
        if self.flux is None:
            raise RuntimeError("ScienceMetrics was made without lyman_alpha settings")
        if self.flux.amplitude is None:
            self.flux.finalize(None)
        return self.flux

    def wavelength_octaves(self):
        """{(low, high): shell indices} grouping shells |k| = n (index n - 1) by wavelength S/n in [low, high) cells:
        the flux P1D's octaves (lyman_alpha.wavelength_octaves) of a crop_size-cell line."""
        return {band: [n - 1 for n in modes] for band, modes in wavelength_octaves(self.crop_size).items()}

    def power_spectra(self):
        """Shell-averaged P(k) in cells^3 of prediction and target: dict of (S/2,) numpy arrays.

        k is in cycles per cell (1 / wavelength; 0.5 is the Nyquist), shells |k| = n / S.
        """
        state = self._state()
        norm = state["num_crops"][0] * self.modes_per_shell * self.crop_size ** 3
        k = np.arange(1, self.crop_size // 2 + 1) / self.crop_size
        with np.errstate(divide="ignore", invalid="ignore"):  # shells without power: inf or NaN, not a warning
            ratio = state["power_pred"] / state["power_true"]
        return {"k": k, "power_pred": state["power_pred"] / norm, "power_true": state["power_true"] / norm,
                "ratio": ratio}

    def histogram(self, which):
        """(NUM_DENSITY_BINS, NUM_TEMPERATURE_BINS) cell counts of 'pred' or 'true' (edges: log_*_edges())."""
        return self._state()[f"hist_{which}"].reshape(NUM_DENSITY_BINS, NUM_TEMPERATURE_BINS)


def format_fit(value, spec, unit="", why=" (densities fill < 2 bins of the fit)"):
    """A fitted gamma or T0 for a log line; the fit's NaN (fewer than two occupied density columns, as in an
    untrained model's near-constant output) reads as what it is, not as a broken run."""
    return format(value, spec) + unit if math.isfinite(value) else "n/a" + why


def format_summary(scalars):
    """One log line from ``compute()``'s scalars: density and temperature L1, gamma, power ratios."""
    return (f"L1 gas density {scalars['L1/gas_density']:.5f}, temperature {scalars['L1/temperature']:.5f} | "
            f"T-rho gamma {format_fit(scalars['T_rho/gamma_pred'], '.3f')} "
            f"(target {format_fit(scalars['T_rho/gamma_true'], '.3f')}) | "
            f"P_pred/P_true at wavelengths [cells] {format_bands(scalars, 'power_ratio/')}")


def lyman_alpha_settings(params, data_path=None):
    """LymanAlphaSettings from a config's ``lyman_alpha`` section, or None when it is disabled.

    A null ``cell_size_mpc_h`` takes the ``cell_size_mpc_h`` attribute of ``data_path`` (default: the
    config's validation file); a file without one is a DataError (``cell_size_for``). Synthetic data has
    no file: the generator's 20/256 Mpc/h.
    """
    section = params.lyman_alpha
    if not section["enabled"]:
        return None
    cell_size = None
    if params.data_loader_config != "synthetic":
        from utils.config import resolve_path
        cell_size = cell_size_for(section, resolve_path(data_path or params.val_path),
                                  "give --lyman_alpha.cell_size_mpc_h (comoving Mpc/h per cell: the box's length "
                                  "over its cells per side), or switch them off with --no-lyman_alpha.enabled")
    return LymanAlphaSettings.from_config(section, cell_size)
