"""Per-node system metrics: MLflow's CPU/memory/disk/network/GPU monitors plus ``neuron-monitor``.

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
from typing import Any

from raytrn.tracking.neuron_monitor import PREFIX, NeuronMonitor

log = logging.getLogger(__name__)


def node_label(node_id: str) -> str:
    """A short, stable name for a Ray node in metric names (its id's first 8 hex digits)."""
    return f"node-{node_id[:8]}"


def _mlflow_monitors() -> list[Any]:
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        import torch

        if torch.cuda.is_available():
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            monitors.append(GPUMonitor())
    except Exception as e:  # no pynvml, no driver: CPU metrics still count
        log.debug("no GPU monitor: %s", e)
    return monitors


class SystemSampler:
    """Samples this node every ``interval_s`` and queues ``system/<node>/...`` metrics into ``logger``."""

    def __init__(self, logger: Any, node: str, interval_s: float) -> None:
        self.logger = logger
        self.node = node
        self.interval_s = interval_s
        self.neuron: NeuronMonitor | None = None  # started by the sampler's thread, where installed
        self.step = 0
        self._monitors: list[Any] | None = None  # MLflow's monitors, made at the first sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._set_up_and_run, name="raytrn-system-metrics", daemon=True)

    @classmethod
    def start(cls, logger: Any, node_id: str, interval_s: float) -> SystemSampler:
        """Start sampling (and ``neuron-monitor`` where it is installed) for the node ``node_id``.

        Returns at once: the set-up (asking the tracking actor for this node's last system step, starting
        neuron-monitor, importing MLflow's monitors at the first sample) runs in the sampler's thread, not
        before the first training step.
        """
        sampler = cls(logger, node_label(node_id), interval_s)
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
        if self._monitors is None:
            self._monitors = _mlflow_monitors()
        out: dict[str, float] = {}
        for monitor in self._monitors:
            try:
                monitor.collect_metrics()
                out.update(monitor.aggregate_metrics())
            except Exception as e:
                log.debug("system metric monitor %s failed: %s", type(monitor).__name__, e)
            finally:
                monitor.clear_metrics()
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
