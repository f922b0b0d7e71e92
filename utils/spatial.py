"""Spatial (domain) parallelism: one 3D crop shared by S ranks, each holding a slab along depth.

A (B, C, D, H, W) crop is cut along D into S slabs of D / S planes; rank ``index`` of the spatial group holds
planes [index * D / S, (index + 1) * D / S). Element-wise layers and the skip concatenations (on channels) act
on the slabs as they are. A convolution's output planes near a slab's faces need input planes that a
neighbour holds, so each convolution first fetches those planes (the halo) from its neighbours, then runs on
its extended slab without padding along depth:

- Conv3d(k, s, p): output plane j reads input planes s j - p ... s j - p + k - 1, so a slab's own outputs need
  ``p`` planes before it and ``k - s - p`` after it (1 and 1 for the U-Net's k4 s2 p1).
- ConvTranspose3d(k, s, p): output plane o gathers input planes i with s i + t = o + p, 0 <= t < k; a slab's own
  outputs need ``(k - 1 - p) // s`` planes before it and ``(p + s - 1) // s`` after it (1 and 1 for k4 s2 p1);
  the local transposed convolution then makes some planes the neighbours own, cropped away (``SpatialConv``).

At the crop's own faces the halo is zeros, exactly what the unsharded layer's zero padding reads; with
``periodic=True`` (whole periodic boxes) the halo wraps around, and H and W wrap too (circular padding).

Deep in the U-Net a slab becomes thinner than the halo, or a level has fewer planes than ranks. There a layer
gathers the activation whole (all-gather), runs whole, and keeps its slab of the output; an output with a depth
S does not divide stays whole (replicated) on every rank. When S divides the batch, each rank runs the whole layer
on only its B / S crops and an all-gather shares the outputs: S times less work than every rank running them all.
The layout of an activation is therefore a function of its depth T: sharded when S divides T, replicated
otherwise. A replicated tensor's gradient is partial on each rank (each rank's share of the loss); every
reduction below sums them, so parameter gradients summed over the spatial group equal the unsharded ones.

Usage (as tests/test_spatial.py puts the pieces together; train.py gets each rank's slab from its loader, whose
SplitSpec.planes are this split_depth, and lets DDP average the gradients over every rank: spatial_loss(...,
ddp=True) scales each share so that the average is the unsharded gradient)::

    spatial = spatial_mesh(S, "cpu")                     # this rank's group of the 2D mesh (data, spatial)
    shard_model(model, spatial)                          # conv layers -> SpatialConv, same parameters
    inputs, target = split_depth(inputs, spatial), split_depth(target, spatial)
    loss = spatial_loss(model(inputs), target, spatial)  # the unsharded loss's value on every rank
    loss.backward(); sum_gradients(model, spatial)
"""
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from utils import ConfigError

logger = logging.getLogger("train")

DEPTH = 2  # the sharded dimension of (B, C, D, H, W)


# --- the spatial group ----------------------------------------------------------------------------------------
_GROUPS = {}  # id(group) -> SpatialGroup: every group made, held here so that its id stays its own


@dataclass
class SpatialGroup:
    """The S ranks sharing one crop: ``index`` is this rank's slab, ``ranks`` the group's global ranks in slab
    order, ``group`` their process group (None when S = 1: nothing to exchange)."""
    size: int = 1
    index: int = 0
    ranks: list = field(default_factory=lambda: [0])
    group: object = None

    def __post_init__(self):
        _GROUPS[id(self)] = self

    def neighbour(self, step, periodic):
        """The global rank holding slab index + step (wrapping when ``periodic``), or None past the crop's face."""
        other = self.index + step
        if periodic:
            other %= self.size
        return self.ranks[other] if 0 <= other < self.size else None


def check_spatial_parallel(world_size, spatial_parallel):
    """One-line ConfigError unless spatial_parallel is a positive divisor of the world size."""
    if spatial_parallel < 1 or world_size % spatial_parallel:
        raise ConfigError(f"spatial_parallel {spatial_parallel} does not divide the world size {world_size}; launch "
                          f"a multiple of {spatial_parallel} ranks or set --spatial_parallel to a divisor of "
                          f"{world_size}")


def spatial_mesh(spatial_parallel, device_type="cpu"):
    """This rank's SpatialGroup: its row of the DeviceMesh of shape (data, spatial); the process group must exist.

    Row-major: the S ranks of one spatial group are consecutive global ranks (one node's GPUs, on NVLink). The
    mesh's data dimension needs no group of its own: DDP averages the gradients over every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    world_size = dist.get_world_size()
    check_spatial_parallel(world_size, spatial_parallel)
    mesh = init_device_mesh(device_type, (world_size // spatial_parallel, spatial_parallel),
                            mesh_dim_names=("data", "spatial"))
    group = mesh["spatial"].get_group()
    return SpatialGroup(spatial_parallel, mesh.get_local_rank("spatial"), dist.get_process_group_ranks(group), group)


# --- halo exchange --------------------------------------------------------------------------------------------
def pad_depth(x, lo, hi, periodic=False):
    """x (B, C, D, H, W) with ``lo`` planes before and ``hi`` after along D: zeros, or wrapped when periodic."""
    if periodic:
        return torch.cat([x.narrow(DEPTH, x.shape[DEPTH] - lo, lo), x, x.narrow(DEPTH, 0, hi)], DEPTH)
    return F.pad(x, (0, 0, 0, 0, lo, hi))


def _exchange(to_prev, to_next, from_prev_shape, from_next_shape, spatial, periodic, like):
    """Send ``to_prev`` to the previous slab's rank and ``to_next`` to the next one; returns (from_prev, from_next),
    zeros where there is no neighbour. The receives are posted in the order [from_next, from_prev], matching the
    peer's sends [to_prev, to_next]: with S = 2 and periodic both neighbours are one rank, and backends that match
    messages by order (NCCL ignores tags) still pair them right."""
    prev, nxt = spatial.neighbour(-1, periodic), spatial.neighbour(1, periodic)
    # gloo sends and receives host memory only (its CUDA support covers collectives such as all_reduce and
    # all_gather): CUDA halos travel through host copies. NCCL, the backend train.py gives CUDA ranks, needs none.
    wire = "cpu" if like.is_cuda and dist.get_backend(spatial.group) == "gloo" else like.device
    from_prev = like.new_zeros(from_prev_shape, device=wire)
    from_next = like.new_zeros(from_next_shape, device=wire)
    ops = []
    if prev is not None and to_prev.shape[DEPTH]:
        ops.append(dist.P2POp(dist.isend, to_prev.contiguous().to(wire), prev, spatial.group, tag=1))
    if nxt is not None and to_next.shape[DEPTH]:
        ops.append(dist.P2POp(dist.isend, to_next.contiguous().to(wire), nxt, spatial.group, tag=2))
    if nxt is not None and from_next_shape[DEPTH]:
        ops.append(dist.P2POp(dist.irecv, from_next, nxt, spatial.group, tag=1))
    if prev is not None and from_prev_shape[DEPTH]:
        ops.append(dist.P2POp(dist.irecv, from_prev, prev, spatial.group, tag=2))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return from_prev.to(like.device), from_next.to(like.device)  # no copy unless staged


def _with_depth(shape, planes):
    return shape[:DEPTH] + (planes,) + shape[DEPTH + 1:]


def _with_planes(x, planes):
    """An unfilled tensor like ``x`` (dtype, device, channels-last or contiguous) with ``planes`` along depth."""
    channels_last = x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
    return torch.empty(_with_depth(tuple(x.shape), planes), dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last_3d if channels_last else torch.contiguous_format)


# The exchange and its gradient are custom operators, so that torch.compile keeps each one as a single
# opaque call in the graph it captures: Dynamo cannot trace point-to-point sends, and a graph break at every
# exchange would split the forward into pieces that recompile for every layer. An operator's arguments are tensors
# and numbers, so it names its group by its key in _GROUPS.
@torch.library.custom_op("unet_spatial::halo_exchange", mutates_args=())
def _halo_exchange(x: torch.Tensor, lo: int, hi: int, group: int, periodic: bool) -> torch.Tensor:
    """(B, C, n, H, W) slab -> (B, C, lo + n + hi, H, W): ``lo`` planes from the previous slab, ``hi`` from the
    next, zeros past the crop's faces (or wrapped when ``periodic``)."""
    n, shape = x.shape[DEPTH], tuple(x.shape)
    # my first hi planes are the previous slab's upper halo; my last lo planes are the next slab's lower halo
    below, above = _exchange(x.narrow(DEPTH, 0, hi), x.narrow(DEPTH, n - lo, lo), _with_depth(shape, lo),
                             _with_depth(shape, hi), _GROUPS[group], periodic, x)
    out = _with_planes(x, lo + n + hi)
    for start, part in ((0, below), (lo, x), (lo + n, above)):
        out.narrow(DEPTH, start, part.shape[DEPTH]).copy_(part)
    return out


@torch.library.custom_op("unet_spatial::halo_exchange_backward", mutates_args=())
def _halo_exchange_backward(grad: torch.Tensor, lo: int, hi: int, group: int, periodic: bool) -> torch.Tensor:
    """The gradient of unet_spatial::halo_exchange: the halo planes' gradients go back to the ranks that own those
    planes and are added to theirs."""
    n = grad.shape[DEPTH] - lo - hi
    grad_x = _with_planes(grad, n).copy_(grad.narrow(DEPTH, lo, n))
    shape = tuple(grad_x.shape)
    # the lower halo's gradient belongs to the previous slab's last lo planes, the upper's to the next's first
    from_prev, from_next = _exchange(grad.narrow(DEPTH, 0, lo), grad.narrow(DEPTH, lo + n, hi),
                                     _with_depth(shape, hi), _with_depth(shape, lo), _GROUPS[group], periodic, grad)
    grad_x.narrow(DEPTH, 0, hi).add_(from_prev)
    grad_x.narrow(DEPTH, n - lo, lo).add_(from_next)
    return grad_x


# What torch.compile traces in their place: shapes and strides, no messages
_halo_exchange.register_fake(lambda x, lo, hi, group, periodic: _with_planes(x, lo + x.shape[DEPTH] + hi))
_halo_exchange_backward.register_fake(lambda grad, lo, hi, group, periodic:
                                      _with_planes(grad, grad.shape[DEPTH] - lo - hi))


def _save_halo(ctx, inputs, output):
    ctx.halo = inputs[1:]  # lo, hi, group, periodic


_halo_exchange.register_autograd(lambda ctx, grad: (_halo_exchange_backward(grad, *ctx.halo), None, None, None,
                                                    None), setup_context=_save_halo)


def halo_exchange(x, lo, hi, spatial, periodic=False):
    """(B, C, n, H, W) slab -> (B, C, lo + n + hi, H, W) by unet_spatial::halo_exchange; needs lo, hi <= the slab's
    depth (thinner slabs: SpatialConv gathers instead). One rank alone pads: zeros, or its own planes wrapped."""
    if max(lo, hi) > x.shape[DEPTH]:
        raise ValueError(f"halo of {lo}/{hi} planes is deeper than the {x.shape[DEPTH]}-plane slab")
    if spatial.size == 1:
        return pad_depth(x, lo, hi, periodic)
    return _halo_exchange(x, lo, hi, id(spatial), periodic)


# --- whole activations: gather and split ----------------------------------------------------------------------
class Gather(torch.autograd.Function):
    """Each rank's part of a tensor along ``dim`` (depth: its slab; batch: its crops) -> the whole, on every rank.

    Backward: each rank's gradient of the whole is its partial share; their sum, sliced to the rank's part, is the
    part's gradient (an all-reduce, then the own slice)."""

    @staticmethod
    def forward(ctx, x, spatial, dim):
        ctx.spatial, ctx.dim = spatial, dim
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(spatial.size)]
        dist.all_gather(pieces, x, group=spatial.group)
        return torch.cat(pieces, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.spatial.group)
        return own_part(grad, ctx.spatial, ctx.dim), None, None


def own_part(x, spatial, dim=DEPTH):
    """This rank's part of a whole tensor along ``dim`` (default: its slab of depth; size divisible by S)."""
    n = x.shape[dim] // spatial.size
    return x.narrow(dim, spatial.index * n, n)


def split_depth(x, spatial):
    """This rank's slab of a whole crop batch (B, C, D, H, W), contiguous; a one-line error unless S divides D."""
    depth = x.shape[DEPTH]
    if depth % spatial.size:
        raise ConfigError(f"crop depth {depth} is not divisible by spatial_parallel {spatial.size}; use a crop size "
                          f"(data_size) that is a multiple of {spatial.size} or a spatial_parallel dividing {depth}")
    return own_part(x, spatial).contiguous()


def gather_depth(x, spatial):
    """The whole crop batch from every rank's slab (differentiable)."""
    return x if spatial.size == 1 else Gather.apply(x, spatial, DEPTH)


# --- convolutions ---------------------------------------------------------------------------------------------
@dataclass
class LayerPlan:
    """How a SpatialConv runs at one crop depth: ``halo`` (exchange, run the slab) or ``gather`` (run whole)."""
    mode: str
    depth_in: int
    depth_out: int
    reason: str = ""


def shares_crops(batch, size):
    """Whether a layer run whole shares the work of a batch: each of the S ranks runs ``batch / S`` crops (S times
    less work than all of them on every rank) and an all-gather gives every rank every crop's output."""
    return batch % size == 0


class _Context:
    """What the sharded layers of one model share: the group, the padding, and the crop depth of this forward."""

    def __init__(self, spatial, periodic):
        self.spatial, self.periodic = spatial, periodic
        self.crop_depth = None  # the whole crop's depth of the forward pass under way
        self.probing = False  # True while the layers learn their input depths from a shape-only (meta) pass
        self.planned = set()


class SpatialConv(nn.Module):
    """A Conv3d or ConvTranspose3d run on depth slabs, holding the wrapped layer's own Parameters.

    Registered under the same names (``weight``, ``bias``) as the layer it replaces: state dicts, optimisers and
    checkpoints see the same tensors. Requires k = 2 p + s along every axis (output depth D / s or s D, so slabs
    map to slabs), dilation 1, zero padding mode and no output_padding.
    """

    def __init__(self, conv, name, context):  # conv: checked by shard_model's check_supported
        super().__init__()
        self.transposed = isinstance(conv, nn.ConvTranspose3d)
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.groups, self.in_channels, self.out_channels = conv.groups, conv.in_channels, conv.out_channels
        self.weight = conv.weight
        self.bias = conv.bias
        self.name, self.context = name, context
        self.plans = {}  # crop depth -> LayerPlan

    def halo(self, axis=0):
        """(planes before, planes after) a slab's own input that its own outputs read, along ``axis`` (0: depth)."""
        k, s, p = self.kernel_size[axis], self.stride[axis], self.padding[axis]
        if self.transposed:
            return (k - 1 - p) // s, (p + s - 1) // s
        return p, k - s - p

    def run(self, x):
        """The layer on x (B, C_in, lo + n + hi, H, W), already extended by its depth halo: (B, C_out, n_out, H', W').

        Without padding along depth (the halo is the padding). Conv: output planes are exactly the slab's own.
        Transposed: the local output's plane q is the whole layer's plane s (a - lo) + q - p, where a is the
        slab's first global input plane (plane q of the padding-free output gathers inputs i with s i + t = q,
        i counted from a - lo); the slab's own outputs s a ... s (a + n) - 1 are q = s lo + p ... s lo + p + s n - 1.
        """
        periodic = self.context.periodic
        weight, bias = self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        if x.is_meta:  # the shape-only planning pass
            weight, bias = weight.to("meta"), None if bias is None else bias.to("meta")
        if periodic:  # H and W wrap too: pad them circularly by their own halos, then no padding at all
            (lo_h, hi_h), (lo_w, hi_w) = self.halo(1), self.halo(2)
            x = F.pad(x, (lo_w, hi_w, lo_h, hi_h, 0, 0), mode="circular")
            padding = (0, 0, 0)
        else:
            padding = (0, self.padding[1], self.padding[2])
        if not self.transposed:
            return F.conv3d(x, weight, bias, self.stride, padding, groups=self.groups)
        lo = self.halo(0)[0]
        n = x.shape[DEPTH] - sum(self.halo(0))
        if (self.kernel_size[0], self.stride[0], self.padding[0]) == (4, 2, 1):
            y = self._own_planes_k4s2p1(x, weight, bias, padding, n)
        else:  # any other k = 2p + s: the local output, then the slab's own planes of it
            y = F.conv_transpose3d(x, weight, bias, self.stride, padding, groups=self.groups)
            y = y.narrow(DEPTH, self.stride[0] * lo + self.padding[0], self.stride[0] * n)
        if periodic:
            for axis, dim in ((1, 3), (2, 4)):
                s, p, lo_axis = self.stride[axis], self.padding[axis], self.halo(axis)[0]
                y = y.narrow(dim, s * lo_axis + p, s * (x.shape[dim] - sum(self.halo(axis))))
        return y

    def _own_planes_k4s2p1(self, x, weight, bias, padding, n):
        """Only the slab's own 2n output planes of a kernel-4, stride-2, padding-1 transposed convolution, none of the
        planes its neighbours own. Along depth, own output 2m + a (phase a) is x[m] w[1] + x[m - 1] w[3] (a = 0) or
        x[m + 1] w[0] + x[m] w[2] (a = 1): for each phase a kernel-2, stride-1 transposed convolution along depth
        (padding 1: no plane beyond the slab's) of the n + 1 input planes it reads, then the phases interleave.
        x: (B, C_in, 1 + n + 1, H, W) with its halo; returns (B, C_out, 2n, H', W')."""
        stride, pad = (1,) + tuple(self.stride[1:]), (1,) + tuple(padding[1:])
        # depth taps [1, 3] and [0, 2]: strided views of the weight, no gather of it every forward
        taps = ((0, slice(1, None, 2)), (1, slice(0, None, 2)))
        phases = [F.conv_transpose3d(x.narrow(DEPTH, a, n + 1), weight[:, :, depth_taps], bias, stride, pad,
                                     groups=self.groups) for a, depth_taps in taps]
        return torch.stack(phases, dim=DEPTH + 1).flatten(DEPTH, DEPTH + 1)  # planes 2m + a

    def depth_out(self, depth_in):
        return depth_in * self.stride[0] if self.transposed else depth_in // self.stride[0]

    def plan(self, depth_in):
        """LayerPlan for a whole input of ``depth_in`` planes on this group."""
        size, stride = self.context.spatial.size, self.stride[0]
        depth_out = self.depth_out(depth_in)
        lo, hi = self.halo(0)
        if depth_in % size:
            return LayerPlan("gather", depth_in, depth_out, f"its {depth_in}-plane input is whole on every rank "
                                                            f"({size} ranks do not divide it)")
        planes = depth_in // size
        if planes < max(lo, hi):
            return LayerPlan("gather", depth_in, depth_out, f"a {planes}-plane slab is thinner than its halo "
                                                            f"({lo} before, {hi} after)")
        if not self.transposed and planes % stride:
            return LayerPlan("gather", depth_in, depth_out, f"a {planes}-plane slab is not a multiple of its "
                                                            f"stride {stride}")
        return LayerPlan("halo", depth_in, depth_out)

    def probe(self, x):
        """Shape-only pass (x whole, on the meta device): record this crop depth's plan, log a switch to gather."""
        crop_depth, size = self.context.crop_depth, self.context.spatial.size
        if crop_depth in self.plans:
            raise NotImplementedError(f"{self.name} is called twice in one forward pass; spatial parallelism "
                                      f"supports each convolution once")
        plan = self.plans[crop_depth] = self.plan(x.shape[DEPTH])
        if plan.mode == "gather" and size > 1:
            batch = x.shape[0]
            crops = f"{batch // size} of the {batch} crops on each rank" if shares_crops(batch, size) else \
                f"all {batch} crops on every rank (S does not divide them)"
            planes = f"{plan.depth_in} plane{'s' * (plan.depth_in != 1)}"
            how = f"gathers its input whole ({planes} at S={size}) and runs" if plan.depth_in % size == 0 else "runs"
            logger.info(f"spatial parallel: {self.name} {how} unsharded, {crops}: {plan.reason}")
        return self.run(pad_depth(x, *self.halo(0)))

    def forward(self, x):  # x: this rank's slab (B, C_in, n, H, W), or the whole input where S does not divide it
        context = self.context
        if context.probing:
            return self.probe(x)
        spatial, plan = context.spatial, self.plans[context.crop_depth]
        if plan.mode == "halo":
            return self.run(halo_exchange(x, *self.halo(0), spatial, context.periodic))
        whole = gather_depth(x, spatial) if plan.depth_in % spatial.size == 0 else x
        if shares_crops(whole.shape[0], spatial.size):  # each rank runs its share of the crops; all get every result
            mine = pad_depth(own_part(whole, spatial, dim=0), *self.halo(0), context.periodic)
            y = Gather.apply(self.run(mine), spatial, 0)
        else:
            y = self.run(pad_depth(whole, *self.halo(0), context.periodic))
        return own_part(y, spatial) if plan.depth_out % spatial.size == 0 else y

    def extra_repr(self):
        kind = "ConvTranspose3d" if self.transposed else "Conv3d"
        return (f"{kind}({self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}), S={self.context.spatial.size}"
                + (", periodic" if self.context.periodic else ""))


# The conv_forms layers compute the plain convolution in their 'native' form (BlurredConvTranspose3d adds a blur).
_NATIVE_FORM_CLASSES = ("StridedConv3d", "StridedConvTranspose3d")


def check_supported(conv, name):
    """Raise NotImplementedError (one line) for a convolution SpatialConv cannot run exactly."""
    problems = []
    if type(conv) not in (nn.Conv3d, nn.ConvTranspose3d) and not (
            type(conv).__name__ in _NATIVE_FORM_CLASSES and getattr(conv, "form", "native") == "native"):
        problems.append(f"{type(conv).__name__}, which computes more than a plain convolution")
    if isinstance(conv.padding, str) or any(k != 2 * p + s for k, s, p in zip(conv.kernel_size, conv.stride,
                                                                               conv.padding)):
        problems.append(f"kernel {conv.kernel_size} != 2 x padding {conv.padding} + stride {conv.stride}")
    if any(d != 1 for d in conv.dilation) or conv.padding_mode != "zeros":
        problems.append("dilation or a padding mode other than zeros")
    if any(conv.output_padding):
        problems.append("output_padding")
    if problems:
        raise NotImplementedError(f"{name}: spatial parallelism does not support {'; '.join(problems)}; use "
                                  f"upsample: transposed and the default conv forms")


def shard_model(model, spatial, periodic=False):
    """Swap every Conv3d / ConvTranspose3d in ``model`` for its SpatialConv, in place; returns the model.

    The model then takes this rank's slab (B, C, D / S, H, W) and returns its slab of the output. At the first
    forward pass of each crop depth, a shape-only pass on the meta device tells every layer its input depth and
    whether it exchanges halos or gathers (logged). Other layers must act per voxel or on channels (the U-Net's
    activations, concatenations and tanh do). Parameters and state-dict keys are unchanged.
    """
    context = _Context(spatial, periodic)
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)) or hasattr(module, "transposed_weight")]
    for name, module in targets:
        if not isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
            raise NotImplementedError(f"{name}: spatial parallelism does not support {type(module).__name__}; use "
                                      f"upsample: transposed")
        check_supported(module, name)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, SpatialConv(module, name, context))
    model.register_forward_pre_hook(_plan_hook(context))
    return model


def _plan_hook(context):
    def plan_before_forward(model, args):
        if context.probing:
            return
        x = args[0]
        context.crop_depth = x.shape[DEPTH] * context.spatial.size
        if context.crop_depth in context.planned:
            return
        context.probing = True
        try:
            with torch.no_grad():
                model(torch.empty(_with_depth(tuple(x.shape), context.crop_depth), dtype=x.dtype, device="meta"))
        finally:
            context.probing = False
        context.planned.add(context.crop_depth)
    return plan_before_forward


# --- loss and gradients ---------------------------------------------------------------------------------------
class _MeanOverGroup(torch.autograd.Function):
    """The mean of one scalar over the group, on every rank; each rank's share of the gradient is 1 / S (or 1:
    ``whole_share``)."""

    @staticmethod
    def forward(ctx, value, spatial, whole_share):
        ctx.size = 1 if whole_share else spatial.size
        total = value.detach().clone()
        dist.all_reduce(total, group=spatial.group)
        return total / spatial.size

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None, None


def spatial_loss(prediction, target, spatial, loss_fn=None, ddp=False, **loss_kwargs):
    """The unsharded loss of the whole crops, from this rank's slabs (B, C, n, H, W); the same value on every rank.

    Every term of networks/UNet.py's loss_func is a mean over voxels, and the slabs are equal, so the whole loss
    is the mean of the slabs' losses. Backward leaves on each rank its slab's share of the parameter gradients:
    their sum over the spatial group is the unsharded gradient (sum_gradients). DDP over the whole (data x
    spatial) mesh averages over D x S ranks instead of summing over S: with ``ddp`` each rank's share is S times
    larger (as if the loss were multiplied by S before backward), so DDP's average is the unsharded gradient
    averaged over the D data ranks, and the loss's value stays the unsharded one.
    """
    if loss_fn is None:
        from networks.UNet import loss_func as loss_fn
    local = loss_fn(prediction, target, **loss_kwargs)
    return local if spatial.size == 1 else _MeanOverGroup.apply(local, spatial, ddp)


def sum_gradients(model, spatial):
    """Sum every parameter's gradient over the spatial group: each rank then holds the unsharded gradient."""
    if spatial.size == 1:
        return
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=spatial.group)


def check_spatial_config(params):
    """One-line ConfigError unless the config alone allows spatial parallelism (launch checks the world size)."""
    size = params.spatial_parallel
    if params.data_size % size:
        raise ConfigError(f"spatial_parallel {size} does not divide the crop depth data_size={params.data_size}; "
                          f"use a data_size that is a multiple of {size} or a spatial_parallel dividing it")
    if params.upsample != "transposed" or params.conv_forms != "native":
        raise ConfigError(f"spatial_parallel {size} shards only plain convolutions; use upsample: transposed and "
                          f"conv_forms: native (got {params.upsample}, {params.conv_forms})")
    if params.data_loader_config == "dali-lowmem":
        raise ConfigError(f"spatial_parallel {size} needs a loader that serves each rank its slab: use "
                          f"data_loader_config inmem, lowmem, gpu or synthetic instead of dali-lowmem")
