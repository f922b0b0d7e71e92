"""Units and normalisation of the stored fields (a bottom layer: imports numpy and utils/symmetry.py only).

Every data file (the generator's, utils/make_dataset.py, and predict.py's output) holds two float32
datasets, channels first, periodic box of N^3 cells:

    Nbody (4, N, N, N): dark-matter density, vx, vy, vz          (NBODY_CHANNELS)
    Hydro (5, N, N, N): gas density, vx, vy, vz, temperature     (HYDRO_CHANNELS)

Velocity component k points along spatial array axis k (axis 1 + k of the stored array); channels
VECTOR_CHANNELS of both are the velocity components (defined in utils/symmetry.py, which moves them). A cell
is DEFAULT_CELL_SIZE comoving Mpc/h (a 256^3 box is 20 Mpc/h) unless the file's ``cell_size_mpc_h`` attribute
says otherwise.

Normalisation uses fixed constants (never per-box statistics), so train and validation files
share one scale; every stored value lies in (-1, 1), matching the model's tanh output:

    density      x = ln(max(rho/mean, DENSITY_FLOOR)) / DENSITY_LOG_SCALE     (exp(14 x) = rho/mean)
    velocity     x = v[km/s] / VELOCITY_SCALE
    temperature  x = (log10 T[K] - TEMPERATURE_LOG10_OFFSET) / TEMPERATURE_LOG10_SCALE

each clipped to [-CLIP, CLIP]. :func:`to_physical` (and the per-field ``denormalize_*``) map back
to rho/mean, km/s and K, for numpy arrays or torch tensors. :func:`physical_attrs` is what every
generated file stores of these constants as HDF5 attributes; :func:`normalisation_mismatches` compares a
file's with them (science/__init__.py's ``check_normalisation`` refuses a file normalised otherwise).
"""
import numpy as np

from utils.symmetry import VECTOR_CHANNELS

# --- normalisation constants (stored as HDF5 attributes too) ---------------------------------
DENSITY_LOG_SCALE = 14.0          # x = ln(rho/mean) / 14
DENSITY_FLOOR = 1e-3              # rho/mean floor before the log (CIC leaves cells empty): x >= -0.49
VELOCITY_SCALE = 500.0            # km/s; 256^3 boxes reach |v| ~ 200 km/s, larger boxes more
TEMPERATURE_LOG10_OFFSET = 4.5    # log10 T of 10^4.5 K maps to 0
TEMPERATURE_LOG10_SCALE = 2.5     # log10 T in (2, 7) maps to (-1, 1)
CLIP = 0.999                      # every stored value is clipped to [-CLIP, CLIP] (sign-symmetric)

NBODY_CHANNELS = ("dm_density", "dm_vx", "dm_vy", "dm_vz")
HYDRO_CHANNELS = ("gas_density", "gas_vx", "gas_vy", "gas_vz", "temperature")

DEFAULT_CELL_SIZE = 20.0 / 256    # Mpc/h per cell (a 256^3 box is 20 Mpc/h) when box_length is None


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


NORMALISATION_ATTRS = ("density_log_scale", "density_floor", "velocity_scale", "temperature_log10_offset",
                       "temperature_log10_scale", "clip")


def normalisation_mismatches(attrs):
    """[(name, stored, this code's)] for each constant of NORMALISATION_ATTRS that ``attrs`` (a data file's HDF5
    attributes) stores with another value than this module's. A file storing none of them is not checked."""
    expected = physical_attrs()
    return [(name, float(attrs[name]), expected[name]) for name in NORMALISATION_ATTRS
            if name in attrs and not np.isclose(float(attrs[name]), expected[name], rtol=1e-6, atol=0)]


def physical_attrs():
    """The normalisation constants, as stored on every generated file (the generator adds its version)."""
    return dict(
        density_log_scale=DENSITY_LOG_SCALE, density_floor=DENSITY_FLOOR, velocity_scale=VELOCITY_SCALE,
        velocity_units="km/s", temperature_log10_offset=TEMPERATURE_LOG10_OFFSET,
        temperature_log10_scale=TEMPERATURE_LOG10_SCALE, temperature_units="K", clip=CLIP,
        nbody_channels=list(NBODY_CHANNELS), hydro_channels=list(HYDRO_CHANNELS),
        vector_channels=list(VECTOR_CHANNELS),
    )
