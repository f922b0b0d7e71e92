"""Generate a synthetic N-body -> hydro training pair (a toy cosmology, cheap and exactly symmetric).

    python -m utils.make_dataset --box 256 --seed 1 --out data/train.h5 [--npy] [--device auto|cpu|cuda]
    python -m utils.make_dataset --out data/train.h5 --npy_only      # only the .npy twins of an existing file

writes an HDF5 file with two float32 datasets, channels first, periodic box of N^3 cells:

    Nbody (4, N, N, N): dark-matter density, vx, vy, vz
    Hydro (5, N, N, N): gas density, vx, vy, vz, temperature

normalised with the fixed constants of utils/units.py (the stored units, and the way back to rho/mean,
km/s and K, are explained there); the constants are stored on the file as attributes too.

Physics (standard cheap approximations; every step is an FFT, a pointwise map or a scatter-add):

1. Initial conditions: unit white noise (N^3 standard normals) coloured by sqrt(P(k)) gives the
   linear density contrast delta. P(k) = A k^n_s T(k)^2 with the BBKS transfer function (shape
   parameter Gamma ~ 0.2), normalised by sigma8 (linear rms in 8 Mpc/h top-hat spheres). sigma8 is
   an *effective* amplitude (an early epoch): chosen so the rms Zel'dovich displacement is a few
   cells and filaments, sheets and voids show. The cell scale is non-linear (rms delta 1.2 per cell;
   a fifth of the particles have crossed a neighbouring stream, which the Zel'dovich approximation
   lets pass through), so sheets come out thicker than in an N-body run: a toy, not a simulation.
2. Zel'dovich approximation: one particle per cell starts on the grid point q and moves to
   x = q + psi(q), psi = -grad phi with laplacian(phi) = delta (spectral derivatives). Linear theory
   makes the peculiar velocity proportional to the displacement, v = f H a psi; we take a round
   f H a = 100 km/s per Mpc/h, about 9% below linear theory's f(z) a H(z) = 109 at z = 3 (Omega_m = 0.3,
   f = Omega_m(z)^0.55), whose Hubble flow science/lyman_alpha.py uses: the generated boxes' redshift-space
   distortions are that much weaker, for prediction and truth alike.
3. Cloud-in-cell deposit (periodic) of particle mass -> rho_dm / mean, and of momentum ->
   mass-weighted velocity p / m (blended towards the smoothed velocity in near-empty cells).
4. Gas: baryons trace dark matter above the filtering (Jeans) scale, so the gas density and
   momentum are the DM ones smoothed by an isotropic Gaussian of `smoothing` cells;
   v_gas = smoothed momentum / smoothed mass.
5. Temperature: the photo-ionised IGM temperature-density relation T = T0 (rho_gas/mean)^(gamma-1)
   plus a heuristic shock heating where the gas's peculiar flow converges: T_shock = (3/16) mu m_p /
   k_B * dv^2 with dv = max(0, -div v_gas) * (shock_length cells). (3/16) mu m_p v^2 / k_B is the
   post-shock temperature of a strong shock of speed v; taking v as the jump across the converging
   region, and shock_length, are calibration choices. The threshold ignores the Hubble expansion
   (the proper flow converges only where -div v > 3 a H), so overdense gas in the linear regime is
   warmed on top of the adiabatic heating T0 rho^(gamma-1) already counts: a broad hot tail, more
   temperature-density scatter than a hydro simulation's.

The Nbody -> Hydro map is learnable (Hydro is computed from the DM mass and momentum, which the
Nbody channels carry) but not pointwise: smoothing and the divergence need neighbourhoods.

Symmetry: every step is equivariant under the 48-element group of the cube (utils/symmetry.py):
the k-space filters are isotropic, spectral gradients/divergence have their Nyquist modes zeroed
(the only modes whose derivative is not odd in k), and particles start on integer grid points
with CIC nodes at integers, so the flip i -> N-1-i maps grid points to grid points and a
position x to N-1-x. Transforming the white noise by g gives g applied to the outputs, up to
float32 rounding.

How it runs (bounded memory, one code path for CPU and GPU). Every FFT and scatter-add is a torch
operation on ``device`` (CUDA when present, else the CPU), done slab by slab, and the nine output
channels double as scratch space: the pipeline streams slabs of planes between the device and a
*store* (the output HDF5 file, or arrays for the in-memory API) and never holds more than one
padded float64 field plus one float32 field (12 bytes per cell) on the device:

- displacements: for each component, the white noise (drawn slab by slab from one seeded stream,
  so the values do not depend on the slab size; drawn again per component, so one float64 field is
  the only full-size buffer) is FFT'd in place in float64, coloured, multiplied by i k_a / k^2 and
  transformed back slab by slab; psi_a goes to the store as float32 plus its float32 residual
  (psi = hi + lo to ~1e-14, i.e. the float64 positions of a whole-box run);
- CIC: particle slabs in x order deposit mass and momentum into a ring of planes (the slab plus
  twice the largest x displacement); finished planes go to the store, overwriting positions
  already read; the planes that wrap around the periodic boundary are completed at the end;
- gas, velocities, temperature: one float64 field at a time is smoothed (in-place FFT), divided by
  the gas density (read back from its stored channel), written, and its spectral divergence
  accumulated in a float32 spectrum.

Mass and momentum are accumulated in float32, and the divergence spectrum is stored in float32;
everything else is float64. Results agree with a float64 whole-box computation (and between slab
sizes and devices) to float32 rounding: a few ulps of the stored values (<= 5e-7; equivariance
under the cube group to 3e-7).

Measured on 2 CPU cores (libraries included): 512^3 in 43 s with 1.86 GiB peak RSS (14.9 bytes
per cell), 1024^3 in 12 min with 13.2 GiB (13.2 bytes per cell); benchmarks/bench_make_dataset.py,
benchmarks/results/make_dataset_cpu.md. The CLI checks free memory (/proc/meminfo MemAvailable, or
the GPU's) and disk space first; a failure raises GenerationError, which the command line
(utils/__init__.py) ends with one line, ``error: ...``, and exit status 2 (130 after Ctrl-C).
"""
import argparse
import contextlib
import fcntl
import functools
import logging
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import torch
from tqdm import tqdm

from utils import DataError, GenerationError, first_line, run
from utils.arguments import at_least, positive_float, positive_int
from utils.out_of_memory import is_out_of_memory
from utils.units import (CLIP, DEFAULT_CELL_SIZE, DENSITY_FLOOR, DENSITY_LOG_SCALE, TEMPERATURE_LOG10_OFFSET,
                         HYDRO_CHANNELS, NBODY_CHANNELS, TEMPERATURE_LOG10_SCALE, VELOCITY_SCALE, physical_attrs)

GENERATOR_VERSION = "utils.make_dataset/2"
# In train.py its lines go to the run's log; on the command line, warnings reach stderr (logging's last resort).
logger = logging.getLogger("train.make_dataset")

# --- physics defaults --------------------------------------------------------------------------
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
# Pipeline stages, in order (the progress bar's postfix; benchmarks/bench_make_dataset.py times them).
_STAGES = ("displacement", "cic", "gas", "velocity", "temperature", "write")
_SLAB_STEPS = 27                  # progress steps per slab of the whole pipeline (see _generate)
_FIELD_BYTES_PER_CELL = 12        # peak: one padded float64 field + one float32 field


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


# --- errors, device, memory and disk --------------------------------------------------------------


def resolve_device(device=None):
    """The torch.device to generate on: None or "auto" -> CUDA when available, else the CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerationError("device cuda was asked for but CUDA is not available; use --device cpu or auto")
    return device


def _gib(nbytes):
    return f"{nbytes / 2 ** 30:.1f} GiB"


PROC, CGROUP_FS = Path("/proc"), Path("/sys/fs/cgroup")
# (controller folder, limit, usage, the reclaimable page cache's line in memory.stat) of cgroup v2 and v1
_CGROUP_MEMORY = {"v2": ("", "memory.max", "memory.current", "inactive_file"),
                  "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def memory_available():
    """Bytes the system can still give this process, None where unknown: /proc/meminfo's MemAvailable, or less where
    the process's memory cgroup (Slurm's --mem, docker --memory) allows less. The kernel kills a process that passes
    its cgroup's limit, whatever MemAvailable says."""
    known = [cgroup_headroom()]
    try:
        with open(PROC / "meminfo") as f:
            known += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    known = [value for value in known if value is not None]
    return min(known) if known else None


def cgroup_headroom():
    """Bytes this process's memory cgroups still allow: the least, over its cgroup and every parent with a limit (Slurm
    limits the job's cgroup, the task runs in a child), of the limit less what is used (page cache it can reclaim not
    counted); None without a limit or a readable cgroup."""
    try:
        lines = (PROC / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        version = "v2" if hierarchy == "0" and not controllers else "v1" if "memory" in controllers.split(",") else None
        if version is None:
            continue
        controller, limit_file, usage_file, cache_line = _CGROUP_MEMORY[version]
        own = Path(path.lstrip("/"))
        # Up to the mount's root; inside a container the file system is mounted at the container's own cgroup, so
        # the folders named by the host's path are not there and the root is its cgroup.
        for folder in (CGROUP_FS / controller / level for level in (own, *own.parents)):
            try:
                limit, usage = ((folder / name).read_text().strip() for name in (limit_file, usage_file))
                words = (folder / "memory.stat").read_text().split()  # "name value" lines
            except OSError:
                continue
            if limit.isdigit() and int(limit) < 2 ** 60:  # v1 says "no limit" with a number near 2^63
                stat = dict(zip(words[::2], words[1::2]))
                headrooms.append(int(limit) - int(usage) + int(stat.get(cache_line, 0)))
    return min(headrooms, default=None)


def slab_planes(n, device="cpu"):
    """Default planes per slab: slab temporaries (~200 bytes per slab cell) of ~1 byte per box cell."""
    budget = max(2 ** 27, n ** 3) * (4 if torch.device(device).type == "cuda" else 1)
    return int(max(1, min(n, budget // (200 * n * n))))


def memory_needed(n, slab):
    """Bytes the pipeline allocates on its device: the peak fields plus slab temporaries."""
    return _FIELD_BYTES_PER_CELL * n * n * 2 * (n // 2 + 1) + 200 * min(slab, n) * n * n


def check_memory(n, slab, device, host_extra=0):
    """Raise GenerationError (one line) unless the pipeline's memory fits what is free now."""
    need = memory_needed(n, slab)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > free:
            raise GenerationError(f"not enough GPU memory for a {n}^3 box: it needs about {_gib(need)}, "
                                  f"{_gib(free)} free on {device}; free GPU memory, or generate it on the CPU "
                                  f"first: python -m utils.make_dataset --device cpu --box {n} --out FILE")
        need = 200 * min(slab, n) * n * n                                   # host: slabs in flight
    need += host_extra
    available = memory_available()
    if available is not None and need > available:
        raise GenerationError(f"not enough memory for a {n}^3 box: it needs about {_gib(need)} more, "
                              f"{_gib(available)} available (MemAvailable, or the job's memory limit); free memory, "
                              f"ask the job for more, use a machine with more, or a smaller box (make_dataset's "
                              f"--box, train.py's --box_size)")


def output_bytes(box, npy=False):
    """Disk bytes of one generated box: 9 float32 channels (and the same again for the .npy twins)."""
    return 9 * 4 * box ** 3 * (2 if npy else 1) + 2 ** 20


def check_disk(path, nbytes, what):
    """Raise GenerationError (one line) unless ``nbytes`` fit in the free space where ``path`` goes."""
    folder = Path(path).resolve().parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise GenerationError(f"not enough disk space for {what}: it needs {_gib(nbytes)}, {_gib(free)} free in "
                              f"{folder}; free some space or choose another --out")


# --- stores: where slabs go ------------------------------------------------------------------------
# Channels 0-3 are Nbody, 4-8 Hydro. Until the final values are written, some slots hold scratch data:
_POSITION = (1, 2, 3)     # psi_a rounded to float32 (in the DM velocity slots) ...
_RESIDUAL = (5, 6, 7)     # ... and psi_a - that, as float32 (in the gas velocity slots)
_MASS = 8                 # raw CIC mass (in the temperature slot)
_MOMENTUM = (1, 2, 3)     # raw CIC sum of weight x psi_a, in cells (overwrites the positions plane by plane)


class _ArrayStore:
    """The nine channels in memory: Nbody (4,N,N,N) and Hydro (5,N,N,N) float32 arrays."""

    def __init__(self, n):
        self.nbody = np.empty((4, n, n, n), np.float32)
        self.hydro = np.empty((5, n, n, n), np.float32)

    def _slot(self, channel):
        return (self.nbody, channel) if channel < 4 else (self.hydro, channel - 4)

    def read(self, channel, x0, x1):
        data, c = self._slot(channel)
        return np.array(data[c, x0:x1])

    def write(self, channel, x0, x1, values):
        data, c = self._slot(channel)
        data[c, x0:x1] = values


class _H5Store(_ArrayStore):
    """The nine channels as the contiguous float32 datasets of an open HDF5 file."""

    def __init__(self, f, n):
        self.nbody = f.create_dataset("Nbody", (4, n, n, n), np.float32, fill_time="never")
        self.hydro = f.create_dataset("Hydro", (5, n, n, n), np.float32, fill_time="never")

    def read(self, channel, x0, x1):
        data, c = self._slot(channel)
        return data[c, x0:x1]


class _Progress:
    """One tqdm bar over the pipeline's slab steps with the stage as postfix.

    progress: None/True (own bar), False (none) or a tqdm to drive (benchmarks time the stages by
    its set_postfix_str calls)."""

    def __init__(self, progress, total, desc):
        self.own = not isinstance(progress, tqdm) and progress is not False
        self.bar = tqdm(total=total, desc=desc, unit="slab") if self.own else (progress or None)

    def stage(self, name):
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=True)

    def step(self, n=1):
        if self.bar is not None:
            self.bar.update(n)

    def close(self, failed=False):
        if self.own and self.bar is not None:
            if failed:
                self.bar.leave = False                  # cleared, so an error message stands alone
            self.bar.close()


# --- slab-wise spectral machinery -----------------------------------------------------------------
class _Box:
    """An N^3 periodic grid on one device: slab ranges, k-space tables and slab-wise FFT passes.

    A field is an (N, N, 2(N//2+1)) real tensor; the same memory viewed as complex (N, N, N//2+1)
    holds an rfftn. A 3-D transform is three passes that need only slab-sized temporaries:
    to_spectrum (2-D rfft of each x-slab of values, into the field's memory), along_x (1-D FFTs
    along x of each y-slab, with a k-space operation between the forward and inverse transform),
    from_spectrum (2-D inverse rfft of each x-slab, handed to a consumer). Slabs run on the worker
    threads (torch releases the GIL), each with one intra-op thread.
    """

    def __init__(self, n, device, slab, progress, pool=None, workers=1):
        self.n, self.device, self.progress, self.pool = n, device, progress, pool
        self.workers = workers if pool is not None else 1
        self.slab = max(1, min(int(slab), n))
        self.ranges = [(x0, min(n, x0 + self.slab)) for x0 in range(0, n, self.slab)]
        index = torch.as_tensor(np.rint(np.fft.fftfreq(n) * n).astype(np.int64), device=device)
        self.index = index                                                  # signed integer frequencies
        self.m_xz = index[:, None] ** 2 + torch.arange(n // 2 + 1, device=device)[None, :] ** 2
        self.derivs = []
        for k in (2 * np.pi * np.fft.fftfreq(n),) * 2 + (2 * np.pi * np.fft.rfftfreq(n),):
            # d/dx of the Nyquist cosine is a sine the grid cannot hold: zeroed (keeps flip symmetry).
            k = k.copy()
            if n % 2 == 0:
                k[np.abs(np.abs(k) - np.pi) < 1e-12] = 0.0
            self.derivs.append(torch.as_tensor(k, device=device))

    def map(self, func, items):
        """[func(item) for item in items], on the worker threads."""
        return list(self.pool.map(func, items)) if self.pool is not None else [func(item) for item in items]

    def each(self, body, inputs=None):
        """body(x0, x1) -- or body(x0, x1, item), items taken in slab order from ``inputs`` on this
        thread -- for every slab, at most one slab per worker in flight; one progress step each."""
        if self.pool is None:
            for x0, x1 in self.ranges:
                body(x0, x1) if inputs is None else body(x0, x1, next(inputs))
                self.progress.step()
            _release_memory()
            return
        pending = []
        try:
            for x0, x1 in self.ranges:
                args = (x0, x1) if inputs is None else (x0, x1, next(inputs))
                pending.append(self.pool.submit(body, *args))
                if len(pending) >= self.workers:
                    pending.pop(0).result()
                    self.progress.step()
            while pending:
                pending.pop(0).result()
                self.progress.step()
            _release_memory()
        finally:
            for future in pending:                   # after a failure: let the others finish first
                future.cancel()
                with contextlib.suppress(BaseException):
                    future.result()

    def field(self, dtype):
        return torch.empty((self.n, self.n, 2 * (self.n // 2 + 1)), dtype=dtype, device=self.device)

    def table(self, func, dtype):
        """func(k^2) (k in radians per cell) tabulated on the integer m = ix^2 + iy^2 + iz^2."""
        k2 = np.arange(3 * (self.n // 2) ** 2 + 1) * (2 * np.pi / self.n) ** 2
        return torch.as_tensor(func(k2), dtype=dtype, device=self.device)

    def radial(self, table, y0, y1):
        """A tabulated isotropic filter on the y-slab [y0, y1) of an rfftn: (N, y1-y0, N//2+1)."""
        return table[self.m_xz[:, None, :] + self.index[y0:y1, None] ** 2]

    def deriv(self, axis, y0, y1, dtype=torch.float64):
        """k_axis (Nyquist zeroed), broadcastable to the y-slab [y0, y1) of an rfftn."""
        d = self.derivs[axis].to(dtype)
        return (d[:, None, None], d[y0:y1][None, :, None], d[None, None, :])[axis]

    @staticmethod
    def spectrum(field):
        return field.view(torch.complex128 if field.dtype == torch.float64 else torch.complex64)

    def to_spectrum(self, field, values, inputs=None):
        """Pass 1: the 2-D rfft of values(x0, x1[, item]) -> (x1-x0, N, N) into each x-slab of field."""
        spec = self.spectrum(field)

        def body(x0, x1, *item):
            torch.fft.rfft2(values(x0, x1, *item).to(field.dtype), out=spec[x0:x1])
        self.each(body, inputs)
        return spec

    def along_x(self, spec, operation, inverse=True):
        """Pass 2: per y-slab, FFT along x, operation(pencils, y0, y1) in place, inverse FFT back."""
        def body(y0, y1):
            pencils = torch.fft.fft(spec[:, y0:y1], dim=0)
            operation(pencils, y0, y1)
            if inverse:
                spec[:, y0:y1] = torch.fft.ifft(pencils, dim=0)
        self.each(body)

    def inverse_along_x(self, spec, dtype=None):
        """Pass 2 without an operation: the inverse FFT along x (computed in ``dtype`` if given)."""
        def body(y0, y1):
            spec[:, y0:y1] = torch.fft.ifft(spec[:, y0:y1].to(dtype or spec.dtype), dim=0)
        self.each(body)

    def from_spectrum(self, spec, consume, dtype=None):
        """Pass 3: consume(x0, x1, values) with the 2-D inverse rfft of each x-slab, (x1-x0, N, N)
        (computed in ``dtype`` if given)."""
        def body(x0, x1):
            consume(x0, x1, torch.fft.irfft2(spec[x0:x1].to(dtype or spec.dtype), s=(self.n, self.n)))
        self.each(body)


class _SeedNoise:
    """Unit white noise from np.random.default_rng(seed), drawn slab by slab from the one stream (the
    values of a whole-box draw, whatever the slab size)."""

    def __init__(self, seed):
        self.seed = seed

    def slabs(self, box):
        rng = np.random.default_rng(self.seed)
        for x0, x1 in box.ranges:
            yield rng.standard_normal((x1 - x0, box.n, box.n))


class _ArrayNoise:
    """White noise given as an (N, N, N) array."""

    def __init__(self, white):
        self.white = white

    def slabs(self, box):
        for x0, x1 in box.ranges:
            yield np.ascontiguousarray(self.white[x0:x1], dtype=np.float64)


def _host(tensor):
    return tensor.detach().to("cpu", torch.float32).numpy()


def _normalize_density_t(rho):
    return (torch.log(rho.double().clamp(min=DENSITY_FLOOR)) / DENSITY_LOG_SCALE).clamp_(-CLIP, CLIP).float()


def _normalize_velocity_t(v):
    return (v.double() / VELOCITY_SCALE).clamp_(-CLIP, CLIP).float()


def _normalize_temperature_t(t):
    return ((torch.log10(t) - TEMPERATURE_LOG10_OFFSET) / TEMPERATURE_LOG10_SCALE).clamp_(-CLIP, CLIP).float()


def _libc():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def _release_memory():
    """Give freed heap memory back to the system (glibc keeps freed slab temporaries otherwise, which
    would add up to the next stage's peak)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@contextlib.contextmanager
def _workers(device, workers):
    """A pool of ``workers`` threads (None for one), each slab op on one torch intra-op thread.

    On the CPU, MKL's own FFT threading costs ~10 ms a call on a busy 2-core machine; threads over
    slabs do not. Restores torch's thread count afterwards."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="make_dataset") if workers > 1 else None
    try:
        yield pool
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        torch.set_num_threads(threads)


# --- the pipeline ---------------------------------------------------------------------------------
def _displacements(box, store, noise, cell, p):
    """Zel'dovich displacements psi_a (cells) into the store as float32 + float32 residual.

    Returns the reach: every particle's CIC nodes along x lie within that many planes of its own."""
    device = box.device

    def colour(k2):
        # psi_k = i k delta_k / k^2 with delta_k = W_k sqrt(P / cell^3): <|W_k|^2> = N^3 for unit white
        # noise and the DFT of delta needs <|delta_k|^2> = P N^3 / cell^3.
        with np.errstate(divide="ignore", invalid="ignore"):
            amplitude = np.sqrt(power_spectrum(np.sqrt(k2) / cell, p["sigma8"], p["spectral_index"],
                                               p["shape_gamma"]) / cell ** 3)
            return np.where(k2 > 0, amplitude / k2, 0.0)

    factor = box.table(colour, torch.float64)
    field = box.field(torch.float64)        # 8 bytes per cell: the noise is drawn again for each component
    floors = []
    for axis in range(3):
        def displace(pencils, y0, y1, axis=axis):
            pencils *= box.radial(factor, y0, y1) * box.deriv(axis, y0, y1)
            pencils *= 1j

        def positions(x0, x1, psi, axis=axis):
            hi = psi.float()
            lo = (psi - hi.double()).float()
            if axis == 0:
                floor = torch.floor(hi.double() + lo.double())                # what _deposit will see
                floors.append((int(floor.min()), int(floor.max())))
            store.write(_POSITION[axis], x0, x1, _host(hi))
            store.write(_RESIDUAL[axis], x0, x1, _host(lo))

        spec = box.to_spectrum(field, lambda x0, x1, white: torch.from_numpy(white).to(device), noise.slabs(box))
        box.along_x(spec, displace)
        box.from_spectrum(spec, positions)
    return max(max(-low, high + 1) for low, high in floors)


def _deposit(box, store, reach):
    """Periodic CIC deposit of mass and momentum (weight x psi, cells) of the particles in the store.

    Particle slabs in x order scatter into a ring of (slab + 2 reach) planes; a plane is written to
    the store once no later slab can reach it. Planes within `reach` of x = 0 also get particles
    from the far end of the box: their first part is held until the end. With a ring as large as
    the box (small boxes, or slab ~ N) the accumulators are simply the whole box.
    """
    n, device, nn = box.n, box.device, box.n * box.n
    ring = box.slab + 2 * reach < n
    planes = box.slab + 2 * reach if ring else n
    # Two complex64 accumulators hold (mass, momentum_x) and (momentum_y, momentum_z): one random
    # access adds two float32 sums (the scatter-adds are most of the deposit's time).
    acc = torch.zeros((2, planes * nn), dtype=torch.complex64, device=device)
    itype = torch.int32 if planes * nn < 2 ** 31 else torch.int64
    grid = [None, torch.arange(n, device=device, dtype=itype).view(1, n, 1),
            torch.arange(n, device=device, dtype=itype).view(1, 1, n)]
    held, emitted = {}, -reach

    def write_planes(j0, j1, values):                        # values (2, j1-j0, N, N) complex
        values = torch.view_as_real(values)
        store.write(_MASS, j0, j1, _host(values[0, ..., 0]))
        for a, (q, part) in enumerate(((0, 1), (1, 0), (1, 1))):
            store.write(_MOMENTUM[a], j0, j1, _host(values[q, ..., part]))

    def emit(u):                                              # u: unwrapped plane index
        r, j = u % planes, u % n
        plane = acc[:, r * nn:(r + 1) * nn].view(2, 1, n, n)
        if u < reach:                                         # more will come from x ~ N
            held[j] = plane.clone()
        else:
            if j in held:
                plane += held.pop(j)
            write_planes(j, j + 1, plane)
        plane.zero_()

    def prepare(axis, x0, x1):
        psi = (torch.from_numpy(store.read(_POSITION[axis], x0, x1)).to(device, torch.float64)
               + torch.from_numpy(store.read(_RESIDUAL[axis], x0, x1)).to(device, torch.float64))
        # Node + fraction without forming q + psi in floating point: frac = psi - floor(psi) is
        # exact, so a flipped box (psi -> -psi) gets exactly 1 - frac.
        floor = torch.floor(psi)
        frac = (psi - floor).float()
        node = floor.to(itype)
        del floor
        node += torch.arange(x0, x1, device=device, dtype=itype).view(-1, 1, 1) if axis == 0 else grid[axis]
        period, stride = (planes, nn) if axis == 0 else (n, n if axis == 1 else 1)
        node.remainder_(period)
        after = node + 1
        after.masked_fill_(after == period, 0)
        return (node * stride, after * stride), (1 - frac, frac), psi.float().view(-1)

    def scatter(which, index, weight, values):
        for cx in (0, 1):
            for cy in (0, 1):
                index_xy = index[0][cx] + index[1][cy]
                weight_xy = weight[0][cx] * weight[1][cy]
                for cz in (0, 1):
                    flat = (index_xy + index[2][cz]).view(-1)
                    w = (weight_xy * weight[2][cz]).view(-1)
                    for q in which:
                        acc[q].index_add_(0, flat, values[q] * w)

    groups = ((0,), (1,)) if box.pool is not None else ((0, 1),)       # one accumulator per thread
    for x0, x1 in box.ranges:
        index, weight, velocity = zip(*box.map(functools.partial(prepare, x0=x0, x1=x1), range(3)))
        # Per particle, deposit weight x (1 + i v_x) and weight x (v_y + i v_z), v = psi in cells.
        values = (torch.complex(torch.ones_like(velocity[0]), velocity[0]), torch.complex(velocity[1], velocity[2]))
        box.map(functools.partial(scatter, index=index, weight=weight, values=values), groups)
        del index, weight, velocity, values
        if ring:
            while emitted < x1 - reach:
                emit(emitted)
                emitted += 1
        box.progress.step()
    _release_memory()
    if ring:
        while emitted < n + reach:
            emit(emitted)
            emitted += 1
        assert not held, sorted(held)
    else:
        for x0, x1 in box.ranges:
            write_planes(x0, x1, acc[:, x0 * nn:x1 * nn].view(2, x1 - x0, n, n))


def _cic_deposit(psi, n, slab=None, device="cpu"):
    """The pipeline's CIC deposit on its own: particles starting on the grid points, displaced by psi
    (3 arrays (N,N,N), cells). Returns mass (N^3,) and sum of weight x psi (3, N^3), float32."""
    device, store = resolve_device(device), _ArrayStore(n)
    for a in range(3):
        exact = np.asarray(psi[a], dtype=np.float64)
        hi = exact.astype(np.float32)
        store.write(_POSITION[a], 0, n, hi)
        store.write(_RESIDUAL[a], 0, n, (exact - hi).astype(np.float32))
    floor = np.floor(store.read(_POSITION[0], 0, n).astype(np.float64) + store.read(_RESIDUAL[0], 0, n))
    reach = int(max(-floor.min(), floor.max() + 1))
    with _workers(device, default_workers(device)) as pool, torch.no_grad():
        _deposit(_Box(n, device, slab or n, _Progress(False, 0, ""), pool, default_workers(device)), store, reach)
    return (store.read(_MASS, 0, n).reshape(-1),
            np.stack([store.read(_MOMENTUM[a], 0, n).reshape(-1) for a in range(3)]))


def _hydro(box, store, cell, smoothing, p, progress):
    """Gas density and velocity (DM smoothed), DM velocity, temperature; all channels final.

    The gas fields are computed in float64 (the FFT error is relative to the rms of a field, and the
    gas velocity divides by the density, small in voids) one at a time: a float64 field and the
    float32 divergence spectrum, 12 bytes per cell. The gas density is read back from its stored
    channel (ln(rho)/14 in float32: rho to ~4e-7) instead of being kept."""
    device = box.device
    kernel = box.table(lambda k2: np.exp(-0.5 * k2 * smoothing ** 2), torch.float64)
    scale = p["velocity_per_displacement"] * cell                         # km/s per cell of displacement

    def read(channel, x0, x1):
        return torch.from_numpy(store.read(channel, x0, x1)).to(device)

    def smooth(pencils, y0, y1):
        pencils *= box.radial(kernel, y0, y1)

    progress.stage("gas")

    def dm_density(x0, x1):
        mass = read(_MASS, x0, x1)
        store.write(0, x0, x1, _host(_normalize_density_t(mass)))
        return mass

    def gas_density(x0, x1, gas):
        store.write(4, x0, x1, _host(_normalize_density_t(gas.clamp_(min=DENSITY_FLOOR))))

    spec = box.to_spectrum(box.field(torch.float64), dm_density)
    box.along_x(spec, smooth)
    box.from_spectrum(spec, gas_density)
    del spec

    progress.stage("velocity")
    divergence = box.spectrum(box.field(torch.float32))
    for a in range(3):
        _velocity(box, store, a, divergence, kernel, scale)

    progress.stage("temperature")
    box.inverse_along_x(divergence, torch.complex128)

    def temperature(x0, x1, div):
        div_v = div / cell                                                 # km/s per Mpc/h
        jump = (-div_v).clamp_(min=0.0) * (p["shock_length"] * cell)       # km/s
        t = (p["temperature_mean_density"] * _gas_density(read, x0, x1) ** (p["eos_gamma"] - 1)
             + _SHOCK_T_PER_KMS2 * jump ** 2)                              # K
        store.write(8, x0, x1, _host(_normalize_temperature_t(t)))

    box.from_spectrum(divergence, temperature, torch.complex128)


def _gas_density(read, x0, x1):
    """rho_gas / mean (float64) from its stored channel."""
    return torch.exp(read(4, x0, x1).double() * DENSITY_LOG_SCALE)


def _velocity(box, store, a, divergence, kernel, scale):
    """Component a: gas velocity (smoothed momentum / gas density) and DM velocity into the store;
    i k_a v_a added to the divergence spectrum (float32; the transforms are float64)."""
    device, eps = box.device, DENSITY_FLOOR

    def read(channel, x0, x1):
        return torch.from_numpy(store.read(channel, x0, x1)).to(device)

    def smooth(pencils, y0, y1):
        pencils *= box.radial(kernel, y0, y1)

    def velocities(x0, x1, gas_v):
        gas_v /= _gas_density(read, x0, x1)                                # km/s
        # DM velocity = momentum / mass; near-empty cells blend towards the gas velocity so the
        # field stays continuous in the mass (no threshold for rounding to flip under a symmetry).
        momentum = read(_MOMENTUM[a], x0, x1).double() * scale
        dm_v = (momentum + eps * gas_v) / (read(_MASS, x0, x1).double() + eps)
        store.write(1 + a, x0, x1, _host(_normalize_velocity_t(dm_v)))
        store.write(5 + a, x0, x1, _host(_normalize_velocity_t(gas_v)))
        torch.fft.rfft2(gas_v, out=spec[x0:x1])                           # on to the divergence

    def derivative(pencils, y0, y1):
        pencils *= box.deriv(a, y0, y1)
        pencils *= 1j
        if a == 0:
            divergence[:, y0:y1] = pencils
        else:
            divergence[:, y0:y1] += pencils

    spec = box.to_spectrum(box.field(torch.float64), lambda x0, x1: read(_MOMENTUM[a], x0, x1).double() * scale)
    box.along_x(spec, smooth)
    box.from_spectrum(spec, velocities)
    box.along_x(spec, derivative, inverse=False)


def _physics(n, box_length, smoothing, physics):
    unknown = set(physics) - set(DEFAULT_PHYSICS)
    if unknown:
        raise TypeError(f"unknown physics parameters {sorted(unknown)}; known: {sorted(DEFAULT_PHYSICS)}")
    if n < 2:
        raise ValueError(f"the box needs at least 2 cells per side, got {n}")
    if box_length is not None and not box_length > 0:
        raise ValueError(f"box_length must be positive (Mpc/h), got {box_length}")
    if not smoothing >= 0:
        raise ValueError(f"smoothing must be >= 0 cells, got {smoothing}")
    cell = box_length / n if box_length is not None else DEFAULT_CELL_SIZE            # Mpc/h
    return cell, {**DEFAULT_PHYSICS, **physics}


def default_workers(device):
    """Worker threads: the cores this process may use (at most 2: the deposit splits in two) on the CPU."""
    if device.type != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 2))


def _generate(store, noise, n, cell, smoothing, p, device, slab, progress, workers=None):
    """Run the whole pipeline into ``store`` (every channel written)."""
    workers = workers or default_workers(device)
    with _workers(device, workers) as pool, torch.no_grad():
        box = _Box(n, device, slab, progress, pool, workers)
        progress.stage("displacement")
        reach = _displacements(box, store, noise, cell, p)
        progress.stage("cic")
        _deposit(box, store, reach)
        _hydro(box, store, cell, smoothing, p, progress)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the blocks the pipeline cached: a training run in this process starts from empty


def _in_memory(noise, n, box_length, smoothing, progress, device, slab, physics):
    cell, p = _physics(n, box_length, smoothing, physics)
    device = resolve_device(device)
    slab = slab or slab_planes(n, device)
    check_memory(n, slab, device, host_extra=9 * 4 * n ** 3)
    store = _ArrayStore(n)
    bar = _Progress(progress, _SLAB_STEPS * -(-n // slab), f"fields {n}^3")
    try:
        _generate(store, noise, n, cell, smoothing, p, device, slab, bar)
    except BaseException:
        bar.close(failed=True)
        raise
    bar.close()
    return store.nbody, store.hydro


def generate_fields(white_noise, box_length=None, smoothing=DEFAULT_SMOOTHING, progress=None, device=None,
                    slab=None, **physics):
    """Nbody (4,N,N,N) and Hydro (5,N,N,N) float32 fields, normalised, from (N,N,N) white noise.

    A pure function of its arguments (up to float32 rounding: slab size and device change only the
    order of float32 sums). box_length in Mpc/h (None: N * DEFAULT_CELL_SIZE); smoothing: gas
    filtering scale in cells; device: "cpu", "cuda" or None (CUDA when available); slab: planes per
    slab (None: from the memory budget); physics: overrides of DEFAULT_PHYSICS.
    """
    white_noise = np.asarray(white_noise)
    n = white_noise.shape[0]
    if white_noise.shape != (n, n, n):
        raise ValueError(f"white noise must be a cube (N,N,N), got shape {white_noise.shape}")
    return _in_memory(_ArrayNoise(white_noise), n, box_length, smoothing, progress, device, slab, physics)


def default_box_length(box):
    return box * DEFAULT_CELL_SIZE


def make_dataset(box, seed, box_length=None, smoothing=DEFAULT_SMOOTHING, progress=None, device=None, slab=None,
                 **physics):
    """(Nbody, Hydro) arrays from the white noise of np.random.default_rng(seed) (see generate_fields).

    Holds the output in memory (36 bytes per cell): for big boxes use write_dataset, which streams."""
    return _in_memory(_SeedNoise(seed), box, box_length, smoothing, progress, device, slab, physics)


# --- writing ------------------------------------------------------------------------------------
def _tmp_path(path):
    path = Path(path)  # the host too: containers on two nodes may share a process ID and a file system
    return path.with_name(f".{path.name}.tmp{socket.gethostname()}-{os.getpid()}")


def warn_of_leftovers(path):
    """Name the hidden temporary files of ``path`` and its twins that a killed generation (SIGKILL, an out-of-memory
    kill: no clean-up runs) left: the size of a box each, which nobody sees in ``ls``. Not deleted: on a shared file
    system they may be another node's writes in progress."""
    leftovers = [tmp for target in (Path(path), *npy_paths(path)) for tmp in target.parent.glob(f".{target.name}.tmp*")
                 if tmp.is_file() and tmp != _tmp_path(target)]
    if leftovers:
        logger.warning(f"{', '.join(map(str, leftovers))} ({_gib(sum(tmp.stat().st_size for tmp in leftovers))}): "
                       f"partial files of a generation that was killed; delete them unless another process is "
                       f"writing {Path(path).name} now")


def _file_attrs():
    """The attributes every generated file carries: the normalisation constants (utils/units.py) and the
    generator's version."""
    return {**physical_attrs(), "generator": GENERATOR_VERSION}


def npy_paths(path_stem):
    """The DALI-layout files written next to ``path_stem`` (a path with or without .h5)."""
    stem = Path(path_stem)
    stem = stem.with_suffix("") if stem.suffix in (".h5", ".hdf5") else stem
    return stem.with_name(stem.name + "_data.npy"), stem.with_name(stem.name + "_label.npy")


def _write_npy_file(path, fields, progress=None):
    """fields (C,N,N,N) -- an array or HDF5 dataset -- as an (N,N,N,C) float32 .npy file, a slab of
    planes at a time (never the whole volume in memory)."""
    channels, n = fields.shape[0], fields.shape[1]
    slab = _npy_slab(channels, n)
    with open(path, "wb") as fp:
        np.lib.format.write_array_header_1_0(fp, {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")),
                                                  "fortran_order": False, "shape": (n,) * 3 + (channels,)})
        for x0 in range(0, n, slab):
            x1 = min(n, x0 + slab)
            block = np.empty((x1 - x0, n, n, channels), dtype="<f4")
            for c in range(channels):
                block[..., c] = fields[c, x0:x1]
            block.tofile(fp)
            if progress is not None:
                progress.step()


def _npy_slab(channels, n):
    """Planes per block of a .npy twin: about 512 MiB of float32 (N, N, C) planes."""
    return max(1, min(n, 2 ** 26 // (8 * channels * n * n)))


def _npy_steps(n):
    """Progress steps of writing both twins: one per block of each (4 Nbody and 5 Hydro channels)."""
    return sum(-(-n // _npy_slab(channels, n)) for channels in (4, 5))


def write_npy(path_stem, nbody, hydro, progress=None, then=None):
    """Write <stem>_data.npy (N,N,N,4) and <stem>_label.npy (N,N,N,5) float32, (D,H,W,C), atomically.

    nbody/hydro: arrays or HDF5 datasets (C,N,N,N). Both go to temporary names first and are renamed
    together (then ``then()``, e.g. renaming the .h5), so a failure leaves neither behind."""
    paths = npy_paths(path_stem)
    tmps = [_tmp_path(path) for path in paths]
    try:
        for tmp, fields in zip(tmps, (nbody, hydro)):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            _write_npy_file(tmp, fields, progress)
        for tmp, path in zip(tmps, paths):
            os.replace(tmp, path)
        if then is not None:
            then()
    finally:
        for tmp in tmps:
            if tmp.exists():
                tmp.unlink()
    return paths


def _attrs(box, seed, box_length, smoothing, physics):
    """Per-file attributes: what was generated and with which physics (write_dataset adds the normalisation
    constants)."""
    length = box_length if box_length is not None else default_box_length(box)
    return dict(box=box, seed=seed, box_size_mpc_h=length, cell_size_mpc_h=length / box,
                smoothing_cells=smoothing, **{**DEFAULT_PHYSICS, **physics})


def write_dataset(path, box, seed, npy=False, box_length=None, smoothing=DEFAULT_SMOOTHING, progress=None,
                  device=None, slab=None, **physics):
    """Generate box^3 from ``seed`` straight into ``path`` (and with npy its .npy twins); returns path.

    Streams slabs: peak memory ~15 bytes per cell whatever the box. Checks free memory and disk
    first (GenerationError, one line, nothing written). Writes to temporary names and renames, so
    an interrupted or failed run leaves nothing behind (the .h5 comes last: its existence means done); a killed one
    leaves its hidden temporary files, which the next run names (``warn_of_leftovers``).
    """
    path = Path(path)
    warn_of_leftovers(path)
    cell, p = _physics(box, box_length, smoothing, physics)
    device = resolve_device(device)
    slab = slab or slab_planes(box, device)
    check_memory(box, slab, device)
    check_disk(path, output_bytes(box, npy), f"{path}{' and its .npy twins' if npy else ''} ({box}^3)")
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = _SLAB_STEPS * -(-box // slab) + (_npy_steps(box) if npy else 0)
    bar = _Progress(progress, steps, f"{path.name} {box}^3 seed {seed}")
    tmp, stale = _tmp_path(path), []
    try:
        with h5py.File(tmp, "w") as f:
            store = _H5Store(f, box)
            _generate(store, _SeedNoise(seed), box, cell, smoothing, p, device, slab, bar)
            bar.stage("write")
            for key, value in {**_file_attrs(), **_attrs(box, seed, box_length, smoothing, physics)}.items():
                f.attrs[key] = value
        if npy:            # the .npy twins first, the .h5 last: its existence is what means done
            with h5py.File(tmp, "r") as f:
                write_npy(path, f["Nbody"], f["Hydro"], progress=bar, then=lambda: os.replace(tmp, path))
        else:
            stale = remove_stale_twins(path)   # before the new .h5 lands: never beside an old box's twins
            os.replace(tmp, path)
    except BaseException:
        bar.close(failed=True)
        raise
    else:
        bar.close()
        if stale:
            logger.warning(f"removed {' and '.join(map(str, stale))}, the .npy twins of the file {path.name} replaced; "
                           f"DALI needs new ones (--npy)")
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


@contextlib.contextmanager
def one_line_failures(out, box, box_flag):
    """Out of memory or a failed write (full disk, quota) as one GenerationError line (utils/__init__.py's run:
    ``error: ...``, exit status 2), no traceback; the writers leave nothing partial behind."""
    try:
        yield
    except (MemoryError, RuntimeError) as err:
        if isinstance(err, GenerationError) or not is_out_of_memory(err):  # torch's failed allocations, CPU or CUDA
            raise
        raise GenerationError(f"ran out of memory generating a {box}^3 box ({type(err).__name__}); nothing "
                              f"was written. Free memory or choose a smaller {box_flag}") from err
    except OSError as err:
        raise GenerationError(f"writing {out} failed: {' '.join(str(err).split())}; nothing was written") from err


def ensure_dataset(path, box, seed, npy=False, box_length=None, smoothing=DEFAULT_SMOOTHING,
                   progress=None, device=None, slab=None, **physics):
    """Generate ``path`` (and with npy its .npy twins) only if missing; return the path. An existing file this module
    wrote for another box or seed is a DataError: reusing it would train on data the config did not ask for.

    Files are written to a temporary name and renamed, so an interrupted run never leaves a
    partial file that a later call would mistake for a finished one.
    """
    path = Path(path)
    with _generation_lock(path):
        return _ensure_dataset(path, box, seed, npy, box_length, smoothing, progress, device, slab, **physics)


@contextlib.contextmanager
def _generation_lock(path):
    """One generator of ``path`` at a time, across processes and nodes: two jobs starting on a missing dataset wrote it
    twice, each naming the other's temporary file a killed generation's; the second now waits, then finds the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.with_name(f".{path.name}.lock")
    with open(name, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info(f"Waiting for another process generating {path}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # no flock on this file system: unlocked, as before
            pass
        try:
            yield
        finally:  # nothing left behind; one waiting on this lock finds the file, or (after a failure) makes it
            name.unlink(missing_ok=True)


def _ensure_dataset(path, box, seed, npy, box_length, smoothing, progress, device, slab, **physics):
    if path.exists():
        try:
            with h5py.File(path, "r") as f:
                made = (f.attrs.get("box"), f.attrs.get("seed"))
        except OSError as err:  # cut off by a full disk, say
            raise DataError(f"cannot read {path} as HDF5: {first_line(err)}; delete it to generate it again") from None
        if None not in made and tuple(map(int, made)) != (box, seed):
            raise DataError(f"{path} holds the generated {made[0]}^3 box of seed {made[1]}, not the {box}^3 box of "
                            f"seed {seed} asked for; delete it (and any .npy twins beside it) to generate that one")
    with one_line_failures(path, box, "--box_size"):
        if not path.exists():
            write_dataset(path, box, seed, npy, box_length, smoothing, progress, device, slab, **physics)
        elif npy and not all(p.exists() for p in npy_paths(path)):
            write_npy_from_h5(path, progress)
    return path


def write_npy_from_h5(path, progress=None):
    """Write (or replace) the .npy twins of the existing HDF5 file ``path``, with a progress bar (``progress`` as
    write_dataset's); returns their paths."""
    with h5py.File(path, "r") as f:
        n = f["Nbody"].shape[1]
        check_disk(path, output_bytes(n), f"the .npy twins of {path}")
        bar = _Progress(progress, _npy_steps(n), f"{Path(path).stem} .npy twins")
        try:
            twins = write_npy(path, f["Nbody"], f["Hydro"], progress=bar)
        except BaseException:
            bar.close(failed=True)
            raise
        bar.close()
        return twins


def remove_stale_twins(path):
    """Delete .npy twins left next to ``path`` by an earlier box: DALI would read them instead of the new .h5."""
    stale = [twin for twin in npy_paths(path) if twin.exists()]
    for twin in stale:
        twin.unlink()
    return stale


class Interrupted(GenerationError):
    """Generation stopped by Ctrl-C (KeyboardInterrupt): ``error: interrupted; ...`` and exit status 130."""
    exit_code = 130


def main(argv=None):
    """The command line; a failure raises GenerationError (``run(main)`` makes it one line and exit status 2)."""
    parser = argparse.ArgumentParser(prog="python -m utils.make_dataset", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--box", type=at_least(2), default=None, help="cells per side (default 256)")
    parser.add_argument("--seed", type=int, default=None, help="white-noise seed (default 1)")
    parser.add_argument("--out", required=True, help="output .h5 path")
    parser.add_argument("--npy", action="store_true", help="also write <stem>_data.npy / <stem>_label.npy")
    parser.add_argument("--npy_only", action="store_true",
                        help="write only the .npy twins (DALI's input) of the existing --out file, e.g. your own "
                             "HDF5 data; takes no generation flags")
    parser.add_argument("--box_length", type=positive_float, default=None,
                        help=f"box side in Mpc/h (default box * {DEFAULT_CELL_SIZE:g})")
    parser.add_argument("--smoothing", type=at_least(0.0, float), default=None,
                        help=f"gas filtering scale, Gaussian sigma in cells (default {DEFAULT_SMOOTHING})")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the FFTs and scatter-adds run (default auto: CUDA when available)")
    parser.add_argument("--slab", type=positive_int, default=None,
                        help="planes per slab (default: from the memory budget; the result depends on it only "
                             "through float32 rounding)")
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    args = parser.parse_args(argv)
    if args.out.endswith(os.sep):  # a folder, made or not: Path() would drop the slash and write a file of its name
        parser.error(f"--out {args.out} is a directory; give a file name such as {Path(args.out) / 'train.h5'}")
    if args.npy_only:
        given = [f"--{key}" for key in ("box", "seed", "box_length", "smoothing", "slab")
                 if getattr(args, key) is not None]
        given += ["--npy"] * args.npy + [f"--device {args.device}"] * (args.device != "auto")
        if given:
            parser.error(f"--npy_only copies the existing file; it takes no generation flags ({', '.join(given)})")
        return _write_twins_only(Path(args.out), args.force)
    args.box = 256 if args.box is None else args.box
    args.seed = 1 if args.seed is None else args.seed
    args.smoothing = DEFAULT_SMOOTHING if args.smoothing is None else args.smoothing
    if args.seed < 0:
        parser.error(f"--seed must be >= 0 (numpy's generators take no negative seeds), got {args.seed}")

    # The twins too without --npy: an older box's are removed (DALI would read them), and they may be someone's data.
    twins_removed = not args.npy and any(twin.exists() for twin in npy_paths(args.out))
    refuse_existing([Path(args.out), *npy_paths(args.out)], args.force,
                    "overwrite them (.npy twins beside a new box are removed)" if twins_removed else "overwrite")
    start = time.perf_counter()
    try:
        with one_line_failures(args.out, args.box, "--box"):
            write_dataset(args.out, args.box, args.seed, args.npy, args.box_length, args.smoothing, None,
                          args.device, args.slab)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; nothing was written") from None
    print(f"wrote {args.out} ({args.box}^3, seed {args.seed}) in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return 0


def refuse_existing(paths, force, verb):
    """GenerationError "<files> already exist(s); pass --force to <verb>" unless ``force`` or none of ``paths`` exists;
    a directory among them is refused whatever ``force`` says (nothing replaces a directory)."""
    for path in map(Path, paths):
        if path.is_dir():
            raise GenerationError(f"{path} is a directory; give a file name such as {path / 'train.h5'}")
    existing = [str(path) for path in paths if Path(path).exists()]
    if existing and not force:
        raise GenerationError(f"{', '.join(existing)} already {'exists' if len(existing) == 1 else 'exist'}; "
                              f"pass --force to {verb}")


def _write_twins_only(path, force):
    """``--npy_only``: the .npy twins of the existing HDF5 file ``path``, atomically; exit status 0."""
    if not path.is_file():
        raise GenerationError(f"{path} {'is a directory' if path.is_dir() else 'does not exist'}; --npy_only writes "
                              f"the .npy twins of an existing .h5 file")
    refuse_existing(npy_paths(path), force, "replace them")
    from utils.data.torch_loader import check_data_file, check_normalised, read_volume_shapes
    box = read_volume_shapes(path, {"Nbody": len(NBODY_CHANNELS), "Hydro": len(HYDRO_CHANNELS)})["Nbody"][1]
    check_normalised(check_data_file(path, box, len(NBODY_CHANNELS), len(HYDRO_CHANNELS)))  # what training checks
    start = time.perf_counter()
    try:
        twins = write_npy_from_h5(path)
    except (OSError, KeyError) as err:  # unreadable file, no Nbody/Hydro datasets, a failed write
        raise GenerationError(f"writing the .npy twins of {path} failed: {' '.join(str(err).split())}; nothing "
                              f"was written") from err
    except KeyboardInterrupt:
        raise Interrupted("interrupted; nothing was written") from None
    print(f"wrote {' and '.join(map(str, twins))} from {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)
