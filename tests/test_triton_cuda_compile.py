"""Every Triton kernel of the GPU path compiles without spilling for the GPUs this tutorial runs on: the A100
(sm_80, Perlmutter's) and the H100 and H200 (sm_90). Checked in CI, where there is no GPU.

test_fused_interleave.py and test_triton_gather.py check what the kernels compute, in Triton's interpreter. The
interpreter runs a kernel's blocks as numpy arrays and never lowers them, so a kernel it runs may still fail to
compile for a GPU, or spill registers to local memory there. Here the kernels go through their own launch path
(networks/triton_interleave.py's custom ops, utils/data/triton_gather.py's ``transform_triton``), so they get the
argument specialisation a GPU launch gives them, with CPU tensors and a stand-in for Triton's CUDA driver. The
stand-in reports the GPU's target, so Triton compiles each kernel to a cubin with the ptxas its wheel ships. It
reads the cubin's registers and local memory with the wheel's cuobjdump and skips the launch. Triton itself still
checks shared memory and threads against the limits the GPU reports (per block, and 1024 threads).

The shapes are the default model's at 64^3 crops, batch 1 (the batch enters only the grid), in the forms that
call the kernels: ``fused`` for down0, down1, up3, up4 and last, in bf16 channels-last as the ``*_opt`` configs
run, and `last` in fp32 contiguous; the GPU loader's gather for both volumes.

The stand-in driver must never be active in a process that launches kernels, so the cases run in a subprocess
(this file run as a script). CI's Triton (requirements-dev.txt) need not be a GPU machine's; to check another
release, install it apart and put it first on the path:

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36:. python tests/test_triton_cuda_compile.py    # each GPU's kernels, as JSON

tests/test_gpu.py runs the kernels on a GPU.
"""
import json
import os
import re
import subprocess
import tempfile

import pytest
import torch

from conftest import run_triton_script

# target: (compute capability, cudaDevAttrMaxSharedMemoryPerBlockOptin in bytes)
TARGETS = {"sm_80": (80, 166912),   # A100: 163 KB
           "sm_90": (90, 232448)}   # H100, H200: 227 KB
FUSED_LAYERS = ("down0", "down1", "up3", "up4", "last")
CROP = 64
GATHER_CASES = {  # name: (channels, storage dtype, layout, planes): the loader's 4 input and 5 target channels
    "gather-inp-fp16-channels_last": (4, torch.float16, torch.channels_last_3d, None),
    "gather-tar-fp16-channels_last": (5, torch.float16, torch.channels_last_3d, None),
    "gather-tar-fp32-contiguous": (5, torch.float32, torch.contiguous_format, None),
    "gather-tar-fp16-channels_last-slab": (5, torch.float16, torch.channels_last_3d, (16, 32)),
}


def install_cuda_driver():
    """Make Triton compile for a CUDA target and skip launches. Returns (the stand-in, whose ``target`` names the
    GPU compiled for, and the list each compiled kernel's resources are appended to, in compilation order)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    compiled = []

    class Utils:
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": TARGETS[stand_in.target][1], "multiprocessor_count": 108}

        @staticmethod
        def load_binary(name, cubin, shared, device):
            """What the CUDA driver's load returns: (module, function, registers, spilled bytes, max threads)."""
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True,
                                       check=True).stdout
            registers, stack, local = (int(re.search(rf"\b{key}:(\d+)", usage).group(1))
                                       for key in ("REG", "STACK", "LOCAL"))
            # Spilled registers live in the stack frame: the driver's local size counts both
            compiled.append({"name": name, "arch": stand_in.loading, "registers": registers,
                             "local_bytes": stack + local, "shared_bytes": shared})
            return None, None, registers, stack + local, 1024

    class StandIn:
        utils = Utils()
        target = "sm_90"

        def get_current_target(self):
            return GPUTarget("cuda", TARGETS[self.target][0], 32)

        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device=None):
            return 0

        def launcher_cls(self, src, metadata):
            self.loading = metadata.target.arch  # what it was compiled for, read back in load_binary
            return lambda *args: None  # compiled and loaded, never launched

    stand_in = StandIn()
    driver.set_active(stand_in)
    return stand_in, compiled


def model_layers():
    """{name: (transposed, c_in, c_out, input edge)} of the default model's stride-2 layers at CROP^3 crops."""
    from networks.UNet import build_model, conv_input_sizes
    from utils.config import load_config
    with torch.device("meta"):
        model = build_model(load_config("bs64_opt"))
    edges = conv_input_sizes(model.num_levels, CROP)
    return {name: (isinstance(layer, torch.nn.ConvTranspose3d), layer.in_channels, layer.out_channels, edges[name])
            for name, layer in model.conv_layers()}


def interleave_cases(layers):
    """{case: thunk}: each fused layer's two kernels (forward and its gradient) at its shapes."""
    from networks.triton_interleave import interleave_phases, interleave_phases_backward, space_to_depth

    def empty(shape, dtype, channels_last):
        return torch.empty(shape, dtype=dtype).contiguous(
            memory_format=torch.channels_last_3d if channels_last else torch.contiguous_format)

    cases = {}
    for name in FUSED_LAYERS:
        transposed, c_in, c_out, s = layers[name]
        for dtype, channels_last in ((torch.bfloat16, True),) + (((torch.float32, False),) if name == "last" else ()):
            key = f"{name}-{str(dtype)[6:]}-{'channels_last' if channels_last else 'contiguous'}"
            if transposed:  # phases (1, 8 C_out, S + 1, ...) -> output (1, C_out, 2S, ...), and back
                cases[key] = [lambda s=s, c=c_out, d=dtype, cl=channels_last: interleave_phases(
                                  empty((1, 8 * c, s + 1, s + 1, s + 1), d, cl), cl),
                              lambda s=s, c=c_out, d=dtype, cl=channels_last: interleave_phases_backward(
                                  empty((1, c, 2 * s, 2 * s, 2 * s), d, cl), cl)]
            else:  # input (1, C_in, S, ...) -> blocks (1, 8 C_in, S/2 + 1, ...), and back
                h = s // 2
                cases[key] = [lambda s=s, c=c_in, d=dtype, cl=channels_last: space_to_depth(
                                  empty((1, c, s, s, s), d, cl), cl),
                              lambda h=h, c=c_in, d=dtype, cl=channels_last: interleave_phases(
                                  empty((1, 8 * c, h + 1, h + 1, h + 1), d, cl), cl)]
    return cases


def gather_cases():
    """{case: thunk}: the GPU loader's gather of one batch (every symmetry element) from an 80^3 box."""
    from utils.data.symmetry_torch import element_table
    from utils.data.triton_gather import transform_triton
    cases = {}
    for key, (channels, dtype, layout, planes) in GATHER_CASES.items():
        volume = torch.zeros((channels, 80, 80, 80), dtype=dtype)
        table = element_table(channels).to("cpu")
        corners = torch.zeros((48, 3), dtype=torch.long)
        cases[key] = [lambda v=volume, t=table, c=corners, m=layout, p=planes: transform_triton(
            v, torch.arange(48), c, CROP, t, m, p)]
    return cases


def spill_probe_case():
    """{case: thunk}: a kernel that must spill, which shows that the stand-in's reading of the cubin sees spills:
    one warp scales 16,384 values by their sum, so each thread holds its 512 across the reduction."""
    import triton
    import triton.language as tl

    @triton.jit
    def _spilling_kernel(source, target, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        x = tl.load(source + offsets)
        tl.store(target + offsets, x * tl.sum(x, axis=0))

    x = torch.zeros(16384)
    return {"spill-probe": [lambda: _spilling_kernel[(1,)](x, x, BLOCK=x.numel(), num_warps=1)]}


def compile_results():
    """{target: {case: [each kernel it loaded: name, registers, local and shared bytes]}}."""
    import networks.triton_interleave as interleave
    import utils.data.triton_gather as gather
    stand_in, compiled = install_cuda_driver()
    cases = {**interleave_cases(model_layers()), **gather_cases(), **spill_probe_case()}
    results = {}
    for stand_in.target in TARGETS:
        results[stand_in.target] = {}
        for case, thunks in cases.items():
            # Forget what is compiled: two layers may share a specialisation, and each target compiles its own
            for kernel in (interleave._interleave_kernel, interleave._interleave_backward_kernel,
                           gather._crops_kernel):
                kernel.device_caches.clear()
            before = len(compiled)
            for thunk in thunks:
                thunk()
            results[stand_in.target][case] = compiled[before:]
    return results


@pytest.fixture(scope="module")
def compiled():
    return run_triton_script(__file__)


ALL_CASES = [f"{name}-bfloat16-channels_last" for name in FUSED_LAYERS] + ["last-float32-contiguous",
                                                                          *GATHER_CASES]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_the_kernel_compiles_without_spilling(compiled, target, case):
    kernels = compiled[target][case]
    names = ["_crops_kernel"] if case.startswith("gather") else ["_interleave_backward_kernel",
                                                                   "_interleave_kernel"]
    assert sorted(k["name"] for k in kernels) == names, kernels  # a fresh specialisation per pass: compiled
    assert {k["arch"] for k in kernels} == {TARGETS[target][0]}, kernels
    for kernel in kernels:
        assert kernel["local_bytes"] == 0, f"{kernel['name']} spills registers on {target}: {kernel}"
        assert 0 < kernel["registers"] <= 255 and kernel["shared_bytes"] <= TARGETS[target][1], kernel


@pytest.mark.parametrize("target", TARGETS)
def test_a_kernel_that_spills_is_seen_to_spill(compiled, target):
    [probe] = compiled[target]["spill-probe"]
    assert probe["name"] == "_spilling_kernel" and probe["local_bytes"] > 1000, probe


def test_the_cases_cover_every_triton_kernel():
    """A new kernel in either module needs a case here."""
    import networks.triton_interleave as interleave
    import utils.data.triton_gather as gather
    pytest.importorskip("triton")
    kernels = {name for module in (interleave, gather) for name, value in vars(module).items()
               if name.endswith("_kernel") and hasattr(value, "warmup")}
    assert kernels == {"_interleave_kernel", "_interleave_backward_kernel", "_crops_kernel"}


if __name__ == "__main__":
    print(json.dumps(compile_results()))
