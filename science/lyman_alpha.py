"""Lyman-alpha forest statistics of predicted and true gas: the observable the emulator is for.

Along skewers (lines of sight) through the gas, the fluctuating Gunn-Peterson approximation (FGPA)
gives the neutral-hydrogen optical depth of photo-ionised gas in ionisation equilibrium,

    tau_real(x) = A (rho/mean)^2 (T / 10^4 K)^-0.7,

which is moved to redshift space: a cell at comoving position x with line-of-sight peculiar velocity
v absorbs at u = a H(z) x + v (km/s), spread by thermal Doppler broadening into a Gaussian line
exp(-(u' - u)^2 / b^2) / (sqrt(pi) b), b = sqrt(2 k_B T / m_p) (12.85 km/s at 10^4 K). Each cell's
optical depth is deposited into velocity bins of width dv = a H(z) dx (one per cell) with the
Gaussian integrated over each bin (erf differences; the profile is renormalised to sum to one, so
optical depth is conserved exactly), periodically wrapped along the skewer. The transmitted flux is
F = exp(-tau). A single constant A, the unknown photo-ionisation rate, is fixed so that the *true*
field has the chosen mean flux <exp(-A tau_true)> = mean_flux (0.7 at z = 3, roughly what is
observed); the prediction gets the same A, so an error in its density or temperature shows up as a
wrong mean flux, as it would in an analysis. Above about 10^5 K collisional ionisation takes over and the
FGPA no longer holds; such gas is so highly ionised that it hardly absorbs either way.

Units are the stored fields' (utils/units.py): cells of ``cell_size`` comoving Mpc/h (the config's
``cell_size_mpc_h``, else the data file's attribute of that name: ``cell_size_for``), velocities in
km/s, temperature in K. H(z) = 100 sqrt(omega_m (1+z)^3 + 1 - omega_m) km/s per Mpc/h (flat LCDM)
unless given, a = 1/(1+z); at z = 3 a generated box's cell (20/256 Mpc/h) is dv = 8.71 km/s.

Statistics, for prediction and truth:
- the flux PDF (50 bins on [0, 1]) and two distances between the predicted and true PDF: the
  Kolmogorov-Smirnov statistic (largest CDF difference) and the Wasserstein-1 distance (mean
  |CDF difference| over F: the average change of flux that turns one distribution into the other);
- the 1D flux power spectrum P1D(k) of delta_F = F / <F> - 1 along the skewers, in km/s, and the
  pred/true ratio summed over octaves of wavelength (in cells), as for the 3D power.

Validation works on crops, which are not periodic; a crop's skewer is treated as periodic (its
velocity-space positions wrap around the crop), for prediction and truth alike, and its flux
contrast is multiplied by a Hann window before the FFT (see ``FluxStatistics``). A whole periodic box
(predict.py, the science report) needs neither. How well crops measure P1D, on the true gas of the
generated 128^3 quickstart training box against the whole box (``python benchmarks/lya_crops.py``):
64^3 crops with the window read 1.00-1.09 of the box's P1D from 32 down to 2 cells (0.85 at the 64-cell
mode), without it 1.1-3.1; 32^3 crops (quickstart's) read 1.3-1.5 from 16 down to 3.2 cells and up to
10 at 2 cells (0.74 at 32 cells), without the window up to 3 already at 4 cells. A crop is only 279 km/s
long at z = 3, comparable to the peculiar velocities: its skewers are short absorption spectra. So
validation P1D ratios compare prediction and truth measured alike; predict.py and the science report
give the whole-box values.

    stats = FluxStatistics(skewer_length=S, settings=LymanAlphaSettings(), device=device)
    for prediction, target in batches:
        stats.update(prediction, target)      # normalised hydro (B, 5, S, S, S); no host sync
    stats.finalize(info)                      # solves A, then sums the statistics over ranks
    stats.compute()                           # {"lyman_alpha/p1d_ratio/wavelength_4-8_cells": ..., ...}
"""
import math
from dataclasses import dataclass

import h5py
import numpy as np
import torch

from utils import DataError, first_line
from utils.distributed import sum_over_ranks
from utils.units import DEFAULT_CELL_SIZE, denormalize_density, denormalize_temperature, denormalize_velocity

BOLTZMANN = 1.380649e-23          # J / K
PROTON_MASS = 1.67262192e-27      # kg
FGPA_TEMPERATURE_EXPONENT = -0.7  # tau ~ rho^2 T^-0.7 (recombination coefficient ~ T^-0.7)
FGPA_TEMPERATURE_UNIT = 1e4       # K
PROFILE_SIGMAS = 4.0              # line profiles are cut at PROFILE_SIGMAS b of the hottest profiled gas ...
PROFILE_MAX_TEMPERATURE = 1e6     # ... this temperature (K); hotter gas keeps its tau, in a truncated profile
FLUX_BINS = 50
_CHUNK_ELEMENTS = 1 << 22         # skewer cells x window bins per deposit chunk (memory bound)
_LOG10_TAU_RANGE = (-40.0, 40.0)  # histogram of log10 tau for the first guess of A
_LOG10_TAU_BINS = 1600            # 0.05 dex


def hubble_rate(redshift, omega_m):
    """H(z) of a flat LCDM universe in km/s per Mpc/h: 100 sqrt(omega_m (1+z)^3 + 1 - omega_m)."""
    return 100.0 * math.sqrt(omega_m * (1 + redshift) ** 3 + 1 - omega_m)


def thermal_width(temperature):
    """Doppler parameter b = sqrt(2 k_B T / m_p) in km/s (tensor or number)."""
    scale = math.sqrt(2 * BOLTZMANN / PROTON_MASS) / 1e3
    return temperature.sqrt() * scale if torch.is_tensor(temperature) else math.sqrt(temperature) * scale


@dataclass(frozen=True)
class LymanAlphaSettings:
    """Physical units and sampling of the flux statistics (the config's ``lyman_alpha`` section)."""
    redshift: float = 3.0
    omega_m: float = 0.3
    hubble: float = None          # H(z) in km/s per Mpc/h; None: flat LCDM from omega_m
    cell_size: float = DEFAULT_CELL_SIZE  # comoving Mpc/h per cell
    mean_flux: float = 0.7        # <F> of the true field
    skewer_stride: int = 4        # every n-th skewer along both transverse axes
    skewer_axes: int = 3          # 1: skewers along the first spatial axis only; 3: along all three

    @property
    def hubble_rate(self):
        return self.hubble if self.hubble is not None else hubble_rate(self.redshift, self.omega_m)

    @property
    def velocity_per_cell(self):
        """dv = a H(z) dx in km/s: the Hubble-flow velocity across one comoving cell."""
        return self.hubble_rate * self.cell_size / (1 + self.redshift)

    def describe(self):
        return (f"z={self.redshift:g}, H(z)={self.hubble_rate:.1f} km/s/(Mpc/h), cell {self.cell_size:.4g} Mpc/h = "
                f"{self.velocity_per_cell:.2f} km/s, mean flux {self.mean_flux:g}, skewer stride {self.skewer_stride} "
                f"along {self.skewer_axes} {'axes' if self.skewer_axes > 1 else 'axis'}")

    @classmethod
    def from_config(cls, section, cell_size=None):
        """From the config's ``lyman_alpha`` mapping; ``cell_size`` (e.g. a data file's) fills a null
        cell_size_mpc_h."""
        size = section["cell_size_mpc_h"] if section["cell_size_mpc_h"] is not None else cell_size
        return cls(redshift=section["redshift"], omega_m=section["omega_m"], hubble=section["hubble_km_s_mpc_h"],
                   cell_size=size if size is not None else DEFAULT_CELL_SIZE, mean_flux=section["mean_flux"],
                   skewer_stride=section["skewer_stride"], skewer_axes=section["skewer_axes"])


def cell_size_for(section, path, remedy):
    """Comoving Mpc/h per cell: the ``lyman_alpha`` section's ``cell_size_mpc_h``, else the HDF5 file ``path``'s.

    A file of utils/make_dataset.py stores its cell size as the attribute ``cell_size_mpc_h``. A file made
    elsewhere (the reference's Nyx boxes) does not, and a guess would shift every velocity-space scale of
    the flux statistics (thermal widths, peculiar-velocity shifts, P1D's k) by the ratio of the true to the
    guessed cell: that is a DataError whose message ends with ``remedy``, as is a file that cannot be read
    (DALI's .npy copies alone, say).
    """
    if section["cell_size_mpc_h"] is not None:
        return section["cell_size_mpc_h"]
    try:
        with h5py.File(path, "r") as f:
            value = f.attrs.get("cell_size_mpc_h")
    except OSError as err:
        raise DataError(f"cannot read the cell size of {path} ({first_line(err)}), which the Lyman-alpha "
                        f"statistics need; {remedy}") from None
    if value is None:
        raise DataError(f"{path} does not say its cell size (no cell_size_mpc_h attribute: it was not written by "
                        f"utils/make_dataset.py), which the Lyman-alpha statistics need; {remedy}")
    return float(value)


# --- skewers and optical depth -------------------------------------------------------------------------------

def skewers(fields, axis, stride=1, offset=None):
    """Physical (density rho/mean, temperature K, line-of-sight velocity km/s) along skewers, each (M, S).

    ``fields``: normalised hydro (B, 5, X, Y, Z) (or (5, X, Y, Z)). Skewers run along spatial ``axis``
    (0, 1, 2), one at every ``stride``-th cell of both transverse axes starting at ``offset`` (default
    stride // 2); the velocity is the component along the skewer.
    """
    if fields.dim() == 4:
        fields = fields[None]
    offset = stride // 2 if offset is None else offset
    fields = fields.movedim(2 + axis, -1)[:, :, offset::stride, offset::stride]     # (B, 5, T1, T2, S)
    return physical_skewers(fields.movedim(-1, 2 + axis), axis)


def physical_skewers(fields, axis):
    """Every skewer along ``axis`` of normalised hydro (B, 5, X, Y, Z): (rho/mean, T in K, v_axis in km/s), (M, S)."""
    out = []
    for channel in (0, 4, 1 + axis):                                                 # density, temperature, v
        field = fields[:, channel].movedim(1 + axis, -1)                             # (B, T1, T2, S)
        out.append(field.reshape(-1, field.shape[-1]).float())
    density, temperature, velocity = out
    return denormalize_density(density), denormalize_temperature(temperature), denormalize_velocity(velocity)


def optical_depth(density, temperature, velocity, velocity_per_cell, max_temperature=PROFILE_MAX_TEMPERATURE):
    """Redshift-space optical depth (A = 1) along periodic skewers; inputs (M, N) in rho/mean, K, km/s.

    Cell i (real-space centre i dv) lands at u_i = i + v_i / dv cells; its FGPA optical depth
    rho^2 (T/1e4)^-0.7 is spread over the bins round(u_i) - W .. round(u_i) + W (wrapped modulo N) by
    the Gaussian of width b_i / dv integrated over each bin, renormalised to sum to one. W covers
    PROFILE_SIGMAS thermal widths at ``max_temperature`` (at most (N - 1) // 2): a fixed, data-independent
    window, so no host sync.
    """
    m, n = density.shape
    device = density.device
    tau_real = density.float() ** 2 * (temperature.float() / FGPA_TEMPERATURE_UNIT) ** FGPA_TEMPERATURE_EXPONENT
    centre = torch.arange(n, device=device, dtype=torch.float32) + velocity.float() / velocity_per_cell
    width = (thermal_width(temperature.float()) / velocity_per_cell).clamp_min(1e-6)  # b in bins
    half = min((n - 1) // 2, math.ceil(PROFILE_SIGMAS * thermal_width(max_temperature) / velocity_per_cell) + 1)
    edges_offset = torch.arange(-half, half + 2, device=device, dtype=torch.float32) - 0.5  # (2W + 2,)
    bins_offset = torch.arange(-half, half + 1, device=device)                              # (2W + 1,)
    out = torch.zeros(m, n, device=device, dtype=torch.float32)
    rows = max(1, _CHUNK_ELEMENTS // (n * (2 * half + 2)))
    for first in range(0, m, rows):
        c, w, t = centre[first:first + rows], width[first:first + rows], tau_real[first:first + rows]
        nearest = c.round()
        cdf = torch.erf((nearest[..., None] + edges_offset - c[..., None]) / w[..., None])    # (r, N, 2W + 2)
        share = cdf[..., 1:] - cdf[..., :-1]                                                  # (r, N, 2W + 1)
        share = share / share.sum(-1, keepdim=True)
        index = (nearest.long()[..., None] + bins_offset) % n
        out[first:first + rows].scatter_add_(1, index.flatten(1), (t[..., None] * share).flatten(1))
    return out


def optical_depth_of_fields(fields, settings, axis, stride=None):
    """(M, S) unnormalised tau along ``axis`` of normalised hydro ``fields`` (B, 5, X, Y, Z)."""
    density, temperature, velocity = skewers(fields, axis, settings.skewer_stride if stride is None else stride)
    return optical_depth(density, temperature, velocity, settings.velocity_per_cell)


# --- normalisation ---------------------------------------------------------------------------------------------

def solve_amplitude(tau, mean_flux, info=None, newton_steps=3):
    """A with <exp(-A tau)> = mean_flux over every element of ``tau`` on every rank (float; same on all ranks).

    ``tau``: a tensor or a list of tensors (processed one at a time: memory stays one part in float64).
    First guess from a histogram of log10 tau (0.05 dex bins, each at its mean tau; one all-reduce),
    solved by bisection on the host, then ``newton_steps`` Newton steps in log A on the exact values
    (one all-reduce each). The number of collectives is fixed, so every rank makes the same calls.
    """
    if not 0 < mean_flux < 1:
        raise ValueError(f"mean_flux must be in (0, 1), got {mean_flux}")
    parts = [tau] if torch.is_tensor(tau) else list(tau)
    # A rank with no samples still joins the all-reduces, on its own device (NCCL refuses CPU tensors).
    device = parts[0].device if parts else (info.device if info is not None else torch.device("cpu"))
    low, high = _LOG10_TAU_RANGE
    scale = _LOG10_TAU_BINS / (high - low)
    sums = torch.zeros(2 * _LOG10_TAU_BINS, dtype=torch.float64, device=device)
    for part in parts:
        part = part.flatten().double()
        index = ((part.clamp_min(1e-300).log10() - low) * scale).floor().long().clamp(0, _LOG10_TAU_BINS - 1)
        sums[:_LOG10_TAU_BINS].index_add_(0, index, torch.ones_like(part))
        sums[_LOG10_TAU_BINS:].index_add_(0, index, part)
    counts, totals = sum_over_ranks(sums, info).cpu().numpy().reshape(2, -1)
    occupied = counts > 0
    if not occupied.any():
        raise ValueError("no optical depths to normalise")
    counts, mean_tau = counts[occupied], totals[occupied] / counts[occupied]

    def histogram_flux(log_a):
        return float((counts * np.exp(-np.exp(log_a) * mean_tau)).sum() / counts.sum())

    # <F>(A) falls from 1 (A = 0) towards the share of tau = 0 cells: bisect ln A over a range wide enough
    # for any tau the normalised fields can hold.
    low_a, high_a = -np.log(mean_tau.max()) - 50.0, -np.log(max(mean_tau.min(), 1e-300)) + 50.0
    for _ in range(200):
        middle = 0.5 * (low_a + high_a)
        if histogram_flux(middle) > mean_flux:
            low_a = middle
        else:
            high_a = middle
    log_a = 0.5 * (low_a + high_a)
    for _ in range(newton_steps):
        a = math.exp(log_a)
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for part in parts:
            part = part.flatten().double()
            flux = torch.exp(-a * part)
            sums += torch.stack([flux.sum(), (a * part * flux).sum(), torch.tensor(float(part.numel()),
                                                                                   dtype=torch.float64, device=device)])
        total_flux, slope, count = sum_over_ranks(sums, info).tolist()   # slope: -d<F>/d ln A, times count
        if slope <= 0:
            break
        step = (total_flux - mean_flux * count) / slope
        log_a += max(-2.0, min(2.0, step))              # a damped step: the histogram guess is already close
    return math.exp(log_a)


# --- statistics --------------------------------------------------------------------------------------------

def wavelength_octaves(length):
    """{(low, high): mode indices k} grouping k = 1 .. length // 2 by wavelength length/k in [low, high) cells."""
    octaves = {}
    for k in range(1, length // 2 + 1):
        low = 1 << ((length // k).bit_length() - 1)
        octaves.setdefault((low, 2 * low), []).append(k)
    return dict(sorted(octaves.items()))


class FluxStatistics:
    """Flux PDF and P1D of predicted and true gas, accumulated over batches and ranks.

    ``update`` computes the optical depth of a subset of skewers and keeps it on the device: 2 fields x
    4 bytes x axes / stride^2 per crop cell, 3 MB for quickstart's validation (256 crops of 32^3, stride
    8, 3 axes) and 200 MB for base's (8192 crops of 64^3, stride 16), divided among the ranks;
    ``finalize`` solves the amplitude A on the true optical depths of all ranks, turns both into flux,
    accumulates the statistics into one float64 tensor and sums it over ranks (a fixed number of
    collectives: DDP-safe). ``compute`` and the figures (science/plots.py) read the summed state.

    ``periodic``: the skewers span a whole periodic box (no window). Otherwise (crops) each skewer's flux
    contrast, less its own mean, is multiplied by a Hann window normalised to mean(w^2) = 1 before the
    FFT, as the 3D power spectrum does: without it the jump where a crop's skewer wraps around leaks
    power to high k. Prediction and target are measured the same way either way.
    """

    def __init__(self, skewer_length, settings=None, device="cpu", periodic=False, num_examples=4):
        self.length = skewer_length
        self.settings = settings or LymanAlphaSettings()
        self.device = torch.device(device)
        self.periodic = periodic
        self.num_examples = num_examples
        self._tau = {"pred": [], "true": []}
        self.amplitude = None
        self.examples = None   # {"pred": (E, S), "true": (E, S)} flux of the first skewers (this rank's)
        self._host = None
        half = skewer_length // 2 + 1
        self._sizes = {"count": 1, "flux_sum_pred": 1, "flux_sum_true": 1, "pdf_pred": FLUX_BINS,
                       "pdf_true": FLUX_BINS, "p1d_pred": half, "p1d_true": half}
        self.sums = torch.zeros(sum(self._sizes.values()), dtype=torch.float64, device=self.device)
        if periodic:
            self._window = torch.ones(skewer_length, device=self.device)
        else:
            hann = torch.hann_window(skewer_length, periodic=False, dtype=torch.float64)
            self._window = (hann / (hann ** 2).mean().sqrt()).float().to(self.device)

    def _view(self, name):
        start = 0
        for key, size in self._sizes.items():
            if key == name:
                return self.sums[start:start + size]
            start += size
        raise KeyError(name)

    @torch.no_grad()
    def update(self, prediction, target):
        """Add a batch of normalised hydro fields (B, 5, S, S, S) (or whole boxes (5, N, N, N) with B = 1)."""
        if self.amplitude is not None:
            raise RuntimeError("FluxStatistics was finalized; make a new one for new data")
        for which, fields in (("pred", prediction), ("true", target)):
            fields = fields.float()
            for axis in range(self.settings.skewer_axes):
                self._tau[which].append(optical_depth_of_fields(fields, self.settings, axis))

    def add_optical_depth(self, tau_pred, tau_true):
        """Add precomputed (M, length) optical depths (A = 1): predict.py streams a box slab by slab."""
        self._tau["pred"].append(tau_pred)
        self._tau["true"].append(tau_true)

    @torch.no_grad()
    def finalize(self, info=None):
        """Solve A over all ranks, accumulate the flux statistics and sum them over ranks. Call on every rank."""
        self.amplitude = solve_amplitude(self._tau["true"], self.settings.mean_flux, info)
        rows = sum(len(part) for part in self._tau["true"])
        chosen = set(np.linspace(0, max(rows - 1, 0), min(self.num_examples, rows)).round().astype(int).tolist())
        self.examples = {}
        self._view("count").add_(rows * self.length)
        for which in ("pred", "true"):
            examples, first = [], 0
            for part in self._tau[which]:                                                   # one batch at a time
                flux = torch.exp(-self.amplitude * part.double())                           # (M, S)
                self._view(f"flux_sum_{which}").add_(flux.sum())
                bins = (flux * FLUX_BINS).floor().long().clamp_(0, FLUX_BINS - 1).flatten()
                self._view(f"pdf_{which}").index_add_(0, bins, torch.ones_like(flux.flatten()))
                contrast = (flux - flux.mean(dim=1, keepdim=True)) * self._window.double()
                modes = torch.fft.rfft(contrast, dim=1)
                self._view(f"p1d_{which}").add_((modes.real ** 2 + modes.imag ** 2).sum(0))
                examples += [flux[row - first] for row in sorted(chosen) if first <= row < first + len(flux)]
                first += len(flux)
            self.examples[which] = (torch.stack(examples).float().cpu().numpy() if examples   # spread over skewers
                                    else np.zeros((0, self.length), dtype=np.float32))
        self._tau = {"pred": [], "true": []}                                             # free the memory
        sum_over_ranks(self.sums, info)
        self._host = None
        return self

    def _state(self):
        if self._host is None:
            if self.amplitude is None:
                raise RuntimeError("FluxStatistics: call finalize() after the updates, before reading results")
            host = self.sums.cpu().numpy()
            self._host = dict(zip(self._sizes, np.split(host, np.cumsum(list(self._sizes.values()))[:-1])))
        return self._host

    def p1d_count(self):
        """Flux pixels the statistics hold (summed over ranks)."""
        return float(self._state()["count"][0])

    def mean_flux(self, which):
        state = self._state()
        return float(state[f"flux_sum_{which}"][0] / state["count"][0])

    def flux_pdf(self):
        """{"edges": (FLUX_BINS + 1,), "pred", "true": probability densities on [0, 1] (integrate to 1)}."""
        state = self._state()
        norm = state["count"][0] / FLUX_BINS
        return {"edges": np.linspace(0, 1, FLUX_BINS + 1), "pred": state["pdf_pred"] / norm,
                "true": state["pdf_true"] / norm}

    def flux_pdf_distances(self):
        """(Kolmogorov-Smirnov statistic, Wasserstein-1 distance in flux units) between predicted and true PDF."""
        state = self._state()
        cdf_pred = np.cumsum(state["pdf_pred"]) / state["count"][0]
        cdf_true = np.cumsum(state["pdf_true"]) / state["count"][0]
        difference = np.abs(cdf_pred - cdf_true)
        return float(difference.max()), float(difference.sum() / FLUX_BINS)

    def p1d(self):
        """{"k": (S/2,) in s/km, "wavelength_cells", "pred", "true" (km/s), "ratio"} for modes k = 1 .. S/2.

        P1D(k) = dv N <|delta_F(k)|^2> with delta_F(k) = (1/N) sum_j delta_F(j) e^(-2 pi i k j / N) and
        delta_F = F / <F> - 1 of each field (its own mean flux): undefined (NaN, not a warning) for a field that
        absorbs all light, as an untrained or diverged model's prediction may.
        """
        state = self._state()
        n, dv = self.length, self.settings.velocity_per_cell
        count = state["count"][0]
        num_skewers = count / n
        spectra = {}
        for which in ("pred", "true"):
            mean = state[f"flux_sum_{which}"][0] / count
            with np.errstate(divide="ignore", invalid="ignore"):
                spectra[which] = (state[f"p1d_{which}"][1:] / num_skewers / n ** 2 * n * dv / mean ** 2)
        modes = np.arange(1, n // 2 + 1)
        return {"k": 2 * np.pi * modes / (n * dv), "wavelength_cells": n / modes, "pred": spectra["pred"],
                "true": spectra["true"], "ratio": spectra["pred"] / spectra["true"]}

    @staticmethod
    def summary(scalars):
        """One log line from the ``lyman_alpha/`` scalars of ``compute()`` (or of ScienceMetrics.compute())."""
        return format_summary(scalars)

    def compute(self):
        """Scalars by TensorBoard tag: mean fluxes, PDF distances, A, and the P1D ratio per wavelength octave."""
        spectra = self.p1d()
        ks, w1 = self.flux_pdf_distances()
        scalars = {"lyman_alpha/mean_flux_pred": self.mean_flux("pred"),
                   "lyman_alpha/mean_flux_true": self.mean_flux("true"),
                   "lyman_alpha/flux_pdf_ks": ks, "lyman_alpha/flux_pdf_w1": w1,
                   "lyman_alpha/tau_amplitude": self.amplitude}
        for (low, high), modes in wavelength_octaves(self.length).items():
            index = np.array(modes) - 1
            ratio = spectra["pred"][index].sum() / spectra["true"][index].sum()
            scalars[f"lyman_alpha/p1d_ratio/wavelength_{low}-{high}_cells"] = float(ratio)
        return scalars


def format_bands(scalars, prefix):
    """'2-4: 8.19, 4-8: 0.945, ...' from the scalars ``<prefix>wavelength_<band>_cells``, in their order."""
    return ", ".join(f"{tag.removeprefix(prefix + 'wavelength_').removesuffix('_cells')}: {value:.3g}"
                     for tag, value in scalars.items() if tag.startswith(prefix))


def format_summary(scalars):
    """One log line from the ``lyman_alpha/`` scalars."""
    return (f"mean flux {scalars['lyman_alpha/mean_flux_pred']:.4f} "
            f"(target {scalars['lyman_alpha/mean_flux_true']:.4f}) | flux PDF distance "
            f"KS {scalars['lyman_alpha/flux_pdf_ks']:.4f}, W1 {scalars['lyman_alpha/flux_pdf_w1']:.4f} | "
            f"P1D_pred/P1D_true at wavelengths [cells] {format_bands(scalars, 'lyman_alpha/p1d_ratio/')}")
