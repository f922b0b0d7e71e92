"""benchmarks/roofline.py: its FLOP and byte counts against independent ones, and its command line."""
import json

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.roofline import (RESULTS, ConvLayer, main, measured_kernel_ms, model_layers, parameter_bytes,
                                 roofline)
from networks.UNet import UNet

CHANNELS = [64, 128, 256, 512, 512, 512]


def counted_flops(module, x, input_grad):
    """(forward, forward + backward) FLOPs of ``module`` on ``x`` by PyTorch's own counter."""
    x = x.clone().requires_grad_(input_grad)
    with FlopCounterMode(display=False) as forward_counter:
        y = module(x)
    with FlopCounterMode(display=False) as backward_counter:
        y.sum().backward()
    return forward_counter.get_total_flops(), backward_counter.get_total_flops()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("input_grad", [True, False])
def test_flops_match_pytorchs_flop_counter(transposed, input_grad):
    torch.manual_seed(0)
    conv = (nn.ConvTranspose3d if transposed else nn.Conv3d)(3, 5, kernel_size=4, stride=2, padding=1)
    x = torch.randn(2, 3, 4, 6, 8)  # uneven edges: a swapped axis or input/output mix-up would show
    y = conv(x)
    layer = ConvLayer("c", transposed, tuple(x.shape), tuple(y.shape), tuple(conv.weight.shape), input_grad)
    forward, backward = counted_flops(conv, x, input_grad)
    assert layer.flops() == forward
    assert backward == layer.flops() * (len(layer.pass_bytes(2)) - 1)  # weight gradient, and input gradient


def test_bytes_of_a_tiny_conv_by_hand():
    # x 2*3*4^3 = 384, y 2*5*2^3 = 80, w 5*3*4^3 = 960 values: every pass touches all three once
    layer = ConvLayer("c", False, (2, 3, 4, 4, 4), (2, 5, 2, 2, 2), (5, 3, 4, 4, 4))
    assert layer.pass_bytes(2) == {"forward": 2848, "input_grad": 2848, "weight_grad": 2848}
    assert layer.pass_bytes(4)["forward"] == 5696
    first = ConvLayer("c", False, (2, 3, 4, 4, 4), (2, 5, 2, 2, 2), (5, 3, 4, 4, 4), needs_input_grad=False)
    assert set(first.pass_bytes(2)) == {"forward", "weight_grad"}


def test_roofline_takes_the_slower_of_compute_and_memory():
    layer = ConvLayer("c", False, (2, 3, 4, 4, 4), (2, 5, 2, 2, 2), (5, 3, 4, 4, 4))
    flops = 2 * 3 * 5 * 64 * 16  # 30,720 per pass, 10.8 FLOP/byte
    compute_bound = roofline(layer, peak_flops=1e9, bandwidth=1e12, dtype_bytes=2)
    assert compute_bound["bound"] == "compute"
    assert compute_bound["total_roofline_ms"] == pytest.approx(3 * flops / 1e9 * 1e3)
    memory_bound = roofline(layer, peak_flops=1e12, bandwidth=1e9, dtype_bytes=2)
    assert memory_bound["bound"] == "memory"
    assert memory_bound["total_roofline_ms"] == pytest.approx(3 * 2848 / 1e9 * 1e3)
    assert memory_bound["intensity_flop_per_byte"] == pytest.approx(flops / 2848)


def test_layer_names_and_shapes_from_the_meta_model():
    _, layers = model_layers(CHANNELS, 64, 64)
    names = [layer.name for layer in layers]
    assert names == [f"down{i}" for i in range(6)] + [f"up{i}" for i in range(5)] + ["last"]
    assert [layer.transposed for layer in layers] == [False] * 6 + [True] * 6
    assert layers[-1].input_shape == (64, 128, 32, 32, 32) and layers[-1].output_shape == (64, 5, 64, 64, 64)
    assert [layer.needs_input_grad for layer in layers] == [False] + [True] * 11


def test_forward_flops_agree_with_the_models_own_count():
    from utils.metrics import flops_per_sample
    _, layers = model_layers(CHANNELS, 2, 64)
    assert sum(layer.flops() for layer in layers) / 2 == flops_per_sample(UNet(CHANNELS), 64) == 27_179_089_920


def test_cli_defaults_print_twelve_layers_and_the_h100_ceiling(capsys):
    result = main([])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| down", "| up", "| last"))]
    assert len(rows) == 12
    assert "Ceiling" in out and "samples/s" in out
    by_layer = {row["layer"]: row["total_roofline_ms"] for row in result["layers"]}
    # issue #39's per-layer roofline: last 0.63 (memory bound), up4 1.67, down1 0.83, down0 0.24 (two passes)
    assert by_layer["last"] == pytest.approx(0.631, abs=1e-3)
    assert by_layer["up4"] == pytest.approx(3 * 549.755813888e9 / 989e12 * 1e3)
    assert by_layer["down1"] == pytest.approx(0.834, abs=1e-3)
    assert by_layer["down0"] == pytest.approx(0.240, abs=1e-3)
    assert result["step_ms"]["convolutions"] == pytest.approx(5.47, abs=0.01)
    assert 9000 < result["samples_per_s"]["+ elementwise, fused"] < 9300


def test_h200_preset_changes_the_bandwidth_only():
    h100, h200 = main([]), main(["--gpu", "h200"])
    assert (h200["setup"]["bandwidth_tbs"], h200["setup"]["peak_tflops"]) == (4.8, 989.0)
    rows = {row["layer"]: row for row in h200["layers"]}
    assert rows["down0"]["total_roofline_ms"] == pytest.approx(0.240 * 3.35 / 4.8, abs=1e-3)  # memory bound
    assert (rows["last"]["bound"], h100["layers"][-1]["bound"]) == ("compute", "memory")  # crosses the ridge
    assert rows["up4"]["total_roofline_ms"] == h100["layers"][10]["total_roofline_ms"]       # compute bound
    assert main(["--gpu", "h100", "--bandwidth_tbs", "4.8"])["step_ms"] == h200["step_ms"]


def test_measured_kernel_times_come_from_h100_json():
    result = main([])
    measured = {row["layer"]: row["measured"] for row in result["layers"]}
    assert measured["last"]["best_form"] == "rewritten" and measured["last"]["best"] == 5.921
    assert measured["last"]["native"] == 11.757
    assert measured["up4"]["best"] == measured["up4"]["native"] == 4.605
    assert all(m is not None for m in measured.values())
    assert result["measured_best_kernel_ms"] == pytest.approx(20.56, abs=0.01)  # issue #39: 20.6


def test_measured_kernel_times_come_from_h200_jsons_condensed_table():
    """A results file may keep conv_variants.py's table condensed ({layer: {form: ms}}, fastest): read it too."""
    result = main(["--gpu", "h200"])
    measured = {row["layer"]: row["measured"] for row in result["layers"]}
    assert result["setup"]["measured_from"] == "h200.json"
    last = result["layers"][-1]
    assert measured["last"] == {"native": 10.767, "best_form": "fused", "best": 2.734,
                                "best_over_roofline": pytest.approx(2.734 / last["total_roofline_ms"]),
                                "best_tflops": pytest.approx(3 * 171.8 / 2.734, rel=1e-3)}  # 3 passes of 171.8 GFLOP
    assert measured["down1"]["best"] == measured["down1"]["native"] == 2.666
    assert result["measured_best_kernel_ms"] == pytest.approx(15.58, abs=0.01)  # roofline_h200.md
    assert measured_kernel_ms(RESULTS / "h200.json", CHANNELS, 32, 64) == {}  # the file is there: another batch


def test_no_measured_times_for_another_setup(tmp_path, capsys):
    assert measured_kernel_ms(RESULTS / "h100.json", CHANNELS, 64, 64)  # the file is there and measured batch 64
    assert measured_kernel_ms(RESULTS / "h100.json", CHANNELS, 32, 64) == {}
    assert measured_kernel_ms(tmp_path / "missing.json", CHANNELS, 64, 64) == {}
    assert all(row["measured"] is None for row in main(["--batch", "32"])["layers"])
    assert all(row["measured"] is None for row in main(["--dtype", "fp32", "--peak_tflops", "67"])["layers"])
    for named in (tmp_path / "missing.json", RESULTS / "h100.md"):  # named: a typo is an error, not "none"
        with pytest.raises(SystemExit):
            main(["--measured", str(named)])
        assert f"--measured {named} is not a readable results JSON" in capsys.readouterr().err


def test_parameter_update_bytes():
    assert parameter_bytes(10, 2) == 10 * (28 + 12)  # Adam, plus fp32 -> bf16 weight and bf16 -> fp32 grad casts
    assert parameter_bytes(10, 4) == 280


def test_json_output(tmp_path):
    out = tmp_path / "roofline.json"
    main(["--batch", "8", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["setup"]["batch"] == 8 and len(saved["layers"]) == 12


@pytest.mark.parametrize("argv, message", [(["--crop", "48"], "divisible by 2^6"),
                                           (["--gpu", "a100"], "give --peak_tflops and --bandwidth_tbs"),
                                           (["--batch", "0"], "argument --batch: must be positive, got 0"),  # 1 / 0
                                           (["--channels", "8", "0"], "argument --channels: must be positive, got 0"),
                                           (["--peak_tflops", "-1"],
                                            "argument --peak_tflops: must be positive, got -1")])
def test_bad_arguments_say_what_to_do(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert message in str(stop.value.code) + capsys.readouterr().err


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_committed_reports_are_what_their_commands_write(gpu, tmp_path, capsys):
    """benchmarks/results/roofline_<gpu>.md names its command on its third line; run again, it writes the same
    report above the hand-written notes (new kernel times in <gpu>.json change it: rerun that command with --out)."""
    import shlex
    from benchmarks.results_file import NOTES_MARKER
    from benchmarks.roofline import RESULTS
    committed = (RESULTS / f"roofline_{gpu}.md").read_text()
    command = shlex.split(committed.split("\n")[2].strip("`"))
    assert command[:2] == ["python", "benchmarks/roofline.py"], command
    main(command[2:] + ["--out", str(tmp_path / "report.md")])
    assert (tmp_path / "report.md").read_text().rstrip("\n") == committed.split(NOTES_MARKER)[0].rstrip("\n"), \
        f"stale: rerun {' '.join(command)} --out benchmarks/results/roofline_{gpu}.md"
