"""Tests of the synthetic N-body -> hydro dataset generator (utils/make_dataset.py). CPU, small boxes."""
import errno
import io
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import scipy.integrate
import torch
from tqdm import tqdm

from conftest import REPO_ROOT, write_random_box
from test_symmetry import from_matrix, matrix
from utils import make_dataset as md
from utils import symmetry, units
from utils import DataError, GenerationError, run

N = 32


@pytest.fixture(scope="module")
def fields48():
    """One 48^3 default-physics box, shared by the statistics tests."""
    return md.make_dataset(48, seed=11, progress=False)


def _white(n, seed):
    return np.random.default_rng(seed).standard_normal((n, n, n))


def _reference_fields(white, box_length=None, smoothing=md.DEFAULT_SMOOTHING, **physics):
    """The physics in its plainest form: whole-box float64 numpy FFTs and an np.add.at CIC deposit
    (utils.make_dataset/1's pipeline). The streamed, slab-wise generator must agree with it."""
    p = {**md.DEFAULT_PHYSICS, **physics}
    n = white.shape[0]
    cell = box_length / n if box_length is not None else units.DEFAULT_CELL_SIZE
    k = (2 * np.pi * np.fft.fftfreq(n))[:, None, None], (2 * np.pi * np.fft.fftfreq(n))[None, :, None], \
        (2 * np.pi * np.fft.rfftfreq(n))[None, None, :]
    deriv = [np.where(np.abs(np.abs(ka) - np.pi) < 1e-12, 0.0, ka) for ka in k]    # Nyquist zeroed
    k2 = k[0] ** 2 + k[1] ** 2 + k[2] ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        amplitude = np.sqrt(md.power_spectrum(np.sqrt(k2) / cell, p["sigma8"], p["spectral_index"],
                                              p["shape_gamma"]) / cell ** 3)
        potential = np.where(k2 > 0, np.fft.rfftn(white) * amplitude / k2, 0.0)
    psi = [np.fft.irfftn(1j * d * potential, s=white.shape, axes=(0, 1, 2)) for d in deriv]
    q = np.indices(white.shape)
    floor = [np.floor(ps) for ps in psi]
    frac = [(ps - f).astype(np.float32).astype(np.float64) for ps, f in zip(psi, floor)]
    mass, momentum = np.zeros(white.shape), np.zeros((3,) + white.shape)
    for corner in range(8):
        offset = [(corner >> a) & 1 for a in range(3)]
        weight = np.prod([frac[a] if offset[a] else 1 - frac[a] for a in range(3)], axis=0)
        cells = tuple((q[a] + floor[a].astype(int) + offset[a]) % n for a in range(3))
        np.add.at(mass, cells, weight)
        for a in range(3):
            np.add.at(momentum[a], cells, weight * psi[a])
    momentum *= p["velocity_per_displacement"] * cell

    kernel = np.exp(-0.5 * k2 * smoothing ** 2)

    def smooth(field):
        return np.fft.irfftn(np.fft.rfftn(field) * kernel, s=white.shape, axes=(0, 1, 2))

    gas = np.maximum(smooth(mass), units.DENSITY_FLOOR)
    gas_v = np.stack([smooth(m) for m in momentum]) / gas
    dm_v = (momentum + units.DENSITY_FLOOR * gas_v) / (mass + units.DENSITY_FLOOR)
    div = np.fft.irfftn(sum(1j * d * np.fft.rfftn(gas_v[a]) for a, d in enumerate(deriv)), s=white.shape,
                        axes=(0, 1, 2)) / cell
    jump = np.maximum(0.0, -div) * (p["shock_length"] * cell)
    temperature = p["temperature_mean_density"] * gas ** (p["eos_gamma"] - 1) + md._SHOCK_T_PER_KMS2 * jump ** 2
    nbody = np.concatenate([units.normalize_density(mass)[None], units.normalize_velocity(dm_v)])
    hydro = np.concatenate([units.normalize_density(gas)[None], units.normalize_velocity(gas_v),
                            units.normalize_temperature(temperature)[None]])
    return nbody, hydro


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
    assert attrs["density_log_scale"] == units.DENSITY_LOG_SCALE == 14
    assert attrs["velocity_scale"] == units.VELOCITY_SCALE
    assert attrs["temperature_log10_offset"] == units.TEMPERATURE_LOG10_OFFSET
    assert attrs["temperature_log10_scale"] == units.TEMPERATURE_LOG10_SCALE
    assert attrs["seed"] == 3 and attrs["box"] == N
    assert attrs["box_size_mpc_h"] == pytest.approx(N * units.DEFAULT_CELL_SIZE)
    assert attrs["generator"] == md.GENERATOR_VERSION
    assert list(attrs["hydro_channels"]) == list(units.HYDRO_CHANNELS)

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


def _one_line_error(argv, capsys, exit_code=2):
    """The command line (main under utils/__init__.py's run, as ``python -m utils.make_dataset`` runs it) on
    ``argv``: it must end with ``exit_code`` and one stderr line ``error: ...``; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(md.main, argv)
    assert exit_info.value.code == exit_code
    err = capsys.readouterr().err.rsplit("\r", 1)[-1]          # after the (cleared) progress bar
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_cli_refuses_to_overwrite(tmp_path):
    """End to end: ``python -m utils.make_dataset`` in a process of its own."""
    out = tmp_path / "d.h5"

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "utils.make_dataset", "--box", "16", "--out", str(out),
                               "--device", "cpu", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)

    assert cli("--seed", "1").returncode == 0
    before = out.stat().st_mtime_ns
    refused = cli("--seed", "2")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == f"error: {out} already exists; pass --force to overwrite\n"
    assert out.stat().st_mtime_ns == before
    with pytest.raises(GenerationError, match="already exists; pass --force to overwrite"):
        md.main(["--box", "16", "--seed", "2", "--out", str(out)])          # what run() turned into that line
    assert cli("--seed", "2", "--force").returncode == 0
    with h5py.File(out, "r") as f:
        assert f.attrs["seed"] == 2


def test_a_directory_as_out_is_refused_before_generating_even_with_force(tmp_path):
    """--force cannot replace a directory, so it is not the advice, and no box is generated for a write that fails."""
    for force in ([], ["--force"]):
        with pytest.raises(GenerationError, match=f"^{tmp_path} is a directory; give a file name such as "
                                                  f"{tmp_path / 'train.h5'}$"):
            md.main(["--box", "16", "--out", str(tmp_path), "--device", "cpu", *force])
    new_folder = f"{tmp_path / 'new'}/"  # not yet made: the slash alone says it is one, where Path() would drop it
    with pytest.raises(SystemExit):
        md.main(["--box", "16", "--out", new_folder, "--device", "cpu"])
    assert not (tmp_path / "new").exists()


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


def test_regenerating_without_npy_removes_the_old_twins(tmp_path, caplog):
    """A new .h5 never lands beside .npy twins of an older box of the same size (DALI would read them)."""
    out = tmp_path / "train.h5"
    assert md.main(["--box", "16", "--seed", "1", "--out", str(out), "--npy"]) == 0
    md.logger.addHandler(caplog.handler)  # a warning: on the command line it reaches stderr, in train.py the
    try:                                  # run's log (the "train" logger, which an earlier test may have set up)
        assert md.main(["--box", "16", "--seed", "2", "--out", str(out), "--force"]) == 0
    finally:
        md.logger.removeHandler(caplog.handler)
    assert sorted(os.listdir(tmp_path)) == ["train.h5"]
    assert f"removed {md.npy_paths(out)[0]} and {md.npy_paths(out)[1]}" in caplog.text and "(--npy)" in caplog.text


def _generate_together(out, barrier, results):
    real, calls = md.write_dataset, []
    md.write_dataset = lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))  # this forked process's
    barrier.wait()
    md.ensure_dataset(out, 16, seed=1, progress=False)
    results.put(len(calls))


def test_two_jobs_needing_the_same_missing_file_take_turns(tmp_path):
    """Two quickstart jobs started together on missing data wrote it twice, each naming the other's temporary file a
    killed generation's: the second now waits for the first's lock and finds the file."""
    import multiprocessing
    context = multiprocessing.get_context("fork")
    out, barrier, results = tmp_path / "d.h5", context.Barrier(2), context.Queue()
    jobs = [context.Process(target=_generate_together, args=(out, barrier, results)) for _ in range(2)]
    for job in jobs:
        job.start()
    writes = [results.get(timeout=120) for _ in jobs]
    for job in jobs:
        job.join(timeout=60)
    assert sorted(writes) == [0, 1] and sorted(os.listdir(tmp_path)) == ["d.h5"]  # no lock or temporary file left


def test_partial_files_of_a_killed_generation_are_named_not_deleted(tmp_path, caplog):
    """SIGKILL runs no clean-up: its hidden temporaries (a box's size each) are named by the next run; not deleted,
    since on a shared file system they may be another node's writes in progress."""
    out = tmp_path / "d.h5"
    leftovers = [tmp_path / ".d.h5.tmp4242", tmp_path / ".d_data.npy.tmp4242"]
    for leftover in leftovers:
        leftover.write_bytes(b"\0" * 1000)
    md.logger.addHandler(caplog.handler)
    try:
        md.write_dataset(out, 8, seed=1, progress=False)
    finally:
        md.logger.removeHandler(caplog.handler)
    assert out.is_file() and all(leftover.is_file() for leftover in leftovers)
    assert (f"{leftovers[0]}, {leftovers[1]} (0.0 GiB): partial files of a generation that was killed; delete them "
            f"unless another process is writing d.h5 now") in caplog.text


def test_the_twins_progress_bar_counts_the_blocks_written(tmp_path):
    """At 160^3 a twin is written in blocks of planes, fewer for the 5 Hydro channels than the 4 Nbody ones: the
    bar's total is the number of blocks, so it ends at 100%, not past it."""
    n = 160
    bar = tqdm(total=md._npy_steps(n), file=io.StringIO())
    md.write_npy(tmp_path / "big", np.zeros((4, n, n, n), np.float32), np.zeros((5, n, n, n), np.float32),
                 md._Progress(bar, bar.total, "twins"))
    assert bar.n == bar.total == 5  # 81 and 65 planes a block: 2 + 3


def test_twins_without_their_h5_are_kept_unless_forced(tmp_path):
    """DALI reads .npy twins alone, so twins with no .h5 beside them may be someone's only copy of their data: a new
    box at that name needs --force, with or without --npy, and removes nothing before it is given."""
    out = tmp_path / "train.h5"
    assert md.main(["--box", "16", "--seed", "1", "--out", str(out), "--npy"]) == 0
    out.unlink()
    twins = [twin.read_bytes() for twin in md.npy_paths(out)]
    for npy in ([], ["--npy"]):
        removed = " them \\(\\.npy twins beside a new box are removed\\)" if not npy else ""
        with pytest.raises(GenerationError, match=f"^{md.npy_paths(out)[0]}, {md.npy_paths(out)[1]} already exist; "
                                                  f"pass --force to overwrite{removed}$"):
            md.main(["--box", "16", "--seed", "2", "--out", str(out), *npy])
    assert not out.exists() and [twin.read_bytes() for twin in md.npy_paths(out)] == twins


def test_ensure_dataset_refuses_a_generated_file_of_another_box_or_seed(tmp_path):
    """A config asking for another generated box (quickstart with a new --box_size) must not train on the old one."""
    path = md.ensure_dataset(tmp_path / "quick.h5", 16, seed=4, progress=False)
    for box, seed in ((16, 5), (24, 4)):
        with pytest.raises(DataError, match=rf"^{path} holds the generated 16\^3 box of seed 4, not the {box}\^3 box "
                                            rf"of seed {seed} asked for; delete it \(and any \.npy twins beside it\) "
                                            rf"to generate that one$"):
            md.ensure_dataset(path, box, seed=seed, progress=False)
    with h5py.File(path, "r+") as f:  # a file made elsewhere says neither: it is the user's to vouch for
        del f.attrs["seed"]
    assert md.ensure_dataset(path, 24, seed=5, progress=False) == path


def test_ensure_dataset_failures_are_one_line_for_train_py(tmp_path, monkeypatch):
    """train.py generates on first use: a cut-off file or a full disk (a quota statvfs does not see) must be the
    same one line as make_dataset's own, not a traceback."""
    cut = tmp_path / "cut.h5"
    md.ensure_dataset(cut, 16, seed=4, progress=False)
    cut.write_bytes(cut.read_bytes()[:1000])
    with pytest.raises(DataError, match=rf"^cannot read {cut} as HDF5: .*; delete it to generate it again$"):
        md.ensure_dataset(cut, 16, seed=4, progress=False)

    def full_disk(*args, **kwargs):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(md, "write_dataset", full_disk)
    with pytest.raises(GenerationError, match=rf"^writing {tmp_path / 'new.h5'} failed: \[Errno {errno.EDQUOT}\] "
                                              rf"Disk quota exceeded; nothing was written$"):
        md.ensure_dataset(tmp_path / "new.h5", 16, seed=4, progress=False)

    def out_of_memory(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(md, "write_dataset", out_of_memory)
    with pytest.raises(GenerationError, match=r"ran out of memory generating a 16\^3 box \(MemoryError\); nothing "
                                              r"was written. Free memory or choose a smaller --box_size$"):
        md.ensure_dataset(tmp_path / "new.h5", 16, seed=4, progress=False)


def test_npy_only_writes_the_twins_of_an_existing_file(tmp_path, capsys):
    out = tmp_path / "mine.h5"
    md.ensure_dataset(out, 16, seed=5, progress=False)
    stamp = out.stat().st_mtime_ns
    assert md.main(["--out", str(out), "--npy_only"]) == 0
    assert out.stat().st_mtime_ns == stamp                                 # the .h5 is only read
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(np.load(md.npy_paths(out)[0]), f["Nbody"][...].transpose(1, 2, 3, 0))
        np.testing.assert_array_equal(np.load(md.npy_paths(out)[1]), f["Hydro"][...].transpose(1, 2, 3, 0))
    assert sorted(os.listdir(tmp_path)) == ["mine.h5", "mine_data.npy", "mine_label.npy"]
    message = _one_line_error(["--out", str(out), "--npy_only"], capsys)
    assert message == (f"error: {md.npy_paths(out)[0]}, {md.npy_paths(out)[1]} already exist; pass --force to "
                       f"replace them\n")
    assert md.main(["--out", str(out), "--npy_only", "--force"]) == 0
    message = _one_line_error(["--out", str(tmp_path / "absent.h5"), "--npy_only"], capsys)
    assert "absent.h5 does not exist; --npy_only writes the .npy twins of an existing .h5 file" in message
    message = _one_line_error(["--out", str(tmp_path), "--npy_only"], capsys)
    assert message == f"error: {tmp_path} is a directory; --npy_only writes the .npy twins of an existing .h5 file\n"
    # someone's file: checked as training checks it, before a twin is written
    channels_last = tmp_path / "channels_last.h5"
    write_random_box(channels_last, 8)
    with h5py.File(channels_last, "a") as f:
        del f["Nbody"]
        f["Nbody"] = np.zeros((8, 8, 8, 4), np.float32)
    message = _one_line_error(["--out", str(channels_last), "--npy_only"], capsys)
    assert message == (f"error: {channels_last}: dataset 'Nbody' has shape (8, 8, 8, 4), expected (4, N, N, N)\n")
    raw = write_random_box(tmp_path / "raw.h5", 8)
    with h5py.File(raw, "a") as f:
        f["Hydro"][0] = 1e3
    assert "'Hydro' channel 0 holds values from 1000 to 1000" in _one_line_error(["--out", str(raw), "--npy_only"],
                                                                                    capsys)
    assert not any(twin.exists() for path in (channels_last, raw) for twin in md.npy_paths(path))
    with pytest.raises(SystemExit) as exit_info:                          # argparse: usage line + error, status 2
        md.main(["--out", str(out), "--npy_only", "--seed", "3"])
    assert exit_info.value.code == 2
    assert "--npy_only copies the existing file; it takes no generation flags (--seed)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        md.main(["--out", str(tmp_path / "negative.h5"), "--seed", "-1"])
    assert exit_info.value.code == 2 and "--seed must be >= 0" in capsys.readouterr().err


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
    np.testing.assert_allclose(units.denormalize_density(units.normalize_density(rho)), rho, rtol=1e-5)
    v = np.array([-300.0, -1.0, 0.0, 42.0, 450.0])
    np.testing.assert_allclose(units.denormalize_velocity(units.normalize_velocity(v)), v, rtol=1e-5, atol=1e-3)
    t = np.array([1e3, 1e4, 3e5, 5e6])
    np.testing.assert_allclose(units.denormalize_temperature(units.normalize_temperature(t)), t, rtol=1e-5)
    assert units.normalize_density(0.0) == pytest.approx(np.log(units.DENSITY_FLOOR) / 14)
    assert units.normalize_velocity(1e9) == pytest.approx(units.CLIP)

    torch = pytest.importorskip("torch")
    nbody, hydro = md.make_dataset(8, 0, progress=False)
    batch = torch.from_numpy(np.stack([hydro, hydro]))  # (B, 5, X, Y, Z)
    physical = units.to_physical(batch, "hydro", channel_axis=1)
    assert isinstance(physical, torch.Tensor)
    np.testing.assert_allclose(physical[0].numpy(), units.to_physical(hydro, "hydro"), rtol=1e-5)
    np.testing.assert_allclose(units.to_physical(hydro, "hydro")[4], units.denormalize_temperature(hydro[4]), rtol=1e-6)
    np.testing.assert_allclose(units.to_physical(nbody.transpose(1, 2, 3, 0), "nbody", channel_axis=-1)[..., 1],
                               nbody[1] * units.VELOCITY_SCALE)
    with pytest.raises(ValueError):
        units.to_physical(nbody, "hydro")


def test_every_normaliser_clips_both_signs_to_the_same_bound():
    """Stored values lie in [-CLIP, CLIP] (the tanh output's range), at the low end as at the high end."""
    assert units.normalize_velocity(-1e9) == pytest.approx(-units.CLIP)
    assert units.normalize_velocity(np.array([-600.0, 600.0])).tolist() == pytest.approx([-units.CLIP, units.CLIP])
    assert units.normalize_temperature(1.0) == pytest.approx(-units.CLIP)            # log10 T = 0 < 2
    assert units.normalize_temperature(1e9) == pytest.approx(units.CLIP)
    assert units.normalize_density(1e300) == pytest.approx(units.CLIP)


def test_the_shock_temperature_is_that_of_a_strong_shock():
    """T = 3/16 mu m_p v^2 / k_B (Rankine-Hugoniot, gamma 5/3) for mu = 0.6: 13.6 K per (km/s)^2, from SI constants."""
    proton_mass, boltzmann = 1.67262192e-27, 1.380649e-23                         # kg, J/K
    assert md._SHOCK_T_PER_KMS2 == pytest.approx(3 / 16 * 0.6 * proton_mass * 1e6 / boltzmann, rel=1e-4)
    assert md._SHOCK_T_PER_KMS2 * 100.0 ** 2 == pytest.approx(1.363e5, rel=1e-3)   # a 100 km/s jump: 1.4e5 K


# --- statistics ---------------------------------------------------------------------------------
def test_mass_conservation(fields48):
    nbody, hydro = fields48
    rho_dm = units.denormalize_density(nbody[0].astype(np.float64))
    rho_gas = units.denormalize_density(hydro[0].astype(np.float64))
    assert rho_dm.mean() == pytest.approx(1.0, rel=1e-4)  # CIC conserves mass; the floor adds a little (5e-6)
    assert rho_gas.mean() == pytest.approx(1.0, rel=1e-6)  # smoothing conserves it too (3e-10)
    # Structure is non-linear at the cell scale, and some cells are empty (at the floor).
    assert 0.5 < np.log(rho_dm).std() < 3.0
    assert rho_dm.max() > 20


def test_the_spectrum_is_bbks_normalised_to_sigma8():
    """Known answers, not the generator's functions checked against themselves: the BBKS transfer function
    (Bardeen et al. 1986, eq. G3) at q = k / Gamma, from its published constants; and sigma8 as an independent
    integral (scipy's adaptive quadrature of the top-hat-filtered variance, in 8 Mpc/h spheres)."""
    gamma = md.DEFAULT_PHYSICS["shape_gamma"]
    q = np.array([0.01, 0.1, 1.0, 10.0])
    transfer_squared = md._bbks_shape(q * gamma, 0.0, gamma)  # n_s = 0: T(q)^2 alone
    np.testing.assert_allclose(np.sqrt(transfer_squared), [0.973037993475, 0.622308291897, 0.0732235006435,
                                                           0.00202987669756], rtol=1e-9)
    np.testing.assert_allclose(md._bbks_shape(q * gamma, 0.96, gamma), (q * gamma) ** 0.96 * transfer_squared)
    for sigma8 in (md.DEFAULT_PHYSICS["sigma8"], 0.8):
        def variance_per_ln_k(ln_k):
            k = np.exp(ln_k)
            window = 3 * (np.sin(8 * k) - 8 * k * np.cos(8 * k)) / (8 * k) ** 3
            return k ** 3 * md.power_spectrum(k, sigma8) * window ** 2 / (2 * np.pi ** 2)
        variance, _ = scipy.integrate.quad(variance_per_ln_k, np.log(1e-5), np.log(1e3), limit=500)
        assert np.sqrt(variance) == pytest.approx(sigma8, rel=1e-4)


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
        delta = units.denormalize_density(nbody[0].astype(np.float64)) - 1
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
    log_t = np.log10(units.denormalize_temperature(hydro[4].ravel().astype(np.float64)))
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
    rotation_z = from_matrix([[0, -1, 0], [1, 0, 0], [0, 0, 1]])   # 90 degrees about z
    cyclic = from_matrix([[0, 1, 0], [0, 0, 1], [1, 0, 0]])         # 120 degrees about (1,1,1)
    reflection = from_matrix(np.diag([-1, 1, 1]))                   # x -> -x
    swap = from_matrix([[0, 1, 0], [1, 0, 0], [0, 0, 1]])           # x <-> y, a reflection
    inversion = from_matrix(-np.eye(3, dtype=int))
    other = 45                                                      # x <-> -z, y kept
    assert [round(np.linalg.det(matrix(g))) for g in (rotation_z, cyclic, reflection, swap, inversion)] \
        == [1, 1, -1, -1, -1]
    white = _white(n, 7)
    # A non-default physics setup too, so every knob is exercised under the symmetry.
    kwargs = dict(box_length=n * 0.1, smoothing=1.2, shock_length=8.0)
    nbody, hydro = md.generate_fields(white, progress=False, **kwargs)
    for g in (rotation_z, cyclic, reflection, swap, inversion, other):
        moved = np.ascontiguousarray(symmetry.transform_view(white[None], g)[0])
        nbody_g, hydro_g = md.generate_fields(moved, progress=False, **kwargs)
        np.testing.assert_allclose(nbody_g, symmetry.transform(nbody, g, vector_channels=(1, 2, 3)),
                                   rtol=0, atol=1e-6, err_msg=f"Nbody, element {g}")
        np.testing.assert_allclose(hydro_g, symmetry.transform(hydro, g, vector_channels=(1, 2, 3)),
                                   rtol=0, atol=1e-6, err_msg=f"Hydro, element {g}")


def test_generate_fields_rejects_bad_input():
    with pytest.raises(ValueError):
        md.generate_fields(np.zeros((8, 8, 9)), progress=False)
    with pytest.raises(TypeError):
        md.generate_fields(np.zeros((8, 8, 8)), progress=False, sigma_8=1.0)


@pytest.mark.parametrize("slab", [None, 2])
def test_cic_matches_a_naive_reference(slab):
    # slab None: one slab, accumulators over the whole box; slab 2: the ring of planes, with the
    # planes near x = 0 completed by particles from the far end of the box.
    n = 24
    rng = np.random.default_rng(0)
    psi = [rng.normal(0, 1.5, (n, n, n)) for _ in range(3)]
    reach = max(-np.floor(psi[0]).min(), np.floor(psi[0]).max() + 1)
    assert slab is None or slab + 2 * reach < n            # so slab 2 runs the ring, not the whole box
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
    got_mass, got_moment = md._cic_deposit(psi, n, slab=slab)
    np.testing.assert_allclose(got_mass.reshape(n, n, n), mass, atol=2e-6)
    np.testing.assert_allclose(got_moment.reshape(3, n, n, n), moment, atol=2e-5)
    assert got_mass.sum(dtype=np.float64) == pytest.approx(n ** 3)


# --- bounded memory: slabs, streaming, one code path --------------------------------------------
def test_matches_the_float64_whole_box_physics():
    # The streamed pipeline against the plain whole-box float64 one, default and non-default physics.
    for n, kwargs in ((32, {}), (27, dict(box_length=4.0, smoothing=1.2, shock_length=8.0, sigma8=0.2))):
        white = _white(n, 3)
        nbody, hydro = md.generate_fields(white, progress=False, slab=4, **kwargs)
        ref_nbody, ref_hydro = _reference_fields(white, **kwargs)
        # float32 sums and storage: a few float32 ulps of the stored values (measured <= 3e-7)
        np.testing.assert_allclose(nbody, ref_nbody, rtol=0, atol=1e-6, err_msg=f"Nbody {n}^3")
        np.testing.assert_allclose(hydro, ref_hydro, rtol=0, atol=1e-6, err_msg=f"Hydro {n}^3")
        assert np.median(np.abs(hydro - ref_hydro)) < 3e-8 and np.median(np.abs(nbody - ref_nbody)) < 3e-8


def test_slab_wise_generation_matches_whole_box():
    n = 40
    white = _white(n, 5)
    whole = md.generate_fields(white, progress=False, slab=n)   # one slab: whole-box FFTs and accumulators
    for slab in (3, 7):                                         # ring deposit, ragged last slab
        sliced = md.generate_fields(white, progress=False, slab=slab)
        for a, b in zip(whole, sliced):                          # only the order of float32 sums differs
            np.testing.assert_allclose(b, a, rtol=0, atol=5e-7, err_msg=f"slab {slab}")
    # Seeded generation draws the noise slab by slab from one stream: the same white noise.
    np.testing.assert_allclose(md.make_dataset(n, 5, progress=False, slab=3)[1], whole[1], rtol=0, atol=5e-7)


def test_streamed_file_equals_in_memory_generation(tmp_path):
    path = md.write_dataset(tmp_path / "s.h5", 24, seed=9, progress=False, slab=5)
    nbody, hydro = md.make_dataset(24, 9, progress=False, slab=5)
    with h5py.File(path, "r") as f:
        assert f["Nbody"].chunks is None and f["Hydro"].chunks is None        # contiguous, memory-mappable
        np.testing.assert_array_equal(f["Nbody"][...], nbody)
        np.testing.assert_array_equal(f["Hydro"][...], hydro)
    assert os.listdir(tmp_path) == ["s.h5"]


def test_progress_names_every_stage_and_counts_slabs():
    class Recorder(tqdm):
        def __init__(self):
            super().__init__(total=1, disable=True)
            self.stages, self.steps = [], 0

        def set_postfix_str(self, s="", refresh=True):
            self.stages.append(s)

        def update(self, n=1):
            self.steps += n

    bar = Recorder()
    md.make_dataset(20, 1, progress=bar, slab=6)
    assert bar.stages == [s for s in md._STAGES if s != "write"]
    assert bar.steps == md._SLAB_STEPS * 4


def test_cli_checks_free_disk_space_first(tmp_path, capsys, monkeypatch):
    real = shutil.disk_usage

    def nearly_full(path):
        return real(path)._replace(free=10 ** 6)

    monkeypatch.setattr(md.shutil, "disk_usage", nearly_full)
    message = _one_line_error(["--box", "64", "--out", str(tmp_path / "big.h5"), "--npy"], capsys)
    assert "not enough disk space" in message and "GiB free" in message and "--out" in message
    assert os.listdir(tmp_path) == []


def test_cli_checks_available_memory_first(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(md, "memory_available", lambda: 2 ** 20)
    message = _one_line_error(["--box", "64", "--out", str(tmp_path / "big.h5")], capsys)
    assert "not enough memory for a 64^3 box" in message and "MemAvailable" in message
    assert os.listdir(tmp_path) == []


GIB = 2 ** 30


@pytest.mark.parametrize("cgroup, files, headroom", [
    ("0::/slurm/job_1\n", {"slurm/job_1/memory.max": 8 * GIB, "slurm/job_1/memory.current": 6 * GIB,
                           "slurm/job_1/memory.stat": "anon 1\ninactive_file 1073741824\n"}, 3 * GIB),  # v2
    ("0::/slurm/job_2/step_0/task_0\n", {  # Slurm limits the job; the task's own cgroup says "max"
        "slurm/job_2/memory.max": 8 * GIB, "slurm/job_2/memory.current": 6 * GIB, "slurm/job_2/memory.stat":
        "inactive_file 0\n", "slurm/job_2/step_0/task_0/memory.max": "max",
        "slurm/job_2/step_0/task_0/memory.current": 5 * GIB, "slurm/job_2/step_0/task_0/memory.stat": "anon 1\n"},
     2 * GIB),
    ("0::/user.slice\n", {"user.slice/memory.max": "max", "user.slice/memory.current": GIB,
                          "user.slice/memory.stat": "inactive_file 0\n"}, None),  # v2 without a limit
    ("4:memory:/docker/abc\n0::/\n", {"memory/memory.limit_in_bytes": 4 * GIB,  # v1 in a container: the mount is
                                      "memory/memory.usage_in_bytes": 3 * GIB,   # the container's own cgroup
                                      "memory/memory.stat": "total_inactive_file 0\n"}, GIB),
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": 9223372036854771712, "memory/memory.usage_in_bytes": GIB,
                      "memory/memory.stat": "total_inactive_file 0\n"}, None)])  # v1's "no limit"
def test_memory_available_is_the_jobs_memory_limit_where_that_is_less(tmp_path, monkeypatch, cgroup, files,
                                                                       headroom):
    """Slurm's --mem and docker --memory are cgroup limits, which MemAvailable does not show: a box that passes it
    would be killed by the kernel mid-generation instead of refused with one line."""
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text("MemTotal:  104857600 kB\nMemAvailable:  52428800 kB\n")  # 50 GiB
    for name, value in files.items():
        (fs / name).parent.mkdir(parents=True, exist_ok=True)
        (fs / name).write_text(f"{value}\n")
    monkeypatch.setattr(md, "PROC", proc)
    monkeypatch.setattr(md, "CGROUP_FS", fs)
    assert md.cgroup_headroom() == headroom
    assert md.memory_available() == (50 * GIB if headroom is None else headroom)
    (proc / "self" / "cgroup").unlink()  # no /proc (not Linux): MemAvailable alone, or nothing
    assert md.cgroup_headroom() is None


def test_cli_failure_midway_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(md, "_hydro", disk_full)
    message = _one_line_error(["--box", "16", "--out", str(tmp_path / "x.h5"), "--npy"], capsys)
    assert "No space left on device" in message and "nothing was written" in message
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),  # the CPU's
    torch.AcceleratorError("CUDA error: out of memory"),  # no room for a CUDA context
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),      # no room for a cuFFT plan
])
def test_cli_running_out_of_memory_midway_is_one_line(tmp_path, capsys, monkeypatch, error):
    def no_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(md, "_deposit", no_memory)
    argv = ["--box", "16", "--out", str(tmp_path / "x.h5")]
    assert "ran out of memory generating a 16^3 box" in _one_line_error(argv, capsys)
    assert os.listdir(tmp_path) == []
    with pytest.raises(GenerationError, match="ran out of memory") as caught:   # main raises; run() reports it
        md.main(argv)
    assert caught.value.exit_code == 2


def test_cli_interrupted_is_one_line_exit_130_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(md, "_hydro", ctrl_c)
    message = _one_line_error(["--box", "16", "--out", str(tmp_path / "x.h5"), "--npy"], capsys, exit_code=130)
    assert message == "error: interrupted; nothing was written\n"
    assert os.listdir(tmp_path) == []


def test_a_failure_writing_the_npy_twins_leaves_nothing(tmp_path, monkeypatch):
    real, calls = md._write_npy_file, []

    def second_fails(path, fields, progress=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(path, fields, progress)

    monkeypatch.setattr(md, "_write_npy_file", second_fails)
    with pytest.raises(GenerationError, match=r"No space left on device; nothing was written$"):
        md.ensure_dataset(tmp_path / "d.h5", 12, seed=1, npy=True, progress=False)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_asking_for_cuda_without_it_fails_in_one_line(tmp_path, capsys):
    assert "CUDA is not available" in _one_line_error(["--box", "8", "--out", str(tmp_path / "x.h5"), "--device",
                                                       "cuda"], capsys)
    assert os.listdir(tmp_path) == []


def test_memory_model_is_under_20_bytes_per_cell():
    # The fields the pipeline holds at its peak (three padded float32 fields) plus default slab
    # temporaries, for the reference's box sizes; measured peaks are in benchmarks/results.
    for n in (512, 1024):
        assert md.memory_needed(n, md.slab_planes(n)) / n ** 3 < 14
    assert md.output_bytes(1024) > 36 * 1024 ** 3
