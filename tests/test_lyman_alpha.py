"""Lyman-alpha forest statistics (science/lyman_alpha.py) against analytic cases, over ranks, and in TensorBoard."""
import math
import os
import warnings

import h5py
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import utils.make_dataset as md
from science import lyman_alpha as lya
from science import metrics as science, plots as science_plots
from utils import units
from utils import DataError
from utils.config import load_config
from utils.distributed import DistInfo, cleanup, init_distributed
from conftest import free_port

SETTINGS = lya.LymanAlphaSettings(skewer_stride=2, skewer_axes=3)


def normalised_hydro(density, temperature, velocity=0.0, shape=(1, 16, 16, 16)):
    """(B, 5, ...) normalised hydro fields from physical rho/mean, T [K], and one velocity [km/s] for all axes."""
    fields = torch.empty((shape[0], 5) + tuple(shape[1:]))
    fields[:, 0] = torch.as_tensor(units.normalize_density(np.asarray(density, dtype=np.float64) * np.ones(shape)))
    fields[:, 1:4] = torch.as_tensor(units.normalize_velocity(np.asarray(velocity) * np.ones(shape)))[:, None]
    temperature = np.asarray(temperature, dtype=np.float64) * np.ones(shape)
    fields[:, 4] = torch.as_tensor(units.normalize_temperature(temperature))
    return fields


@pytest.fixture(scope="module")
def generated():
    """A generated 32^3 box as normalised hydro (5, 32, 32, 32) and its eight 16^3 crops (8, 5, 16, 16, 16)."""
    _, hydro = md.make_dataset(32, seed=3, progress=False)
    box = torch.from_numpy(hydro)
    tiles = box.unfold(1, 16, 16).unfold(2, 16, 16).unfold(3, 16, 16)
    return box, tiles.permute(1, 2, 3, 0, 4, 5, 6).reshape(-1, 5, 16, 16, 16).contiguous()


def line(temperature, velocity=0.0, velocity_per_cell=2.0, n=128, at=40):
    """Optical depth of one overdense cell (rho/mean 1) on a skewer of near-empty gas (rho/mean 1e-3)."""
    density = torch.full((1, n), 1e-3)
    density[0, at] = 1.0
    velocities = torch.zeros(1, n)
    velocities[0, at] = velocity
    tau = lya.optical_depth(density, torch.full((1, n), temperature), velocities, velocity_per_cell)[0].double()
    background = lya.optical_depth(torch.full((1, n), 1e-3), torch.full((1, n), temperature), torch.zeros(1, n),
                                   velocity_per_cell)[0].double()
    return tau - background


def centroid_and_variance(profile):
    """Circular centroid (cells) and variance (cells^2) about it of a profile on a periodic skewer."""
    n = len(profile)
    angle = torch.angle((profile * torch.exp(2j * math.pi * torch.arange(n) / n)).sum()).item()
    centre = angle * n / (2 * math.pi) % n
    distance = (torch.arange(n) - centre + n / 2) % n - n / 2
    return centre, float((profile * distance ** 2).sum() / profile.sum())


def test_units_at_redshift_3():
    # H(z = 3) = 100 sqrt(0.3 x 64 + 0.7) = 446.1 km/s per Mpc/h; a = 1/4; 20/256 Mpc/h per cell
    assert lya.hubble_rate(3.0, 0.3) == pytest.approx(446.094, rel=1e-5)
    assert SETTINGS.velocity_per_cell == pytest.approx(446.094 * 20 / 256 / 4, rel=1e-5)   # 8.713 km/s
    assert lya.thermal_width(1e4) == pytest.approx(12.849, rel=1e-4)                       # sqrt(2 k T / m_p)
    assert lya.LymanAlphaSettings(hubble=300.0, redshift=2.0).velocity_per_cell == pytest.approx(300 * 20 / 256 / 3)


def test_uniform_gas_gives_uniform_flux_at_the_mean():
    for velocity in (0.0, 137.0):  # a bulk flow moves every cell alike: still uniform
        fields = normalised_hydro(1.0, 1.2e4, velocity, shape=(2, 16, 16, 16))
        tau = lya.optical_depth_of_fields(fields, SETTINGS, axis=1)
        assert tau.shape == (2 * 8 * 8, 16)
        assert (tau.std() / tau.mean()).item() < 1e-5
        stats = lya.FluxStatistics(16, SETTINGS)
        stats.update(fields, fields)
        stats.finalize()
        flux = stats.examples["true"]
        assert np.abs(flux - 0.7).max() < 1e-5
        assert stats.mean_flux("true") == pytest.approx(0.7, abs=1e-9)
        pdf = stats.flux_pdf()
        edge = round(0.7 * lya.FLUX_BINS)   # 0.7 is a bin edge: rounding puts F on either side of it
        assert pdf["true"][edge - 1:edge + 1].sum() == pytest.approx(lya.FLUX_BINS)  # density 1 / bin width
        assert stats.flux_pdf_distances() == (0.0, 0.0)


@pytest.mark.parametrize("temperature", [5e3, 1e4, 4e4])
def test_an_isolated_overdensity_gives_a_line_of_the_thermal_width(temperature):
    """tau(u) ~ exp(-(u - u0)^2 / b^2): variance b^2 / 2, plus dv^2 / 12 from integrating it over bins of dv."""
    dv = 2.0
    profile = line(temperature, velocity_per_cell=dv)
    centre, variance = centroid_and_variance(profile)
    assert centre == pytest.approx(40.0, abs=1e-3)
    b = math.sqrt(2 * 1.380649e-23 * temperature / 1.67262192e-27) / 1e3            # km/s
    assert variance * dv ** 2 == pytest.approx(b ** 2 / 2 + dv ** 2 / 12, rel=0.01)
    # optical depth is conserved: the line holds the cell's rho^2 (T / 1e4)^-0.7 (less the background's share)
    assert profile.sum().item() == pytest.approx((temperature / 1e4) ** -0.7 * (1 - 1e-6), rel=1e-4)
    # colder gas, narrower line
    assert centroid_and_variance(line(temperature / 4, velocity_per_cell=dv))[1] < variance


@pytest.mark.parametrize("velocity", [50.0, -80.0, 300.0])
def test_a_line_of_sight_velocity_shifts_the_line_by_v_over_aH(velocity):
    dv = SETTINGS.velocity_per_cell                                                 # a H dx: 8.71 km/s per cell
    rest, _ = centroid_and_variance(line(1e4, 0.0, dv))
    moved, _ = centroid_and_variance(line(1e4, velocity, dv))
    shift = (moved - rest + 64) % 128 - 64
    assert shift == pytest.approx(velocity / dv, abs=2e-3)                          # 300 km/s: 34 cells


def test_the_velocity_shift_wraps_around_a_periodic_skewer():
    dv, n = SETTINGS.velocity_per_cell, 32
    profile = line(1e4, velocity=20 * dv, velocity_per_cell=dv, n=n, at=25)         # lands at 45 = 13 (mod 32)
    assert centroid_and_variance(profile)[0] == pytest.approx(13.0, abs=2e-3)


@pytest.mark.parametrize("mean_flux", [0.3, 0.7, 0.9])
def test_the_normalisation_reproduces_the_chosen_mean_flux(generated, mean_flux):
    _, crops = generated
    stats = lya.FluxStatistics(16, lya.LymanAlphaSettings(mean_flux=mean_flux, skewer_stride=2))
    for batch in crops.split(3):
        stats.update(batch * 0.95, batch)
    stats.finalize()
    assert stats.mean_flux("true") == pytest.approx(mean_flux, abs=1e-7)
    tau = torch.cat([lya.optical_depth_of_fields(crops, stats.settings, axis) for axis in range(3)])
    assert torch.exp(-stats.amplitude * tau.double()).mean().item() == pytest.approx(mean_flux, abs=1e-7)


def test_the_prediction_gets_the_truths_amplitude(generated):
    _, crops = generated
    denser = crops.clone()
    denser[:, 0] += math.log(1.1) / units.DENSITY_LOG_SCALE                        # rho x 1.1: tau x 1.21
    stats = lya.FluxStatistics(16, SETTINGS)
    stats.update(denser, crops)
    stats.finalize()
    tau = torch.cat([lya.optical_depth_of_fields(crops, SETTINGS, axis) for axis in range(3)]).double()
    expected = torch.exp(-1.21 * stats.amplitude * tau).mean().item()
    assert stats.mean_flux("pred") == pytest.approx(expected, rel=1e-5)
    assert stats.mean_flux("pred") < 0.69
    scalars = stats.compute()
    assert scalars["lyman_alpha/mean_flux_pred"] == pytest.approx(expected, rel=1e-5)
    assert scalars["lyman_alpha/flux_pdf_ks"] > 0.01 and scalars["lyman_alpha/flux_pdf_w1"] > 0.005


def test_a_prediction_that_absorbs_all_light_has_no_p1d_and_no_warning(generated):
    """A diverged model's gas can be so dense that no flux is left: its P1D (of F / <F>) is NaN, said quietly."""
    _, crops = generated
    opaque = crops.clone()
    opaque[:, 0] = 0.99                                                            # rho/mean = e^13.9 everywhere
    stats = lya.FluxStatistics(16, SETTINGS)
    stats.update(opaque, crops)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                             # numpy's divide warnings too
        scalars = stats.finalize().compute()
    assert scalars["lyman_alpha/mean_flux_pred"] == 0.0
    bands = [tag for tag in scalars if tag.startswith("lyman_alpha/p1d_ratio/")]
    assert bands and all(math.isnan(scalars[tag]) for tag in bands)
    assert "2-4: nan" in lya.format_summary(scalars)


def test_perfect_prediction_and_p1d_bands(generated):
    _, crops = generated
    stats = lya.FluxStatistics(16, SETTINGS)
    stats.update(crops, crops)
    scalars = stats.finalize().compute()
    assert scalars["lyman_alpha/flux_pdf_ks"] == 0.0 and scalars["lyman_alpha/flux_pdf_w1"] == 0.0
    bands = [tag for tag in scalars if tag.startswith("lyman_alpha/p1d_ratio/")]
    # 16-cell skewers: modes k = 1..8 are wavelengths 16, 8, 5.3, 4, 3.2, 2.7, 2.3, 2 cells
    assert bands == ["lyman_alpha/p1d_ratio/wavelength_2-4_cells", "lyman_alpha/p1d_ratio/wavelength_4-8_cells",
                     "lyman_alpha/p1d_ratio/wavelength_8-16_cells", "lyman_alpha/p1d_ratio/wavelength_16-32_cells"]
    assert all(scalars[tag] == 1.0 for tag in bands)
    assert lya.format_summary(scalars).endswith("[cells] 2-4: 1, 4-8: 1, 8-16: 1, 16-32: 1")


@pytest.mark.parametrize("pred_flux", [0.51, 0.91])
def test_flux_pdf_distances_of_uniform_fluxes_are_one_and_their_flux_difference(pred_flux):
    """True F = 0.71 and predicted F uniform, darker or brighter: the CDFs differ by 1 between the two fluxes, so
    KS = 1 either way, and Wasserstein-1 (the mean flux change that turns one into the other) = |0.71 - F| = 0.2."""
    stats = lya.FluxStatistics(8, lya.LymanAlphaSettings(mean_flux=0.71), periodic=True)
    stats.add_optical_depth(torch.full((3, 8), -math.log(pred_flux)), torch.full((3, 8), -math.log(0.71)))
    stats.finalize()
    assert stats.amplitude == pytest.approx(1.0, rel=1e-6)
    ks, w1 = stats.flux_pdf_distances()
    assert ks == pytest.approx(1.0) and w1 == pytest.approx(0.2)


def test_p1d_of_a_known_flux_wave():
    """F = 0.7 (1 + eps cos(2 pi m j / N)) on a periodic skewer: <F> = 0.7 so A = 1, and P1D(k_m) = N dv eps^2 / 4."""
    n, m, eps = 32, 5, 0.2
    flux = 0.7 * (1 + eps * torch.cos(2 * math.pi * m * torch.arange(n) / n))
    tau = (-torch.log(flux)).repeat(6, 1)
    stats = lya.FluxStatistics(n, lya.LymanAlphaSettings(), periodic=True)
    stats.add_optical_depth(tau, tau)
    stats.finalize()
    assert stats.amplitude == pytest.approx(1.0, rel=1e-6)
    spectra = stats.p1d()
    dv = stats.settings.velocity_per_cell
    expected = np.zeros(n // 2)
    expected[m - 1] = n * dv * eps ** 2 / 4
    np.testing.assert_allclose(spectra["true"], expected, rtol=1e-5, atol=1e-9 * expected.max())
    assert spectra["k"][m - 1] == pytest.approx(2 * math.pi * m / (n * dv))        # s/km
    # the variance of delta_F is the sum over all +-k modes: 2 x P1D(k_m) / (N dv)
    assert 2 * spectra["true"].sum() / (n * dv) == pytest.approx(eps ** 2 / 2, rel=1e-5)


def test_the_windowed_p1d_of_white_noise_flux_on_crops_is_its_variance():
    """Crops' skewers are Hann-windowed, the window normalised to mean(w^2) = 1: white-noise flux still reads
    P1D(k) = var(delta_F) dv at every k (the windowed power is the variance, not 1.5x it)."""
    torch.manual_seed(0)
    n = 32
    tau = -torch.log(0.7 * (1 + 0.05 * torch.randn(2000, n, dtype=torch.float64)))
    stats = lya.FluxStatistics(n, lya.LymanAlphaSettings())                        # crops: windowed
    stats.add_optical_depth(tau, tau)
    stats.finalize()
    flux = torch.exp(-stats.amplitude * tau)
    variance = ((flux / flux.mean() - 1) ** 2).mean().item()
    ratio = stats.p1d()["true"][1:] / stats.settings.velocity_per_cell / variance  # k = 2 .. 16 (k = 1 loses its mean)
    assert ratio.mean() == pytest.approx(1.0, abs=0.05) and np.abs(ratio - 1).max() < 0.15


def test_settings_from_config_and_files(tmp_path):
    params = load_config("quickstart")
    assert params.lyman_alpha["skewer_stride"] == 8 and load_config("base").lyman_alpha["skewer_stride"] == 16
    path = tmp_path / "box.h5"
    with h5py.File(path, "w") as f:
        f.attrs["cell_size_mpc_h"] = 0.5
    settings = science.lyman_alpha_settings(params, data_path=path)
    assert settings.cell_size == 0.5 and settings.mean_flux == 0.7 and settings.redshift == 3.0
    with pytest.raises(DataError, match=r"cannot read the cell size of .*missing.h5 .* give --lyman_alpha.cell_size"):
        science.lyman_alpha_settings(params, data_path=tmp_path / "missing.h5")      # DALI's twins alone, say
    foreign = tmp_path / "foreign.h5"          # not a make_dataset file: no guess of its cell size
    h5py.File(foreign, "w").close()
    with pytest.raises(DataError, match=r"foreign.h5 does not say its cell size .* give --lyman_alpha.cell_size_mpc_h"):
        science.lyman_alpha_settings(params, data_path=foreign)
    synthetic = load_config("quickstart", overrides={"data_loader_config": "synthetic"})
    assert science.lyman_alpha_settings(synthetic, data_path=foreign).cell_size == units.DEFAULT_CELL_SIZE
    fixed = load_config("quickstart", overrides={"lyman_alpha.cell_size_mpc_h": 0.25, "lyman_alpha.redshift": 2.0,
                                                 "lyman_alpha.hubble_km_s_mpc_h": 200.0})
    settings = science.lyman_alpha_settings(fixed, data_path=path)
    assert science.lyman_alpha_settings(fixed, data_path=foreign).cell_size == 0.25      # the config's value wins
    assert settings.cell_size == 0.25 and settings.velocity_per_cell == pytest.approx(200 * 0.25 / 3)
    assert science.lyman_alpha_settings(load_config("quickstart", overrides={"lyman_alpha.enabled": False})) is None


def ranks_worker(rank, port, prediction, target, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    try:
        metrics = science.ScienceMetrics(16, "cpu", lyman_alpha=SETTINGS)
        for p, t in zip(prediction[rank::2].split(2), target[rank::2].split(2)):
            metrics.update(p, t)
        metrics.all_reduce(info)
        torch.save(metrics.compute(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        cleanup(info)


def test_two_gloo_ranks_give_the_single_process_result(generated, tmp_path):
    """A is solved over both ranks' true optical depths, the statistics summed: as one process on all crops."""
    _, crops = generated
    prediction = crops * 0.9 + 0.01
    mp.start_processes(ranks_worker, args=(free_port(), prediction, crops, str(tmp_path)), nprocs=2,
                       start_method="spawn" if torch.cuda.is_initialized() else "fork")
    single = science.ScienceMetrics(16, "cpu", lyman_alpha=SETTINGS)
    for p, t in zip(prediction.split(4), crops.split(4)):
        single.update(p, t)
    single.all_reduce(DistInfo())
    expected = single.compute()
    for rank in (0, 1):
        reduced = torch.load(tmp_path / f"rank{rank}.pt")
        assert reduced.keys() == expected.keys()
        for tag in expected:
            assert reduced[tag] == pytest.approx(expected[tag], rel=1e-6, abs=1e-9), (rank, tag)


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_tensorboard_gets_the_flux_scalars_and_figure(generated, tmp_path):
    box, crops = generated
    metrics = science.ScienceMetrics(16, "cpu", lyman_alpha=SETTINGS)
    metrics.update(crops * 0.95, crops)
    scalars = metrics.compute()            # finalizes the flux statistics in this process
    assert {"lyman_alpha/mean_flux_pred", "lyman_alpha/flux_pdf_ks", "lyman_alpha/flux_pdf_w1",
            "lyman_alpha/p1d_ratio/wavelength_4-8_cells"} <= set(scalars)
    fig = science_plots.flux_figure(metrics.flux_statistics())
    assert len(fig.axes) == 6                         # PDF, P1D, its ratio, three skewers
    writer = SummaryWriter(log_dir=str(tmp_path / "logs"))
    science_plots.write_tensorboard(writer, 3, metrics, metrics.compute(),
                                    example=(torch.zeros(4, 16, 16, 16), crops[0], crops[0]))
    writer.close()
    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(scalars)
    assert events.Scalars("lyman_alpha/mean_flux_true")[0].value == pytest.approx(0.7, abs=1e-6)
    assert "Science/lyman_alpha" in events.Tags()["images"]


def test_whole_periodic_box_needs_no_window(generated):
    box, _ = generated
    metrics = science.ScienceMetrics(32, "cpu", lyman_alpha=SETTINGS, periodic=True)
    metrics.update(box[None], box[None])
    scalars = metrics.compute()
    assert scalars["lyman_alpha/mean_flux_true"] == pytest.approx(0.7, abs=1e-7)
    assert all(value == 1.0 for tag, value in scalars.items() if "ratio/" in tag)
    assert metrics.flux.periodic and torch.equal(metrics.flux._window, torch.ones(32))


def test_a_rank_without_samples_reduces_on_its_own_device(monkeypatch):
    """Nsamples_val below the number of ranks leaves a rank with no skewers; its all-reduce must still use
    the rank's device (NCCL refuses CPU tensors: the other ranks would hang in the collective)."""
    devices = []

    def record(values, info):
        devices.append(values.device)
        return torch.zeros(values.shape, dtype=values.dtype)  # no optical depths on any rank

    monkeypatch.setattr(lya, "sum_over_ranks", record)
    info = DistInfo(rank=1, local_rank=1, world_size=2, device=torch.device("meta"))  # stands in for the rank's GPU
    with pytest.raises(ValueError, match="no optical depths"):
        lya.solve_amplitude([], 0.7, info)
    assert devices == [torch.device("meta")]


@pytest.mark.parametrize("other", [1, 2])
def test_skewers_along_each_axis_take_that_axis_velocity(other):
    """Redshift-space distortion uses the velocity along the skewer: a box with axes 0 and ``other`` swapped (and
    their velocity components with them) has, along ``other``, the optical depths the first box has along x."""
    _, hydro = md.make_dataset(16, seed=3, progress=False)
    swapped = np.swapaxes(hydro, 1, 1 + other).copy()
    swapped[[1, 1 + other]] = swapped[[1 + other, 1]]                     # vx <-> v_other
    settings = lya.LymanAlphaSettings(skewer_stride=1)
    along_x = lya.optical_depth_of_fields(torch.from_numpy(hydro)[None], settings, axis=0).reshape(16, 16, 16)
    along_other = lya.optical_depth_of_fields(torch.from_numpy(swapped)[None], settings, axis=other)
    along_other = along_other.reshape(16, 16, 16)
    if other == 2:  # skewers listed by the transverse axes in order: (z, y) there, (y, z) for x
        along_other = along_other.transpose(0, 1)
    torch.testing.assert_close(along_other, along_x)
    at_rest = hydro.copy()
    at_rest[1] = 0.0                                                      # no x velocity: other optical depths
    assert not torch.allclose(along_x.flatten(), lya.optical_depth_of_fields(torch.from_numpy(at_rest)[None],
                                                                             settings, axis=0).flatten(), rtol=1e-2)
