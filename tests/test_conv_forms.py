"""networks/conv_forms.py computes exactly what the U-Net's stride-2 convolutions compute, gradients included,
and the config key conv_forms puts the forms into the model train.py trains."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import run_train_cli
from networks.conv_forms import (apply_conv_forms, conv3d_matmul, conv3d_padded_in, conv3d_s2d, conv3d_unfold,
                                 conv_transpose3d_matmul, conv_transpose3d_overlap_add, conv_transpose3d_padded_out,
                                 conv_transpose3d_subpixel, describe_conv_forms, parse_conv_forms, stride2_conv)
from networks.UNet import UPSAMPLE_MODES, UNet, conv_input_sizes
from utils import ConfigError
from utils.config import load_config
from utils.metrics import conv_flops, describe_model

FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last_3d}


def grads(output, inputs, seed):
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed), dtype=output.dtype)
    return torch.autograd.grad(output, inputs, upstream)


def assert_same_layer(got, reference, inputs, seed):
    """A form's output ``got`` is the native layer's ``reference``, and so are its gradients with respect to
    ``inputs`` for a random upstream gradient, to float64 rounding."""
    assert got.shape == reference.shape
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    for got_grad, want in zip(grads(got, inputs, seed), grads(reference, inputs, seed)):
        torch.testing.assert_close(got_grad, want, rtol=0, atol=1e-12)


def assert_same_model(native, other, x, upstream):
    """``other`` (the same parameters in other forms) gives ``native``'s output on ``x`` and its gradients for the
    upstream gradient ``upstream``, to float64 rounding."""
    outputs = []
    for model in (native, other):
        y = model(x)
        (y * upstream).sum().backward()
        outputs.append(y)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-12)
    for (name, got), want in zip(other.named_parameters(), native.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("size", [2, 4, 8])
def test_space_to_depth_conv3d_equals_the_stride_2_convolution(size, layout):
    torch.manual_seed(size)
    x = torch.randn(2, 3, size, size, size, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(5, 3, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reference = F.conv3d(x, weight, bias, stride=2, padding=1)
    assert reference.shape == (2, 5, size // 2, size // 2, size // 2)
    assert_same_layer(conv3d_s2d(x, weight, bias), reference, (x, weight, bias), 1)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_subpixel_conv_transpose3d_equals_the_stride_2_transposed_convolution(size, layout):
    torch.manual_seed(10 + size)
    x = torch.randn(2, 6, size, size, size, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(6, 5, 4, 4, 4, dtype=torch.float64, requires_grad=True)  # (C_in, C_out, k, k, k)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reference = F.conv_transpose3d(x, weight, bias, stride=2, padding=1)
    assert reference.shape == (2, 5, 2 * size, 2 * size, 2 * size)
    rewritten = conv_transpose3d_subpixel(x, weight, bias)
    assert_same_layer(rewritten, reference, (x, weight, bias), 2)
    if layout == "channels_last" and size > 1:  # the layout the GPU path trains in is kept
        assert rewritten.is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "plain ops, as under compile"])
@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_overlap_add_conv_transpose3d_equals_the_stride_2_transposed_convolution(size, layout, compiling,
                                                                                 monkeypatch):
    """One matrix product to every tap's contribution, each added where it lands: the same outputs, gradients and
    layout as the native layer, on every input size (1^3 is up0's), in both of its paths (eager writes the sums
    into one output; under torch.compile it is plain ops); a convolution is refused."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    torch.manual_seed(20 + size)
    x = torch.randn(2, 6, size, size, size, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(6, 5, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reference = F.conv_transpose3d(x, weight, bias, stride=2, padding=1)
    got = conv_transpose3d_overlap_add(x, weight, bias)
    assert_same_layer(got, reference, (x, weight, bias), 7)
    if size > 1:  # a 1^3 input is contiguous in both layouts, and the output follows it as the sub-pixel form's does
        assert got.is_contiguous(memory_format=FORMATS[layout])
    with pytest.raises(ValueError, match="the overlap_add form computes transposed convolutions only"):
        stride2_conv(x, weight.transpose(0, 1), bias, transposed=False, form="overlap_add")


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("size", [2, 4, 8])
def test_unfold_conv3d_equals_the_stride_2_convolution(size, layout):
    """Every output voxel's window as a row (im2col) times the weight: the same outputs, gradients and layout as the
    native layer; a transposed convolution is refused."""
    torch.manual_seed(30 + size)
    x = torch.randn(2, 3, size, size, size, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(5, 3, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reference, got = F.conv3d(x, weight, bias, stride=2, padding=1), conv3d_unfold(x, weight, bias)
    assert_same_layer(got, reference, (x, weight, bias), 9)
    if size > 2:  # a 1^3 output is contiguous in both layouts
        assert got.is_contiguous(memory_format=FORMATS[layout])
    with pytest.raises(ValueError, match="the unfold form computes convolutions only"):
        stride2_conv(x, weight.transpose(0, 1), bias, transposed=True, form="unfold")


@pytest.mark.parametrize("layout", FORMATS)
def test_channel_padded_forms_equal_the_first_and_last_layers(layout):
    """The first layer (4 input channels) and the last (5 output channels), padded to 8 and back."""
    torch.manual_seed(3)
    x = torch.randn(2, 4, 8, 8, 8, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(6, 4, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
    reference, padded = F.conv3d(x, weight, bias, stride=2, padding=1), conv3d_padded_in(x, weight, bias)
    torch.testing.assert_close(padded, reference, rtol=0, atol=1e-12)
    for got, want in zip(grads(padded, (x, weight, bias), 3), grads(reference, (x, weight, bias), 3)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    x = torch.randn(2, 6, 4, 4, 4, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(6, 5, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reference = F.conv_transpose3d(x, weight, bias, stride=2, padding=1)
    padded = conv_transpose3d_padded_out(x, weight, bias)
    assert padded.shape == reference.shape == (2, 5, 8, 8, 8)
    torch.testing.assert_close(padded, reference, rtol=0, atol=1e-12)
    for got, want in zip(grads(padded, (x, weight, bias), 4), grads(reference, (x, weight, bias), 4)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", FORMATS)
def test_matmul_forms_equal_the_layers_at_the_bottom(layout):
    """A stride-2 convolution of a 2^3 input and a transposed one of a 1^3 input as one matrix product over the
    central taps: outputs, gradients and the native output's layout; any other input size is refused."""
    torch.manual_seed(5)
    cases = [(conv3d_matmul, F.conv3d, (3, 6, 2, 2, 2), (5, 6, 4, 4, 4), (3, 5, 1, 1, 1)),
             (conv_transpose3d_matmul, F.conv_transpose3d, (3, 6, 1, 1, 1), (6, 5, 4, 4, 4), (3, 5, 2, 2, 2))]
    for matmul, native, x_shape, w_shape, y_shape in cases:
        x = torch.randn(x_shape, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
        weight = torch.randn(w_shape, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
        bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
        reference, got = native(x, weight, bias, stride=2, padding=1), matmul(x, weight, bias)
        assert reference.shape == y_shape
        assert_same_layer(got, reference, (x, weight, bias), 6)
        assert got.is_contiguous(memory_format=FORMATS[layout])
        with pytest.raises(ValueError, match="matmul form .* needs a"):
            matmul(torch.randn(3, 6, 4, 4, 4, dtype=torch.float64), weight, bias)


def test_the_matmul_form_in_the_model_and_where_it_fits():
    """In a 3-level U-Net on 8^3 crops down2 sees 2^3 and up0 1^3: the model with those two in the matmul form
    equals the native one; load_config refuses the form anywhere else, naming where it fits."""
    torch.manual_seed(0)
    native = UNet([4, 8, 8]).to(torch.float64)
    other = copy.deepcopy(native)
    assert apply_conv_forms(other, "down2=matmul,up0=matmul")["up0"] == "matmul"
    x, upstream = torch.randn(2, 4, 8, 8, 8, dtype=torch.float64), torch.randn(2, 5, 8, 8, 8, dtype=torch.float64)
    assert_same_model(native, other, x, upstream)

    assert load_config("base", overrides={"conv_forms": "down0=rewritten,down5=matmul,up0=matmul"}).conv_forms
    for spec, wrong in (("matmul", "down0, down1, down2, down3, down4, up1, up2, up3, up4, last"),
                        ("up1=matmul", "up1")):
        with pytest.raises(ConfigError, match=re.escape(
                f"the matmul form fits only a convolution of a 2^3 input or a transposed convolution of a 1^3 input, "
                f"not {wrong}; at this crop size it fits down5 and up0")):
            load_config("base", overrides={"conv_forms": spec})
    with pytest.raises(ConfigError, match="not down5; at this crop size it fits no layer of this model"):
        load_config("base", overrides={"conv_forms": "down5=matmul", "data_size": 128, "box_size": [1024, 512]})


@pytest.mark.parametrize("form, native", [(conv3d_unfold, F.conv3d),
                                          (conv_transpose3d_overlap_add, F.conv_transpose3d)],
                         ids=["unfold", "overlap_add"])
@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_the_matrix_product_forms_compile_to_the_native_layer(form, native):
    """torch.compile (Inductor's C++ on the CPU) of the unfold and overlap_add forms in one graph each (overlap_add
    through its plain-ops path): the native layer's outputs and gradients."""
    import torch._dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 4, 4).to(memory_format=torch.channels_last_3d).requires_grad_()
    weight = torch.randn(5, 6, 4, 4, 4) if native is F.conv3d else torch.randn(6, 5, 4, 4, 4)
    weight, bias = weight.requires_grad_(), torch.randn(5, requires_grad=True)
    got, reference = torch.compile(form, fullgraph=True)(x, weight, bias), native(x, weight, bias, stride=2, padding=1)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    for got_grad, want in zip(grads(got, (x, weight, bias), 8), grads(reference, (x, weight, bias), 8)):
        torch.testing.assert_close(got_grad, want, rtol=1e-5, atol=1e-4)
    torch._dynamo.reset()


def test_the_matrix_product_forms_in_the_model_and_where_they_fit():
    """Every convolution unfolded and every transposed layer an overlap-add (up0 on a 1^3 input among them): the
    native model's outputs and gradients; load_config refuses each form on the other kind of layer, naming which."""
    torch.manual_seed(0)
    native = UNet([4, 8, 8]).to(torch.float64, memory_format=torch.channels_last_3d)
    other = copy.deepcopy(native)
    forms = apply_conv_forms(other, "unfold,up0=overlap_add,up1=overlap_add,last=overlap_add")
    assert forms == {"down0": "unfold", "down1": "unfold", "down2": "unfold", "up0": "overlap_add",
                     "up1": "overlap_add", "last": "overlap_add"}
    x, upstream = torch.randn(2, 4, 8, 8, 8, dtype=torch.float64), torch.randn(2, 5, 8, 8, 8, dtype=torch.float64)
    assert_same_model(native, other, x.to(memory_format=torch.channels_last_3d), upstream)
    assert load_config("base", overrides={"conv_forms": "down0=rewritten,down4=unfold,up4=overlap_add,"
                                                        "last=overlap_add"})
    for spec, message in (("overlap_add", "the overlap_add form computes transposed convolutions only, not down0, "
                                          "down1, down2, down3, down4, down5; give it to the up layers or last"),
                          ("down1=overlap_add", "overlap_add form computes transposed convolutions only, not down1;"),
                          ("unfold", "the unfold form computes convolutions only, not up0, up1, up2, up3, up4, last; "
                                     "give it to the down layers, e.g. 'down4=unfold'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("base", overrides={"conv_forms": spec})


def test_a_wrong_rearrangement_would_be_caught():
    """The checks above are sensitive: swapping two kernel taps changes the result far beyond the tolerance."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 4, 4, dtype=torch.float64)
    weight = torch.randn(2, 3, 4, 4, 4, dtype=torch.float64)
    swapped = weight.clone()
    swapped[..., [0, 3]] = weight[..., [3, 0]]
    error = (conv_transpose3d_subpixel(x, swapped, None) - F.conv_transpose3d(x, weight, stride=2, padding=1)).abs()
    assert error.max() > 1e-3


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_conv_variants_times_every_form_of_every_layer():
    """benchmarks/conv_variants.py (the GPU suite's part h) on a tiny model: every layer, every form, whole steps."""
    from benchmarks.conv_variants import measure, slowest_layers
    lines = []
    results = measure(batch=1, crop=16, channels=[8, 16], device=torch.device("cpu"), log=lines.append, repeats=1)
    assert [row["layer"] for row in results["layers"]] == ["down0", "down1", "up0", "last"]
    for row in results["layers"]:
        expected = {"native", "rewritten", "fused"} | ({"padded"} if row["layer"] in ("down0", "last") else set()) | (
            {"overlap_add"} if row["layer"] in ("up0", "last") else {"unfold"})
        assert set(row["ms"]) == set(row["forward_ms"]) == set(row["tflops"]) == expected
        assert all(ms > 0 for ms in row["ms"].values()) and all(ms > 0 for ms in row["forward_ms"].values())
        assert row["forward_gflop"] == conv_flops(UNet([8, 16]), 16)[row["layer"]] / 1e9
        # GPU kernel times and the longest kernels: on a GPU only (tests/test_gpu.py)
        assert set(row["kernel_ms"].values()) == set(row["kernels"].values()) == {None}
        passes = 2 if row["layer"] == "down0" else 3  # forward, weight gradient (and input gradient)
        for form, ms in row["ms"].items():
            assert row["tflops"][form] == pytest.approx(passes * row["forward_gflop"] / ms, rel=0.01)
        assert row["best"] == min(row["ms"], key=row["ms"].get)
        assert all(error < 0.02 for error in row["relative_error_bf16"].values()), row  # same maths, bf16 rounding
    assert set(results["steps"]) == {"native", "rewritten", "best", "opt", "opt_fused"}
    assert len(results["steps"]["rewritten"]["forms"]) == 4 and results["steps"]["native"]["forms"] == {}
    assert results["steps"]["opt_fused"]["forms"] == {"down0": "rewritten", "up0": "rewritten", "last": "fused"}
    assert results["steps"]["rewritten"]["conv_forms"] == "rewritten"
    assert results["fastest_step"] == min(results["steps"], key=lambda variant: results["steps"][variant]["ms"])
    assert results["fastest_conv_forms"] == results["steps"][results["fastest_step"]]["conv_forms"]
    assert 0 < results["conv_share_of_native_step"] and len(lines) == 4 + 5 + 2  # no kernel lines on a CPU
    assert slowest_layers(results) == []
    assert lines[-1].endswith(f"train with --conv_forms {results['fastest_conv_forms']}")
    # On 8^3 crops a 3-level model's down2 sees 2^3 and up0 1^3: there the matmul form is a candidate too.
    results = measure(batch=1, crop=8, channels=[4, 8, 8], device=torch.device("cpu"), log=lines.append, repeats=1)
    candidates = {row["layer"]: set(row["ms"]) for row in results["layers"]}
    assert {name for name, forms in candidates.items() if "matmul" in forms} == {"down2", "up0"}
    assert all(row["relative_error_bf16"].get("matmul", 0) < 0.02 for row in results["layers"])


def test_kernel_rows_sum_each_kernels_time_per_call_longest_first():
    """conv_variants' kernel breakdown from (name, microseconds) GPU events of ``repeats`` calls: one row per
    kernel name, per call, longest first; template-heavy names shown cut, without "void "."""
    from benchmarks.conv_variants import kernel_rows
    long = "void at::native::elementwise_kernel<128, 4, " + "x" * 200
    events = [("sm90_xmma_dgrad", 300.0), ("sm90_xmma_fprop", 100.0), (long, 40.0), ("sm90_xmma_dgrad", 300.0),
              (long, 40.0)]
    rows = kernel_rows(events, repeats=2)
    assert [(row["ms"], row["calls"]) for row in rows] == [(0.3, 1), (0.05, 0.5), (0.04, 1)]
    assert [row["kernel"][:15] for row in rows] == ["sm90_xmma_dgrad", "sm90_xmma_fprop", "at::native::ele"]
    assert len(rows[2]["kernel"]) == 110 and rows[2]["kernel"].endswith("x…")
    assert kernel_rows([], repeats=5) == []


# --- the forms inside the model: the conv_forms key ---------------------------------------------------------------
NAMES = ["down0", "down1", "up0", "last"]


def test_conv_forms_values_and_their_errors():
    assert parse_conv_forms("native", NAMES) == dict.fromkeys(NAMES, "native")
    assert parse_conv_forms("rewritten,last=padded", NAMES) == {
        "down0": "rewritten", "down1": "rewritten", "up0": "rewritten", "last": "padded"}
    assert parse_conv_forms(" down0=padded , up0=rewritten", NAMES) == {
        "down0": "padded", "down1": "native", "up0": "rewritten", "last": "native"}
    assert parse_conv_forms("up0=rewritten,native", NAMES) == dict.fromkeys(NAMES, "native")  # items apply in order
    for bad, message in [("fast", "unknown form 'fast'; choose from native, rewritten, padded, matmul"),
                         ("down7=rewritten", "has no layer 'down7'; its layers are down0, down1, up0, last"),
                         ("rewritten,", "has an empty item"), ("down0=", "unknown form ''")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_conv_forms(bad, NAMES)


@pytest.mark.parametrize("forms", [dict.fromkeys(NAMES, "native"), dict.fromkeys(NAMES, "rewritten"),
                                   {"down0": "padded", "down1": "native", "up0": "rewritten", "last": "padded"},
                                   {"down0": "padded", "down1": "rewritten", "up0": "rewritten", "last": "rewritten"}])
def test_the_printed_conv_forms_value_selects_the_same_forms(forms):
    """benchmarks/conv_variants.py prints describe_conv_forms(fastest) for the user to pass back as --conv_forms."""
    value = describe_conv_forms(forms)
    assert parse_conv_forms(value, NAMES) == forms
    assert len(value) <= len(",".join(f"{name}={form}" for name, form in forms.items()))


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("upsample", UPSAMPLE_MODES)
def test_the_model_in_other_forms_is_the_native_model(upsample, layout):
    """Every layer rewritten or padded: same parameters (checkpoints load either way), same outputs and gradients."""
    torch.manual_seed(0)
    native = UNet([8, 12, 16], upsample=upsample).to(torch.float64, memory_format=FORMATS[layout])  # as training
    other = copy.deepcopy(native)
    parameters = list(other.parameters())
    forms = apply_conv_forms(other, "rewritten,down0=padded,last=padded")
    assert forms == {"down0": "padded", "down1": "rewritten", "down2": "rewritten", "up0": "rewritten",
                     "up1": "rewritten", "last": "padded"}
    assert [module.form for _, module in other.conv_layers()] == list(forms.values())
    assert "conv_forms=rewritten,down0=padded,last=padded, " in describe_model(other, 16)
    assert "form=padded" in repr(other)
    assert list(other.state_dict()) == list(native.state_dict())
    assert all(new is old for new, old in zip(other.parameters(), parameters, strict=True))  # the optimiser's tensors
    x = torch.randn(2, 4, 16, 16, 16, dtype=torch.float64).to(memory_format=FORMATS[layout])
    upstream = torch.randn(2, 5, 16, 16, 16, dtype=torch.float64)
    assert_same_model(native, other, x, upstream)
    apply_conv_forms(other, "native")
    assert describe_model(other, 16) == describe_model(native, 16)


@pytest.mark.parametrize("input_layout", FORMATS)
@pytest.mark.parametrize("spec", ["rewritten", "padded"])
def test_every_form_keeps_the_channels_last_layout(spec, input_layout):
    """Each layer's output in the layout the native layer gives: channels-last when the weights are, whatever the
    input's layout (float32: the CPU keeps channels-last there)."""
    torch.manual_seed(0)
    model = UNet([8, 12, 16]).to(memory_format=torch.channels_last_3d)
    apply_conv_forms(model, spec)
    layouts = []
    for name, module in model.conv_layers():
        module.register_forward_hook(lambda module, args, out, name=name: layouts.append(
            (name, out.is_contiguous(memory_format=torch.channels_last_3d))))
    model(torch.randn(2, 4, 16, 16, 16).to(memory_format=FORMATS[input_layout]))
    assert layouts == [(name, True) for name, _ in model.conv_layers()]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_train_py_trains_with_conv_forms_and_refuses_a_wrong_value(tiny_argv, tmp_path, capsys):
    import train
    train.main(tiny_argv + ["--conv_forms", "rewritten,down0=padded", "--num_epochs", "1"])
    log = next((tmp_path / "runs").rglob("out.log")).read_text()
    assert "conv_forms=rewritten,down0=padded, " in log and "Time taken for epoch 1" in log
    runs = sorted(path.name for path in (tmp_path / "runs").rglob("*") if path.is_dir())
    code, err = run_train_cli(tiny_argv + ["--conv_forms", "up9=rewritten"], capsys)
    assert code == 2 and "conv_forms item 'up9=rewritten': this model has no layer 'up9'; its layers are down0, " \
                          "down1, " \
                          "up0, last" in err
    assert sorted(path.name for path in (tmp_path / "runs").rglob("*") if path.is_dir()) == runs  # refused up front


def test_load_config_checks_conv_forms_against_the_models_layers():
    assert load_config("base", overrides={"conv_forms": "rewritten,up4=native,last=padded"}).conv_forms == \
        "rewritten,up4=native,last=padded"
    with pytest.raises(ConfigError, match=re.escape("no layer 'up4'; its layers are down0, down1, down2, down3, down4, "
                                                    "up0, up1, up2, up3, last")):
        load_config("base", overrides={"conv_forms": "up4=rewritten", "full_scale": False})
    with pytest.raises(ConfigError, match="unknown form 'fast'"):
        load_config("base", overrides={"conv_forms": "fast"})


def test_each_layer_knows_the_edge_of_its_input():
    edges = conv_input_sizes(6, 64)
    assert edges == {"down0": 64, "down1": 32, "down2": 16, "down3": 8, "down4": 4, "down5": 2,
                     "up0": 1, "up1": 2, "up2": 4, "up3": 8, "up4": 16, "last": 32}
    model = UNet([4, 8, 8])
    seen = {}
    for name, module in model.conv_layers():
        module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].shape[-1]))
    model(torch.randn(1, 4, 16, 16, 16))
    assert seen == conv_input_sizes(model.num_levels, 16) == {"down0": 16, "down1": 8, "down2": 4, "up0": 2, "up1": 4,
                                                              "last": 8}


@pytest.mark.parametrize("upsample", UPSAMPLE_MODES)
def test_compile_with_channels_last_is_refused_on_cuda_only_for_a_native_transposed_conv_on_one_voxel(
        tiny_params, upsample):
    """pytorch#171622 (torch 2.11): the compiled channels-last backward of a transposed convolution on a 1^3 input
    fails Inductor's stride check. build_training refuses exactly that, in one line, before touching the device
    (so a CPU test can ask with a CUDA device), and names the conv_forms value that avoids it."""
    from utils.distributed import DistInfo
    from train import build_training
    from networks.conv_forms import compile_channels_last_blockers
    cuda = DistInfo(device=torch.device("cuda"))
    params = tiny_params(model_channels=[4, 8, 8], data_size=8, upsample=upsample, enable_jit=True,
                         channels_last=True)   # 3 levels on 8^3 crops: up0 sees the 1^3 bottom
    with pytest.raises(ConfigError) as refused:
        build_training(params, cuda)
    assert str(refused.value) == (
        "enable_jit and channels_last together fail on CUDA for a transposed convolution on a 1^3 input (up0): a "
        "PyTorch Inductor bug (pytorch#171622, seen with torch 2.11) breaks its compiled backward; add --conv_forms "
        "up0=rewritten (the same maths as a stride-1 convolution), or drop --channels_last or --enable_jit")
    if upsample == "transposed":  # spatial parallelism shards the native forms only (and only this upsample)
        with pytest.raises(ConfigError) as refused:
            build_training(tiny_params(model_channels=[4, 8, 8], data_size=8, enable_jit=True, channels_last=True,
                                       spatial_parallel=2), cuda)
        assert str(refused.value).endswith("breaks its compiled backward; drop --channels_last or --enable_jit "
                                           "(spatial parallelism shards the native forms only)")
    model = UNet([4, 8, 8], upsample=upsample)
    for spec, blockers in (("native", ["up0"]), ("padded", ["up0"]), ("up0=rewritten", []), ("rewritten", []),
                           ("rewritten,up0=padded", ["up0"]), ("up0=matmul", []), ("up0=overlap_add", [])):
        apply_conv_forms(model, spec)
        assert compile_channels_last_blockers(model, conv_input_sizes(model.num_levels, 8)) == blockers, spec
    apply_conv_forms(model, "native")
    # a 2^3 bottom: nothing ambiguous
    assert compile_channels_last_blockers(model, conv_input_sizes(model.num_levels, 16)) == []
    state = build_training(params, DistInfo(device=torch.device("cpu")))  # the CPU compiles it (Inductor's C++)
    assert state.memory_format == torch.channels_last_3d and state.train_model is not state.model


def test_cudnn_benchmark_limit_is_a_checked_speed_knob(tiny_params):
    assert tiny_params().cudnn_benchmark_limit == 10  # PyTorch's own default
    assert tiny_params(cudnn_benchmark_limit=0).cudnn_benchmark_limit == 0
    with pytest.raises(ConfigError, match="cudnn_benchmark_limit"):
        tiny_params(cudnn_benchmark_limit=-1)
