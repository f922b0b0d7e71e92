"""Part h: benchmarks/conv_variants.py, each convolution's forward + backward time (beside it the forward alone, the
kernel time and the rate in TFLOP/s) in its native form and in the other forms of networks/conv_forms.py, the
longest kernels of the three slowest layers (which pass or copy a faster form must shorten), and whole steps with
each layer in its fastest form (where the step's time goes), with the ``--conv_forms`` value of the fastest step
and the throughput goal checked again for it.
"""
import torch

from benchmarks import conv_variants
from benchmarks.suite.settings import COMPUTE_GOAL


class ConvFormsPart:
    def conv_forms(self):
        size = dict(batch=self.size["batch"], crop=self.size["crop"], channels=self.size["channels"])
        with self.quiet():
            result = conv_variants.measure(**size, device=torch.device("cuda" if self.cuda else "cpu"),
                                           log=self.log, repeats=10 if self.cuda else 1)
        self.results["conv_forms"] = result
        worst = max(max(row["relative_error_bf16"].values()) for row in result["layers"])
        self.check("convolution forms compute the native result", worst < 0.02,
                   f"largest bf16 relative difference from the native form {worst:.1e} over "
                   f"{len(result['layers'])} layers")
        steps = result["steps"]
        self.log(f"step with every layer in its fastest form: {steps['best']['samples_per_s']:.0f} samples/s vs "
                 f"{steps['native']['samples_per_s']:.0f} native; fastest step: --conv_forms "
                 f"{result['fastest_conv_forms']}")
        if self.cuda:  # the ladder's goal again, with the convolutions in their fastest forms
            fastest = steps[result["fastest_step"]]
            self.check(f"compute-only throughput >= {COMPUTE_GOAL} samples/s with --conv_forms",
                       fastest["samples_per_s"] >= COMPUTE_GOAL,
                       f"--conv_forms {result['fastest_conv_forms']}: {fastest['samples_per_s']:.0f} samples/s "
                       f"(bf16, fused Adam, channels-last; median step)", kind="goal")
