"""Part a: the environment (torch, CUDA, cuDNN, driver, GPU; recorded whatever ``--parts`` says) and
benchmarks/kernel_probe.py: every Conv3d and ConvTranspose3d shape of the U-Net, forward and backward, in fp32,
TF32, bf16, fp16 and bf16, fp32 and TF32 channels-last, classified from the profiler's op and kernel names (cuDNN
or PyTorch's slow fallback). The slow-path check is a GPU check: on a CPU the kernel PyTorch picks depends on the
CPU's instruction set, so there the paths are reported, and only a crash fails.
"""
import json
import platform
import time

import torch

from benchmarks import kernel_probe


class ProbePart:
    def environment(self):
        env = kernel_probe.environment()
        env.update(python=platform.python_version(), numpy=__import__("numpy").__version__,
                   h5py=__import__("h5py").__version__)
        self.results["device"] = env["device"]
        self.results["versions"] = {k: env.get(k) for k in ("torch", "cuda", "cudnn", "driver", "python", "numpy",
                                                            "h5py")}
        self.results["environment"] = env
        self.log(json.dumps(env))
        return env

    def probe(self):
        env = self.environment()
        settings = dict(self.size["probe"])
        begin = time.perf_counter()
        with self.quiet():
            cases = kernel_probe.run_probe(device=torch.device("cuda" if self.cuda else "cpu"), **settings)
        (self.out / "probe.json").write_text(json.dumps({"environment": env, **settings, "cases": cases}, indent=1))
        paths = {}
        for case in cases:
            paths.setdefault(case["path"], []).append(f"{case['layer']}/{case['mode']}")
        self.results["probe"] = {"cases": len(cases), "paths": {k: len(v) for k, v in paths.items()},
                                 "not_cudnn": [name for path, names in paths.items() if path not in ("cudnn", "cpu")
                                               for name in names], "seconds": round(time.perf_counter() - begin, 1)}
        passed, detail = kernel_probe.judge(cases, on_gpu=self.cuda)
        if self.cuda:
            self.check("cuDNN for every convolution", passed, detail)
        else:  # which kernel a CPU runs depends on its instruction set: reported, not judged
            self.check("kernel probe ran", passed, detail)
            self.skip("cuDNN for every convolution", "no GPU")
