"""The tutorial's 3D U-Net: N-body fields (4 channels) in, hydro fields (5 channels) out.

Down path: per level a Conv3d(kernel 4, stride 2, padding 1) and a LeakyReLU, halving the crop. The negative
slope is ``leaky_relu_slope``, 0.01 by default (PyTorch's default for nn.LeakyReLU).
Up path: per level a ConvTranspose3d(kernel 4, stride 2, padding 1) and a ReLU, doubling it; above the bottom
each level first concatenates the matching down-path output (the skip connection). The last transposed
convolution maps to the output channels, followed by tanh (targets are normalised into (-1, 1)).

With the default widths [64, 128, 256, 512, 512, 512] a 64^3 crop reaches 1^3 at the bottom, and the model has
116,977,029 parameters.

Two config keys change the layers without changing this file:
- ``upsample`` other than ``transposed`` builds the up path from networks/upsample.py's layers;
- ``conv_forms`` other than ``native`` computes the stride-2 layers in other shapes, faster on some GPUs, with
  the same parameters (networks/conv_forms.py's ``apply_conv_forms``, called by train.py's build_training).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

UPSAMPLE_MODES = ("transposed", "resize_conv", "linear_conv", "transposed_blur")


def down_conv(in_channels, out_channels, leaky_relu_slope):
    return nn.Sequential(
        nn.Conv3d(in_channels, out_channels, kernel_size=4, stride=2, padding=1),
        nn.LeakyReLU(negative_slope=leaky_relu_slope, inplace=True),
    )


def upsampler(in_channels, out_channels, upsample="transposed"):
    """The stride-2 upsampling layer of the up path."""
    if upsample == "transposed":
        return nn.ConvTranspose3d(in_channels, out_channels, kernel_size=4, stride=2, padding=1)
    from networks.upsample import upsampler as alternative_upsampler
    return alternative_upsampler(in_channels, out_channels, upsample)


def up_conv(in_channels, out_channels, upsample):
    return nn.Sequential(
        upsampler(in_channels, out_channels, upsample),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, channels=(64, 128, 256, 512, 512, 512), in_channels=4, out_channels=5,
                 full_scale=True, leaky_relu_slope=0.01, upsample="transposed"):
        super().__init__()
        if upsample not in UPSAMPLE_MODES:
            raise ValueError(f"upsample must be one of {', '.join(UPSAMPLE_MODES)}, got {upsample!r}")
        channels = list(channels) if full_scale else list(channels)[:-1]
        self.num_levels = len(channels)
        self.upsample = upsample
        widths = [in_channels] + channels
        self.down = nn.ModuleList(down_conv(widths[i], widths[i + 1], leaky_relu_slope)
                                  for i in range(self.num_levels))
        # up{k} doubles the resolution of down level L-1-k's output to level L-2-k's; up0 sees only the bottom
        # output, each later one also the skip connection concatenated after the block before it (L: num_levels).
        self.up = nn.ModuleList()
        for level in range(self.num_levels - 1, 0, -1):
            skip = 0 if level == self.num_levels - 1 else channels[level]
            self.up.append(up_conv(channels[level] + skip, channels[level - 1], upsample))
        last_in = channels[0] + (channels[0] if self.num_levels > 1 else 0)
        self.conv_last = upsampler(last_in, out_channels, upsample)

    def forward(self, x):  # x: (B, C_in, S, S, S) with S divisible by 2^num_levels
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)  # level i: (B, channels[i], S / 2^(i+1), ...)
        skips.pop()  # the bottom output is x itself
        for block in self.up:
            x = block(x)
            x = torch.cat([x, skips.pop()], dim=1)
        return torch.tanh(self.conv_last(x))  # (B, C_out, S, S, S)

    def conv_layers(self):
        """[(name, layer)] of the stride-2 (transposed) convolutions in forward order, named as ``conv_layer_names``."""
        layers = [block[0] for block in self.down] + [block[0] for block in self.up] + [self.conv_last]
        return list(zip(conv_layer_names(self.num_levels), layers))

    def init_weights(self, conv_scale=0.02, conv_bias=0.0):
        for _, layer in self.conv_layers():
            nn.init.normal_(layer.weight, 0.0, conv_scale)
            nn.init.constant_(layer.bias, conv_bias)


def conv_layer_names(num_levels):
    """The names of a ``num_levels``-level U-Net's stride-2 layers in forward order: down0, ..., up0, ..., last."""
    return [f"down{i}" for i in range(num_levels)] + [f"up{i}" for i in range(num_levels - 1)] + ["last"]


def conv_input_sizes(num_levels, crop_size):
    """{layer name: edge of the input it sees} on a crop_size^3 sample: down{i} sees crop_size / 2^i, up0 the
    bottom (1 for the default model on 64^3 crops), each later up layer twice the edge of the one before, and last
    crop_size / 2."""
    edges = [crop_size // 2 ** i for i in range(num_levels)]                     # down0 .. down{L-1}
    edges += [crop_size // 2 ** (num_levels - k) for k in range(num_levels - 1)]  # up0 (the bottom) .. up{L-2}
    edges.append(crop_size // 2)                                                  # last
    return dict(zip(conv_layer_names(num_levels), edges))


def build_model(params):
    model = UNet(params.model_channels, params.N_in_channels, params.N_out_channels, params.full_scale,
                 leaky_relu_slope=params.leaky_relu_slope, upsample=params.upsample)
    model.init_weights(params.weight_init["conv_scale"], params.weight_init["conv_bias"])
    return model


def loss_func(prediction, target, lambda_rho=0.0):
    """Mean L1 over all channels, plus lambda_rho x L1 of the physical gas density exp(14 x)."""
    loss = F.l1_loss(prediction, target)
    if lambda_rho > 0:
        loss = loss + lambda_rho * F.l1_loss(torch.exp(14.0 * prediction[:, 0]), torch.exp(14.0 * target[:, 0]))
    return loss
