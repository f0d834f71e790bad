"""Accelerator backends behind one small seam.

The training loop asks its backend for the device, how to wrap the model, how to step and sync, and
which Ray Train backend config to use. An accelerator is a module registered in :data:`_BACKENDS`, not a change
to the loop: ``neuron`` is TorchNeuron (trn2/trn3), ``neuron-xla`` the frozen XLA path (trn1,
:mod:`raytrn.xla`).
"""

from __future__ import annotations

import importlib

from raytrn.backends.base import Backend
from raytrn.errors import BackendError, BackendUnavailableError

#: Each backend by module path, imported on first use: the frozen XLA path (raytrn.xla) loads only for the
#: jobs that ask for it, never for cpu, cuda or neuron jobs (nor their checks).
_BACKENDS = {
    "cpu": "raytrn.backends.cpu:CpuBackend",
    "cuda": "raytrn.backends.cuda:CudaBackend",
    "neuron": "raytrn.backends.neuron:NeuronBackend",
    "neuron-xla": "raytrn.xla.neuron_xla:NeuronXlaBackend",
    "xla-cpu": "raytrn.xla.backend:XlaCpuBackend",
}


def get_backend(name: str) -> Backend:
    """The backend for ``scaling.accelerator``; a clear error when it is unavailable here."""
    target = _BACKENDS.get(name)
    if target is None:
        raise BackendError(
            f"scaling.accelerator={name!r}: unknown accelerator; choose cpu, cuda, neuron (TorchNeuron, trn2/trn3), neuron-xla (trn1) or xla-cpu"
        )
    module, cls = target.split(":")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:  # an installation without the frozen XLA path (raytrn.xla)
        if not (e.name and module.startswith(e.name)):
            raise
        raise BackendUnavailableError(
            f"scaling.accelerator={name!r}: this raytrn has no {module} (the frozen trn1 XLA path is not installed); "
            "use cpu, cuda or neuron"
        ) from None
    return getattr(loaded, cls)()


__all__ = ["Backend", "get_backend"]
