"""The ``fused`` form of the transposed convolutions (networks/conv_forms.py) computes the native layer, and its
Triton depth-to-space (networks/triton_interleave.py) is the sub-pixel form's interleave, bit for bit.

The Triton kernels run on the CPU in Triton's interpreter, which reads TRITON_INTERPRET when a kernel is
defined: they run in one subprocess with it set (this file run as a script), so no kernel of this process, or
of a later test, is interpreted by accident."""
import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import run_interpreted
from networks.conv_forms import (CHANNELS_LAST, _InterleavePhases, _subpixel_weight, apply_conv_forms,
                                 conv3d_fused, conv_transpose3d_fused, stride2_conv)
from networks.UNet import UNet

FORMATS = {"contiguous": torch.contiguous_format, "channels_last": CHANNELS_LAST}
BATCH, HALF = 3, 4  # an odd batch; the output is (2 HALF)^3, the phases (HALF + 1)^3


def interleave_case(c_out, phases_layout, out_layout, dtype):
    """(name, arguments) of one interpreter case."""
    return f"c_out{c_out}-phases_{phases_layout}-out_{out_layout}-{dtype}", (c_out, phases_layout, out_layout, dtype)


FORM_CASES = {f"{kind}-{layout}": {"transposed": kind == "transposed", "layout": layout}
              for kind in ("transposed", "conv") for layout in ("channels_last", "contiguous")}
INTERLEAVE_CASES = dict(
    [interleave_case(c_out, phases, out, "float32") for c_out in (5, 8) for phases in FORMATS for out in FORMATS]
    + [interleave_case(5, "channels_last", "channels_last", "bfloat16")])  # the training layout and dtype


def _reference_pass(phases, out_format, grad):
    """The sub-pixel form's interleave of ``phases`` and its phase gradient for the output gradient ``grad``."""
    phases = phases.detach().requires_grad_()
    out = _InterleavePhases.apply(phases, out_format)
    out.backward(grad)
    return out, phases.grad


def _compare(got, want):
    return {"equal": torch.equal(got, want), "same_strides": got.stride() == want.stride(),
            "max_abs_diff": (got.float() - want.float()).abs().max().item()}


def _interleave_results(c_out, phases_layout, out_layout, dtype, device="cpu"):
    """The Triton interleave (forward and backward, through autograd) against the reference, on random phases; the
    backward also for an output gradient with zero strides (what a sum's backward hands on)."""
    from networks.triton_interleave import interleave_phases
    torch.manual_seed(c_out)
    phases = torch.randn(BATCH, 8 * c_out, HALF + 1, HALF + 1, HALF + 1).to(
        device, getattr(torch, dtype), memory_format=FORMATS[phases_layout])
    results = {}
    for grad_kind in ("dense", "broadcast"):
        got_phases = phases.detach().requires_grad_()
        got = interleave_phases(got_phases, out_layout == "channels_last")
        grad = (torch.randn_like(got) if grad_kind == "dense"
                else torch.randn(BATCH, c_out, 1, 1, 1, dtype=got.dtype, device=device).expand(got.shape))
        got.backward(grad)
        want, want_grad = _reference_pass(phases, FORMATS[out_layout], grad)
        if grad_kind == "dense":
            results["forward"] = _compare(got.detach(), want.detach())
        results[f"backward_{grad_kind}"] = _compare(got_phases.grad, want_grad)
    return results


def _form_results(device="cpu", transposed=True, layout="channels_last"):
    """The fused form with its Triton kernels against the native layer (float32), forward and gradients:
    ``conv_transpose3d_fused`` against F.conv_transpose3d, or ``conv3d_fused`` against F.conv3d."""
    torch.manual_seed(1)
    edge = HALF if transposed else 2 * HALF
    x = torch.randn(BATCH, 6, edge, edge, edge, device=device).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(*((6, 5) if transposed else (5, 6)), 4, 4, 4, device=device, requires_grad=True)
    bias = torch.randn(5, device=device, requires_grad=True)
    native = F.conv_transpose3d if transposed else F.conv3d
    outputs = [(conv_transpose3d_fused if transposed else conv3d_fused)(x, weight, bias),
               native(x, weight, bias, stride=2, padding=1)]
    upstream = torch.randn_like(outputs[1])
    (got_grads, want_grads) = [torch.autograd.grad(y, (x, weight, bias), upstream) for y in outputs]
    return {"max_abs_diff": max((got - want).abs().max().item() for got, want in
                                zip((outputs[0], *got_grads), (outputs[1], *want_grads))),
            "same_layout": outputs[0].is_contiguous(memory_format=FORMATS[layout])}


def interpreter_results():
    """Every interpreter case's comparisons: {case name: {...}}; run with TRITON_INTERPRET=1."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the Triton kernels would need a GPU"
    from networks import conv_forms, triton_interleave
    results = {name: _interleave_results(*case) for name, case in INTERLEAVE_CASES.items()}
    conv_forms._use_triton = lambda x: True  # as on a GPU
    for name, case in FORM_CASES.items():
        results[name] = _form_results(**case)
    triton_interleave._needs_int64 = lambda *tensors: True  # the 64-bit index path, for tensors past 2^31 elements
    for name, case in FORM_CASES.items():
        results[f"{name}-int64_indices"] = _form_results(**case)
    return results


@pytest.fixture(scope="module")
def interpreted():
    """interpreter_results() from a subprocess with TRITON_INTERPRET=1."""
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", INTERLEAVE_CASES)
def test_triton_interleave_is_the_reference_bit_for_bit(interpreted, case):
    """Forward and backward, dense and broadcast output gradients: the same values (a permutation, and the phase
    gradient's unread border planes 0) in the layout the reference gives."""
    for check, result in interpreted[case].items():
        assert result["equal"] and result["same_strides"], (check, result)


@pytest.mark.parametrize("case", [f"{name}{suffix}" for name in FORM_CASES for suffix in ("", "-int64_indices")])
def test_fused_form_with_triton_equals_the_native_layer(interpreted, case):
    """Transposed: the depth-to-space forward, its backward for the input gradient. Convolution: the same kernels
    the other way round (space-to-depth = the depth-to-space's backward)."""
    assert interpreted[case]["max_abs_diff"] < 1e-4 and interpreted[case]["same_layout"], interpreted[case]


def test_the_convolution_padding_its_input_gives_the_padded_inputs_phases():
    """``padding=1`` in the kernel-2 convolution is the sub-pixel form's F.pad of the input: the (S + 1)^3 phases."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, 6, HALF, HALF, HALF, dtype=torch.float64)
    weight = _subpixel_weight(torch.randn(6, 5, 4, 4, 4, dtype=torch.float64))
    padded_first = F.conv3d(F.pad(x, (1, 1, 1, 1, 1, 1)), weight)
    assert padded_first.shape == (BATCH, 40, HALF + 1, HALF + 1, HALF + 1)
    torch.testing.assert_close(F.conv3d(x, weight, padding=1), padded_first, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("c_out", [5, 8])
def test_fused_form_on_the_cpu_equals_the_transposed_convolution(c_out, layout):
    """Off CUDA the fused form interleaves in PyTorch: the native layer's output, layout and gradients (float32)."""
    torch.manual_seed(c_out)
    x = torch.randn(BATCH, 6, HALF, HALF, HALF).to(memory_format=FORMATS[layout]).requires_grad_()
    weight, bias = torch.randn(6, c_out, 4, 4, 4, requires_grad=True), torch.randn(c_out, requires_grad=True)
    got = stride2_conv(x, weight, bias, transposed=True, form="fused")
    want = F.conv_transpose3d(x, weight, bias, stride=2, padding=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert got.is_contiguous(memory_format=FORMATS[layout])
    upstream = torch.randn_like(want)
    for got_grad, want_grad in zip(torch.autograd.grad(got, (x, weight, bias), upstream),
                                   torch.autograd.grad(want, (x, weight, bias), upstream)):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-4)


def test_fused_form_in_the_model():
    """Every layer fused (up0 on a 1^3 input among them) gives the native model's output and gradients (float64, on
    the CPU: the convolutions in their space-to-depth form, the transposed ones interleaved in PyTorch)."""
    torch.manual_seed(0)
    native = UNet([4, 8, 8]).to(torch.float64, memory_format=CHANNELS_LAST)
    other = copy.deepcopy(native)
    assert apply_conv_forms(other, "fused") == dict.fromkeys(["down0", "down1", "down2", "up0", "up1", "last"],
                                                             "fused")
    x = torch.randn(2, 4, 8, 8, 8, dtype=torch.float64).to(memory_format=CHANNELS_LAST)
    upstream = torch.randn(2, 5, 8, 8, 8, dtype=torch.float64)
    outputs = []
    for model in (native, other):
        outputs.append(model(x))
        (outputs[-1] * upstream).sum().backward()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-12)
    for (name, got), want in zip(other.named_parameters(), native.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-10, msg=name)


# --- on a GPU: the compiled kernels, and the form under torch.compile ---------------------------------------------
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU")


@CUDA_ONLY
@pytest.mark.parametrize("case", INTERLEAVE_CASES)
def test_triton_interleave_on_the_gpu_is_the_reference_bit_for_bit(case):
    for check, result in _interleave_results(*INTERLEAVE_CASES[case], device="cuda").items():
        assert result["equal"] and result["same_strides"], (check, result)


@CUDA_ONLY
@pytest.mark.parametrize("case", FORM_CASES)
@pytest.mark.parametrize("int64_indices", [False, True], ids=["int32", "int64"])
def test_fused_form_on_the_gpu_equals_the_native_layer(monkeypatch, case, int64_indices):
    from networks import triton_interleave
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 against float32
    if int64_indices:
        monkeypatch.setattr(triton_interleave, "_needs_int64", lambda *tensors: True)
    result = _form_results(device="cuda", **FORM_CASES[case])
    assert result["max_abs_diff"] < 1e-4 and result["same_layout"], result


@CUDA_ONLY
def test_fused_form_compiles_and_gives_the_eager_gradients():
    """torch.compile sees the Triton kernels as custom ops (their fake shapes, their autograd): the compiled model
    with every layer fused gives the eager model's output and gradients, bf16 autocast and channels-last as trained."""
    torch.manual_seed(0)
    eager = UNet([8, 16]).cuda().to(memory_format=CHANNELS_LAST)
    apply_conv_forms(eager, "fused")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    x = torch.randn(2, 4, 16, 16, 16, device="cuda").to(memory_format=CHANNELS_LAST)
    upstream = torch.randn(2, 5, 16, 16, 16, device="cuda")
    outputs = []
    for model in (eager, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs.append(model(x).float())
        (outputs[-1] * upstream).sum().backward()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=2e-2, atol=2e-2)
    for (name, got), want in zip(compiled_model.named_parameters(), eager.parameters()):
        scale = want.grad.abs().max().item()
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=3e-2 * scale, msg=name)


if __name__ == "__main__":
    print(json.dumps(interpreter_results()))
