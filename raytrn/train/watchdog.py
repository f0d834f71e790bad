"""A hung step is detected, shown and restarted: no silent hang.

A collective that never returns (a peer stuck in a kernel, a lost NeuronCore, a network partition gloo does not
notice) holds every worker of the group forever, and Ray Train sees nothing wrong. Each worker runs a
:class:`HangWatch`: when no step completes within ``run.hang_timeout_s`` (default: 10x the median step time, at
least :data:`MIN_TIMEOUT_S`; not before the first step, whose compiles take long; while the loop evaluates or
checkpoints, :data:`WORK_FACTOR` times that: a collective inside a save can hang as well), it dumps every thread's
Python stack (``faulthandler``) into the run's directory, ``<run>/hangs/step_<N>/rank_<R>.txt``, and the run's
MLflow artifacts (``hangs/``), then ends its process: Ray Train sees the worker die and restarts the group from the
newest committed checkpoint (``scaling.max_failures``). Under ``scaling.recovery: live`` each replica runs one too
(:func:`live_hang_watch`): the others train on without the hung replica, and its replacement joins them live.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from raytrn import storage
from raytrn.checkpoint.rundir import RunDir

if TYPE_CHECKING:
    from raytrn.config import JobSpec
    from raytrn.train.protocol import StepEnd

log = logging.getLogger(__name__)

#: The least time without a step that counts as a hang (a slow step, a long data wait are not).
MIN_TIMEOUT_S = 300.0
#: An evaluation or a checkpoint (they take their own time) is a hang past this many times the step's bound.
WORK_FACTOR = 10
#: How often a watch looks at most (its default is a quarter of its least bound, if that is sooner).
POLL_S = 5.0
#: A hung worker's exit status (Ray Train restarts the group).
HANG_EXIT = 75


def stacks() -> str:
    """Every thread's Python stack in this process, as ``faulthandler`` writes them (also for threads stuck in C)."""
    with tempfile.TemporaryFile(mode="w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.flush()
        f.seek(0)
        return f.read()


class HangWatch:
    """Watches one worker's steps from a daemon thread; ``on_hang(step, waited_s, stacks)`` runs once, on a hang.

    ``timeout_s``: fixed (``run.hang_timeout_s``), else 10x the median of the recent step times, at least
    :data:`MIN_TIMEOUT_S`; within :meth:`working` (an evaluation, a checkpoint), :data:`WORK_FACTOR` times that.
    ``poll_s``: how often the thread looks; by default a quarter of the least bound, at most :data:`POLL_S` (a hang
    is seen within 1.25x its bound: an 8 s bound after 8-10 s, not up to 13 s).
    The ``watchdog`` phase of the step protocol (:mod:`raytrn.train.protocol`): a step's end after its metrics."""

    phase: ClassVar[str] = "watchdog"
    long: ClassVar[bool] = False
    blocking: ClassVar[str | None] = None

    def __init__(
        self,
        on_hang: Callable[[int, float, str], None],
        *,
        timeout_s: float | None = None,
        min_timeout_s: float = MIN_TIMEOUT_S,
        poll_s: float | None = None,
    ) -> None:
        self.on_hang, self.fixed, self.min_timeout_s = on_hang, timeout_s, min_timeout_s
        if poll_s is None:
            poll_s = min(POLL_S, (timeout_s if timeout_s is not None else min_timeout_s) / 4)
        self.poll_s = poll_s
        self._durations: deque[float] = deque(maxlen=100)
        # When the last step ended, or an evaluation or a checkpoint began or ended; None before the first step.
        self._last: float | None = None
        self._step = 0
        self._working = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="raytrn-hang-watch", daemon=True)
        self._thread.start()

    def step_ended(self, end: StepEnd) -> None:
        self.step_done(end.step)

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last is not None:
                self._durations.append(now - self._last)
            self._last, self._step = now, step

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """An evaluation or a checkpoint: watched with :data:`WORK_FACTOR` times the bound, from its start; the
        step's clock starts again after it."""
        with self._lock:
            self._working += 1
            if self._last is not None:
                self._last = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._working -= 1
                if self._last is not None:
                    self._last = time.monotonic()

    def timeout(self) -> float | None:
        """The current timeout (None: not known yet, no step time measured)."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            if not self._durations:
                return None
            return max(self.min_timeout_s, 10 * statistics.median(self._durations))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            timeout = self.timeout()
            with self._lock:
                last, working, step = self._last, self._working, self._step
            if last is None or timeout is None:
                continue
            if working:
                timeout *= WORK_FACTOR
            waited = time.monotonic() - last
            if waited > timeout:
                self.on_hang(step, waited, stacks())
                return


#: What a hung worker's exit leads to, in its log line: on the restart path, and under live recovery.
RESTART = "Ray Train restarts the group from the newest committed checkpoint"
LIVE = "the other replicas train on, and Ray Train replaces this one, which joins them live"


def on_hang_exit(job: JobSpec, rank: int, logger: Any, *, then: str = RESTART) -> Callable[[int, float, str], None]:
    """What a worker does on a hang: say so (``then``: what happens next), keep the stacks (run directory, MLflow
    artifacts), exit."""

    def handle(step: int, waited: float, text: str) -> None:
        run = RunDir.of(job)
        path = storage.join(run.root, "hangs", f"step_{step:08d}", f"rank_{rank}.txt")
        log.error(
            "rank %d: no step completed for %.0f s after step %d (run.hang_timeout_s): a hung collective? Every "
            "thread's stack is in %s; ending this worker: %s",
            rank,
            waited,
            step,
            path,
            then,
        )
        try:
            storage.write_text(path, text)
        except OSError as e:
            log.error("rank %d: the stacks could not be written (%s):\n%s", rank, e, text)
        try:
            run_id = logger.run_id if logger is not None else None
            if run_id:
                logger.client.log_text(run_id, text, f"hangs/step_{step:08d}/rank_{rank}.txt")
        except Exception as e:  # the artifact is a bonus: the file is written
            log.warning("rank %d: the stacks were not logged to MLflow: %s", rank, e)
        logging.shutdown()
        os._exit(HANG_EXIT)

    return handle


def live_hang_watch(job: JobSpec, rank: int, logger: Any) -> HangWatch:
    """The watch of a ``scaling.recovery: live`` replica (:mod:`raytrn.train.live_loop`). A replica hung outside a
    collective (a stuck device or filesystem call) while its heartbeat thread beats is dropped by the others, but its
    process would stay, and the run could not end while it does: it dumps its stacks and exits like any hung worker,
    and Ray Train replaces it (it joins live). The bound is the restart path's plus two ``scaling.peer_timeout_s``: a
    survivor's step that re-forms the group waits up to that long for a frozen or late peer, and is no hang."""
    reform = 2 * job.scaling.peer_timeout_s
    fixed = job.run.hang_timeout_s
    return HangWatch(
        on_hang_exit(job, rank, logger, then=LIVE),
        timeout_s=fixed + reform if fixed is not None else None,
        min_timeout_s=MIN_TIMEOUT_S + reform,
    )
