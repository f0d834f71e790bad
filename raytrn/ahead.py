"""Imports a training worker starts ahead of its training function, in a daemon thread, while Ray Train sets it up.

A worker's training function imports its loop (torch, its distributed checkpointing, raytrn's training modules: 3-5
CPU-seconds in a fresh process) only once Ray Train has created the worker's actor and set it up in round trips from
the controller (its metadata, its train context, its log paths, raytrn's backend: its process group), then started the
function. Two points start those imports earlier, each in one thread that imports its modules in order:

- the worker actor's construction (:class:`raytrn.compat.worker.RayTrainWorker`): torch and the modules every raytrn
  loop imports (:data:`raytrn.compat.worker.AT_CONSTRUCTION`), beside all of Ray Train's set-up;
- raytrn's backend, once the worker's process group is up: the job's own loop module (the config's ``ahead``:
  :func:`raytrn.train.entry.loop_module`), the little left of it.

The training function's own import then finds a module done, or waits for the rest on Python's import lock. A thread
that imports a module the other has half imported waits for it the same way; what could deadlock is a thread that
imports a submodule of a package another thread is still initialising (``import torch.distributed`` on the worker's
main thread while this thread runs ``import torch``, which imports it too: each holds the lock the other waits for,
and Python fails one of the imports or hands one thread a half-initialised torch; torch cannot be imported twice). So
code on the worker's main thread waits for torch's import here (:func:`wait_for`) before it touches torch. A module
that fails here is left to the importer that needs it, which raises the error itself. Once a process.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

#: Each module imported ahead in this process: set once its import ended (done or failed).
_ended: dict[str, threading.Event] = {}
_lock = threading.Lock()


def import_ahead(modules: Sequence[str]) -> list[threading.Thread]:
    """Import those of ``modules`` not imported ahead before, in this order, in one daemon thread
    ("raytrn-import-ahead"). Returns the thread started (none when every module was asked for before)."""
    with _lock:
        todo = [m for m in dict.fromkeys(modules) if m not in _ended]
        for module in todo:
            _ended[module] = threading.Event()
    if not todo:
        return []
    thread = threading.Thread(target=_import_in_order, args=(todo,), name="raytrn-import-ahead", daemon=True)
    thread.start()
    return [thread]


def wait_for(module: str, timeout_s: float = 300.0) -> bool:
    """Wait until ``module``'s import ahead has ended (done or failed); at once when it was never asked for. Returns
    whether it ended (False after ``timeout_s``: the caller imports it then, as it would have without this)."""
    ended = _ended.get(module)
    return ended is None or ended.wait(timeout_s)


def _import_in_order(modules: Sequence[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001 - the importer that needs it raises it
            log.debug("importing %s ahead of the training function: %s", module, e)
        finally:
            _ended[module].set()
