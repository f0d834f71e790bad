"""Price tables, per-device peaks, MFU and the running cost tracker."""

from __future__ import annotations

import pytest

from raytrn.tracking.cost import PRICES_USD_PER_HOUR, CostTracker, mfu, peak_flops_per_worker, usd_per_hour


def test_mfu_matches_aws_llama31_8b_figure():
    # AWS: Llama-3.1-8B on 32 trn1.32xlarge, 47.95 seq/s at 8192 tokens; 57.91 GFLOPs/token (train).
    peak = peak_flops_per_worker("neuron", "trn1.32xlarge")
    assert peak == 95e12
    value = mfu(47.95 * 8192, 57.91e9, num_workers=32 * 32, peak_per_worker=peak)
    assert value == pytest.approx(47.95 * 8192 * 57.91e9 / (1024 * 95e12))
    assert value == pytest.approx(0.2338, abs=1e-4)


def test_peak_flops_per_worker():
    assert peak_flops_per_worker("neuron", "trn1n.32xlarge") == 95e12
    assert peak_flops_per_worker("neuron-xla", None) == 95e12  # the XLA path: trn1 by default
    assert peak_flops_per_worker("neuron", "trn2.48xlarge") == pytest.approx(2 * 667e12 / 8)
    assert peak_flops_per_worker("neuron", "trn2.48xlarge", lnc=1) == pytest.approx(667e12 / 8)
    assert peak_flops_per_worker("neuron", "trn2u.48xlarge") == pytest.approx(2 * 667e12 / 8)  # UltraServer member
    assert peak_flops_per_worker("neuron-xla", "trn1.32xlarge") == 95e12  # the frozen XLA path, same trn1 cores
    assert peak_flops_per_worker("neuron", None) == pytest.approx(2 * 667e12 / 8)  # TorchNeuron: trn2 by default
    # Trainium3 (UNCONFIRMED per core): 671 dense BF16 TFLOPS a chip of 8 NeuronCore-v4, at LNC 2 by default.
    assert peak_flops_per_worker("neuron", "trn3.48xlarge") == pytest.approx(2 * 671e12 / 8)
    assert peak_flops_per_worker("neuron", "trn3.48xlarge", lnc=1) == pytest.approx(671e12 / 8)
    assert peak_flops_per_worker("neuron", "trn3p.48xlarge", lnc=2) == pytest.approx(2 * 671e12 / 8)
    assert peak_flops_per_worker("neuron", "trn3e.24xlarge") == pytest.approx(2 * 671e12 / 8)
    assert peak_flops_per_worker("cuda", "p4d.24xlarge") == 312e12
    assert peak_flops_per_worker("cuda", "p5.48xlarge") == 989e12
    assert peak_flops_per_worker("cuda", "p5en.48xlarge") == 989e12
    assert peak_flops_per_worker("cuda", None, gpu="NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_per_worker("cuda", "g5.xlarge") is None
    assert peak_flops_per_worker("cuda", None) is None
    assert peak_flops_per_worker("neuron", "m5.large") is None
    assert peak_flops_per_worker("cpu", "m5.large") is None


def test_mfu_unknown_peak_or_no_workers():
    assert mfu(1000.0, 1e9, 8, None) is None
    assert mfu(1000.0, 1e9, 0, 1e12) is None


def test_usd_per_hour_precedence():
    assert usd_per_hour("trn1.32xlarge") == 21.50
    assert usd_per_hour("trn1.2xlarge") == 1.34
    assert usd_per_hour("trn1n.32xlarge") == 24.78
    assert usd_per_hour("trn2.48xlarge") == 46.98  # on demand, us-east-1
    assert usd_per_hour("trn2u.48xlarge") is None  # capacity reservations only: set tracking.usd_per_hour
    for trn3 in ("trn3.48xlarge", "trn3p.48xlarge", "trn3e.24xlarge"):
        assert usd_per_hour(trn3) is None  # no public price (capacity reservations): set tracking.usd_per_hour
        assert usd_per_hour(trn3, override=40.0) == 40.0
    assert usd_per_hour("trn1.32xlarge", override=20.0) == 20.0
    assert usd_per_hour("trn1.32xlarge", override=20.0, spot_price=7.5) == 7.5
    assert usd_per_hour("x9.huge") is None
    assert usd_per_hour(None) is None
    assert usd_per_hour(None, override=3.0) == 3.0
    assert all(price > 0 for price in PRICES_USD_PER_HOUR.values())


def test_cost_tracker_running_cost():
    tracker = CostTracker(usd_per_hour_per_node=21.50, num_nodes=4)
    first = tracker.update(elapsed_s=1800.0, tokens=1_000_000)
    assert first["cost_usd"] == pytest.approx(43.0)
    assert first["usd_per_1m_tokens"] == pytest.approx(43.0)
    assert first["tokens_per_usd"] == pytest.approx(1_000_000 / 43.0)
    second = tracker.update(elapsed_s=3600.0, tokens=4_000_000)
    assert second["cost_usd"] == pytest.approx(86.0)
    assert second["usd_per_1m_tokens"] == pytest.approx(21.5)
    assert tracker.cost_usd == pytest.approx(86.0)


def test_cost_tracker_zero_tokens_and_unknown_price():
    tracker = CostTracker(usd_per_hour_per_node=1.34, num_nodes=1)
    assert tracker.update(elapsed_s=0.0, tokens=0) == {"cost_usd": 0.0}
    out = tracker.update(elapsed_s=3600.0, tokens=0)
    assert out == {"cost_usd": pytest.approx(1.34)}
    assert CostTracker(usd_per_hour_per_node=None, num_nodes=2).update(elapsed_s=60.0, tokens=100) == {}
