"""A training worker's SIGTERM (a scheduler's stop, ``ray stop`` on its node): flagged the moment it arrives, so the
loop can checkpoint at the next step and exit once the checkpoint is committed (:mod:`raytrn.train.preemption`).

Installed on every worker at start by raytrn's Ray Train backend (:mod:`raytrn.backends.ray_backend`); read
by the loop every step. A process-level piece with no dependency on training, so the backends can install it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)

#: Set by the worker's SIGTERM handler; read by the loop every step.
_SIGTERM = threading.Event()
#: Set while the loop trains (a SIGTERM outside of it ends the process as Ray's own handler would).
TRAINING = threading.Event()
#: After a SIGTERM, the process ends this much later even if the loop never got to its checkpoint.
SIGTERM_GRACE_S = 120.0

#: What :func:`install_sigterm_handler` changed in this process, for :func:`uninstall_sigterm_handler`: the handler
#: and wakeup fd it replaced, its pipe, and the exit timer a flagged SIGTERM started.
_installed: dict[str, Any] = {}
_exit_timer: threading.Timer | None = None


def install_sigterm_handler() -> bool:
    """Make SIGTERM to this training worker a notice (checkpoint at once, then exit) instead of an immediate exit.

    Runs on the worker actor's main thread (Ray Train runs its backends' ``on_start`` there; Python signal handlers
    can only be set from it); False elsewhere. While the loop trains, the signal only flags the notice (and ends
    the process after :data:`SIGTERM_GRACE_S` whatever happens); otherwise the handler calls the one it replaced
    (Ray's, which exits).

    A Python handler runs only when the main thread next runs Python, and a Ray worker's main thread waits in
    Ray's C++ task loop while the training function runs in another thread: the notice could come seconds late,
    or after the last step. So the flag is also raised by a thread reading the signal's wakeup fd, which Python's
    C-level handler writes to the moment the signal arrives, in whichever thread takes it."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        if _SIGTERM.is_set():  # the wakeup thread took it
            return
        if not TRAINING.is_set():
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)
        _flag_sigterm(signum)

    signal.signal(signal.SIGTERM, handler)
    _installed["handler"] = previous
    _watch_wakeup_fd()
    return True


def uninstall_sigterm_handler() -> None:
    """Undo :func:`install_sigterm_handler` in this process: the handler and wakeup fd it replaced come back, its
    reader thread ends, and a flagged SIGTERM's pending exit is cancelled (the flags are cleared).

    For a process that goes on after training in it (a test run): the exit timer otherwise ends it with 143 up to
    :data:`SIGTERM_GRACE_S` later, whatever it is doing then. Main thread only, like the install."""
    global _exit_timer
    with _FLAG_LOCK:
        if _exit_timer is not None:
            _exit_timer.cancel()
            _exit_timer = None
        _SIGTERM.clear()
    TRAINING.clear()
    if "handler" in _installed:
        signal.signal(signal.SIGTERM, _installed.pop("handler"))
    if "pipe" in _installed:
        read_fd, write_fd = _installed.pop("pipe")
        signal.set_wakeup_fd(_installed.pop("wakeup_fd"))
        os.close(write_fd)  # the reader sees end of file and returns; it closes the read end


_FLAG_LOCK = threading.Lock()


def _flag_sigterm(signum: int) -> None:
    global _exit_timer
    with _FLAG_LOCK:
        if _SIGTERM.is_set():
            return
        _SIGTERM.set()
        _exit_timer = threading.Timer(SIGTERM_GRACE_S, os._exit, args=(128 + signum,))
        _exit_timer.name = "raytrn-sigterm-exit"
        _exit_timer.daemon = True
        _exit_timer.start()
    log.log(
        logging.DEBUG if _QUIET.is_set() else logging.WARNING,
        "SIGTERM: checkpointing at the next step, then exiting (at the latest in %.0f s)",
        SIGTERM_GRACE_S,
    )


#: Set in a sweep's trial: a SIGTERM there is the scheduler stopping the trial, which the sweep's own line says.
_QUIET = threading.Event()


def quiet_sigterm(quiet: bool) -> None:
    """Whether this worker's SIGTERM is said on the driver's terminal (not in a sweep's trial: the sweep says why)."""
    if quiet:
        _QUIET.set()
    else:
        _QUIET.clear()


def _watch_wakeup_fd() -> None:
    """A daemon thread that flags a SIGTERM while training as soon as it arrives (see install_sigterm_handler);
    nothing if someone else already owns the wakeup fd (then the Python handler alone flags it)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        old = -2
    if old != -1:
        if old != -2:
            signal.set_wakeup_fd(old)
        os.close(read_fd)
        os.close(write_fd)
        return

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # uninstall_sigterm_handler closed the write end
                os.close(read_fd)
                return
            if signal.SIGTERM in data and TRAINING.is_set():
                _flag_sigterm(signal.SIGTERM)

    _installed.update(pipe=(read_fd, write_fd), wakeup_fd=old)
    threading.Thread(target=watch, name="raytrn-sigterm", daemon=True).start()


def sigterm_received() -> bool:
    return _SIGTERM.is_set()
