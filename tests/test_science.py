"""Science metrics (science/metrics.py): known answers on constructed and generated fields, DDP reduction, figures
(science/plots.py)."""
import math
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import utils.make_dataset as md
from science import metrics as science, plots as science_plots
from utils import units
from utils.distributed import DistInfo, cleanup, init_distributed
from conftest import free_port

CROP = 16


def crops(hydro, size=CROP):
    """(C, N, N, N) -> (N/size)^3 non-overlapping crops (B, C, size, size, size)."""
    c = hydro.shape[0]
    tiles = hydro.unfold(1, size, size).unfold(2, size, size).unfold(3, size, size)
    return tiles.permute(1, 2, 3, 0, 4, 5, 6).reshape(-1, c, size, size, size).contiguous()


@pytest.fixture(scope="module")
def generated():
    """(nbody, hydro) crops of a generated 32^3 box: eight (8, C, 16, 16, 16) tensors."""
    nbody, hydro = md.make_dataset(32, seed=3, progress=False)
    return crops(torch.from_numpy(nbody)), crops(torch.from_numpy(hydro))


def metrics_of(prediction, target, batch=4):
    metrics = science.ScienceMetrics(prediction.shape[-1], "cpu")
    for p, t in zip(prediction.split(batch), target.split(batch)):
        metrics.update(p, t)
    return metrics


def test_perfect_prediction_and_the_generators_temperature_density_relation(generated):
    _, hydro = generated
    scalars = metrics_of(hydro, hydro).compute()
    assert all(scalars[tag] == 0.0 for tag in science.L1_TAGS + science.L1_PHYSICAL_TAGS)
    ratios = {tag: v for tag, v in scalars.items() if tag.startswith("power_ratio/")}
    # 16^3 crops: shells |k| = 1..8 are wavelengths 16, 8, 5.3, 4, 3.2, 2.7, 2.3, 2 cells
    assert list(ratios) == ["power_ratio/wavelength_2-4_cells", "power_ratio/wavelength_4-8_cells",
                            "power_ratio/wavelength_8-16_cells", "power_ratio/wavelength_16-32_cells"]
    assert all(v == 1.0 for v in ratios.values())
    correlations = [v for tag, v in scalars.items() if tag.startswith("cross_correlation/")]
    assert len(correlations) == 4 and all(v == pytest.approx(1.0, abs=1e-12) for v in correlations)
    assert scalars["T_rho/gamma_pred"] == scalars["T_rho/gamma_true"]
    # Underdense gas follows the generator's T = T0 (rho/mean)^(gamma - 1), T0 = 1e4 K, gamma = 1.5.
    assert scalars["T_rho/gamma_true"] == pytest.approx(md.DEFAULT_PHYSICS["eos_gamma"], abs=0.01)
    assert scalars["T_rho/T0_true_K"] == pytest.approx(md.DEFAULT_PHYSICS["temperature_mean_density"], rel=0.02)


# Ops that read a device tensor on the host on CUDA (bincount sizes its output from the values' min and max).
HOST_READS = {"_local_scalar_dense", "bincount", "nonzero", "masked_select", "unique", "_unique2", "equal"}


def ops_run_by(function):
    """The names of the aten ops ``function()`` runs (recorded on the CPU with a dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    ops = set()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.add(func.overloadpacket.__name__.rstrip("_"))
            return func(*args, **(kwargs or {}))
    with Recorder():
        function()
    return ops


def test_validation_updates_never_wait_for_the_device(generated):
    """ScienceMetrics.update, with the Lyman-alpha statistics, runs none of the ops that on a GPU would wait for it,
    so validation batches queue back to back; the host reads the sums once, in compute."""
    from science import lyman_alpha
    assert {"bincount", "_local_scalar_dense"} <= ops_run_by(lambda: torch.tensor([1, 2]).bincount()[0].item())
    _, hydro = generated
    metrics = science.ScienceMetrics(CROP, "cpu", lyman_alpha=lyman_alpha.LymanAlphaSettings(skewer_stride=4))
    ops = ops_run_by(lambda: metrics.update(hydro[:4] * 0.9, hydro[:4]))
    assert "index_add" in ops and not ops & HOST_READS, sorted(ops & HOST_READS)


def test_density_scaled_prediction(generated):
    _, hydro = generated
    scale = 1.3
    prediction = hydro.clone()
    prediction[:, 0] += math.log(scale) / units.DENSITY_LOG_SCALE    # rho_pred = 1.3 rho_true
    metrics = metrics_of(prediction, hydro)
    scalars = metrics.compute()
    for tag, value in scalars.items():
        if tag.startswith("power_ratio/"):
            assert value == pytest.approx(scale ** 2, rel=1e-4), tag  # every k: delta scales by 1.3
    assert metrics.power_spectra()["ratio"] == pytest.approx(np.full(CROP // 2, scale ** 2), rel=1e-4)
    # the same structures, only brighter: perfectly correlated at every scale
    assert all(v == pytest.approx(1.0, abs=1e-6) for tag, v in scalars.items() if tag.startswith("cross_correlation/"))
    assert science.format_summary(scalars).endswith("[cells] 2-4: 1.69, 4-8: 1.69, 8-16: 1.69, 16-32: 1.69")
    assert scalars["L1/gas_density"] == pytest.approx(math.log(scale) / units.DENSITY_LOG_SCALE, rel=1e-4)
    rho = units.denormalize_density(hydro[:, 0].double())
    assert scalars["L1_physical/gas_density_over_mean"] == pytest.approx((scale - 1) * rho.mean().item(), rel=1e-4)
    assert all(scalars[tag] == 0.0 for tag in science.L1_TAGS[1:])
    # The T-rho relation moves right by log10(1.3) at fixed T: T0 drops by 1.3^(gamma - 1), gamma stays.
    assert scalars["T_rho/gamma_pred"] == pytest.approx(scalars["T_rho/gamma_true"], abs=0.02)
    assert scalars["T_rho/T0_pred_K"] / scalars["T_rho/T0_true_K"] == pytest.approx(
        scale ** -(scalars["T_rho/gamma_true"] - 1), rel=0.02)


def test_window_keeps_a_non_periodic_wave_in_its_shells():
    # rho/mean = 1 + 0.5 cos(2 pi 4.5 x / S): 4.5 waves do not fit the crop, so without a window the
    # jump at the faces spreads ~7% of the power over every shell (0.8% in the Nyquist shell).
    x = torch.arange(CROP, dtype=torch.float64)
    rho = 1 + 0.5 * torch.cos(2 * math.pi * 4.5 * x / CROP)
    fields = torch.zeros(1, 5, CROP, CROP, CROP)
    fields[:, 0] = (rho.log() / units.DENSITY_LOG_SCALE).float()[:, None, None]
    metrics = metrics_of(fields, fields)
    power = metrics.power_spectra()["power_true"] * metrics.modes_per_shell     # total power per shell
    share = power / power.sum()
    assert share[2:6].sum() > 0.99                                              # shells |k| = 3..6
    assert share[-1] < 1e-4


def test_physical_l1_of_velocity_and_temperature(generated):
    _, hydro = generated
    prediction = hydro.clone()
    prediction[:, 1] += 0.01                      # vx + 5 km/s
    prediction[:, 4] -= 0.04                      # log10 T - 0.1
    scalars = metrics_of(prediction, hydro).compute()
    assert scalars["L1/gas_vx"] == pytest.approx(0.01, rel=1e-4)
    assert scalars["L1_physical/gas_vx_km_s"] == pytest.approx(5.0, rel=1e-4)
    temperature = units.denormalize_temperature(hydro[:, 4].double())
    expected = (temperature * (1 - 10 ** -0.1)).mean().item()
    assert scalars["L1_physical/temperature_K"] == pytest.approx(expected, rel=1e-4)
    assert scalars["L1_physical/gas_vy_km_s"] == 0.0


def test_fit_recovers_a_constructed_relation(generated):
    _, hydro = generated
    prediction = hydro.clone()
    gamma, t0 = 1.6, 2.0e4                        # an exact T-rho relation, no shock-heated tail
    log_rho = prediction[:, 0].double() * units.DENSITY_LOG_SCALE / math.log(10)
    log_t = math.log10(t0) + (gamma - 1) * log_rho
    prediction[:, 4] = ((log_t - units.TEMPERATURE_LOG10_OFFSET) / units.TEMPERATURE_LOG10_SCALE).float()
    scalars = metrics_of(prediction, hydro).compute()
    assert scalars["T_rho/gamma_pred"] == pytest.approx(gamma, abs=0.01)  # 0.05-dex bins: measured 1.596
    assert scalars["T_rho/T0_pred_K"] == pytest.approx(t0, rel=0.01)
    # Nothing in the fit range: NaN, not a number made up.
    empty = np.zeros((science.NUM_DENSITY_BINS, science.NUM_TEMPERATURE_BINS))
    assert all(math.isnan(v) for v in science.fit_temperature_density(empty))


def test_the_t_rho_line_is_a_least_squares_fit_weighted_by_each_columns_cell_count():
    """Three density columns whose cells sit in one temperature bin each (median: the bin's centre), off a line:
    the fitted slope and intercept are the count-weighted least-squares ones, by the closed-form formula."""
    histogram = np.zeros((science.NUM_DENSITY_BINS, science.NUM_TEMPERATURE_BINS))
    density_edges, temperature_edges = science.log_density_edges(), science.log_temperature_edges()
    density_centres = 0.5 * (density_edges[1:] + density_edges[:-1])
    columns = [int(np.argmin(np.abs(density_centres - x))) for x in (-0.9, -0.5, -0.2)]
    rows, counts = [80, 110, 97], np.array([1000.0, 10.0, 1000.0])  # medians 4.0125, 4.7625, 4.4375: not a line
    for column, row, count in zip(columns, rows, counts):
        histogram[column, row] = count
    x = density_centres[columns]
    y = 0.5 * (temperature_edges[rows] + temperature_edges[np.array(rows) + 1])
    x_mean, y_mean = np.average(x, weights=counts), np.average(y, weights=counts)
    slope = np.sum(counts * (x - x_mean) * (y - y_mean)) / np.sum(counts * (x - x_mean) ** 2)
    gamma, t0 = science.fit_temperature_density(histogram)
    assert gamma == pytest.approx(1 + slope, rel=1e-9)
    assert t0 == pytest.approx(10 ** (y_mean - slope * x_mean), rel=1e-9)
    assert abs(gamma - (1 + np.polyfit(x, y, 1)[0])) > 0.05  # unweighted, the middle column would pull it


def test_two_accumulators_sum_to_one_over_both_batches(generated):
    _, hydro = generated
    prediction = hydro * 0.9 + 0.01
    single = metrics_of(prediction, hydro, batch=8)
    first, second = metrics_of(prediction[:3], hydro[:3], batch=3), metrics_of(prediction[3:], hydro[3:], batch=5)
    first.sums += second.sums                     # what all_reduce does across two ranks
    assert torch.allclose(first.sums, single.sums, rtol=1e-6, atol=0)
    merged, expected = first.compute(), single.compute()
    assert merged.keys() == expected.keys()
    for tag in expected:
        assert merged[tag] == pytest.approx(expected[tag], rel=1e-6), tag


def all_reduce_worker(rank, port, prediction, target, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    info = init_distributed("cpu")  # gloo on CPU tensors, also where GPUs are visible
    try:
        metrics = metrics_of(prediction[rank::2], target[rank::2])
        metrics.all_reduce(info)
        torch.save(metrics.compute(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        cleanup(info)


def test_all_reduce_over_two_gloo_ranks(generated, tmp_path):
    _, hydro = generated
    prediction = hydro * 0.9 + 0.01
    # fork: the children reuse this process's imports (spawn re-imports torch, ~10 s on 2 cores);
    # DataLoader workers start the same way. Not after CUDA was initialised here (by another test in
    # this process, on a GPU machine): a forked child cannot use, or safely inherit, that state.
    mp.start_processes(all_reduce_worker, args=(free_port(), prediction, hydro, str(tmp_path)), nprocs=2,
                       start_method="spawn" if torch.cuda.is_initialized() else "fork")
    expected = metrics_of(prediction, hydro).compute()
    for rank in (0, 1):
        reduced = torch.load(tmp_path / f"rank{rank}.pt")
        for tag in expected:
            assert reduced[tag] == pytest.approx(expected[tag], rel=1e-6), (rank, tag)
    # Single process: all_reduce leaves the state alone.
    metrics = metrics_of(prediction, hydro)
    before = metrics.sums.clone()
    metrics.all_reduce(DistInfo())
    assert torch.equal(metrics.sums, before)


def test_errors_say_what_was_wrong():
    metrics = science.ScienceMetrics(CROP, "cpu")
    with pytest.raises(RuntimeError, match="no data: call update"):
        metrics.compute()
    with pytest.raises(ValueError, match=r"shape \(B, 5, 16, 16, 16\), got \(2, 5, 8, 8, 8\)"):
        metrics.update(torch.zeros(2, 5, 8, 8, 8), torch.zeros(2, 5, 8, 8, 8))


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_figures_and_tensorboard_logging(generated, tmp_path):
    nbody, hydro = generated
    prediction = hydro * 0.9 + 0.01
    metrics = metrics_of(prediction, hydro)
    figures = {"slices": (science_plots.slice_figure(nbody[0], prediction[0], hydro[0]), 5 * 3 + 5 + 1),
               "power": (science_plots.power_spectrum_figure(metrics), 2),
               "t_rho": (science_plots.temperature_density_figure(metrics), 3)}
    for name, (fig, num_axes) in figures.items():
        assert len(fig.axes) == num_axes, name
        fig.savefig(tmp_path / f"{name}.png", dpi=50)
        height, width, channels = imread(tmp_path / f"{name}.png").shape
        assert (height, width) == (round(fig.get_figheight() * 50), round(fig.get_figwidth() * 50)), name
    # a row shares one colour range: prediction and target of gas density, and the input beside them
    slices = figures["slices"][0].axes
    assert slices[0].images[0].get_clim() == slices[1].images[0].get_clim() == slices[2].images[0].get_clim()

    writer = SummaryWriter(log_dir=str(tmp_path / "logs"))
    science_plots.write_tensorboard(writer, 7, metrics, metrics.compute(), example=(nbody[0], prediction[0], hydro[0]))
    writer.close()
    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    scalars = metrics.compute()
    assert set(events.Tags()["scalars"]) == set(scalars)
    assert events.Scalars("T_rho/gamma_true")[0].step == 7
    assert events.Scalars("T_rho/gamma_true")[0].value == pytest.approx(scalars["T_rho/gamma_true"])
    assert set(events.Tags()["images"]) == {"Science/slices", "Science/power_spectrum", "Science/temperature_density"}
    # figures_every_minutes: a validation between drawings writes the scalars alone
    writer = SummaryWriter(log_dir=str(tmp_path / "scalars_only"))
    science_plots.write_tensorboard(writer, 8, metrics, scalars, example=(nbody[0], prediction[0], hydro[0]),
                                    figures=False)
    writer.close()
    events = EventAccumulator(str(tmp_path / "scalars_only"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(scalars) and events.Tags()["images"] == []


def test_validation_metrics_follow_the_config(tmp_path):
    from utils.config import load_config
    params = load_config("quickstart", overrides={"data_loader_config": "synthetic"})
    metrics = science.ScienceMetrics.for_validation(params, "cpu")
    assert metrics.crop_size == 32 and not metrics.periodic
    assert metrics.flux.settings.skewer_stride == 8 and metrics.flux.settings.skewer_axes == 3
    assert metrics.flux.settings.cell_size == units.DEFAULT_CELL_SIZE    # synthetic, no file: the generator's 20/256
    off = load_config("quickstart", overrides={"lyman_alpha.enabled": False})
    assert science.ScienceMetrics.for_validation(off, "cpu").flux is None


def test_a_periodic_box_is_measured_without_a_window(generated):
    """A whole periodic box needs no window: a wave that fits the box stays in its own shell."""
    x = torch.arange(CROP, dtype=torch.float64)
    rho = 1 + 0.5 * torch.cos(2 * math.pi * 3 * x / CROP)
    fields = torch.zeros(1, 5, CROP, CROP, CROP)
    fields[:, 0] = (rho.log() / units.DENSITY_LOG_SCALE).float()[:, None, None]
    metrics = science.ScienceMetrics(CROP, "cpu", periodic=True)
    metrics.update(fields, fields)
    power = metrics.power_spectra()["power_true"] * metrics.modes_per_shell
    assert power[2] / power.sum() > 0.99                                   # shell |k| = 3 only
    assert "periodic box" in science_plots.power_spectrum_figure(metrics).axes[0].get_title()



def density_fields(rho_over_mean):
    """(B, 5, S, S, S) normalised hydro fields: ``rho_over_mean`` (B, S, S, S) as gas density, zeros elsewhere."""
    fields = torch.zeros(rho_over_mean.shape[0], 5, *rho_over_mean.shape[1:])
    fields[:, 0] = (rho_over_mean.log() / units.DENSITY_LOG_SCALE).float()
    return fields


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_a_periodic_boxs_power_sums_to_its_variance_along_every_axis(axis):
    """Parseval in absolute units: the shells' P(k) times their modes add up to the sum of delta^2 over the cells,
    whichever axis the wave runs along (a wave along x or y lies in the kz = 0 plane that rfftn stores once)."""
    x = torch.arange(CROP, dtype=torch.float64)
    wave = (1 + 0.5 * torch.cos(2 * math.pi * 3 * x / CROP)).reshape([CROP if a == axis else 1 for a in range(3)])
    fields = density_fields(wave.expand(CROP, CROP, CROP)[None])
    metrics = science.ScienceMetrics(CROP, "cpu", periodic=True)
    metrics.update(fields, fields)
    rho = units.to_physical(fields, "hydro", channel_axis=1)[:, 0].double()
    total = (metrics.power_spectra()["power_true"] * metrics.modes_per_shell).sum()
    assert total == pytest.approx(((rho - rho.mean()) ** 2).sum().item(), rel=1e-4)


@pytest.mark.parametrize("wavevector, shell", [((0, 0, 8), 8), ((8, 0, 0), 8), ((2, 2, 0), 3), ((1, 1, 1), 2)])
def test_a_wave_lands_in_the_shell_nearest_its_wavenumber_with_all_its_power(wavevector, shell):
    """Shells are |k| rounded (|(2, 2, 0)| = 2.83 is shell 3, |(1, 1, 1)| = 1.73 shell 2), and Parseval holds at the
    Nyquist frequency too, where rfftn's last kz plane, like kz = 0, stands for itself alone."""
    x = torch.stack(torch.meshgrid(*[torch.arange(CROP, dtype=torch.float64)] * 3, indexing="ij"))
    phase = sum(k * x[a] for a, k in enumerate(wavevector))
    fields = density_fields((1 + 0.5 * torch.cos(2 * math.pi * phase / CROP))[None])
    metrics = science.ScienceMetrics(CROP, "cpu", periodic=True)
    metrics.update(fields, fields)
    rho = units.to_physical(fields, "hydro", channel_axis=1)[:, 0].double()
    power = metrics.power_spectra()["power_true"] * metrics.modes_per_shell
    assert power[shell - 1] / power.sum() > 0.99
    assert power.sum() == pytest.approx(((rho - rho.mean()) ** 2).sum().item(), rel=1e-4)


def test_the_windowed_power_of_white_noise_is_its_variance():
    """The Hann window is scaled to mean(w^2) = 1, so a crop's windowed P(k) of white noise is its variance in
    absolute units (not just in the ratio of prediction to truth, which any scale would keep)."""
    noise = torch.randn(64, CROP, CROP, CROP, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fields = density_fields(1 + 0.05 * noise)
    metrics = metrics_of(fields, fields, batch=16)
    rho = units.to_physical(fields, "hydro", channel_axis=1)[:, 0].double()
    variance = ((rho - rho.mean(dim=(1, 2, 3), keepdim=True)) ** 2).mean().item()
    power = metrics.power_spectra()["power_true"]
    assert power[1:].mean() == pytest.approx(variance, rel=0.05)  # shell 1 holds the crop mean's leakage
    assert np.all(np.abs(power[1:] / variance - 1) < 0.2)

def test_cross_correlation_of_an_independent_field_is_near_zero(generated):
    """The prediction of another box has the right power but the wrong structures: r ~ 0 at every scale."""
    _, hydro = generated
    other = torch.flip(hydro, dims=(0,))                                   # other crops, same statistics
    scalars = metrics_of(other, hydro).compute()
    correlations = {tag: v for tag, v in scalars.items() if tag.startswith("cross_correlation/")}
    assert all(abs(v) < 0.3 for v in correlations.values()), correlations


def test_untrained_constant_prediction_reads_na(generated):
    """An untrained model's near-constant density fills one column of the T-rho fit: the fit is NaN, and the log line
    says n/a and why instead of printing 'nan' as if the run were broken."""
    _, hydro = generated
    scalars = metrics_of(torch.zeros_like(hydro), hydro).compute()
    assert math.isnan(scalars["T_rho/gamma_pred"]) and math.isnan(scalars["T_rho/T0_pred_K"])
    # no power in the prediction: its correlation with the truth is undefined, not a 0/0 warning
    assert all(math.isnan(v) for tag, v in scalars.items() if tag.startswith("cross_correlation/"))
    line = science.format_summary(scalars)
    assert "nan" not in line
    assert f"T-rho gamma n/a (densities fill < 2 bins of the fit) (target {scalars['T_rho/gamma_true']:.3f})" in line
    assert science.format_fit(1234.4, ".0f", " K") == "1234 K"


def test_the_mean_predictor_reads_the_label_twin_where_there_is_no_h5(tmp_path, tiny_params):
    """A DALI run may have the .npy twins alone: its end-of-run baseline (the training mean per channel) reads the
    (N, N, N, C) label twin then, and gives what the .h5 gives."""
    from types import SimpleNamespace
    from science import mean_predictor_l1
    h5 = md.ensure_dataset(tmp_path / "train.h5", 16, seed=1, npy=True, progress=False)
    params = tiny_params(train_path=str(h5))
    loader, sampler = [(None, torch.rand(2, 5, 8, 8, 8))], SimpleNamespace(set_epoch=lambda epoch: None)
    state = SimpleNamespace(info=DistInfo(), to_device=lambda tensor: tensor)
    from_h5 = mean_predictor_l1(params, loader, sampler, state)
    h5.unlink()
    assert mean_predictor_l1(params, loader, sampler, state) == pytest.approx(from_h5, rel=1e-6)
