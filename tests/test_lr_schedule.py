import math

import pytest

from train import initial_lr, learning_rate, warmup_steps

SQRT = {"scaling": "sqrt", "start_lr": 2e-4, "end_lr": 0.0, "warmup_steps": 128}


def test_no_scaling_at_base_batch_is_pure_cosine():
    # global == base: no warm-up even though warmup_steps is 128
    assert learning_rate(0, SQRT, 64, 64, 1000) == pytest.approx(2e-4)
    assert learning_rate(500, SQRT, 64, 64, 1000) == pytest.approx(1e-4)   # half-way: (1 + cos(pi/2)) / 2
    assert learning_rate(250, SQRT, 64, 64, 1000) == pytest.approx(2e-4 * (1 + math.sqrt(0.5)) / 2)
    assert learning_rate(1000, SQRT, 64, 64, 1000) == pytest.approx(0.0, abs=1e-15)


def test_sqrt_and_linear_scaling():
    assert initial_lr(SQRT, 256, 64) == pytest.approx(4e-4)               # sqrt(4) = 2
    assert initial_lr({**SQRT, "scaling": "linear"}, 256, 64) == pytest.approx(8e-4)
    assert initial_lr({**SQRT, "scaling": "none"}, 256, 64) == pytest.approx(2e-4)


def test_warmup_then_cosine_when_scaled_up():
    total = 1128  # 128 warm-up + 1000 decay steps
    assert learning_rate(0, SQRT, 256, 64, total) == 0.0
    assert learning_rate(64, SQRT, 256, 64, total) == pytest.approx(2e-4)   # half of 4e-4
    assert learning_rate(128, SQRT, 256, 64, total) == pytest.approx(4e-4)  # peak
    assert learning_rate(628, SQRT, 256, 64, total) == pytest.approx(2e-4)  # half-way through the decay
    assert learning_rate(total, SQRT, 256, 64, total) == pytest.approx(0.0, abs=1e-15)


def test_end_lr_and_no_warmup_without_scaling():
    schedule = {"scaling": "none", "start_lr": 1e-3, "end_lr": 1e-4, "warmup_steps": 10}
    assert learning_rate(0, schedule, 512, 64, 100) == pytest.approx(1e-3)
    assert learning_rate(50, schedule, 512, 64, 100) == pytest.approx(5.5e-4)
    assert learning_rate(100, schedule, 512, 64, 100) == pytest.approx(1e-4)


def test_a_warmup_longer_than_the_run_is_cut_to_the_run():
    """warmup_steps 128 in a 100-step run: the rate rises linearly over the 100 steps (half the peak at step 50)."""
    assert warmup_steps(SQRT, 256, 64, 100) == 100
    assert learning_rate(50, SQRT, 256, 64, 100) == pytest.approx(2e-4)     # 4e-4 x 50 / 100
    assert learning_rate(99, SQRT, 256, 64, 100) == pytest.approx(3.96e-4)


def test_a_batch_below_the_base_scales_the_rate_down_without_warmup():
    """global 16 < base 64: linear scaling gives a quarter of start_lr from step 0; warm-up is for scaling up only."""
    linear = {**SQRT, "scaling": "linear"}
    assert warmup_steps(linear, 16, 64, 1000) == 0
    assert learning_rate(0, linear, 16, 64, 1000) == pytest.approx(5e-5)
    assert learning_rate(0, SQRT, 16, 64, 1000) == pytest.approx(1e-4)        # sqrt(1/4) = 1/2
