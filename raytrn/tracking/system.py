"""Per-node system metrics: CPU/memory/disk/network (psutil), GPU (MLflow's monitor) and ``neuron-monitor``.

One sampler runs per node (in the worker with local rank 0). Metric names follow MLflow's multi-node
convention, ``system/<node>/<metric>`` (e.g. ``system/node-1a2b3c4d/cpu_utilization_percentage``,
``system/node-1a2b3c4d/neuroncore_0_utilization_percentage``), so the nodes of one run never collide. The
samples go through the job's :class:`~raytrn.tracking.logger.AsyncLogger`: buffered across an MLflow outage
like every other metric. MLflow's own ``SystemMetricsMonitor`` is not used because it stops for good at
the first failed request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from raytrn.compat import gpu_monitor
from raytrn.tracking.neuron_monitor import PREFIX, NeuronMonitor

log = logging.getLogger(__name__)


def node_label(node_id: str) -> str:
    """A short, stable name for a Ray node in metric names (its id's first 8 hex digits)."""
    return f"node-{node_id[:8]}"


class _HostMonitor:
    """CPU, memory, disk and network with psutil, under the names MLflow's own monitors use.

    Not MLflow's classes: importing them imports all of ``mlflow`` (~2 s of CPU holding the GIL) in the
    training process, which stalled the training thread for ~0.6 s at the first sample (measured). The CPU
    percentage is primed at start, so the first sample is a real reading (MLflow's first one reads 0).
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        psutil.cpu_percent()  # the next call measures from here
        net = psutil.net_io_counters()
        self._net0 = (net.bytes_recv, net.bytes_sent)

    def sample(self) -> dict[str, float]:
        import os

        ps = self._psutil
        mem, disk, net = ps.virtual_memory(), ps.disk_usage(os.sep), ps.net_io_counters()
        return {
            "cpu_utilization_percentage": round(ps.cpu_percent(), 1),
            "system_memory_usage_megabytes": round(mem.used / 1e6, 1),
            "system_memory_usage_percentage": round(mem.used / mem.total * 100, 1),
            "disk_usage_percentage": round(disk.percent, 1),
            "disk_usage_megabytes": round(disk.used / 1e6, 1),
            "disk_available_megabytes": round(disk.free / 1e6, 1),
            "network_receive_megabytes": (net.bytes_recv - self._net0[0]) / 1e6,  # since the sampler started
            "network_transmit_megabytes": (net.bytes_sent - self._net0[1]) / 1e6,
        }


class _GpuMonitor:
    """MLflow's GPU monitor (pynvml): only on a node with CUDA, where importing MLflow is worth it."""

    def __init__(self) -> None:
        self._monitor = gpu_monitor()

    def sample(self) -> dict[str, float]:
        try:
            self._monitor.collect_metrics()
            return dict(self._monitor.aggregate_metrics())
        finally:
            self._monitor.clear_metrics()


class _DeviceMemoryMonitor:
    """The local rank 0 worker's device memory, as its backend reads it (``Backend.device_memory``)."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.sample = read


def _gpu_monitor() -> _GpuMonitor | None:
    try:
        import torch

        if torch.cuda.is_available():
            return _GpuMonitor()
    except Exception as e:  # no pynvml, no driver: CPU metrics still count
        log.debug("no GPU monitor: %s", e)
    return None


class SystemSampler:
    """Samples this node every ``interval_s`` and queues ``system/<node>/...`` metrics into ``logger``."""

    def __init__(
        self, logger: Any, node: str, interval_s: float, device_memory: Callable[[], dict[str, float]] | None = None
    ) -> None:
        self.logger = logger
        self.node = node
        self.interval_s = interval_s
        self.neuron: NeuronMonitor | None = None  # started by the sampler's thread, where installed
        self.step = 0
        self._monitors: list[Any] = [_HostMonitor()]  # cheap (psutil); primes the CPU percentage now
        if device_memory is not None:  # the backend's allocator counters (TorchNeuron: torch.neuron)
            self._monitors.append(_DeviceMemoryMonitor(device_memory))
        self._gpu_checked = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._set_up_and_run, name="raytrn-system-metrics", daemon=True)

    @classmethod
    def start(
        cls,
        logger: Any,
        node_id: str,
        interval_s: float,
        device_memory: Callable[[], dict[str, float]] | None = None,
    ) -> SystemSampler:
        """Start sampling (and ``neuron-monitor`` where it is installed) for the node ``node_id``.

        Returns at once: the set-up (asking the tracking actor for this node's last system step, starting
        neuron-monitor) runs in the sampler's thread, not before the first training step.
        """
        sampler = cls(logger, node_label(node_id), interval_s, device_memory)
        sampler._thread.start()
        return sampler

    def _set_up_and_run(self) -> None:
        self.step = _next_step(self.logger, f"{PREFIX}{self.node}/")
        if not self._stop.is_set():
            self.neuron = NeuronMonitor.start()
        while not self._stop.wait(self.interval_s):
            self.logger.log_metrics(self.sample(), self.step, training=False)
            self.step += 1

    def sample(self) -> dict[str, float]:
        """One aggregated sample, named ``system/<node>/...``."""
        if not self._gpu_checked:  # at the first sample, not during start-up: it imports MLflow
            self._gpu_checked = True
            gpu = _gpu_monitor()
            self._monitors += [gpu] if gpu else []
        out: dict[str, float] = {}
        for monitor in self._monitors:
            try:
                out.update(monitor.sample())
            except Exception as e:
                log.debug("system metric monitor %s failed: %s", type(monitor).__name__, e)
        named = {f"{PREFIX}{self.node}/{k}": float(v) for k, v in out.items()}
        if self.neuron is not None:  # parse_report names them system/<metric>: put the node in
            for key, value in self.neuron.latest().items():
                named[f"{PREFIX}{self.node}/{key[len(PREFIX) :]}"] = value
        return named

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)  # may still be setting up
        if self.neuron is not None:
            self.neuron.close()


def _next_step(logger: Any, prefix: str) -> int:
    """After a restart on the same node, continue the node's system-metric steps instead of repeating them.

    The tracking actor knows them (it read the run once at its start): no MLflow call from the worker,
    which could hang in the MLflow client's retries while the server is down.
    """
    ask = getattr(logger, "next_step", None)
    if ask is None:
        return 0
    try:
        return int(ask(prefix))
    except Exception as e:
        log.warning("system metrics of %s start at step 0: %s", prefix, e)
        return 0
