"""python -m utils.plot_logs on TensorBoard event files laid out as train.py writes them."""
import re
import time

import numpy as np
import pytest
from matplotlib.image import imread
from torch.utils.tensorboard import SummaryWriter

from utils import plot_logs
from science.metrics import L1_TAGS


def write_run(run_dir, losses, minutes_per_epoch, science=False):
    """logs/ of a run: Loss/valid at step 0 then, per epoch, Loss/train and Loss/valid (plus science scalars)."""
    writer = SummaryWriter(log_dir=str(run_dir / "logs"))  # its file's header is the run's first event: now
    start = time.time()  # after it, so that a stall between the two cannot shift every wall time
    writer.add_scalar("Loss/valid", losses[0] * 2, 0, walltime=start)
    for epoch, loss in enumerate(losses, start=1):
        walltime = start + 60 * minutes_per_epoch * epoch
        writer.add_scalar("Loss/train", loss, 10 * epoch, walltime=walltime)
        writer.add_scalar("Loss/valid", loss * 1.1, 10 * epoch, walltime=walltime)
        if science:
            for tag in L1_TAGS:
                writer.add_scalar(tag, loss, 10 * epoch, walltime=walltime)
            writer.add_scalar("T_rho/gamma_pred", 1.4 + 0.02 * epoch, 10 * epoch, walltime=walltime)
            writer.add_scalar("T_rho/gamma_true", 1.5, 10 * epoch, walltime=walltime)
    writer.close()
    return run_dir


@pytest.fixture
def two_runs(tmp_path):
    runs = tmp_path / "runs" / "short"
    return (write_run(runs / "1GPU" / "0", [0.1, 0.05, 0.03], minutes_per_epoch=2.0, science=True),
            write_run(runs / "4GPU" / "0", [0.2, 0.08], minutes_per_epoch=0.5))


def png_shape(path):
    return imread(path).shape


def test_loss_png_of_two_runs(two_runs, capsys):
    first, second = two_runs
    plot_logs.main([str(first), str(second)])
    assert png_shape(first / "loss.png") == (5 * 120, 8 * 120, 4)   # figsize (8, 5) at dpi 120
    assert f"wrote {first / 'loss.png'}" in capsys.readouterr().out

    runs = {plot_logs.run_label(run): plot_logs.load_run(run) for run in two_runs}
    assert list(runs) == ["short/1GPU/0", "short/4GPU/0"]
    ax = plot_logs.loss_figure(runs).axes[0]
    assert ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    train = [f"short/{n}GPU/0 train (epoch mean)" for n in (1, 4)]
    assert sorted(lines) == [train[0], "short/1GPU/0 valid", train[1], "short/4GPU/0 valid"]
    assert list(lines["short/1GPU/0 valid"].get_xdata()) == [0, 10, 20, 30]
    # an epoch's mean, logged at its end, is drawn flat across the epoch: from step 0 at the first
    assert list(lines[train[1]].get_xdata()) == [0, 10, 20] and lines[train[1]].get_drawstyle() == "steps-pre"
    assert list(lines[train[1]].get_ydata()) == pytest.approx([0.2, 0.2, 0.08])
    assert lines[train[0]].get_color() != lines[train[1]].get_color()


def test_walltime_axis_is_minutes_since_the_runs_first_event(two_runs, tmp_path):
    out = tmp_path / "plots" / "bs.png"
    plot_logs.main([*map(str, two_runs), "--walltime", "--out", str(out)])
    assert png_shape(out)[0] > 0
    runs = {plot_logs.run_label(run): plot_logs.load_run(run) for run in two_runs}
    ax = plot_logs.loss_figure(runs, walltime=True).axes[0]
    assert "wall-clock" in ax.get_xlabel()
    lines = {line.get_label(): line for line in ax.get_lines()}
    # the first event is the event file's header, written when the SummaryWriter opened (~now)
    assert lines["short/1GPU/0 train (epoch mean)"].get_xdata() == pytest.approx([0, 2, 4, 6], abs=0.05)
    assert lines["short/4GPU/0 train (epoch mean)"].get_xdata() == pytest.approx([0, 0.5, 1.0], abs=0.05)


def test_science_png(two_runs, tmp_path):
    out = tmp_path / "curves.png"
    plot_logs.main([*map(str, two_runs), "--science", "--out", str(out)])
    assert png_shape(tmp_path / "curves_science.png") == (7 * 120, 13 * 120, 4)
    runs = {plot_logs.run_label(run): plot_logs.load_run(run) for run in two_runs}
    axes = plot_logs.science_figure(runs).axes
    assert len(axes) == 6
    gamma = {line.get_label(): line.get_ydata() for line in axes[5].get_lines()}
    assert gamma["short/1GPU/0 prediction"] == pytest.approx([1.42, 1.44, 1.46])
    assert np.all(gamma["short/1GPU/0 target"] == np.float32(1.5))


def test_out_is_the_file_written_and_the_one_named(two_runs, tmp_path, capsys):
    """savefig adds .png to a name without a suffix: the "wrote" line must name that file; a folder
    (one that exists, or a new one named with a trailing /) gets loss.png in it; another suffix is the format, and
    one matplotlib cannot write is one line."""
    folder = tmp_path / "plots"
    folder.mkdir()
    for out, written in ((folder, folder / "loss.png"), (tmp_path / "curves", tmp_path / "curves.png"),
                         (tmp_path / "curves.pdf", tmp_path / "curves.pdf"),
                         (f"{tmp_path / 'new' / 'folder'}/", tmp_path / "new" / "folder" / "loss.png")):  # a slash
        plot_logs.main([str(two_runs[0]), "--out", str(out)])
        assert capsys.readouterr().out == f"wrote {written}\n" and written.is_file()
    assert_one_line_error(capsys, [str(two_runs[0]), "--out", str(tmp_path / "curves.v2")],
                          r"--out .*curves\.v2: matplotlib writes no \.v2 files; end the name with one of .*\.pdf, "
                          r".*\.png")


def assert_one_line_error(capsys, argv, pattern):
    """The command line's way out of a user error: ``error: <message>`` on one stderr line, exit status 2, as
    train.py, predict.py and the science report end."""
    with pytest.raises(SystemExit) as stop:
        plot_logs.cli(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and re.fullmatch(f"error: {pattern}.*\n", err), err


def test_errors_are_one_line(tmp_path, two_runs, capsys):
    empty = tmp_path / "empty"
    (empty / "logs").mkdir(parents=True)
    assert_one_line_error(capsys, [str(empty)], r"no TensorBoard event files in .*empty/logs; pass run directories")
    benchmark = tmp_path / "benchmark"  # --enable_benchy: out.log, config.yaml, benchy.json and no logs/
    benchmark.mkdir()
    (benchmark / "benchy.json").write_text("{}")
    assert_one_line_error(capsys, [str(benchmark)], r".*benchmark is a benchmark-mode run \(--enable_benchy\), which "
                                                    r"writes no TensorBoard events: its throughputs are in benchy.json")
    assert_one_line_error(capsys, [str(tmp_path / "missing")], r".*missing is not a directory")
    no_science = two_runs[1]
    assert_one_line_error(capsys, [str(no_science), "--science"],
                          r"no science scalars \(L1/gas_density, T_rho/gamma_pred, ...\)")
    only_lr = tmp_path / "runs" / "x" / "1GPU" / "0"
    writer = SummaryWriter(log_dir=str(only_lr / "logs"))
    writer.add_scalar("Learning Rate", 1e-3, 0)
    writer.close()
    assert_one_line_error(capsys, [str(only_lr)], r".*has no Loss/train or Loss/valid scalars yet")


def test_a_failed_write_or_ctrl_c_is_one_line(two_runs, tmp_path, capsys, monkeypatch):
    """A full disk: one line, and no half-written PNG under the name (a temporary file, renamed); Ctrl-C: exit 130."""
    import errno
    from matplotlib.figure import Figure

    def full_disk(self, path, **kwargs):
        open(path, "wb").close()  # started, then the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full_disk)
    out = tmp_path / "out" / "loss.png"
    assert_one_line_error(capsys, [str(two_runs[0]), "--out", str(out)],
                          rf"cannot write {out} \(ENOSPC: No space left on device\); free space there or choose "
                          rf"another --out")
    assert list(out.parent.iterdir()) == []

    def interrupted(self, path, **kwargs):
        open(path, "wb").close()
        raise KeyboardInterrupt
    monkeypatch.setattr(Figure, "savefig", interrupted)
    with pytest.raises(SystemExit) as stop:
        plot_logs.cli([str(two_runs[0]), "--out", str(out)])
    assert stop.value.code == 130 and capsys.readouterr().err == "stopped: interrupted (Ctrl-C)\n"
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("low, high, labelled", [
    (0.011, 0.09, ["0.02", "0.03", "0.04", "0.05", "0.06", "0.07", "0.08", "0.09"]),  # under a decade: every one
    (0.005, 0.09, ["0.005", "0.02", "0.05"]),                                         # under two: the 2s and 5s
    (0.0005, 0.9, [])])                                                                # more: none
def test_log_axis_minor_labels_thin_out_with_the_span(low, high, labelled):
    from matplotlib.figure import Figure

    from science.plots import plain_log_ticks  # plot_logs', large_batch_study's and the science report's ticks
    ax = Figure().subplots()
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    plain_log_ticks(ax)
    ticks = [t for t in ax.yaxis.get_minorticklocs() if low <= t <= high]
    labels = [ax.yaxis.get_minor_formatter()(t, i) for i, t in enumerate(ticks)]
    assert [label for label in labels if label] == labelled
    assert ax.yaxis.get_major_formatter()(0.01, 0) == "0.01"


@pytest.mark.parametrize("low, high, ends", [(0.00529, 0.070, (0.005, 0.1)), (0.0005, 0.9, (0.0001, 1.0)),
                                             (0.00095, 0.0205, (0.0001, 0.1)),  # 2s and 5s would span 100x
                                             (0.011, 0.09, (0.011, 0.09))])
def test_a_log_axis_spanning_a_decade_or_more_ends_at_labelled_values(low, high, ends):
    """The quickstart's loss.png: validation 0.0085 to 0.006 lay below its lowest label, 0.01, unreadable."""
    from matplotlib.figure import Figure

    from science.plots import plain_log_ticks
    ax = Figure().subplots()
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    plain_log_ticks(ax)
    assert ax.get_ylim() == pytest.approx(ends)
    if high / low >= 10:  # both ends carry a label, a decade's (major) or a 2's or 5's (minor)
        for end in ends:
            decade = float(f"{end:.0e}"[0]) == 1
            assert (ax.yaxis.get_major_formatter() if decade else ax.yaxis.get_minor_formatter())(end, 0) != ""
