"""benchmarks/gemm_bound.py: each layer's matrix products have the convolution's FLOPs, and the CPU smoke run."""
import json

import pytest

from benchmarks.gemm_bound import gemm_shape, main
from benchmarks.roofline import DEFAULT_CHANNELS, model_layers


def test_each_layers_gemm_has_the_convolutions_flops():
    layers = model_layers(DEFAULT_CHANNELS, 64, 64)[1]
    assert [2 * m * n * k for m, n, k in map(gemm_shape, layers)] == [layer.flops() for layer in layers]
    shapes = {layer.name: gemm_shape(layer) for layer in layers}
    assert shapes["down1"] == (64 * 16 ** 3, 128, 64 * 4 ** 3)       # Conv3d: B x output voxels, C_out, C_in x 4^3
    assert shapes["last"] == (64 * 32 ** 3, 8 * 5, 8 * 128)          # sub-pixel: B x input voxels, 8 C_out, 8 C_in


def test_tiny_run_on_the_cpu(tmp_path, capsys):
    result = main(["--tiny", "--repeats", "2", "--json", str(tmp_path / "gemm.json")])
    rows = {row["layer"]: row for row in json.loads((tmp_path / "gemm.json").read_text())["layers"]}
    assert list(rows) == ["down0", "down1", "up0", "last"]
    assert set(rows["down0"]["gemm_ms"]) == {"forward", "weight_grad"}  # the data needs no gradient
    assert set(rows["last"]["gemm_ms"]) == {"forward", "input_grad", "weight_grad"}
    assert all(row["total_gemm_ms"] > 0 and row["conv_ms"] is None for row in rows.values())
    out = capsys.readouterr().out
    assert result["total_conv_ms"] is None and "| down1 | 128 × 8 × 256 |" in out
    assert f"`python benchmarks/gemm_bound.py --tiny --repeats 2 --json {tmp_path / 'gemm.json'}` (median of 2" in out


def test_the_full_model_on_a_cpu_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on a CPU machine, also where a GPU is
    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2 and "use --tiny" in capsys.readouterr().err


def test_sizes_and_repeats_below_one_are_refused_in_one_line(capsys):
    for argv, message in ((["--tiny", "--repeats", "0"], "argument --repeats: must be positive, got 0"),
                          (["--batch", "0"], "argument --batch: must be positive, got 0"),
                          (["--tiny", "--crop", "32"], "--tiny sets the batch, crop and widths itself; drop --crop "
                                                       "or --tiny")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and capsys.readouterr().err.endswith(f" error: {message}\n")
