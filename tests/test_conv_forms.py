"""networks/conv_forms.py computes exactly what the U-Net's stride-2 convolutions compute, gradients included."""
import pytest
import torch
import torch.nn.functional as F

from networks.conv_forms import conv3d_s2d, conv_transpose3d_subpixel

FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last_3d}


def grads(output, inputs, seed):
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed), dtype=output.dtype)
    return torch.autograd.grad(output, inputs, upstream)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("size", [2, 4, 8])
def test_space_to_depth_conv3d_equals_the_stride_2_convolution(size, layout):
    torch.manual_seed(size)
    x = torch.randn(2, 3, size, size, size, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(5, 3, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reference = F.conv3d(x, weight, bias, stride=2, padding=1)
    rewritten = conv3d_s2d(x, weight, bias)
    assert rewritten.shape == reference.shape == (2, 5, size // 2, size // 2, size // 2)
    torch.testing.assert_close(rewritten, reference, rtol=0, atol=1e-12)
    for got, want in zip(grads(rewritten, (x, weight, bias), 1), grads(reference, (x, weight, bias), 1)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", FORMATS)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_subpixel_conv_transpose3d_equals_the_stride_2_transposed_convolution(size, layout):
    torch.manual_seed(10 + size)
    x = torch.randn(2, 6, size, size, size, dtype=torch.float64).to(memory_format=FORMATS[layout]).requires_grad_()
    weight = torch.randn(6, 5, 4, 4, 4, dtype=torch.float64, requires_grad=True)  # (C_in, C_out, k, k, k)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    reference = F.conv_transpose3d(x, weight, bias, stride=2, padding=1)
    rewritten = conv_transpose3d_subpixel(x, weight, bias)
    assert rewritten.shape == reference.shape == (2, 5, 2 * size, 2 * size, 2 * size)
    torch.testing.assert_close(rewritten, reference, rtol=0, atol=1e-12)
    for got, want in zip(grads(rewritten, (x, weight, bias), 2), grads(reference, (x, weight, bias), 2)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if layout == "channels_last" and size > 1:  # the layout the GPU path trains in is kept
        assert rewritten.is_contiguous(memory_format=torch.channels_last_3d)


def test_a_wrong_rearrangement_would_be_caught():
    """The checks above are sensitive: swapping two kernel taps changes the result far beyond the tolerance."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 4, 4, dtype=torch.float64)
    weight = torch.randn(2, 3, 4, 4, 4, dtype=torch.float64)
    swapped = weight.clone()
    swapped[..., [0, 3]] = weight[..., [3, 0]]
    error = (conv_transpose3d_subpixel(x, swapped, None) - F.conv_transpose3d(x, weight, stride=2, padding=1)).abs()
    assert error.max() > 1e-3
