"""Generate a synthetic N-body -> hydro training pair (a toy cosmology, cheap and exactly symmetric).

    python -m utils.make_dataset --box 256 --seed 1 --out data/train.h5 [--npy]

writes an HDF5 file with two float32 datasets, channels first, periodic box of N^3 cells:

    Nbody (4, N, N, N): dark-matter density, vx, vy, vz
    Hydro (5, N, N, N): gas density, vx, vy, vz, temperature

Velocity component k points along spatial array axis k (axis 1 + k of the stored array).

Physics (standard cheap approximations; every step is a numpy FFT, a pointwise map or a bincount):

1. Initial conditions: unit white noise (N^3 standard normals) coloured by sqrt(P(k)) gives the
   linear density contrast delta. P(k) = A k^n_s T(k)^2 with the BBKS transfer function (shape
   parameter Gamma ~ 0.2), normalised by sigma8 (linear rms in 8 Mpc/h top-hat spheres). sigma8 is
   an *effective* amplitude (an early epoch): chosen so the rms Zel'dovich displacement is a few
   cells and the cell scale is mildly non-linear (filaments, sheets and voids, no hopeless
   shell-crossing mess).
2. Zel'dovich approximation: one particle per cell starts on the grid point q and moves to
   x = q + psi(q), psi = -grad phi with laplacian(phi) = delta (spectral derivatives). Linear theory
   makes the peculiar velocity proportional to the displacement, v = f H a psi; we take
   f H a = 100 km/s per Mpc/h (a constant: the stored velocities are normalised anyway).
3. Cloud-in-cell deposit (periodic) of particle mass -> rho_dm / mean, and of momentum ->
   mass-weighted velocity p / m (blended towards the smoothed velocity in near-empty cells).
4. Gas: baryons trace dark matter above the filtering (Jeans) scale, so the gas density and
   momentum are the DM ones smoothed by an isotropic Gaussian of `smoothing` cells;
   v_gas = smoothed momentum / smoothed mass.
5. Temperature: the photo-ionised IGM temperature-density relation T = T0 (rho_gas/mean)^(gamma-1)
   plus shock heating where the gas flow converges: T_shock = (3/16) mu m_p / k_B * dv^2 with
   dv = max(0, -div v_gas) * (shock_length cells): the post-shock temperature of the velocity jump
   across the converging region.

The Nbody -> Hydro map is learnable (Hydro is computed from the DM mass and momentum, which the
Nbody channels carry) but not pointwise: smoothing and the divergence need neighbourhoods.

Symmetry: every step is equivariant under the 48-element group of the cube (utils/symmetry.py):
the k-space filters are isotropic, spectral gradients/divergence have their Nyquist modes zeroed
(the only modes whose derivative is not odd in k), and particles start on integer grid points
with CIC nodes at integers, so the flip i -> N-1-i maps grid points to grid points and a
position x to N-1-x. Transforming the white noise by g gives exactly g applied to the outputs,
up to float rounding (~1e-6).

Normalisation uses fixed constants (never per-box statistics), so train and validation files
share one scale; every stored value lies in (-1, 1), matching the model's tanh output:

    density      x = ln(max(rho/mean, DENSITY_FLOOR)) / DENSITY_LOG_SCALE     (exp(14 x) = rho/mean)
    velocity     x = v[km/s] / VELOCITY_SCALE
    temperature  x = (log10 T[K] - TEMPERATURE_LOG10_OFFSET) / TEMPERATURE_LOG10_SCALE

each clipped to [-CLIP, CLIP]. :func:`to_physical` (and the per-field ``denormalize_*``) map back
to rho/mean, km/s and K, for numpy arrays or torch tensors.

Cost: float64 throughout the pipeline (float32 positions would break the exact symmetry in
near-empty cells); peak memory ~170 bytes per cell (256^3: 2.6 GiB, 512^3: ~21 GiB) and about
one microsecond per cell on 2 cores (256^3 in 12-20 s; benchmarks/bench_make_dataset.py), most
of it in the CIC bincounts. The same seed gives identical bytes every run.
"""
import argparse
import functools
import os
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import scipy.fft
from tqdm import tqdm

GENERATOR_VERSION = "utils.make_dataset/1"

# --- normalisation constants (stored as HDF5 attributes too) ---------------------------------
DENSITY_LOG_SCALE = 14.0          # x = ln(rho/mean) / 14
DENSITY_FLOOR = 1e-3              # rho/mean floor before the log (CIC leaves cells empty): x >= -0.49
VELOCITY_SCALE = 500.0            # km/s; 256^3 boxes reach |v| ~ 200 km/s, larger boxes more
TEMPERATURE_LOG10_OFFSET = 4.5    # log10 T of 10^4.5 K maps to 0
TEMPERATURE_LOG10_SCALE = 2.5     # log10 T in (2, 7) maps to (-1, 1)
CLIP = 0.999                      # every stored value is clipped to [-CLIP, CLIP] (sign-symmetric)

NBODY_CHANNELS = ("dm_density", "dm_vx", "dm_vy", "dm_vz")
HYDRO_CHANNELS = ("gas_density", "gas_vx", "gas_vy", "gas_vz", "temperature")
VECTOR_CHANNELS = (1, 2, 3)       # velocity components in both Nbody and Hydro

# --- physics defaults --------------------------------------------------------------------------
DEFAULT_CELL_SIZE = 20.0 / 256    # Mpc/h per cell (a 256^3 box is 20 Mpc/h) when box_length is None
DEFAULT_SMOOTHING = 1.5           # Gaussian filtering (Jeans) scale of the gas, in cells
DEFAULT_PHYSICS = dict(
    sigma8=0.15,                  # effective linear amplitude (an early epoch), see module docstring
    spectral_index=0.96,          # n_s
    shape_gamma=0.2,              # BBKS shape parameter Gamma = Omega_m h, in h/Mpc
    velocity_per_displacement=100.0,  # f H a in km/s per Mpc/h
    temperature_mean_density=1e4,     # T0 in K
    eos_gamma=1.5,                # T ~ rho^(gamma - 1)
    shock_length=6.0,             # cells: converging flow dv = -div(v) * shock_length * cell
)

_SHOCK_T_PER_KMS2 = 3.0 / 16.0 * 0.6 * 1.6726e-24 * 1e10 / 1.3807e-16  # K per (km/s)^2, mu = 0.6
_STAGES = ("noise", "fft", "displacement", "cic", "gas", "temperature", "write")
# FFT threads: the cores this process may use (not the host's count), at most 8. pocketfft splits
# whole 1-D transforms between threads, so the result does not depend on the count.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_WORKERS = max(1, min(_CORES, 8))


# --- normalisation ------------------------------------------------------------------------------
def _exp(x):
    # torch tensors have .exp(); numpy arrays (and scalars) go through np.exp. Keeps torch optional.
    return x.exp() if hasattr(x, "exp") and not isinstance(x, np.ndarray) else np.exp(x)


def _clip(x, out=None):
    # Cast first (float64 -> the float32 output slot), then clip in place: np.clip on the float64
    # intermediate was the slowest step of the whole pipeline.
    out = np.array(x, dtype=np.float32) if out is None else out
    if out is not x:
        out[...] = x
    np.minimum(out, CLIP, out=out)
    np.maximum(out, -CLIP, out=out)
    return out


def normalize_density(rho_over_mean, out=None):
    """Stored value of rho/mean: ln(max(rho/mean, DENSITY_FLOOR)) / 14, float32, clipped."""
    x = np.log(np.maximum(rho_over_mean, DENSITY_FLOOR))
    x /= DENSITY_LOG_SCALE
    return _clip(x, out)


def denormalize_density(x):
    """rho / mean from the stored value (values at the floor come back as DENSITY_FLOOR)."""
    return _exp(x * DENSITY_LOG_SCALE)


def normalize_velocity(v_kms, out=None):
    """Stored value of a velocity in km/s: v / VELOCITY_SCALE, float32, clipped."""
    return _clip(np.asarray(v_kms) / VELOCITY_SCALE, out)


def denormalize_velocity(x):
    """km/s from the stored value."""
    return x * VELOCITY_SCALE


def normalize_temperature(t_kelvin, out=None):
    """Stored value of a temperature in K: (log10 T - OFFSET) / SCALE, float32, clipped."""
    x = np.log10(t_kelvin)
    x -= TEMPERATURE_LOG10_OFFSET
    x /= TEMPERATURE_LOG10_SCALE
    return _clip(x, out)


def denormalize_temperature(x):
    """Kelvin from the stored value."""
    return _exp((x * TEMPERATURE_LOG10_SCALE + TEMPERATURE_LOG10_OFFSET) * np.log(10.0))


_DENORMALIZERS = {
    "nbody": (denormalize_density,) + (denormalize_velocity,) * 3,
    "hydro": (denormalize_density,) + (denormalize_velocity,) * 3 + (denormalize_temperature,),
}


def to_physical(x, kind, channel_axis=0):
    """Map a stored/predicted array to physical units, channel by channel.

    ``kind`` is "nbody" (4 channels) or "hydro" (5 channels) along ``channel_axis`` (use 1 for a
    (B, C, X, Y, Z) batch, -1 for the (D, H, W, C) npy layout). Densities -> rho/mean,
    velocities -> km/s, temperature -> K. Works on numpy arrays and torch tensors (any device).
    """
    funcs = _DENORMALIZERS[kind]
    axis = channel_axis % x.ndim
    if x.shape[axis] != len(funcs):
        raise ValueError(f"{kind} data has {len(funcs)} channels on axis {channel_axis}, got shape {tuple(x.shape)}")
    out = x.copy() if isinstance(x, np.ndarray) else x.clone()
    for c, func in enumerate(funcs):
        index = (slice(None),) * axis + (c,)
        out[index] = func(x[index])
    return out


def physical_attrs():
    """The normalisation constants, as stored on every file."""
    return dict(
        density_log_scale=DENSITY_LOG_SCALE, density_floor=DENSITY_FLOOR, velocity_scale=VELOCITY_SCALE,
        velocity_units="km/s", temperature_log10_offset=TEMPERATURE_LOG10_OFFSET,
        temperature_log10_scale=TEMPERATURE_LOG10_SCALE, temperature_units="K", clip=CLIP,
        nbody_channels=list(NBODY_CHANNELS), hydro_channels=list(HYDRO_CHANNELS),
        vector_channels=list(VECTOR_CHANNELS), generator=GENERATOR_VERSION,
    )


# --- power spectrum -----------------------------------------------------------------------------
def _bbks_shape(k, spectral_index, shape_gamma):
    """Unnormalised k^n_s T_BBKS(k)^2, k in h/Mpc (k = 0 -> 0)."""
    q = np.asarray(k, dtype=np.float64) / shape_gamma
    with np.errstate(divide="ignore", invalid="ignore"):
        transfer = (np.log1p(2.34 * q) / (2.34 * q)
                    * (1 + 3.89 * q + (16.1 * q) ** 2 + (5.46 * q) ** 3 + (6.71 * q) ** 4) ** -0.25)
        shape = np.where(q > 0, np.power(k, spectral_index) * transfer ** 2, 0.0)
    return shape


@functools.lru_cache(maxsize=32)
def _amplitude(sigma8, spectral_index, shape_gamma):
    # sigma^2(R) = int dk/k  k^3 P(k) W(kR)^2 / (2 pi^2), top-hat W, R = 8 Mpc/h.
    k = np.logspace(-5, 3, 20001)
    x = 8.0 * k
    window = 3 * (np.sin(x) - x * np.cos(x)) / x ** 3
    integrand = k ** 3 * _bbks_shape(k, spectral_index, shape_gamma) * window ** 2 / (2 * np.pi ** 2)
    sigma2 = np.trapezoid(integrand, np.log(k))
    return sigma8 ** 2 / sigma2


def power_spectrum(k, sigma8=DEFAULT_PHYSICS["sigma8"], spectral_index=DEFAULT_PHYSICS["spectral_index"],
                   shape_gamma=DEFAULT_PHYSICS["shape_gamma"]):
    """Linear P(k) in (Mpc/h)^3 for k in h/Mpc (BBKS, sigma8-normalised)."""
    return _amplitude(sigma8, spectral_index, shape_gamma) * _bbks_shape(k, spectral_index, shape_gamma)


# --- spectral helpers ---------------------------------------------------------------------------
def _wavenumbers(n):
    """Angular wavenumbers in radians per cell for an rfftn grid: kx (N,1,1), ky (1,N,1), kz (1,1,N//2+1).

    Also returns the derivative multipliers (same shapes) with the Nyquist mode zeroed: d/dx of the
    Nyquist cosine is a sine that the grid cannot hold, and keeping it would break flip symmetry.
    """
    k_full = 2 * np.pi * np.fft.fftfreq(n)
    k_half = 2 * np.pi * np.fft.rfftfreq(n)
    kx, ky, kz = k_full[:, None, None], k_full[None, :, None], k_half[None, None, :]
    deriv = []
    for k in (kx, ky, kz):
        d = k.copy()
        if n % 2 == 0:
            d[np.abs(np.abs(d) - np.pi) < 1e-12] = 0.0
        deriv.append(d)
    return (kx, ky, kz), tuple(deriv)


def _rfftn(x):
    return scipy.fft.rfftn(x, workers=_WORKERS)


def _irfftn(xk, n):
    return scipy.fft.irfftn(xk, s=(n, n, n), workers=_WORKERS)


class _Stages:
    """A tqdm bar advanced once per pipeline stage. progress: None/True (own bar), False, or a bar."""

    def __init__(self, progress, total, desc):
        self.own = not isinstance(progress, tqdm) and progress is not False
        self.bar = tqdm(total=total, desc=desc, unit="stage") if self.own else (progress or None)

    def __call__(self, name):
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=True)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None and exc[0] is None:
            self.bar.update(1)

    def close(self):
        if self.own and self.bar is not None:
            self.bar.close()


# --- the pipeline -------------------------------------------------------------------------------
def _cic_deposit(psi, n):
    """Periodic CIC deposit of N^3 unit-mass particles starting on grid points q, moved to q + psi(q).

    psi: 3 arrays (N,N,N) float64, displacements in cells. Returns the deposited mass (N^3,) (mean 1)
    and sum_p w_p psi_p (3, N^3), float64, flat C order; momentum = the latter x velocity/displacement.
    """
    # Per-axis index parts fit int32 (half the memory) while the flat index N^3 does.
    index_dtype = np.int32 if n ** 3 < 2 ** 31 else np.int64
    q = np.arange(n, dtype=index_dtype)
    nodes, weights = [], []                      # per axis: (flat-index part, weight) for offsets 0, 1
    for axis, stride in enumerate((n * n, n, 1)):
        # Split the position into integer node + fraction without forming q + psi in floating point:
        # frac = psi - floor(psi) is exact, so a flipped run (psi -> -psi) gets exactly 1 - frac.
        floor = np.floor(psi[axis])
        frac = (psi[axis] - floor).astype(np.float32)                                 # (N,N,N) in [0,1)
        shape = [1, 1, 1]
        shape[axis] = n
        node = (floor.astype(index_dtype) + q.reshape(shape)) % n                     # (N,N,N)
        del floor
        nodes.append((node * stride, (node + 1) % n * stride))
        weights.append((1 - frac, frac))
        del node, frac
    mass = np.zeros(n ** 3)
    moment = np.zeros((3, n ** 3))
    flat_psi = [a.ravel() for a in psi]
    # Reused buffers: fresh 8-byte-per-cell temporaries in every pass cost more in page faults than
    # the arithmetic. (Threads over particle slabs and batching corners into one bincount were
    # tried: no faster on 2 shared cores, and more memory.)
    index_xy = np.empty((n, n, n), dtype=np.int64)
    weight_xy = np.empty((n, n, n))
    index = np.empty((n, n, n), dtype=np.int64)
    weight = np.empty((n, n, n))
    weighted_psi = np.empty(n ** 3)
    # Loop over the 8 cube corners, building the index and weight of each corner incrementally
    # (x, then xy, then xyz) so each corner costs one add, one multiply and four bincounts.
    for cx in (0, 1):
        for cy in (0, 1):
            np.add(nodes[0][cx], nodes[1][cy], out=index_xy, dtype=np.int64)
            np.multiply(weights[0][cx], weights[1][cy], out=weight_xy, dtype=np.float64)
            for cz in (0, 1):
                np.add(index_xy, nodes[2][cz], out=index)
                np.multiply(weight_xy, weights[2][cz], out=weight)
                flat_index, flat_weight = index.ravel(), weight.ravel()                # (N^3,) views
                mass += np.bincount(flat_index, weights=flat_weight, minlength=n ** 3)
                for a in range(3):
                    np.multiply(flat_weight, flat_psi[a], out=weighted_psi)
                    moment[a] += np.bincount(flat_index, weights=weighted_psi, minlength=n ** 3)
    return mass, moment


def generate_fields(white_noise, box_length=None, smoothing=DEFAULT_SMOOTHING, progress=None, **physics):
    """Nbody (4,N,N,N) and Hydro (5,N,N,N) float32 fields, normalised, from (N,N,N) white noise.

    A pure function of its arguments. box_length in Mpc/h (None: N * DEFAULT_CELL_SIZE);
    smoothing: gas filtering scale in cells; physics: overrides of DEFAULT_PHYSICS.
    """
    unknown = set(physics) - set(DEFAULT_PHYSICS)
    if unknown:
        raise TypeError(f"unknown physics parameters {sorted(unknown)}; known: {sorted(DEFAULT_PHYSICS)}")
    p = {**DEFAULT_PHYSICS, **physics}
    white_noise = np.asarray(white_noise)
    n = white_noise.shape[0]
    if white_noise.shape != (n, n, n) or n < 2:
        raise ValueError(f"white noise must be a cube (N,N,N), got shape {white_noise.shape}")
    if box_length is not None and not box_length > 0:
        raise ValueError(f"box_length must be positive (Mpc/h), got {box_length}")
    if not smoothing >= 0:
        raise ValueError(f"smoothing must be >= 0 cells, got {smoothing}")
    cell = box_length / n if box_length is not None else DEFAULT_CELL_SIZE             # Mpc/h
    stages = _Stages(progress, len(_STAGES) - 2, f"fields {n}^3")
    (kx, ky, kz), deriv = _wavenumbers(n)
    k2 = kx ** 2 + ky ** 2 + kz ** 2                                                   # (N,N,N//2+1) rad^2/cell^2

    with stages("fft"):
        # <|W_k|^2> = N^3 for unit white noise; the DFT of delta needs <|delta_k|^2> = P N^3 / cell^3.
        amplitude = np.sqrt(power_spectrum(np.sqrt(k2) / cell, p["sigma8"], p["spectral_index"],
                                           p["shape_gamma"]) / cell ** 3)
        delta_k = _rfftn(white_noise.astype(np.float64)) * amplitude                  # (N,N,N//2+1)
        del amplitude

    with stages("displacement"):
        # psi_k = i k delta_k / k^2 (cells), so that div psi = -delta.
        with np.errstate(divide="ignore", invalid="ignore"):
            potential_k = np.where(k2 > 0, delta_k / k2, 0.0)
        del delta_k
        psi = [_irfftn(1j * d * potential_k, n) for d in deriv]                        # 3 x (N,N,N) cells
        del potential_k

    with stages("cic"):
        mass, moment = _cic_deposit(psi, n)                                            # (N^3,), (3,N^3)
        del psi
        mass = mass.reshape(n, n, n)
        momentum = moment.reshape(3, n, n, n)
        momentum *= p["velocity_per_displacement"] * cell                             # km/s x mass
        del moment

    with stages("gas"):
        # Gas = DM smoothed at the filtering scale (isotropic Gaussian in k).
        kernel = np.exp(-0.5 * k2 * smoothing ** 2)
        gas_density = np.maximum(_irfftn(_rfftn(mass) * kernel, n), DENSITY_FLOOR)    # (N,N,N)
        gas_velocity = np.stack([_irfftn(_rfftn(momentum[a]) * kernel, n) for a in range(3)])
        gas_velocity /= gas_density                                                   # (3,N,N,N) km/s
        del kernel
        # DM velocity = momentum / mass; near-empty cells blend towards the gas velocity so the
        # field stays continuous in the mass (no threshold for rounding to flip under a symmetry).
        eps = DENSITY_FLOOR
        dm_velocity = (momentum + eps * gas_velocity) / (mass + eps)                  # (3,N,N,N) km/s
        del momentum

    with stages("temperature"):
        div_k = sum(1j * d * _rfftn(gas_velocity[a]) for a, d in enumerate(deriv))
        divergence = _irfftn(div_k, n) / cell                                         # km/s per Mpc/h
        del div_k
        jump = np.maximum(0.0, -divergence) * (p["shock_length"] * cell)               # km/s
        temperature = (p["temperature_mean_density"] * gas_density ** (p["eos_gamma"] - 1)
                       + _SHOCK_T_PER_KMS2 * jump ** 2)                                # (N,N,N) K
        del divergence, jump

        nbody = np.empty((4, n, n, n), dtype=np.float32)
        normalize_density(mass, out=nbody[0])
        normalize_velocity(dm_velocity, out=nbody[1:])
        hydro = np.empty((5, n, n, n), dtype=np.float32)
        normalize_density(gas_density, out=hydro[0])
        normalize_velocity(gas_velocity, out=hydro[1:4])
        normalize_temperature(temperature, out=hydro[4])
    stages.close()
    return nbody, hydro


def default_box_length(box):
    return box * DEFAULT_CELL_SIZE


def make_dataset(box, seed, box_length=None, smoothing=DEFAULT_SMOOTHING, progress=None, **physics):
    """Draw (box,)*3 white noise from np.random.default_rng(seed) and run :func:`generate_fields`."""
    stages = _Stages(progress, len(_STAGES) - 1, f"dataset {box}^3 seed {seed}")
    with stages("noise"):
        white = np.random.default_rng(seed).standard_normal((box, box, box), dtype=np.float64)
    nbody, hydro = generate_fields(white, box_length=box_length, smoothing=smoothing,
                                   progress=stages.bar if stages.bar is not None else False, **physics)
    stages.close()
    return nbody, hydro


# --- writing ------------------------------------------------------------------------------------
def _tmp_path(path):
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def write_h5(path, nbody, hydro, attrs=None):
    """Write datasets Nbody/Hydro (contiguous float32, memory-mappable) and attrs, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("Nbody", data=np.asarray(nbody, dtype=np.float32))
            f.create_dataset("Hydro", data=np.asarray(hydro, dtype=np.float32))
            for key, value in {**physical_attrs(), **(attrs or {})}.items():
                f.attrs[key] = value
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def npy_paths(path_stem):
    """The DALI-layout files written next to ``path_stem`` (a path with or without .h5)."""
    stem = Path(path_stem)
    stem = stem.with_suffix("") if stem.suffix in (".h5", ".hdf5") else stem
    return stem.with_name(stem.name + "_data.npy"), stem.with_name(stem.name + "_label.npy")


def write_npy(path_stem, nbody, hydro):
    """Write <stem>_data.npy (N,N,N,4) and <stem>_label.npy (N,N,N,5) float32, (D,H,W,C), atomically."""
    paths = npy_paths(path_stem)
    for path, fields in zip(paths, (nbody, hydro)):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_path(path)
        try:
            # open_memmap writes straight to disk: no second in-memory copy of the transposed volume.
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                            shape=fields.shape[1:] + fields.shape[:1])
            for c in range(fields.shape[0]):
                out[..., c] = fields[c]
            out.flush()
            del out
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    return paths


def _attrs(box, seed, box_length, smoothing, physics):
    """Per-file attributes: what was generated and with which physics (constants are added by write_h5)."""
    length = box_length if box_length is not None else default_box_length(box)
    return dict(box=box, seed=seed, box_size_mpc_h=length, cell_size_mpc_h=length / box,
                smoothing_cells=smoothing, **{**DEFAULT_PHYSICS, **physics})


def _generate_and_write(path, box, seed, npy, box_length, smoothing, progress, physics):
    stages = _Stages(progress, len(_STAGES), f"{Path(path).name} {box}^3 seed {seed}")
    bar = stages.bar if stages.bar is not None else False
    nbody, hydro = make_dataset(box, seed, box_length=box_length, smoothing=smoothing, progress=bar, **physics)
    with stages("write"):
        if npy:
            write_npy(path, nbody, hydro)
        # The .h5 last: its existence is what ensure_dataset takes as "done".
        write_h5(path, nbody, hydro, _attrs(box, seed, box_length, smoothing, physics))
    stages.close()


def ensure_dataset(path, box, seed, npy=False, box_length=None, smoothing=DEFAULT_SMOOTHING,
                   progress=None, **physics):
    """Generate ``path`` (and with npy its .npy twins) only if missing; return the path.

    Files are written to a temporary name and renamed, so an interrupted run never leaves a
    partial file that a later call would mistake for a finished one.
    """
    path = Path(path)
    if not path.exists():
        _generate_and_write(path, box, seed, npy, box_length, smoothing, progress, physics)
    elif npy and not all(p.exists() for p in npy_paths(path)):
        with h5py.File(path, "r") as f:
            write_npy(path, f["Nbody"][...], f["Hydro"][...])
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m utils.make_dataset", description=__doc__.split("\n")[0])
    parser.add_argument("--box", type=int, default=256, help="cells per side (default 256)")
    parser.add_argument("--seed", type=int, default=1, help="white-noise seed (default 1)")
    parser.add_argument("--out", required=True, help="output .h5 path")
    parser.add_argument("--npy", action="store_true", help="also write <stem>_data.npy / <stem>_label.npy")
    parser.add_argument("--box_length", type=float, default=None,
                        help=f"box side in Mpc/h (default box * {DEFAULT_CELL_SIZE:g})")
    parser.add_argument("--smoothing", type=float, default=DEFAULT_SMOOTHING,
                        help=f"gas filtering scale, Gaussian sigma in cells (default {DEFAULT_SMOOTHING})")
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    args = parser.parse_args(argv)
    if args.box < 2:
        parser.error(f"--box must be >= 2, got {args.box}")
    targets = [Path(args.out)] + (list(npy_paths(args.out)) if args.npy else [])
    existing = [str(t) for t in targets if t.exists()]
    if existing and not args.force:
        # One line on stderr, exit status 1 (SystemExit carries the message for callers of main).
        raise SystemExit(f"{parser.prog}: error: {', '.join(existing)} already "
                         f"{'exists' if len(existing) == 1 else 'exist'}; pass --force to overwrite")
    start = time.perf_counter()
    _generate_and_write(args.out, args.box, args.seed, args.npy, args.box_length, args.smoothing, None, {})
    print(f"wrote {args.out} ({args.box}^3, seed {args.seed}) in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
