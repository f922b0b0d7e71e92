"""The tutorial's 3D U-Net: N-body fields (4 channels) in, hydro fields (5 channels) out.

Down path: Conv3d(kernel 4, stride 2, padding 1) + LeakyReLU(0.2) per level, halving the crop.
Up path: ConvTranspose3d(kernel 4, stride 2, padding 1) + ReLU, each next level concatenating the
matching down-path output (skip connection); the last transposed convolution maps to the output
channels, followed by tanh (targets are normalised into (-1, 1)).

With the default widths [64, 128, 256, 512, 512, 512] this is exactly the reference model:
116,977,029 parameters, 64^3 -> 1^3 at the bottom.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def down_conv(in_channels, out_channels):
    return nn.Sequential(
        nn.Conv3d(in_channels, out_channels, kernel_size=4, stride=2, padding=1),
        nn.LeakyReLU(negative_slope=0.2, inplace=True),
    )


def up_conv(in_channels, out_channels):
    return nn.Sequential(
        nn.ConvTranspose3d(in_channels, out_channels, kernel_size=4, stride=2, padding=1),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, channels=(64, 128, 256, 512, 512, 512), in_channels=4, out_channels=5,
                 full_scale=True):
        super().__init__()
        channels = list(channels) if full_scale else list(channels)[:-1]
        self.num_levels = len(channels)
        widths = [in_channels] + channels
        self.down = nn.ModuleList(down_conv(widths[i], widths[i + 1]) for i in range(self.num_levels))
        # Up level i produces the resolution of down level i - 1; below the bottom it sees only
        # the bottom output, above it also the concatenated skip connection.
        self.up = nn.ModuleList()
        for level in range(self.num_levels - 1, 0, -1):
            skip = 0 if level == self.num_levels - 1 else channels[level]
            self.up.append(up_conv(channels[level] + skip, channels[level - 1]))
        last_in = channels[0] + (channels[0] if self.num_levels > 1 else 0)
        self.conv_last = nn.ConvTranspose3d(last_in, out_channels, kernel_size=4, stride=2, padding=1)

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

    def init_weights(self, conv_scale=0.02, conv_bias=0.0):
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
                nn.init.normal_(module.weight, 0.0, conv_scale)
                nn.init.constant_(module.bias, conv_bias)

    def flops_per_sample(self, crop_size):
        """Multiply-adds x 2 of one forward pass on a crop_size^3 sample (convolutions only)."""
        flops, size = 0, crop_size
        for block in self.down:
            conv = block[0]
            size //= 2
            flops += 2 * conv.in_channels * conv.out_channels * 64 * size ** 3
        for block in list(self.up) + [self.conv_last]:
            conv = block[0] if isinstance(block, nn.Sequential) else block
            # A stride-2 transposed conv does kernel^3 / 8 = 8 MACs per output element per pair.
            flops += 2 * conv.in_channels * conv.out_channels * 64 * size ** 3
            size *= 2
        return flops


def build_model(params):
    model = UNet(params.model_channels, params.N_in_channels, params.N_out_channels, params.full_scale)
    model.init_weights(params.weight_init["conv_scale"], params.weight_init["conv_bias"])
    return model


def loss_func(prediction, target, lambda_rho=0.0):
    """Mean L1 over all channels, plus lambda_rho x L1 of the physical gas density exp(14 x)."""
    loss = F.l1_loss(prediction, target)
    if lambda_rho > 0:
        loss = loss + lambda_rho * F.l1_loss(torch.exp(14.0 * prediction[:, 0]), torch.exp(14.0 * target[:, 0]))
    return loss
