"""Ray Train's torch backend (process group on gloo or nccl) plus what raytrn's workers need before training:
a SIGTERM handler that turns the signal into a checkpoint (:func:`raytrn.sigterm.install_sigterm_handler`).

Imported only where a trainer is built (it imports torch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig

from raytrn.compat import torch_backend_class
from raytrn.sigterm import install_sigterm_handler

log = logging.getLogger(__name__)


class _RaytrnTorchBackend(torch_backend_class()):  # type: ignore[misc]
    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        super().on_start(worker_group, backend_config)
        install_on_workers(worker_group)


def install_on_workers(worker_group: Any) -> None:
    """The SIGTERM handler on every worker (run on each worker actor's main thread by Ray Train)."""
    installed = worker_group.execute(install_sigterm_handler)
    if not all(installed):
        log.warning("SIGTERM handler not installed on %d of %d workers", installed.count(False), len(installed))


@dataclass
class RaytrnTorchConfig(TorchConfig):
    """``TorchConfig`` (the process group backend, init method, timeout) with raytrn's worker set-up."""

    @property
    def backend_cls(self) -> type:
        return _RaytrnTorchBackend
