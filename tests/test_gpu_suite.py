"""benchmarks/gpu_suite.py (its parts in benchmarks/suite/), so the one-command GPU suite cannot rot between GPU
sessions. Its CPU smoke mode runs once in CI, as a README command (tests/test_readme_commands.py checks it)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from utils.config import REPO_ROOT

from benchmarks import conv_variants, gpu_suite, kernel_probe
from benchmarks.suite import part_b_ladder, part_g_tests, part_i_levers, settings, trace
from benchmarks.suite.core import with_up0_rewritten
from benchmarks.suite.part_de_training import checkpoint_stalls
from benchmarks.suite.summary import markdown
from utils.checkpoint import stall_message


@pytest.fixture(autouse=True)
def release_suites(monkeypatch):
    """Most tests make a Suite without calling finish(): close its suite.log and remove its temporary folder."""
    made, init = [], gpu_suite.Suite.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(gpu_suite.Suite, "__init__", recording_init)
    yield
    for suite in made:
        suite.log_file.close()
        shutil.rmtree(suite.tmp, ignore_errors=True)


def test_a_part_that_would_overrun_the_budget_is_skipped_with_its_command(tmp_path, capsys):
    assert gpu_suite.main([str(tmp_path), "--small", "--parts", "h", "--budget_s", "0"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    skipped = summary["checks"][-1]
    assert skipped["name"] == "h. convolution forms" and skipped["status"] == "SKIP"
    assert "budget spent" in skipped["detail"]
    assert "`python benchmarks/gpu_suite.py OUT2 --parts h`" in skipped["detail"]
    assert "SKIP h. convolution forms: not started" in capsys.readouterr().out
    # Without part a the environment is still recorded, but neither the kernel probe nor the data set-up runs
    # (a second GPU call for the parts the first one skipped spends its time on them).
    assert summary["versions"]["torch"] == torch.__version__ and "probe" not in summary and "setup" not in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite.log", "summary.json", "summary.md"]


@pytest.mark.parametrize("names, path", [
    (["aten::convolution", "aten::slow_conv3d_forward"], "slow"),                               # CPU/GPU fallback op
    (["aten::cudnn_convolution", "void at::native::vol2col_kernel<float>(long, float const*, int)"], "slow"),
    (["aten::convolution_backward", "void at::native::im2col_kernel<c10::BFloat16>(long, ...)"], "slow"),
    (["aten::cudnn_convolution", "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_ndhwc_kernel"], "cudnn"),
    (["aten::cudnn_convolution", "im2col4d_kernel", "sm80_xmma_gemm_f32f32_tf32f32_f32_nt_n"], "cudnn"),  # GEMM engine
    (["aten::convolution", "some_unnamed_kernel"], "unknown"),
])
def test_kernel_probe_tells_cudnn_from_pytorchs_slow_fallback(names, path):
    assert kernel_probe.classify(names) == path


def probe_case(layer, mode, path):
    ops = {"slow": ["aten::convolution", "aten::slow_conv3d_forward", "aten::slow_conv3d_backward"],
           "cpu": ["aten::convolution", "aten::mkldnn_convolution"],
           "cudnn": ["aten::cudnn_convolution"]}.get(path, [])
    return {"layer": layer, "kind": "Conv3d", "mode": mode, "ops": ops, "kernels": [], "path": path, "ms": 1.0,
            "tflops": 0.1}


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "cuda"])
def test_the_kernel_probes_slow_path_fails_a_gpu_only(tmp_path, monkeypatch, on_gpu):
    """Part a on the cases an AVX2 CPU without AVX-512 gives (bf16 channels-last Conv3d in slow_conv3d): on a CPU
    the kernel is the CPU's choice, reported as information, and the part passes; the same rows from a GPU are
    PyTorch's slow fallback where cuDNN was expected, and fail it."""
    cases = [probe_case("down0", "fp32", "cudnn" if on_gpu else "cpu"), probe_case("down0", "bf16_cl", "slow"),
             probe_case("last", "bf16_cl", "slow")]
    monkeypatch.setattr(kernel_probe, "run_probe", lambda **settings: cases)
    suite = gpu_suite.Suite(tmp_path, small=True)
    suite.cuda = on_gpu
    suite.probe()
    suite.finish()
    checks = {c["name"]: c for c in suite.checks}
    if on_gpu:
        assert "kernel probe ran" not in checks
        assert checks["cuDNN for every convolution"]["status"] == "FAIL"
        assert checks["cuDNN for every convolution"]["detail"] == (
            "1/3 cases on cuDNN; not cuDNN: down0/bf16_cl=slow, last/bf16_cl=slow")
    else:
        assert checks["kernel probe ran"]["status"] == "PASS", checks["kernel probe ran"]
        assert "down0/bf16_cl, last/bf16_cl" in checks["kernel probe ran"]["detail"]
        assert checks["cuDNN for every convolution"]["status"] == "SKIP"
    assert suite.results["probe"]["paths"] == {"cudnn" if on_gpu else "cpu": 1, "slow": 2}


def test_a_probe_case_that_crashes_fails_on_a_cpu_too():
    cases = [probe_case("down0", "fp32", "cpu"), {**probe_case("up0", "bf16_cl", "error"), "error": "RuntimeError"}]
    passed, detail = kernel_probe.judge(cases, on_gpu=False)
    assert not passed and detail.endswith("; crashed: up0/bf16_cl")
    assert kernel_probe.judge([], on_gpu=False)[0] is False  # nothing ran: nothing was checked


PROFILE_ONCE = ("import torch\nwith torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):\n"
                "    torch.ones(3).sum()\n")


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_the_cpu_kernel_probe_prints_no_profiler_markers():
    """Kineto prints 'USDT: ... profiler_start' and 'profiler_stop' on stderr around every profiled region, at a
    level above its errors; the probe turns them off on a CPU (KINETO_LOG_LEVEL), and its verdict still prints."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    plain = subprocess.run([sys.executable, "-c", PROFILE_ONCE], capture_output=True, text=True, env=env, timeout=120)
    if "profiler_start" not in plain.stderr:
        pytest.skip("this PyTorch's Kineto prints no USDT lines: nothing to silence")
    result = subprocess.run([sys.executable, "benchmarks/kernel_probe.py", "--batch", "1", "--crop", "16",
                             "--channels", "4,8", "--modes", "fp32", "--repeats", "1"],
                            cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS kernel probe: 4 cases ran on the CPU" in result.stdout
    assert "USDT" not in result.stderr and "profiler_start" not in result.stderr, result.stderr


def test_the_checkpoint_stall_is_parsed_from_train_pys_own_log_lines():
    text = "\n".join(["INFO " + stall_message("periodic", 40, 0.031, 0.0),
                      "Checkpoint (periodic) written: /x/ckpt_step00000040.pt (2.3 s, 1.40 GB)",
                      "INFO " + stall_message("periodic", 80, 1.732, 1.701),
                      "INFO " + stall_message("end of epoch 1", 160, 0.045, 0.0004)])
    assert checkpoint_stalls(text) == [("periodic", 0.031, 0.0), ("periodic", 1.732, 1.701),
                                                 ("end of epoch 1", 0.045, 0.0)]


def runtime_call(name, ts, correlation):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": 5, "args": {"correlation": correlation}}


def gpu_event(category, ts, dur, stream, correlation=None):
    name = "Memcpy HtoD (Pinned -> Device)" if category == "gpu_memcpy" else "kernel"
    return {"cat": category, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": correlation}}


def test_the_trace_tells_how_much_of_each_copy_hid_and_what_made_the_host_wait():
    """Part f's reading of a Kineto trace (times in microseconds), on a hand-made one: copy 1 on stream 20 runs
    400-500 under kernels on stream 7 for 400-450 and 440-480 (80% hidden), 40 us after the host queued it;
    copy 2 runs alone (0%): a kernel on the copy's own stream does not count."""
    kernels = [gpu_event("kernel", 400, 50, 7), gpu_event("kernel", 440, 40, 7), gpu_event("kernel", 600, 100, 20)]
    copies = [gpu_event("gpu_memcpy", 400, 100, 20, correlation=1),
              gpu_event("gpu_memcpy", 600, 100, 20, correlation=2)]
    events = [runtime_call("cudaMemcpyAsync", 360, 1), runtime_call("cudaMemcpyAsync", 590, 2),
              runtime_call("cudaStreamSynchronize", 700, 3), runtime_call("cudaFree", 710, 4),
              runtime_call("cudaFree", 720, 5), runtime_call("cudaLaunchKernel", 730, 6), *kernels, *copies]
    assert trace.copy_compute_overlap(copies, kernels) == 0.4  # 80 of the 200 us
    rows = trace.copy_rows(copies, kernels, events)
    assert [(r["hidden"], r["start_after_queued_ms"], r["ms"], r["stream"]) for r in rows] == [(0.8, 0.04, 0.1, 20),
                                                                                           (0.0, 0.01, 0.1, 20)]
    assert trace.blocking_calls(events) == {"cudaStreamSynchronize": 1, "cudaFree": 2}
    unlinked = gpu_event("gpu_memcpy", 400, 100, 20)  # no correlation id in the trace
    assert trace.copy_rows([unlinked], kernels, events)[0]["start_after_queued_ms"] is None


def test_the_summary_shows_where_the_slowest_layers_kernel_time_goes():
    """Part h's summary lists the longest kernels of the three layers with the most kernel time in their fastest
    form, each with its share of that layer's kernel time."""
    def layer(name, kernel_ms):
        kernels = [{"kernel": f"{name}_dgrad", "calls": 1, "ms": 0.75 * kernel_ms},
                   {"kernel": "copy", "calls": 8, "ms": 0.25 * kernel_ms}]
        return {"layer": name, "input_shape": [2, 8, 4, 4, 4], "best": "rewritten",
                "ms": {"native": 3 * kernel_ms, "rewritten": 2 * kernel_ms},
                "forward_ms": {"native": kernel_ms, "rewritten": kernel_ms},
                "kernel_ms": {"native": 2 * kernel_ms, "rewritten": kernel_ms},
                "kernels": {"native": kernels, "rewritten": kernels}, "tflops": {"native": 1.0, "rewritten": 2.0}}
    forms = {"layers": [layer("down0", 1.0), layer("up4", 5.0), layer("last", 6.0), layer("down1", 3.0)],
             "steps": {"native": {"samples_per_s": 1700.0}}, "conv_share_of_native_step": 0.9,
             "fastest_conv_forms": "rewritten"}
    slowest = conv_variants.slowest_layers(forms)
    assert [(name, form, ms) for name, form, ms, _ in slowest] == [
        ("last", "rewritten", 6.0), ("up4", "rewritten", 5.0), ("down1", "rewritten", 3.0)]
    text = markdown({"command": "gpu_suite.py OUT", "mode": "full", "conv_forms": forms})
    assert "| last (rewritten) | `last_dgrad` | 1 | 4.500 | 75% |" in text
    assert "| up4 (rewritten) | `copy` | 8 | 1.250 | 25% |" in text and "down0 (rewritten)" not in text
    for row in forms["layers"]:  # results of a CPU, or from before the breakdown: no table
        row["kernels"] = {"native": None, "rewritten": None}
    assert "slowest layers" not in markdown({"command": "OUT", "mode": "full", "conv_forms": forms})


def test_parts_the_budget_skips_are_named_with_the_fewest_calls_that_run_them(tmp_path, capsys):
    """Late in a call (500 s of 560 spent) every part is skipped; the suite ends by naming the calls that run them,
    packed in order by the budget's guesses (d-h fit one call; b and i, 370 and 240 s, do not), with this run's
    settings, and never with d and e apart (e compares with d's rate)."""
    suite = gpu_suite.Suite(tmp_path, small=True, budget_s=560, conv_forms="last=rewritten",
                            started=time.perf_counter() - 500)
    suite.cuda = True  # as on a GPU: the guesses count

    def never():
        raise AssertionError("a part over the budget was started")
    for key in "bdefghi":
        suite.part(f"{key}. part", never, key)
    assert [check["status"] for check in suite.checks] == ["SKIP"] * 7
    assert "`python benchmarks/gpu_suite.py OUT2 --parts d --conv_forms last=rewritten`" in \
        suite.checks[1]["detail"]
    assert suite.calls_for("defgh") == ["defgh"] and suite.calls_for("bi") == ["b", "i"]
    suite.budget_s = 480  # b's 370 s and d's 70 s fit after the call's start (30 s), d and e's 110 s do not
    assert suite.calls_for("bde") == ["b", "de"]
    suite.budget_s = 560
    assert suite.finish() == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "Not started for time: part(s) b, d, e, f, g, h, i. By the budget's guesses they need 2 more calls: "
        "`python benchmarks/gpu_suite.py OUT2 --parts bde --conv_forms last=rewritten`, then "
        "`python benchmarks/gpu_suite.py OUT3 --parts fghi --conv_forms last=rewritten`")
    assert json.loads((tmp_path / "summary.json").read_text())["not_started_for_time"]["parts"] == "bdefghi"


def test_part_c_stops_starting_runs_once_the_budget_is_spent(tmp_path, monkeypatch):
    """A part that ran past its guess: part c's remaining benchmark-mode runs and probe are reported as SKIP with
    the command that runs the part alone, instead of running on into the device's limit (and losing the call)."""
    suite = gpu_suite.Suite(tmp_path, small=True, budget_s=560, started=time.perf_counter() - 561)
    monkeypatch.setattr(suite, "thread_sweep", lambda: {2: 100.0})
    monkeypatch.setattr(suite, "train", lambda *args: pytest.fail("a run started after the budget was spent"))
    suite.benchy()
    skipped = {check["name"]: check["detail"] for check in suite.checks if check["status"] == "SKIP"}
    assert "benchmark mode, fast inmem, 2 threads" in skipped
    assert "GPU-resident loader: gather candidates (benchmarks/gather_probe.py)" in skipped
    assert all("560 s budget spent" in detail and "--parts c`" in detail for name, detail in skipped.items()
               if name != "benchmark mode, GPU-resident loader")  # (that one: no GPU here)
    assert suite.results["benchy"] == {} and suite.skipped_for_time == ["c"]  # in the calls printed at the end


def test_compile_gives_each_training_run_a_compile_in_the_guesses(tmp_path, monkeypatch, capsys):
    """--compile: every training run of parts c-f is given COMPILE_S more (the ladder, the tests and part h's
    timings are unchanged), so the parts take three calls, carrying the flag; and part c starts a compiled run
    only if the run and its compile fit what is left (15 s of the budget left: an eager run would start)."""
    for name in ("eager", "compiled"):
        (tmp_path / name).mkdir()
    eager = gpu_suite.Suite(tmp_path / "eager", small=True, budget_s=560, conv_forms="last=rewritten")
    compiled = gpu_suite.Suite(tmp_path / "compiled", small=True, budget_s=560, conv_forms="last=rewritten",
                               train_compile=True, started=time.perf_counter() - 545)
    eager.cuda = compiled.cuda = True  # as on a GPU: the guesses count
    added = {key: compiled.needs(key, True) - eager.needs(key, True) for key in "bcdefgh"}
    assert added == {"b": 0, "c": 7 * settings.COMPILE_S, "d": 2 * settings.COMPILE_S, "e": settings.COMPILE_S,
                     "f": settings.COMPILE_S, "g": 0, "h": 0}
    assert eager.calls_for("abcdefgh") == ["abc", "defgh"]
    assert compiled.calls_for("abcdefgh") == ["ab", "cdef", "gh"]

    monkeypatch.setattr(compiled, "thread_sweep", lambda: {8: 100.0})
    monkeypatch.setattr(compiled, "train", lambda *args: pytest.fail("a compiled run started without the time"))
    monkeypatch.setattr(compiled, "gather_probe", lambda: None)
    compiled.benchy()
    skipped = [check for check in compiled.checks if check["status"] == "SKIP"]
    assert len(skipped) == 7 and all(f"it needs about {settings.BENCHY_RUN_S + settings.COMPILE_S} s" in
                                     check["detail"] and "--parts c --conv_forms last=rewritten --compile`" in
                                     check["detail"] for check in skipped), skipped
    for suite in (eager, compiled):
        suite.finish()
    capsys.readouterr()


def test_an_xdist_worker_takes_its_share_of_the_cores_for_threads_and_compile_processes(monkeypatch):
    """conftest's share for one of 4 pytest-xdist workers on a 16-core machine (part g's case): 4 torch threads and 4
    Inductor compile processes, the latter also in the environment the tests' subprocesses inherit."""
    import torch._inductor.config as inductor_config
    from conftest import share_the_cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # share_the_cores sets it; monkeypatch puts it back after
    threads, compile_threads = torch.get_num_threads(), inductor_config.compile_threads
    try:
        share_the_cores(4)
        assert torch.get_num_threads() == 4 and inductor_config.compile_threads == 4
        assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")  # one the user set is kept
        share_the_cores(4)
        assert inductor_config.compile_threads == 2
    finally:
        torch.set_num_threads(threads)
        inductor_config.compile_threads = compile_threads  # not monkeypatch: pytest 9.2 would delete the entry


@pytest.mark.parametrize("plugins", [True, False], ids=["xdist and pytest-timeout", "neither"])
def test_part_g_runs_the_cuda_tests_on_workers_with_a_limit_per_test(tmp_path, monkeypatch, plugins):
    """Part g's pytest command (no GPU here: the command is recorded, not run): on TEST_WORKERS xdist workers and
    with a per-test timeout where those plugins are installed, within the time left in the budget."""
    suite = gpu_suite.Suite(tmp_path, small=True, budget_s=560)
    suite.cuda = True  # as on a GPU: the part runs
    commands = []

    def run(command, timeout, **kwargs):
        commands.append((command, timeout))
        return subprocess.CompletedProcess(command, 0, stdout="30 passed in 60.00s\n",
                                           stderr="[W] a worker's warning at its exit\n")
    monkeypatch.setattr(part_g_tests.subprocess, "run", run)
    monkeypatch.setattr(part_g_tests, "importable", lambda name: plugins)
    suite.tests()
    [(command, timeout)] = commands
    assert command[-1] == "tests/test_gpu.py" and 500 < timeout <= 550
    if plugins:
        assert command[command.index("-n") + 1] == str(settings.TEST_WORKERS)
        assert command[command.index("--timeout") + 1] == str(settings.TEST_TIMEOUT_S)
    else:
        assert "-n" not in command and "--timeout" not in command
    assert suite.checks[-1]["status"] == "PASS" and suite.checks[-1]["detail"] == "30 passed in 60.00s"
    assert (tmp_path / "pytest.log").read_text() == "30 passed in 60.00s\n[W] a worker's warning at its exit\n"


def test_part_b_compares_the_overlap_add_candidate_with_the_opt_rung(tmp_path, monkeypatch):
    """Part b on a ladder report (made up here: no GPU) where both compiled rungs ran: the candidate's rate over the
    *_opt configs' rung is recorded; the 2,500 goal is judged on the best rung. The ladder is the tutorial's whatever
    --conv_forms says (that flag sets the training parts' forms; the ladder's last rungs add forms of their own)."""
    from benchmarks import ladder
    calls = []

    def rung(name, rate):
        return {"name": name, "label": name, "status": "ok", "settings": "bf16", "samples_per_sec": rate, "mfu": 0.2,
                "peak_memory_gb": 5.0, "loss_last": 0.0556, "loss_first": 0.06}

    def fake_ladder(argv):
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.write_text(json.dumps({"setup": {}, "rungs": [rung("fp32", 310.0), rung("compile_conv_forms", 2700.0),
                                                           rung("compile_overlap_add", 3240.0)]}))
        return 0
    monkeypatch.setattr(ladder, "main", fake_ladder)
    monkeypatch.setattr(part_b_ladder, "plot_ladder", lambda *args: None)
    suite = gpu_suite.Suite(tmp_path, small=True, budget_s=560, conv_forms="last=rewritten", train_compile=True)
    suite.cuda = True
    suite.ladder()
    assert len(calls) == 1 and "--conv_forms" not in calls[0]
    assert suite.results["overlap_add_vs_opt"] == 1.2 and suite.results["best_rung"] == "compile_overlap_add"
    goal = next(c for c in suite.checks if c["name"].startswith("compute-only throughput"))
    assert goal["status"] == "PASS" and goal["kind"] == "goal" and "compile_overlap_add: 3240" in goal["detail"]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_part_i_runs_two_fresh_ladders_and_compares_them(tmp_path, monkeypatch):
    """Part i's bookkeeping, on the CPU with the tiny ladder in place of the full one: the compile + channels-last
    rung needs CUDA, so its run is a FAIL naming why; every cuDNN engine's run is compared with the eager rung."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the ladders run on the CPU on a GPU machine too
    suite = gpu_suite.Suite(tmp_path, small=True, budget_s=560)
    suite.cuda = True  # as on a GPU: the part runs
    monkeypatch.setattr(part_i_levers, "LADDER_TIMING", ["--tiny", "--loss_steps", "1", "--warmup_steps", "0",
                                                     "--windows", "1", "--steps_per_window", "1"])
    suite.levers()
    checks = {c["name"]: c for c in suite.checks}
    assert checks["levers: compile runs"]["status"] == "FAIL"
    assert "not run: {'compile_channels_last': \"the rung measures Inductor's GPU kernels" in checks[
        "levers: compile runs"]["detail"]
    assert checks["levers: all_engines runs"]["status"] == "PASS"
    levers = suite.results["levers"]
    assert set(levers["samples_per_s"]["compile"]) == set(levers["samples_per_s"]["all_engines"]) == {"channels_last"}
    assert set(levers["vs_eager_channels_last"]) == {"all_cudnn_engines"}
    goal = checks[f"compute-only throughput >= {settings.COMPUTE_GOAL} samples/s with compile or every cuDNN engine"]
    assert goal["kind"] == "goal" and goal["detail"].startswith(
        f"best {levers['samples_per_s']['all_engines']['channels_last']:.0f} samples/s")  # a lever, not the baseline
    assert "## More levers" in markdown(suite.results)
    suite.finish()


@pytest.mark.parametrize("forms", ["native", "rewritten", "padded", "down0=rewritten,last=rewritten", "up0=padded"])
def test_part_i_keeps_the_given_forms_and_rewrites_up0(forms):
    """Part i times compile + channels-last, which needs up0 rewritten on CUDA (pytorch#171622), in the forms of
    --conv_forms otherwise."""
    from networks.conv_forms import parse_conv_forms
    from networks.UNet import conv_layer_names
    names = conv_layer_names(6)
    given, used = parse_conv_forms(forms, names), parse_conv_forms(with_up0_rewritten(forms), names)
    assert used == {**given, "up0": "rewritten"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_prefetch_probe_refuses_to_run_without_a_gpu(capsys):
    from benchmarks import prefetch_probe
    with pytest.raises(SystemExit) as exit_info:
        prefetch_probe.main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: needs a CUDA GPU (the prefetcher is a passthrough on the CPU)")


def test_compile_trains_parts_c_to_f_as_the_opt_configs_do(tmp_path):
    """--compile: the training runs' config compiles, with up0 rewritten (compile with channels-last needs it on
    CUDA); the ladder's forms stay as given."""
    suite = gpu_suite.Suite(tmp_path, small=True, conv_forms="down0=rewritten,last=rewritten", train_compile=True)
    try:
        suite.prepare()
    finally:
        suite.finish()
    setup = suite.results["setup"]
    assert setup["enable_jit"] is True and setup["channels_last"] is True
    assert setup["conv_forms"] == "down0=rewritten,last=rewritten,up0=rewritten"
    assert suite.train_forms == "down0=rewritten,last=rewritten"


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_part_j_runs_the_spatial_sweep_and_the_two_rank_check(tmp_path):
    """Part j in the smoke mode: benchmarks/spatial_gpu.py's tiny batch of slabs, tiny sweep and two-rank S = 2 check,
    each a fresh process, judged from their JSON; named only (not among the default parts)."""
    assert "j" not in settings.DEFAULT_PARTS
    assert gpu_suite.main([str(tmp_path), "--small", "--parts", "j"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    assert checks["spatial: a training step's memory per crop"]["status"] == "PASS"
    memory = checks["spatial: a training step's memory per crop"]["detail"]
    assert memory.startswith("largest crop trained at S = 1: 16^3")
    assert checks["spatial: one rank's slabs train"]["detail"].count("S=") == 2
    assert checks["two gloo ranks: S = 2 equals the unsharded model (fp32)"]["status"] == "PASS"
    batch = checks["spatial: slabs at batch 4 (the projection's setup)"]
    assert batch["status"] == "PASS" and batch["detail"].startswith("8^3 S=4: compute-only efficiency ")
    assert set(summary["spatial"]) == {"batch", "memory", "check"}


def test_part_j_judges_a_stopped_sweep_and_a_failed_check(tmp_path):
    """On a GPU (made up here): the 256^3 share at S = 8 is the issue's goal; a sweep killed before its slabs and a
    rank's error are FAILs that say what happened."""
    suite = gpu_suite.Suite(tmp_path, small=True, budget_s=560)
    suite.cuda = True
    suite.judge_memory({"whole": [{"crop": 64, "status": "ok", "peak_allocated_gib": 1.78}],
                        "largest_whole_crop": 64, "memory_wall_found": False,
                        "slabs": [{"crop": 256, "spatial_parallel": 8, "status": "ok", "step_ms": 15.4,
                                   "peak_allocated_gib": 2.18, "compute_efficiency": 0.69}]})
    suite.judge_check({"ranks": [{"spatial": {"ok": False, "error": "RuntimeError: writev: Bad address"},
                                  "spatial_compile": {"ok": False, "error": "BackendCompilerFailed: inductor"}}] * 2})
    suite.judge_check({"ended": "killed after 60 s"})
    checks = {c["name"]: c for c in suite.checks}
    assert checks["spatial: a training step's memory per crop"]["detail"] == (
        "largest crop trained at S = 1: 64^3 (the sweep ended before any crop failed to fit); 64^3 1.78 GiB")
    goal = checks["a rank's share of a 256^3 crop at S = 8 trains"]
    assert goal["status"] == "PASS" and goal["kind"] == "goal" and goal["detail"].startswith("2.18 GiB")
    failed = checks["two gloo ranks: S = 2 equals the unsharded model (fp32)"]
    assert failed["status"] == "FAIL" and "Bad address" in failed["detail"]
    compiled = checks["two gloo ranks: compiled S = 2 equals the unsharded model"]  # spatial_gpu check's default part
    assert compiled["status"] == "FAIL" and compiled["detail"] == "BackendCompilerFailed: inductor"
    assert checks["spatial: two gloo ranks on one device"] == {
        "name": "spatial: two gloo ranks on one device", "status": "FAIL", "detail": "killed after 60 s",
        "kind": "check"}
    suite.finish()
