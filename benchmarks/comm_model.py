"""How far should data-parallel training of the U-Net scale? A ring all-reduce model, checked against the reference.

    python benchmarks/comm_model.py --out benchmarks/results/comm_model.md    # the committed table, 4-512 GPUs
    python benchmarks/comm_model.py --samples_per_sec 708 --overlap 0.5 --node_bw 25   # a what-if: printed only

Per optimiser step every GPU computes its local batch, then DDP all-reduces the gradients:

    t_compute = local_batch / samples_per_sec            (measured single-GPU throughput)
    t_comm    = 2 (N-1)/N x gradient_bytes / B  +  2 (N-1) x alpha      (ring all-reduce)
    exposed   = t_comm - min(overlap x t_comm, t_backward)              (t_backward = 2/3 t_compute)
    efficiency = t_compute / (t_compute + exposed)                      (weak scaling, vs 1 GPU)

B is the ring's bottleneck bandwidth: NVLink inside one node (N <= gpus_per_node), otherwise the
node's network injection bandwidth. With one ring per NIC, each node sends 2 (N-1)/N x gradient
bytes across the network in total, the same as one GPU in a flat ring, so the node's aggregate NIC
bandwidth (Perlmutter: 4 x 25 GB/s) is the bus bandwidth. ``overlap`` is the share of the
all-reduce that DDP hides behind the backward pass (it cannot hide more than the backward time).
"""
import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from scipy.optimize import minimize_scalar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.results_file import check_outputs, command_line  # noqa: E402
from utils.arguments import at_least, fraction, positive_float, positive_int  # noqa: E402

NUM_PARAMS = 116_977_029          # the full-scale U-Net
FP32_GRAD_BYTES = 4 * NUM_PARAMS  # 467.9 MB of gradients per step; a bf16 comm hook sends half
BACKWARD_SHARE = 2 / 3            # a training step is 81.5 GFLOP/sample = 3 x the 27.2 of the forward

# Published weak-scaling efficiencies at 32 Perlmutter nodes (128 A100), by local batch size.
REFERENCE_EFFICIENCY = {64: 0.78, 128: 0.89}
REFERENCE_GPUS = 128
# The reference's single-A100 compute throughput (benchy SYNTHETIC, fully optimised), SC21 and SC22.
REFERENCE_THROUGHPUTS = (708.0, 893.0)


@dataclass(frozen=True)
class Network:
    """Bandwidths in bytes/s, latency in s. Defaults: A100 NVLink3 nodes of 4 GPUs on Slingshot-11."""
    intra_bw: float = 200e9   # NVLink-class ring bus bandwidth inside a node (assumed ~2/3 of 300 GB/s peak)
    node_bw: float = 100e9    # network injection per node: 4 NICs x 25 GB/s
    alpha: float = 5e-6       # latency per ring hop
    gpus_per_node: int = 4

    def bandwidth(self, num_gpus):
        return self.intra_bw if num_gpus <= self.gpus_per_node else self.node_bw


def ring_allreduce_time(num_bytes, num_gpus, bandwidth, alpha):
    """Seconds for a ring all-reduce of ``num_bytes`` over ``num_gpus`` (0 for one GPU)."""
    return 2 * (num_gpus - 1) / num_gpus * num_bytes / bandwidth + 2 * (num_gpus - 1) * alpha


def exposed_comm_time(t_comm, t_compute, overlap):
    """The part of the all-reduce not hidden behind the backward pass."""
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap is a fraction in [0, 1], got {overlap}")
    return t_comm - min(overlap * t_comm, BACKWARD_SHARE * t_compute)


def scaling_efficiency(num_gpus, local_batch, samples_per_sec, network=Network(), grad_bytes=FP32_GRAD_BYTES,
                       overlap=0.0):
    """Weak-scaling efficiency: throughput of ``num_gpus`` over num_gpus x the single-GPU throughput."""
    t_compute = local_batch / samples_per_sec
    t_comm = ring_allreduce_time(grad_bytes, num_gpus, network.bandwidth(num_gpus), network.alpha)
    return t_compute / (t_compute + exposed_comm_time(t_comm, t_compute, overlap))


def fit_exposed_time(samples_per_sec, reference=REFERENCE_EFFICIENCY):
    """The one exposed communication time per step (s) that best fits the published efficiencies.

    Both published points share the gradient size and GPU count, so the model gives them the same
    exposed time as long as the backward pass is long enough to hide ``overlap x t_comm``.
    """
    def squared_error(exposed):
        return sum((batch / samples_per_sec / (batch / samples_per_sec + exposed) - eff) ** 2
                   for batch, eff in reference.items())
    return minimize_scalar(squared_error, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-7}).x


def implied_bandwidth(exposed, num_gpus, overlap, alpha, grad_bytes=FP32_GRAD_BYTES):
    """Bus bandwidth (bytes/s) at which the model's exposed time equals ``exposed`` (uncapped overlap)."""
    t_comm = exposed / (1 - overlap)
    bandwidth_time = t_comm - 2 * (num_gpus - 1) * alpha
    return 2 * (num_gpus - 1) / num_gpus * grad_bytes / bandwidth_time if bandwidth_time > 0 else float("inf")


GPU_COUNTS = (4, 8, 16, 32, 64, 128, 256, 512)
COLUMNS = [(batch, precision) for batch in (64, 128) for precision in ("fp32", "bf16")]
GRAD_BYTES = {"fp32": FP32_GRAD_BYTES, "bf16": FP32_GRAD_BYTES // 2}


def projection_table(samples_per_sec, network, overlap):
    lines = ["| GPUs | nodes | all-reduce fp32 (ms) | " + " | ".join(
                 f"eff. b{batch} {precision}" for batch, precision in COLUMNS) + " |",
             "|---:|---:|---:|" + "---:|" * len(COLUMNS)]
    for num_gpus in GPU_COUNTS:
        t_comm = ring_allreduce_time(FP32_GRAD_BYTES, num_gpus, network.bandwidth(num_gpus), network.alpha)
        efficiencies = [scaling_efficiency(num_gpus, batch, samples_per_sec, network, GRAD_BYTES[precision], overlap)
                        for batch, precision in COLUMNS]
        nodes = -(-num_gpus // network.gpus_per_node)
        cells = [str(num_gpus), str(nodes), f"{1e3 * t_comm:.1f}"] + [f"{100 * e:.1f}%" for e in efficiencies]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(network, samples_per_sec, overlap):
    return (f"single-GPU compute {samples_per_sec:g} samples/s; NVLink ring {network.intra_bw / 1e9:.0f} GB/s within "
            f"a node of {network.gpus_per_node} GPUs; {network.node_bw / 1e9:.0f} GB/s per node between nodes; "
            f"alpha {network.alpha * 1e6:g} us per hop; overlap {overlap:g}")


def calibration(network):
    """Markdown: the model at the given network vs the published 128-GPU points, and what reproduces them."""
    n = REFERENCE_GPUS
    t_comm = ring_allreduce_time(FP32_GRAD_BYTES, n, network.bandwidth(n), network.alpha)
    lines = [f"Ideal ring all-reduce of the fp32 gradients on {n} GPUs at {network.node_bw / 1e9:g} GB/s per node: "
             f"{1e3 * t_comm:.1f} ms per step.", "",
             "| single-GPU samples/s | local batch | published | model, overlap 0 | fitted exposed comm (ms) | "
             "fit | implied GB/s per node at overlap 0 / 0.25 / 0.5 |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    findings = []
    for rate in REFERENCE_THROUGHPUTS:
        exposed = fit_exposed_time(rate)
        bandwidths = " / ".join(f"{implied_bandwidth(exposed, n, f, network.alpha) / 1e9:.0f}" for f in (0, 0.25, 0.5))
        worst = 0.0
        for batch, published in REFERENCE_EFFICIENCY.items():
            t_compute = batch / rate
            fitted = t_compute / (t_compute + exposed)
            worst = max(worst, abs(fitted - published))
            lines.append(f"| {rate:g} | {batch} | {100 * published:.0f}% | "
                         f"{100 * scaling_efficiency(n, batch, rate, network):.1f}% | {1e3 * exposed:.1f} | "
                         f"{100 * fitted:.1f}% | {bandwidths} |")
        if exposed > t_comm:
            verdict = (f"{exposed / t_comm:.1f}x the ideal ring time, so no overlap reproduces the published "
                       f"points at {network.node_bw / 1e9:g} GB/s per node: they need an effective bandwidth of "
                       f"{implied_bandwidth(exposed, n, 0, network.alpha) / 1e9:.0f} GB/s per node with no overlap, "
                       f"less with overlap")
        else:
            verdict = (f"{exposed / t_comm:.2f}x the ideal ring time: {network.node_bw / 1e9:g} GB/s per node with "
                       f"overlap {1 - exposed / t_comm:.2f} reproduces it")
        findings.append(f"- At {rate:g} samples/s one exposed time of {1e3 * exposed:.1f} ms per step fits both "
                        f"published points to within {100 * worst:.1f} points of efficiency; it is {verdict}.")
    return "\n".join(lines + [""] + findings + [
        "- The fitted time absorbs everything else that grows with scale (stragglers, data loading, "
        "synchronisation), so read it as an upper bound on the communication that was exposed."])


def report(samples_per_sec, network, overlap, command="python benchmarks/comm_model.py"):
    exposed = fit_exposed_time(samples_per_sec)
    calibrated = replace(network, node_bw=implied_bandwidth(exposed, REFERENCE_GPUS, 0.0, network.alpha))
    return "\n".join([
        "# Communication model: weak scaling of DDP training of the full U-Net",
        "",
        f"Generated by `{command}`. Gradients: {NUM_PARAMS:,} fp32 parameters = "
        f"{FP32_GRAD_BYTES / 1e6:.1f} MB per step (bf16 compression: {FP32_GRAD_BYTES / 2e6:.1f} MB). "
        "Efficiency is weak scaling: throughput of N GPUs over N x the single-GPU throughput. "
        "The model and its assumptions are in the module docstring.",
        "",
        f"## Nominal hardware ({describe(network, samples_per_sec, overlap)})",
        "",
        projection_table(samples_per_sec, network, overlap),
        "",
        f"## Check against the reference ({REFERENCE_GPUS} A100 on 32 Perlmutter nodes)",
        "",
        calibration(network),
        "",
        f"## Calibrated to the reference ({describe(calibrated, samples_per_sec, 0.0)})",
        "",
        projection_table(samples_per_sec, calibrated, 0.0),
        "",
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--samples_per_sec", type=positive_float, default=REFERENCE_THROUGHPUTS[1],
                        help="single-GPU compute throughput (default: the reference's SC22 A100 SYNTHETIC)")
    parser.add_argument("--intra_bw", type=positive_float, default=Network.intra_bw / 1e9,
                        help="GB/s, ring inside a node")
    parser.add_argument("--node_bw", type=positive_float, default=Network.node_bw / 1e9,
                        help="GB/s per node between nodes")
    parser.add_argument("--alpha_us", type=at_least(0.0, float), default=Network.alpha * 1e6,
                        help="latency per ring hop, us")
    parser.add_argument("--gpus_per_node", type=positive_int, default=Network.gpus_per_node)
    parser.add_argument("--overlap", type=fraction, default=0.0, help="share of the all-reduce hidden by backward")
    parser.add_argument("--out", type=Path, help="also write the report here (benchmarks/results/comm_model.md is "
                                                 "the committed one; a what-if is printed only)")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    network = Network(args.intra_bw * 1e9, args.node_bw * 1e9, args.alpha_us * 1e-6, args.gpus_per_node)
    command = command_line(__file__, argv)
    text = report(args.samples_per_sec, network, args.overlap, command)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
