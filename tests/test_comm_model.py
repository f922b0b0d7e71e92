"""benchmarks/comm_model.py against hand-computed numbers."""
import pytest

from benchmarks.comm_model import (FP32_GRAD_BYTES, Network, fit_exposed_time, implied_bandwidth,
                                   ring_allreduce_time, scaling_efficiency)

# 8 GPUs on 2 nodes at 50 GB/s per node, no latency: t_comm = 2 x 7/8 x 400 MB / 50 GB/s = 14 ms.
TWO_NODES = Network(intra_bw=200e9, node_bw=50e9, alpha=0.0, gpus_per_node=4)


def test_ring_allreduce_time_has_bandwidth_and_latency_terms():
    # 2 x 3/4 x 400 MB / 100 GB/s = 6 ms, plus 2 x 3 hops x 1 us
    assert ring_allreduce_time(400e6, 4, 100e9, 1e-6) == pytest.approx(6.006e-3, rel=1e-12)
    assert ring_allreduce_time(400e6, 1, 100e9, 1e-6) == 0


def test_full_model_gradients_are_468_mb():
    assert FP32_GRAD_BYTES == 467_908_116


@pytest.mark.parametrize("overlap, local_batch, expected", [
    (0.0, 64, 0.1 / 0.114),     # compute 64 / 640 = 100 ms, all 14 ms exposed
    (0.5, 64, 0.1 / 0.107),     # half of it hidden behind backward
    (1.0, 6.4, 0.01 / (0.01 + 0.014 - 0.01 * 2 / 3)),  # backward (6.7 ms) is too short to hide all 14 ms
])
def test_scaling_efficiency_between_nodes(overlap, local_batch, expected):
    assert scaling_efficiency(8, local_batch, 640.0, TWO_NODES, 400e6, overlap) == pytest.approx(expected, rel=1e-9)


def test_one_node_uses_the_nvlink_bandwidth():
    # 2 x 3/4 x 400 MB / 200 GB/s = 3 ms
    assert scaling_efficiency(4, 64, 640.0, TWO_NODES, 400e6) == pytest.approx(0.1 / 0.103, rel=1e-9)


def test_default_network_at_the_reference_scale():
    # 128 GPUs, 100 GB/s per node, 5 us per hop: 2 x 127/128 x 467.9 MB / 100 GB/s + 254 x 5 us = 10.555 ms;
    # compute 64 / 893 = 71.67 ms -> 87.2%, below the published 78%: see the calibration in the report.
    t_comm = 2 * 127 / 128 * 467_908_116 / 100e9 + 254 * 5e-6
    assert t_comm == pytest.approx(10.555e-3, rel=1e-4)
    assert scaling_efficiency(128, 64, 893.0) == pytest.approx(0.8716, abs=1e-4)


def test_bf16_compression_halves_the_bandwidth_time():
    fp32 = ring_allreduce_time(FP32_GRAD_BYTES, 16, 100e9, 0.0)
    assert ring_allreduce_time(FP32_GRAD_BYTES // 2, 16, 100e9, 0.0) == pytest.approx(fp32 / 2)


def test_fit_recovers_a_known_exposed_time():
    # 20 ms exposed at 640 samples/s: 100 ms -> 83.3% (batch 64), 200 ms -> 90.9% (batch 128)
    reference = {64: 0.1 / 0.12, 128: 0.2 / 0.22}
    assert fit_exposed_time(640.0, reference) == pytest.approx(0.02, abs=1e-6)


def test_implied_bandwidth_inverts_the_ring_time():
    exposed = ring_allreduce_time(FP32_GRAD_BYTES, 128, 40e9, 5e-6) * (1 - 0.25)
    assert implied_bandwidth(exposed, 128, 0.25, 5e-6) == pytest.approx(40e9, rel=1e-9)


def test_overlap_must_be_a_fraction():
    with pytest.raises(ValueError, match="overlap is a fraction in"):
        scaling_efficiency(8, 64, 640.0, TWO_NODES, 400e6, overlap=1.5)
