"""train_graph.py's refusals and warm-up undo, the profiler window, and the ladder's CPU smoke run."""
import gzip
import json
import logging
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

import train
import train_graph
from benchmarks import ladder
from networks.UNet import UNet, loss_func
from utils import Preempted, StorageError
from utils.config import REPO_ROOT, ConfigError, load_config
from utils import profiling
from utils.profiling import Profiler


# --- train_graph.py -----------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_train_graph_without_cuda_exits_with_one_line_before_any_work(tmp_path, capsys):
    runs, data = tmp_path / "runs", tmp_path / "data"
    argv = ["--config=quickstart", "--expdir", str(runs), "--train_path", str(data / "train.h5"),
            "--val_path", str(data / "val.h5")]
    with pytest.raises(SystemExit) as exit_info:
        train.cli(lambda: train_graph.main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train_graph.py captures the training step in a CUDA graph and needs a CUDA GPU")
    assert "use train.py" in err and len(err.strip().splitlines()) == 1
    assert not runs.exists() and not data.exists()  # no run folder, no generated data


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU, as a login node")
def test_train_graph_print_config_needs_no_gpu_but_still_checks_the_config(tmp_path, monkeypatch, capsys):
    """On a login node a reader sees what a GPU job would run; a config the graph cannot run is still refused."""
    monkeypatch.chdir(tmp_path)
    argv = ["--config=bs64_opt", "--num_epochs", "2", "--print_config"]
    assert train_graph.main(argv) is None
    printed = capsys.readouterr().out
    assert train.main(argv) is None and printed == capsys.readouterr().out  # what train.py prints for it
    assert "num_epochs: 2\n" in printed
    with pytest.raises(SystemExit) as exit_info:
        train.cli(lambda: train_graph.main(argv + ["--amp_mode=fp16"]))
    assert exit_info.value.code == 2 and "use --amp_mode=bf16" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flags, world_size, expected", [
    (["--amp_mode=fp16"], 1, "use --amp_mode=bf16"),
    (["--enable_amp"], 1, "use --amp_mode=bf16"),
    (["--enable_apex"], 1, "use --enable_fused"),
    ([], 2, "use train.py for multi-GPU"),
    (["--device", "cpu"], 1, "use train.py for CPU runs"),  # on a GPU machine it used to crash at the capture
])
def test_train_graph_refuses_what_a_graph_cannot_run(tmp_path, monkeypatch, capsys, flags, world_size, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the GPU check to the config checks
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exit_info:
        train.cli(lambda: train_graph.main(["--config=quickstart", "--expdir", str(tmp_path / "runs"), *flags]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def tiny_model_and_adam(seed=0, **adam):
    torch.manual_seed(seed)
    model = UNet([4, 8])
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, **adam)


def adam_step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    inp = torch.rand(2, 4, 8, 8, 8, generator=generator) * 2 - 1
    tar = torch.rand(2, 5, 8, 8, 8, generator=generator) * 2 - 1
    optimizer.zero_grad(set_to_none=True)
    loss_func(model(inp), tar).backward()
    optimizer.step()


@pytest.mark.parametrize("steps_before", [0, 2], ids=["fresh", "resumed"])
def test_undoing_the_warm_up_continues_exactly_as_without_it(steps_before):
    runs = {}
    for warm_up in (False, True):
        model, optimizer = tiny_model_and_adam()
        for step in range(steps_before):
            adam_step(model, optimizer, seed=step)
        if warm_up:
            snapshot = train_graph.snapshot_training_state(model, optimizer)
            for step in range(3):
                adam_step(model, optimizer, seed=100 + step)
            train_graph.restore_training_state(model, optimizer, snapshot)
        adam_step(model, optimizer, seed=10)
        runs[warm_up] = (model.state_dict(), optimizer.state_dict()["state"])
    (weights, adam_state), (weights_warm, adam_state_warm) = runs[False], runs[True]
    for name in weights:
        assert torch.equal(weights[name], weights_warm[name]), name
    for index in adam_state:
        assert adam_state[index]["step"].item() == steps_before + 1
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(adam_state[index][key], adam_state_warm[index][key]), (index, key)


@pytest.mark.slow  # compiles a tiny model with Inductor, twice: left out of the fast run
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_the_capture_after_a_compiled_warm_up_compiles_nothing_new(tiny_params, channels_last):
    """train_graph.py --enable_jit compiles in the warm-up; the capture must run that compiled code as it is (a
    recompile would trace, compile and autotune inside the capture, where waiting for the GPU is an error). The
    warm-up as capture_train_step runs it, on the CPU (compile runs here, graphs do not): the step after it compiles
    nothing, and the warm-up is undone."""
    from torch._dynamo.utils import counters
    from utils.distributed import init_distributed
    from train import build_training
    params = tiny_params(enable_jit=True, channels_last=channels_last, amp_mode="bf16")
    state = build_training(params, init_distributed("cpu"))
    initial = {name: value.clone() for name, value in state.model.state_dict().items()}
    memory_format = torch.channels_last_3d if channels_last else torch.contiguous_format
    inp = torch.rand(4, 4, 8, 8, 8).to(memory_format=memory_format) * 2 - 1
    tar = torch.rand(4, 5, 8, 8, 8).to(memory_format=memory_format) * 2 - 1
    counters.clear()
    try:
        train_graph.warm_up(state, inp, tar, train_graph.NUM_WARMUP_STEPS)
        graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
        assert graphs == 2  # the model and the loss
        assert all(torch.equal(value, initial[name]) for name, value in state.model.state_dict().items())
        state.optimizer.zero_grad(set_to_none=True)
        train_graph.train_step_body(state, inp, tar)  # what the capture records
        # Dynamo converts a frame only where its compiled code's guards failed (a recompile)
        assert (counters["stats"]["unique_graphs"], counters["frames"]["total"]) == (graphs, frames)
    finally:
        torch._dynamo.reset()
        counters.clear()


def test_a_float_learning_rate_is_refused_for_capture():
    model, optimizer = tiny_model_and_adam(capturable=True)  # lr=1e-2: a float would be baked into the graph
    with pytest.raises(RuntimeError, match="lr must be a tensor on cpu"):
        train_graph.check_capturable(optimizer, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="capturable=True"):
        train_graph.check_capturable(tiny_model_and_adam()[1], torch.device("cpu"))
    tensor_lr = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2), capturable=True)
    train_graph.check_capturable(tensor_lr, torch.device("cpu"))


@pytest.mark.parametrize("fused", [False, True])
def test_the_capturable_optimizer_is_foreach_or_fused_never_single_tensor(tiny_params, fused):
    """fused=False alone would pick torch's single-tensor Adam, whose capturable update writes NaN into weights
    with an always-zero gradient when lr is 0 (the first warm-up step); tests/test_gpu.py checks that on a GPU."""
    params = tiny_params(enable_fused=fused)
    optimizer, name = train_graph.capturable_adam(UNet([4, 8]), params, torch.device("cpu"))
    implementation = "fused" if fused else "foreach"
    assert optimizer.defaults[implementation] is True and not optimizer.defaults["fused" if not fused else "foreach"]
    assert optimizer.defaults["capturable"] and torch.is_tensor(optimizer.param_groups[0]["lr"])
    assert name == f"torch Adam ({implementation}, capturable, lr on device)"


# --- utils/profiling.py -------------------------------------------------------------------------
def profiled_run(profiler, num_steps):
    """A training-like loop with the ranges train.py uses."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for global_step in range(num_steps):
        profiler.step(global_step)
        with profiler.range("step"):
            with profiler.range("data copy"):
                inp = torch.randn(4, 8)
            with profiler.range("forward"):
                loss = model(inp).square().mean()
            with profiler.range("backward"):
                loss.backward()
            with profiler.range("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    profiler.close()


def trace_event_names(trace_dir):
    files = sorted(trace_dir.glob("*.pt.trace.json*"))
    assert len(files) == 1, files
    opener = gzip.open if files[0].suffix == ".gz" else open
    with opener(files[0], "rt") as f:
        return [event.get("name") for event in json.load(f)["traceEvents"]]


def test_each_rank_checks_only_its_own_trace_while_another_writes_beside_it(tmp_path):
    """Under DDP every rank traces into the run folder; the rank that finishes first must not take another rank's
    half-written file for its own failed write (StorageError, and the run stopped on that rank only)."""
    params = load_config("quickstart", overrides={"profile_dir": "profile", "profile_window": [2, 4]})
    profiler = Profiler(params, tmp_path, torch.device("cpu"), rank=0)
    step = profiler.step

    def step_while_rank_1_writes(global_step):
        if global_step == 3:  # inside the window: rank 1's file has begun, not ended
            (tmp_path / "profile" / "rank1.123.pt.trace.json").write_text('{"traceEvents": [')
        step(global_step)

    profiler.step = step_while_rank_1_writes
    profiled_run(profiler, 6)
    assert [p.name.split(".")[0] for p in sorted((tmp_path / "profile").glob("*.pt.trace.json"))] == ["rank0", "rank1"]


# torch's warnings are a user's noise: torch 2.11 (the GPU image's) warns at the window's start without acc_events
@pytest.mark.filterwarnings("error::UserWarning")
@pytest.mark.parametrize("num_steps, recorded", [(6, 2), (3, 1)], ids=["whole window", "run ends inside"])
def test_profile_window_writes_a_trace_of_exactly_its_steps(tmp_path, num_steps, recorded):
    params = load_config("quickstart", overrides={"profile_dir": "profile", "profile_window": [2, 4]})
    profiled_run(Profiler(params, tmp_path, torch.device("cpu")), num_steps)
    names = trace_event_names(tmp_path / "profile")  # relative profile_dir: inside the run directory
    for name in ("step", "data copy", "forward", "backward", "optimizer"):
        assert names.count(name) == recorded, name  # the warm-up step (1) and steps after the window: not recorded
    assert sum(1 for name in names if name and name.startswith("ProfilerStep#")) == recorded


@pytest.mark.parametrize("first, last, trained", [(0, 1, "global steps 0 to 1"), (0, 2, "global steps 0 to 2"),
                                                   (5, 7, "global steps 5 to 7"), (None, None, "no steps"),
                                                   (4, 7, "global steps 4 to 7"), (3, 7, "global steps 3 to 7")],
                         ids=["short", "ends at the window", "resumed after it", "no step", "resumed inside it",
                              "resumed at its start"])
def test_a_window_the_run_never_reached_is_said_not_silent(tmp_path, monkeypatch, first, last, trained):
    """A short run (or one resumed past or into the window) writes no trace: silence would read as if one were
    somewhere, and "not reached" would be wrong for a run that began inside it."""
    params = load_config("quickstart", overrides={"profile_dir": "profile", "profile_window": [3, 5]})
    profiler = Profiler(params, tmp_path, torch.device("cpu"))
    said = []
    monkeypatch.setattr(profiling.logger, "info", said.append)
    for global_step in range(first, last + 1) if first is not None else ():
        profiler.step(global_step)
    profiler.close()
    where = {4: "began before this run", 3: "starts at this run's first step"}.get(first, "not reached")
    assert said == [f"profile_window [3, 5] {where}: this run trained {trained}; no torch.profiler trace written "
                    f"(choose a --profile_window inside those steps, from the second on: a window opens at its first "
                    f"step, and a trace warms up on the step before it)"]
    assert not list((tmp_path / "profile").iterdir())


@pytest.mark.parametrize("ending_with", [None, Preempted("stop signal")], ids=["alone", "while a stop ends the run"])
def test_a_close_that_fails_does_not_replace_the_exception_ending_the_run(tmp_path, monkeypatch, caplog,
                                                                         ending_with):
    """The run ends inside the window and the trace cannot be written: alone that is the error; when the run is
    already ending with an exception (a preemption must still exit with 3), it is one logged line."""
    params = load_config("quickstart", overrides={"profile_dir": "profile", "profile_window": [2, 4]})
    profiler = Profiler(params, tmp_path, torch.device("cpu"))

    def full_disk(self):
        raise StorageError("torch.profiler trace: no trace file arrived")
    monkeypatch.setattr(Profiler, "_check_trace_written", full_disk)
    for global_step in range(3):
        profiler.step(global_step)
    if ending_with is None:
        with pytest.raises(StorageError, match="no trace file arrived"):
            profiler.close()
    else:
        logger = logging.getLogger("train")  # a training run in this process stops it propagating (utils/run_dir.py)
        logger.addHandler(caplog.handler)
        try:
            profiler.close(ending_with)
        finally:
            logger.removeHandler(caplog.handler)
        assert "closing it failed too (StorageError: torch.profiler trace: no trace file arrived)" in caplog.text
    assert profiler.torch_profiler is None  # stopped either way


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_run_that_ends_well_inside_a_callers_except_block_closes_as_ending_well(tiny_argv, monkeypatch):
    """The loop hands its own exception to the closes, not whatever a caller (a notebook cell) is handling:
    with the caller's, a failed close would be logged as a second failure and the run would report success."""
    from utils import metrics
    closes = []
    monkeypatch.setattr(type(metrics.NO_PROFILER), "close", lambda self, ending_with=None: closes.append(ending_with))
    try:
        raise KeyError("the caller's own")
    except KeyError:
        assert train.main(tiny_argv) is not None
    assert closes == [None]


def test_a_profile_dir_that_cannot_be_made_is_one_line_at_start_up(tmp_path):
    """torch's trace handler makes the folder only when the window begins, and fails there with a traceback."""
    (tmp_path / "a_file").write_text("")
    params = load_config("quickstart", overrides={"profile_dir": str(tmp_path / "a_file" / "traces")})
    with pytest.raises(ConfigError, match=f"^profile_dir {tmp_path}/a_file/traces cannot be created \\(Not a "
                                          f"directory\\); choose another --profile_dir$"):
        Profiler(params, tmp_path, torch.device("cpu"))
    params = load_config("quickstart", overrides={"profile_dir": "traces"})
    Profiler(params, tmp_path, torch.device("cpu"))
    assert (tmp_path / "traces").is_dir()  # relative: inside the run directory


def test_profiling_off_costs_nothing_and_writes_nothing(tmp_path):
    for manual in (False, True):  # manual profiling without CUDA: NVTX has nothing to mark
        params = load_config("quickstart", overrides={"enable_manual_profiling": manual, "profile_window": [1, 3]})
        profiler = Profiler(params, tmp_path, torch.device("cpu"))
        assert isinstance(profiler.range("forward"), nullcontext)
        profiled_run(profiler, 4)
    assert list(tmp_path.iterdir()) == []


def test_the_nvtx_window_brackets_its_steps_for_nsys(tmp_path, monkeypatch):
    """The CUDA calls of --enable_manual_profiling, recorded (no GPU here): the capture range opens after the
    host has waited for earlier steps, closes after the window's kernels finished, and the ranges pair up."""
    calls = []
    for module, name in ((torch.cuda, "synchronize"), (torch.cuda.profiler, "start"), (torch.cuda.profiler, "stop"),
                         (torch.cuda.nvtx, "range_push"), (torch.cuda.nvtx, "range_pop")):
        monkeypatch.setattr(module, name, lambda *args, name=name: calls.append((name, *args)))
    params = load_config("quickstart", overrides={"enable_manual_profiling": True, "profile_window": [2, 4]})
    profiled_run(Profiler(params, tmp_path, torch.device("cuda")), 6)
    window = [call for call in calls if call[0] in ("synchronize", "start", "stop")]
    assert window == [("synchronize",), ("start",), ("synchronize",), ("stop",)]
    start, stop = calls.index(("start",)), calls.index(("stop",))
    inside = [call[1] for call in calls[start:stop] if call[0] == "range_push"]
    assert inside == ["step", "data copy", "forward", "backward", "optimizer"] * 2  # steps 2 and 3
    assert [c[0] for c in calls].count("range_push") == [c[0] for c in calls].count("range_pop") == 6 * 5


@pytest.mark.parametrize("num_steps", [6, 3], ids=["whole window", "run ends inside"])
def test_a_trace_window_on_cuda_waits_for_the_gpu_at_its_edges(tmp_path, monkeypatch, num_steps):
    """profile_dir on CUDA, its calls recorded (no GPU here): the host waits for the GPU before the window's first
    step and before the trace closes. The host runs steps ahead and a trace keeps only the GPU work between its
    start and stop, so without the waits earlier steps' kernels would run inside it unrecorded and the window's
    own would run after it (tests/test_gpu.py checks the kernels that land in a real trace)."""
    calls = []

    class Trace:
        def step(self):
            calls.append("profiler step")

        def stop(self):
            calls.append("profiler stop")

    def start_trace(profiler):
        calls.append("profiler start")
        profiler.torch_profiler = Trace()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append("synchronize"))
    monkeypatch.setattr(Profiler, "_start_trace", start_trace)
    monkeypatch.setattr(Profiler, "_check_trace_written", lambda profiler: None)
    params = load_config("quickstart", overrides={"profile_dir": "profile", "profile_window": [2, 4]})
    profiler = Profiler(params, tmp_path, torch.device("cuda"))
    for step in range(num_steps):
        profiler.step(step)
        calls.append(f"step {step}")
    profiler.close()
    window = ["step 0", "profiler start", "step 1", "synchronize", "profiler step", "step 2"]
    if num_steps == 6:
        assert calls == window + ["profiler step", "step 3", "synchronize", "profiler step", "profiler stop",
                                  "step 4", "step 5"]
    else:
        assert calls == window + ["synchronize", "profiler stop"]


@pytest.mark.parametrize("window", [[5, 5], [30, 20]])  # [0, 4]: the schema (positive ints)
def test_profile_window_must_be_a_nonempty_range(window):
    """Checked with the config, before a run folder is made for a run that could not profile."""
    with pytest.raises(ConfigError, match=rf"^profile_window \[{window[0]}, {window[1]}\] must be \[start, stop\) "
                                          rf"with 0 < start < stop$"):
        load_config("quickstart", overrides={"profile_window": window})


# --- benchmarks/ladder.py -----------------------------------------------------------------------
@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke run")
def test_ladder_tiny_runs_on_cpu_and_skips_cuda_rungs(tmp_path):
    out = tmp_path / "cpu.json"
    code = ladder.main(["--tiny", "--out", str(out), "--loss_steps", "3", "--warmup_steps", "0",
                        "--windows", "2", "--steps_per_window", "1"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu" and report["setup"]["batch_size"] == 2
    rows = {row["name"]: row for row in report["rungs"]}
    assert list(rows) == [rung.name for rung in ladder.RUNGS]
    assert {name for name, row in rows.items() if row["status"] == "skipped"} == {
        "tf32", "fp16", "compile", "cuda_graph", "cuda_graph_compile", "compile_channels_last", "compile_conv_forms",
        "compile_overlap_add", "compile_fused", "compile_fastest_forms"}
    assert rows["cuda_graph"]["reason"] == "CUDA graphs need a CUDA GPU"
    # Skipped rungs' settings are not carried up: no compile on CPU.
    assert rows["channels_last"]["settings"] == "bf16, fused Adam, channels-last"
    # The conv_forms rung sets its own forms (the *_opt configs' eager part), whatever --conv_forms says.
    assert rows["conv_forms"]["settings"] == f"bf16, fused Adam, channels-last, conv_forms={ladder.FASTEST_EAGER_FORMS}"
    ran = [rows[name] for name in ("fp32", "bf16", "fused_adam", "channels_last", "conv_forms")]
    assert all(row["status"] == "ok" and row["samples_per_sec"] > 0 for row in ran)
    assert rows["fp32"]["speedup"] == 1.0 and len(rows["fp32"]["window_samples_per_sec"]) == 2
    assert rows["fp32"]["loss_last"] < rows["fp32"]["loss_first"]  # it learns from the generated batch
    # Same seed, same weights: bf16 and bf16 + fused Adam share step 1 exactly, then differ by rounding.
    assert rows["fused_adam"]["loss_first"] == rows["bf16"]["loss_first"]
    assert rows["fused_adam"]["loss_last"] == pytest.approx(rows["bf16"]["loss_last"], rel=1e-4)
    for row in ran:
        assert row["loss_last"] == pytest.approx(rows["fp32"]["loss_last"], rel=2e-2)
    table = out.with_suffix(".md").read_text()
    assert "| rung | settings | samples/s |" in table
    assert "| + CUDA graph | skipped: CUDA graphs need a CUDA GPU |" in table
    assert table.count("\n| ") == 2 + len(ladder.RUNGS)  # header, separator, one row per rung


def test_ladder_runs_every_rung_in_the_conv_forms_it_is_given(tmp_path):
    """--conv_forms reaches every rung's model (the same maths: fp32 losses equal the native ladder's)."""
    fast = ["--tiny", "--rungs", "fp32", "--loss_steps", "2", "--warmup_steps", "0", "--windows", "1",
            "--steps_per_window", "1"]
    reports = {}
    for forms in ("native", "rewritten,down0=padded"):
        out = tmp_path / f"{forms}.json"
        assert ladder.main(fast + ["--conv_forms", forms, "--out", str(out)]) == 0
        reports[forms] = json.loads(out.read_text())
    native, forms = (reports[key]["rungs"][0] for key in ("native", "rewritten,down0=padded"))
    assert native["settings"] == "fp32" and forms["settings"] == "fp32, conv_forms=rewritten,down0=padded"
    assert reports["rewritten,down0=padded"]["setup"]["conv_forms"] == "rewritten,down0=padded"
    assert forms["loss_last"] == pytest.approx(native["loss_last"], rel=1e-5)
    with pytest.raises(SystemExit, match="ladder.py: conv_forms item 'up7=padded': this model has no "
                                         "layer 'up7'"):
        ladder.main(fast + ["--conv_forms", "up7=padded", "--out", str(tmp_path / "bad.json")])


def test_a_ladder_stopped_mid_rung_has_saved_the_rungs_before_it(tmp_path, monkeypatch):
    """A job's time limit may stop the ladder in any rung: the report on disk already holds the rungs finished."""
    out = tmp_path / "stopped.json"
    run_rung = ladder.run_rung

    def stopped_in_bf16(rung, *args):
        if rung.name == "bf16":
            raise KeyboardInterrupt  # stands for a kill at the time limit: the rung never finishes
        return run_rung(rung, *args)

    monkeypatch.setattr(ladder, "run_rung", stopped_in_bf16)
    with pytest.raises(KeyboardInterrupt):
        ladder.main(["--tiny", "--rungs", "fp32,bf16", "--out", str(out), "--loss_steps", "2", "--warmup_steps", "0",
                     "--windows", "1", "--steps_per_window", "1"])
    report = json.loads(out.read_text())
    assert [(row["name"], row["status"]) for row in report["rungs"]] == [("fp32", "ok")]
    assert report["setup"]["batch_size"] == 2 and report["environment"]["device"]


def test_a_rung_run_alone_has_the_rungs_above_it_and_a_refused_rung_is_skipped(tmp_path, monkeypatch):
    """--rungs channels_last measures what the table calls + channels-last (bf16 and fused Adam from the rungs
    above it); --cudnn_benchmark_limit reaches every rung; a combination build_training refuses (compile with
    channels-last and a native up0 on CUDA) is a skipped row with the refusal, not a failure."""
    out = tmp_path / "alone.json"
    fast = ["--tiny", "--loss_steps", "1", "--warmup_steps", "0", "--windows", "1", "--steps_per_window", "1",
            "--out", str(out)]
    limit = torch.backends.cudnn.benchmark_limit
    try:
        assert ladder.main(fast + ["--rungs", "channels_last", "--cudnn_benchmark_limit", "0"]) == 0
    finally:  # on a GPU machine the rung set it for the process
        torch.backends.cudnn.benchmark_limit = limit
    report = json.loads(out.read_text())
    assert report["setup"]["cudnn_benchmark_limit"] == 0
    [row] = report["rungs"]
    assert row["status"] == "ok" and row["settings"] == "bf16, fused Adam, channels-last, cudnn_benchmark_limit=0"

    def refuse(rung, params, device, batch, args):
        raise ConfigError("enable_jit and channels_last together fail on CUDA ...")
    monkeypatch.setattr(ladder, "run_rung", refuse)
    assert ladder.main(fast + ["--rungs", "fp32"]) == 0
    [row] = json.loads(out.read_text())["rungs"]
    assert row["status"] == "skipped"
    assert row["reason"] == "refused: enable_jit and channels_last together fail on CUDA ..."


def test_ladder_model_size_flags(tmp_path):
    """--model_channels and --crop_size choose the model the rungs run (quickstart's on a CPU, say)."""
    out = tmp_path / "small.json"
    fast = ["--tiny", "--rungs", "fp32", "--loss_steps", "1", "--warmup_steps", "0", "--windows", "1",
            "--steps_per_window", "1", "--out", str(out)]
    assert ladder.main(fast + ["--model_channels", "4", "8", "8", "--crop_size", "8"]) == 0
    setup = json.loads(out.read_text())["setup"]
    assert setup["model_channels"] == [4, 8, 8] and setup["crop_size"] == 8
    with pytest.raises(SystemExit, match="ladder.py: data_size 12 must be divisible by 2\\^3"):
        ladder.main(fast + ["--model_channels", "4", "8", "8", "--crop_size", "12"])


def test_a_cpu_trace_prints_no_kineto_noise(tmp_path):
    """Kineto prints 'USDT: ... profiler_start' on stderr around every profiled region unless told not to; a user
    profiling on a CPU should see none of it. In a fresh process: Kineto reads its log level once per process."""
    code = (f"import sys, torch; sys.path.insert(0, {str(REPO_ROOT)!r})\n"
            "from utils.config import load_config\nfrom utils.profiling import Profiler\n"
            "params = load_config('quickstart', overrides={'profile_dir': 'profile', 'profile_window': [1, 2]})\n"
            f"profiler = Profiler(params, {str(tmp_path)!r}, torch.device('cpu'))\n"
            "for step in range(3):\n    profiler.step(step)\n    torch.ones(8).sum()\nprofiler.close()\n")
    env = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.rglob("*.pt.trace.json")) and "USDT" not in result.stderr, result.stderr
