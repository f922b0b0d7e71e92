"""Tests of the synthetic N-body -> hydro dataset generator (utils/make_dataset.py). CPU, small boxes."""
import os

import h5py
import numpy as np
import pytest

from utils import make_dataset as md
from utils import symmetry

N = 32


@pytest.fixture(scope="module")
def fields48():
    """One 48^3 default-physics box, shared by the statistics tests."""
    return md.make_dataset(48, seed=11, progress=False)


def _white(n, seed):
    return np.random.default_rng(seed).standard_normal((n, n, n))


# --- file layout --------------------------------------------------------------------------------
def test_cli_writes_h5_and_npy_layout(tmp_path):
    out = tmp_path / "sub" / "train.h5"
    assert md.main(["--box", str(N), "--seed", "3", "--out", str(out), "--npy"]) == 0
    with h5py.File(out, "r") as f:
        assert set(f.keys()) == {"Nbody", "Hydro"}
        nbody, hydro = f["Nbody"][...], f["Hydro"][...]
        assert f["Nbody"].dtype == np.float32 and f["Hydro"].dtype == np.float32
        attrs = dict(f.attrs)
    assert nbody.shape == (4, N, N, N) and hydro.shape == (5, N, N, N)
    for data in (nbody, hydro):
        assert np.isfinite(data).all()
        assert np.abs(data).max() < 1.0
    assert attrs["density_log_scale"] == md.DENSITY_LOG_SCALE == 14
    assert attrs["velocity_scale"] == md.VELOCITY_SCALE
    assert attrs["temperature_log10_offset"] == md.TEMPERATURE_LOG10_OFFSET
    assert attrs["temperature_log10_scale"] == md.TEMPERATURE_LOG10_SCALE
    assert attrs["seed"] == 3 and attrs["box"] == N
    assert attrs["box_size_mpc_h"] == pytest.approx(N * md.DEFAULT_CELL_SIZE)
    assert attrs["generator"] == md.GENERATOR_VERSION
    assert list(attrs["hydro_channels"]) == list(md.HYDRO_CHANNELS)

    data_path, label_path = tmp_path / "sub" / "train_data.npy", tmp_path / "sub" / "train_label.npy"
    assert (data_path, label_path) == md.npy_paths(out)
    data, label = np.load(data_path), np.load(label_path)
    assert data.dtype == np.float32 and data.shape == (N, N, N, 4)
    assert label.dtype == np.float32 and label.shape == (N, N, N, 5)
    np.testing.assert_array_equal(data, nbody.transpose(1, 2, 3, 0))
    np.testing.assert_array_equal(label, hydro.transpose(1, 2, 3, 0))
    # Same content as the in-memory API, and no temporary files left behind.
    nbody_api, hydro_api = md.make_dataset(N, 3, progress=False)
    np.testing.assert_array_equal(nbody, nbody_api)
    np.testing.assert_array_equal(hydro, hydro_api)
    assert sorted(os.listdir(out.parent)) == ["train.h5", "train_data.npy", "train_label.npy"]


def test_cli_refuses_to_overwrite(tmp_path):
    out = tmp_path / "d.h5"
    md.main(["--box", "16", "--seed", "1", "--out", str(out)])
    before = out.stat().st_mtime_ns
    with pytest.raises(SystemExit) as err:
        md.main(["--box", "16", "--seed", "2", "--out", str(out)])
    message = str(err.value.code)  # SystemExit(str): printed to stderr, exit status 1
    assert str(out) in message and "--force" in message and "\n" not in message
    assert out.stat().st_mtime_ns == before
    md.main(["--box", "16", "--seed", "2", "--out", str(out), "--force"])
    with h5py.File(out, "r") as f:
        assert f.attrs["seed"] == 2


def test_ensure_dataset_generates_only_when_missing(tmp_path):
    path = tmp_path / "a" / "b" / "quick.h5"
    assert md.ensure_dataset(path, 16, seed=4) == path
    stamp = path.stat().st_mtime_ns
    md.ensure_dataset(path, 16, seed=4)
    assert path.stat().st_mtime_ns == stamp  # not regenerated
    md.ensure_dataset(path, 16, seed=4, npy=True)  # adds the npy twins from the existing file
    assert path.stat().st_mtime_ns == stamp
    data = np.load(md.npy_paths(path)[0])
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(data, f["Nbody"][...].transpose(1, 2, 3, 0))
    assert sorted(os.listdir(path.parent)) == ["quick.h5", "quick_data.npy", "quick_label.npy"]


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "x.h5"

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(h5py.File, "create_dataset", boom)
    with pytest.raises(KeyboardInterrupt):
        md.ensure_dataset(path, 8, seed=0, progress=False)
    assert os.listdir(tmp_path) == []


# --- determinism --------------------------------------------------------------------------------
def test_same_seed_same_bytes_different_seed_differs():
    a = md.make_dataset(N, 5, progress=False)
    b = md.make_dataset(N, 5, progress=False)
    c = md.make_dataset(N, 6, progress=False)
    for x, y, z in zip(a, b, c):
        assert x.tobytes() == y.tobytes()
        assert np.abs(x - z).mean() > 1e-3


# --- normalisation ------------------------------------------------------------------------------
def test_normalisation_round_trip_numpy_and_torch():
    rho = np.array([1e-2, 0.5, 1.0, 30.0, 1e4])
    np.testing.assert_allclose(md.denormalize_density(md.normalize_density(rho)), rho, rtol=1e-5)
    v = np.array([-300.0, -1.0, 0.0, 42.0, 450.0])
    np.testing.assert_allclose(md.denormalize_velocity(md.normalize_velocity(v)), v, rtol=1e-5, atol=1e-3)
    t = np.array([1e3, 1e4, 3e5, 5e6])
    np.testing.assert_allclose(md.denormalize_temperature(md.normalize_temperature(t)), t, rtol=1e-5)
    assert md.normalize_density(0.0) == pytest.approx(np.log(md.DENSITY_FLOOR) / 14)
    assert md.normalize_velocity(1e9) == pytest.approx(md.CLIP)

    torch = pytest.importorskip("torch")
    nbody, hydro = md.make_dataset(8, 0, progress=False)
    batch = torch.from_numpy(np.stack([hydro, hydro]))  # (B, 5, X, Y, Z)
    physical = md.to_physical(batch, "hydro", channel_axis=1)
    assert isinstance(physical, torch.Tensor)
    np.testing.assert_allclose(physical[0].numpy(), md.to_physical(hydro, "hydro"), rtol=1e-5)
    np.testing.assert_allclose(md.to_physical(hydro, "hydro")[4], md.denormalize_temperature(hydro[4]), rtol=1e-6)
    np.testing.assert_allclose(md.to_physical(nbody.transpose(1, 2, 3, 0), "nbody", channel_axis=-1)[..., 1],
                               nbody[1] * md.VELOCITY_SCALE)
    with pytest.raises(ValueError):
        md.to_physical(nbody, "hydro")


# --- statistics ---------------------------------------------------------------------------------
def test_mass_conservation(fields48):
    nbody, hydro = fields48
    rho_dm = md.denormalize_density(nbody[0].astype(np.float64))
    rho_gas = md.denormalize_density(hydro[0].astype(np.float64))
    assert rho_dm.mean() == pytest.approx(1.0, abs=0.02)
    assert rho_gas.mean() == pytest.approx(1.0, abs=0.02)
    # Structure is non-linear at the cell scale, and some cells are empty (at the floor).
    assert 0.5 < np.log(rho_dm).std() < 3.0
    assert rho_dm.max() > 20


def test_power_spectrum_follows_input_on_large_scales():
    # A 20 Mpc/h box on a coarse 32^3 grid: the lowest shells are the linear scales of a 256^3 box.
    n, box_length = 32, 20.0
    cell = box_length / n
    k_full = 2 * np.pi * np.fft.fftfreq(n) / cell
    k_half = 2 * np.pi * np.fft.rfftfreq(n) / cell
    k = np.sqrt(k_full[:, None, None] ** 2 + k_full[None, :, None] ** 2 + k_half[None, None, :] ** 2)
    shell = k / (2 * np.pi / box_length)  # |k| in units of the fundamental
    lowest = (shell > 0.5) & (shell < 2.5)
    large = (shell > 0.5) & (shell < 5.5)
    measured_power, model_power = 0.0, 0.0
    for seed in range(4):
        white = _white(n, seed)
        nbody, _ = md.generate_fields(white, box_length=box_length, progress=False)
        delta = md.denormalize_density(nbody[0].astype(np.float64)) - 1
        measured = np.fft.rfftn(delta)
        # The linear field built here from the same noise: <|delta_k|^2> = P(k) N^3 / cell^3.
        linear = np.fft.rfftn(white) * np.sqrt(md.power_spectrum(k) / cell ** 3)
        ratio = (np.abs(measured[lowest]) ** 2).sum() / (np.abs(linear[lowest]) ** 2).sum()
        corr = ((measured[lowest] * linear[lowest].conj()).real.sum()
                / np.sqrt((np.abs(measured[lowest]) ** 2).sum() * (np.abs(linear[lowest]) ** 2).sum()))
        assert 0.8 < ratio < 1.2, (seed, ratio)
        assert corr > 0.95, (seed, corr)
        measured_power += (np.abs(measured[large]) ** 2).sum() * cell ** 3 / n ** 3
        model_power += md.power_spectrum(k[large]).sum()
    assert measured_power / model_power == pytest.approx(1.0, abs=0.15)


def test_temperature_density_relation(fields48):
    _, hydro = fields48
    log_rho = hydro[0].ravel() * 14 / np.log(10)                 # log10 rho_gas / mean
    log_t = np.log10(md.denormalize_temperature(hydro[4].ravel().astype(np.float64)))
    assert np.corrcoef(log_rho, log_t)[0, 1] > 0.5
    # Expanding (in linear theory: underdense) gas is not shock heated, so there log T follows the
    # T0 rho^(gamma - 1) relation: fit the binned median over the underdense cells.
    under = log_rho < -0.1
    edges = np.quantile(log_rho[under], np.linspace(0.02, 1, 11))
    centres = [np.median(log_rho[(log_rho >= lo) & (log_rho < hi)]) for lo, hi in zip(edges[:-1], edges[1:])]
    medians = [np.median(log_t[(log_rho >= lo) & (log_rho < hi)]) for lo, hi in zip(edges[:-1], edges[1:])]
    slope, intercept = np.polyfit(centres, medians, 1)
    gamma = md.DEFAULT_PHYSICS["eos_gamma"]
    assert slope == pytest.approx(gamma - 1, abs=0.05)
    assert intercept == pytest.approx(np.log10(md.DEFAULT_PHYSICS["temperature_mean_density"]), abs=0.05)
    # Converging (overdense) gas is shock heated on top: a hot tail and a steeper overall relation.
    excess = log_t - (intercept + slope * log_rho)
    assert (excess > 0.3).mean() > 0.01
    assert np.polyfit(log_rho, log_t, 1)[0] > gamma - 1 + 0.2


def _unexplained_fraction(x, y, bins=50):
    """1 - correlation ratio: variance of y left after the best pointwise (binned) function of x."""
    edges = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)))
    which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    count = np.bincount(which, minlength=len(edges) - 1)
    mean = np.bincount(which, y, minlength=len(edges) - 1) / np.maximum(count, 1)
    return ((y - mean[which]) ** 2).mean() / y.var()


def test_hydro_is_not_a_pointwise_function_of_nbody(fields48):
    nbody, hydro = fields48
    dm, gas, temperature = nbody[0].ravel(), hydro[0].ravel(), hydro[4].ravel()
    assert _unexplained_fraction(dm, gas) > 0.2
    assert _unexplained_fraction(dm, temperature) > 0.2
    # Temperature is not a function of the gas density either (shock heating needs div v).
    assert _unexplained_fraction(gas, temperature) > 0.03
    # The gas velocity is the DM one smoothed: close but not equal.
    assert 0.8 < np.corrcoef(nbody[1].ravel(), hydro[1].ravel())[0, 1] < 0.9999


# --- symmetry -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [24, 25])
def test_equivariance_under_the_cube_group(n):
    rotation_z = symmetry.from_matrix([[0, -1, 0], [1, 0, 0], [0, 0, 1]])   # 90 degrees about z
    cyclic = symmetry.from_matrix([[0, 1, 0], [0, 0, 1], [1, 0, 0]])         # 120 degrees about (1,1,1)
    reflection = symmetry.from_matrix(np.diag([-1, 1, 1]))                   # x -> -x
    swap = symmetry.from_matrix([[0, 1, 0], [1, 0, 0], [0, 0, 1]])           # x <-> y, a reflection
    inversion = symmetry.from_matrix(-np.eye(3, dtype=int))
    other = 45                                                              # x <-> -z, y kept
    assert [round(np.linalg.det(symmetry.matrix(g))) for g in (rotation_z, cyclic, reflection, swap, inversion)] \
        == [1, 1, -1, -1, -1]
    white = _white(n, 7)
    # A non-default physics setup too, so every knob is exercised under the symmetry.
    kwargs = dict(box_length=n * 0.1, smoothing=1.2, shock_length=8.0)
    nbody, hydro = md.generate_fields(white, progress=False, **kwargs)
    for g in (rotation_z, cyclic, reflection, swap, inversion, other):
        moved = np.ascontiguousarray(symmetry.transform_view(white[None], g)[0])
        nbody_g, hydro_g = md.generate_fields(moved, progress=False, **kwargs)
        np.testing.assert_allclose(nbody_g, symmetry.transform(nbody, g, vector_channels=(1, 2, 3)),
                                   rtol=0, atol=1e-4, err_msg=f"Nbody, element {g}")
        np.testing.assert_allclose(hydro_g, symmetry.transform(hydro, g, vector_channels=(1, 2, 3)),
                                   rtol=0, atol=1e-4, err_msg=f"Hydro, element {g}")


def test_generate_fields_rejects_bad_input():
    with pytest.raises(ValueError):
        md.generate_fields(np.zeros((8, 8, 9)), progress=False)
    with pytest.raises(TypeError):
        md.generate_fields(np.zeros((8, 8, 8)), progress=False, sigma_8=1.0)


def test_cic_matches_a_naive_reference():
    n = 9
    rng = np.random.default_rng(0)
    psi = [rng.normal(0, 2.5, (n, n, n)) for _ in range(3)]
    # Reference: positions q + psi, the 8 corners with np.add.at, no tricks.
    q = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"))
    pos = q + np.stack(psi)
    base = np.floor(pos).astype(int)
    frac = pos - base
    mass = np.zeros((n, n, n))
    moment = np.zeros((3, n, n, n))
    for corner in range(8):
        off = [(corner >> a) & 1 for a in range(3)]
        w = np.prod([frac[a] if off[a] else 1 - frac[a] for a in range(3)], axis=0)
        idx = tuple((base[a] + off[a]) % n for a in range(3))
        np.add.at(mass, idx, w)
        for a in range(3):
            np.add.at(moment[a], idx, w * psi[a])
    got_mass, got_moment = md._cic_deposit(psi, n)
    np.testing.assert_allclose(got_mass.reshape(n, n, n), mass, atol=1e-6)
    np.testing.assert_allclose(got_moment.reshape(3, n, n, n), moment, atol=1e-5)
    assert got_mass.sum() == pytest.approx(n ** 3)
