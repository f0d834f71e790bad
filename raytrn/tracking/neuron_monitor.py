"""NeuronCore utilisation and device memory from ``neuron-monitor``, as MLflow system metrics.

``neuron-monitor`` prints one JSON report per period on stdout (AWS Neuron docs, "neuron-monitor User
Guide"): ``neuron_runtime_data`` (one entry per Neuron runtime, i.e. per process, each with a ``report``
holding ``neuroncore_counters`` and ``memory_used``), ``system_data``, ``neuron_hardware_info`` and
``instance_info``. Any section may carry an ``error`` string instead of data; the parser skips what it
cannot read and never raises, so a monitoring hiccup never stops training.
"""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from raytrn import jsonfile

log = logging.getLogger(__name__)

PREFIX = "system/"


def _num(value: Any) -> float | None:
    """A finite number from the report, else None (a bool, a string, NaN, or an integer beyond float range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _section(parent: Any, key: str) -> dict[str, Any] | None:
    """``parent[key]`` when it is a dict without an ``error``; None otherwise."""
    if not isinstance(parent, dict):
        return None
    value = parent.get(key)
    if not isinstance(value, dict) or value.get("error"):
        return None
    return value


def parse_report(doc: dict[str, Any]) -> dict[str, float]:
    """MLflow-ready metrics from one ``neuron-monitor`` report; missing or errored sections are skipped.

    A core reported by several runtimes counts once, at its highest utilisation. Memory is summed over
    runtimes (each runtime reports its own allocations).
    """
    metrics: dict[str, float] = {}
    if not isinstance(doc, dict):
        return metrics
    util: dict[str, float] = {}
    device_bytes = host_bytes = 0.0
    saw_memory = False
    runtimes = doc.get("neuron_runtime_data")
    for runtime in runtimes if isinstance(runtimes, list) else []:
        if not isinstance(runtime, dict) or runtime.get("error"):
            continue
        report = runtime.get("report")
        counters = _section(report, "neuroncore_counters")
        cores = _section(counters, "neuroncores_in_use") if counters else None
        for index, core in (cores or {}).items():
            value = _num(core.get("neuroncore_utilization")) if isinstance(core, dict) else None
            if value is not None:
                util[str(index)] = max(value, util.get(str(index), value))
        memory = _section(report, "memory_used")
        used = _section(memory, "neuron_runtime_used_bytes") if memory else None
        if used:
            device, host = _num(used.get("neuron_device")), _num(used.get("host"))
            if device is not None:
                device_bytes += device
                saw_memory = True
            if host is not None:
                host_bytes += host
                saw_memory = True
    for index in sorted(util, key=lambda i: (len(i), i)):
        metrics[f"{PREFIX}neuroncore_{index}_utilization_percentage"] = util[index]
    if util:
        metrics[f"{PREFIX}neuroncore_utilization_percentage"] = sum(util.values()) / len(util)
    metrics[f"{PREFIX}neuroncores_in_use"] = float(len(util))
    if saw_memory:
        metrics[f"{PREFIX}neuron_device_memory_used_bytes"] = device_bytes
        metrics[f"{PREFIX}neuron_host_memory_used_bytes"] = host_bytes
    hardware = _section(doc, "neuron_hardware_info")
    devices = _num(hardware.get("neuron_device_count")) if hardware else None
    if devices is not None:
        metrics[f"{PREFIX}neuron_devices"] = devices
    return {k: v for k, v in metrics.items() if math.isfinite(v)}  # sums of absurd values can overflow


def iter_reports(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON documents in a ``neuron-monitor`` stream, one per line; blank and malformed lines are skipped."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            doc = jsonfile.loads(line)
        except ValueError:
            log.debug("neuron-monitor: skipping malformed line %.80r", line)
            continue
        if isinstance(doc, dict):
            yield doc


class NeuronMonitor:
    """A ``neuron-monitor`` subprocess whose latest report is kept, parsed, for the metrics logger.

    ``NeuronMonitor.start()`` returns None where ``neuron-monitor`` is not on PATH (off a trn host).
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._proc = proc
        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        self._thread = threading.Thread(target=self._read, name="neuron-monitor-reader", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, args: Sequence[str] = (), *, executable: str = "neuron-monitor") -> NeuronMonitor | None:
        """Start ``neuron-monitor`` (with optional ``args``, e.g. ``-c config.json``); None when it is absent."""
        path = shutil.which(executable)
        if path is None:
            return None
        proc = subprocess.Popen(
            [path, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True
        )
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for doc in iter_reports(self._proc.stdout):
            metrics = parse_report(doc)
            with self._lock:
                self._latest = metrics

    def latest(self) -> dict[str, float]:
        """The metrics of the most recent report (empty before the first one)."""
        with self._lock:
            return dict(self._latest)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the subprocess (this PID only: terminate, then kill) and the reader thread."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._thread.join(timeout=timeout_s)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> NeuronMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
