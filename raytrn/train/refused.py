"""Stopping a run whose MLflow run was refused (a deleted experiment or run, a bad ``tracking.run_id``).

The tracking actor creates the run while the workers start, so MLflow's answer comes once ``fit()`` runs. Stopping
goes through Ray Train's own Ctrl-C path: a ``KeyboardInterrupt`` in the main thread, where raytrn's controller
aborts the worker group (:mod:`raytrn.compat.controller`); the driver then raises the refusal.

That path needs a Python handler for SIGINT, and a process may start without one: a background job of a
non-interactive shell (``raytrn train job.yaml &`` in a script, a CI step, a pytest-xdist worker's child) inherits
SIGINT ignored, and Python then installs none, so ``_thread.interrupt_main`` did nothing and the refused run trained
on (stop 94). While ``fit()`` runs, such a process gets a handler that stops the run for a refusal only: a real
SIGINT stays ignored, as its parent meant (one with SIGINT at its default, terminate, stops as on Ctrl-C).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from raytrn.errors import RaytrnError
from raytrn.pending import Pending

log = logging.getLogger(__name__)


class RunRefusedWatch:
    """``with watch: trainer.fit()``: waits for ``ready`` (the tracking actor's answer; None: no tracking) in a
    thread and, when it is a refusal while ``fit()`` runs in the main thread, interrupts ``fit()``;
    :meth:`raise_if_refused` then raises the refusal."""

    def __init__(self, ready: Pending[Any] | None) -> None:
        self.error: RaytrnError | None = None
        self._fitting = False
        self._lock = threading.Lock()
        self._restore: Any = None
        # Ray Train aborts on SIGINT only when fit() runs in the main thread; elsewhere fit() runs to its end.
        self._can_stop = threading.current_thread() is threading.main_thread()
        if ready is not None:
            threading.Thread(target=self._wait, args=(ready,), name="raytrn-mlflow-run", daemon=True).start()

    def _wait(self, ready: Pending[Any]) -> None:
        import _thread

        try:
            ready.result()
        except RaytrnError as e:  # Ray's RayTaskError(ConfigError): the original is its cause
            cause = getattr(e, "cause", None)
            with self._lock:
                self.error = cause if isinstance(cause, RaytrnError) else e
                if self._fitting and self._can_stop:
                    _thread.interrupt_main(signal.SIGINT)
        except Exception as e:  # the actor died: its own error says why; tracking never fails a job here
            log.warning("MLflow tracking actor: %s", e)

    def raise_if_refused(self) -> None:
        if self.error is not None:
            raise self.error

    def _on_sigint(self, signum: int, frame: Any) -> None:
        """SIGINT's handler in a process that started without one: a refusal (or, where SIGINT was at its
        default, a real Ctrl-C) interrupts ``fit()``; a real SIGINT the parent ignored is ignored."""
        if self.error is not None or self._restore == signal.SIG_DFL:
            raise KeyboardInterrupt

    def __enter__(self) -> RunRefusedWatch:
        with self._lock:
            self.raise_if_refused()
            if self._can_stop:
                current = signal.getsignal(signal.SIGINT)
                # no Python handler to interrupt with (None: one installed from C, which stays)
                if current in (signal.SIG_IGN, signal.SIG_DFL):
                    self._restore = current
                    signal.signal(signal.SIGINT, self._on_sigint)
            self._fitting = True
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._fitting = False
            if self._restore is not None:
                signal.signal(signal.SIGINT, self._restore)
                self._restore = None
