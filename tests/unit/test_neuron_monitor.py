"""The neuron-monitor report parser and the subprocess wrapper (with a fake neuron-monitor on PATH)."""

from __future__ import annotations

import copy
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from raytrn.tracking.neuron_monitor import NeuronMonitor, iter_reports, parse_report

FIXTURE = Path(__file__).parent.parent / "fixtures" / "neuron-monitor-report.json"


@pytest.fixture
def report() -> dict:
    return json.loads(FIXTURE.read_text())


def test_parse_report_exact(report):
    assert parse_report(report) == {
        "system/neuroncore_0_utilization_percentage": 91.5,
        "system/neuroncore_1_utilization_percentage": 88.0,
        "system/neuroncore_2_utilization_percentage": 72.25,
        "system/neuroncore_3_utilization_percentage": 60.25,
        "system/neuroncore_utilization_percentage": 78.0,
        "system/neuroncores_in_use": 4.0,
        "system/neuron_device_memory_used_bytes": 17179869184.0,
        "system/neuron_host_memory_used_bytes": 612368384.0,
        "system/neuron_devices": 16.0,
    }


def test_parse_report_two_runtimes_take_max_core_and_sum_memory(report):
    other = copy.deepcopy(report["neuron_runtime_data"][0])
    other["pid"] = 999
    other["report"]["neuroncore_counters"]["neuroncores_in_use"] = {
        "3": {"neuroncore_utilization": 99.75},
        "10": {"neuroncore_utilization": 10.0},
    }
    report["neuron_runtime_data"].append(other)
    metrics = parse_report(report)
    assert metrics["system/neuroncore_3_utilization_percentage"] == 99.75
    assert metrics["system/neuroncore_10_utilization_percentage"] == 10.0
    assert metrics["system/neuroncores_in_use"] == 5.0
    assert metrics["system/neuroncore_utilization_percentage"] == pytest.approx((91.5 + 88 + 72.25 + 99.75 + 10) / 5)
    assert metrics["system/neuron_device_memory_used_bytes"] == 2 * 17179869184.0
    keys = [k for k in metrics if k.startswith("system/neuroncore_") and k.endswith("_utilization_percentage")]
    assert keys[:5] == [f"system/neuroncore_{i}_utilization_percentage" for i in (0, 1, 2, 3, 10)]


def test_parse_report_error_and_missing_sections(report):
    runtime = report["neuron_runtime_data"][0]["report"]
    runtime["neuroncore_counters"]["error"] = "failed to read counters"
    runtime["memory_used"] = "garbage"
    report["neuron_hardware_info"] = {"error": "no driver"}
    assert parse_report(report) == {"system/neuroncores_in_use": 0.0}

    assert parse_report({}) == {"system/neuroncores_in_use": 0.0}
    assert parse_report({"neuron_runtime_data": [{"pid": 1, "error": "runtime gone"}, None, 3]}) == {
        "system/neuroncores_in_use": 0.0
    }
    assert parse_report({"neuron_runtime_data": "x", "neuron_hardware_info": []}) == {"system/neuroncores_in_use": 0.0}
    weird = {"neuron_runtime_data": [{"report": {"neuroncore_counters": {"neuroncores_in_use": {"0": "x", "1": {}}}}}]}
    assert parse_report(weird) == {"system/neuroncores_in_use": 0.0}
    assert parse_report([]) == {}  # type: ignore[arg-type]


def test_iter_reports_skips_malformed_lines(report):
    lines = ["", "not json", json.dumps(report), "[1, 2]", '{"truncated": ', json.dumps({"a": 1}) + "\n"]
    docs = list(iter_reports(lines))
    assert docs == [report, {"a": 1}]


def _fake_neuron_monitor(tmp_path: Path, report: dict) -> Path:
    second = copy.deepcopy(report)
    second["neuron_runtime_data"][0]["report"]["neuroncore_counters"]["neuroncores_in_use"]["0"][
        "neuroncore_utilization"
    ] = 12.5
    script = tmp_path / "bin" / "neuron-monitor"
    script.parent.mkdir()
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"print({json.dumps(report)!r}, flush=True)\n"
        "print('garbage', flush=True)\n"
        f"print({json.dumps(second)!r}, flush=True)\n"
        "time.sleep(60)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_neuron_monitor_subprocess(tmp_path, monkeypatch, report):
    monkeypatch.setenv("PATH", f"{_fake_neuron_monitor(tmp_path, report)}{os.pathsep}{os.environ['PATH']}")
    monitor = NeuronMonitor.start()
    assert monitor is not None
    try:
        deadline = time.monotonic() + 10
        while monitor.latest().get("system/neuroncore_0_utilization_percentage") != 12.5:
            assert time.monotonic() < deadline, monitor.latest()
            time.sleep(0.05)
        latest = monitor.latest()
        assert latest["system/neuroncores_in_use"] == 4.0
        assert latest["system/neuron_devices"] == 16.0
    finally:
        monitor.close()
    assert monitor._proc.returncode is not None
    assert not _alive(monitor.pid)


def test_neuron_monitor_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert NeuronMonitor.start() is None
