"""Fire-and-forget Ray actor calls made off the training thread: rank 0's metrics and progress posts.

A Ray actor call (``handle.method.remote(...)``) does not wait for the actor, but submitting it releases the GIL
inside Ray's core worker; in a Ray Train worker other Python threads (Ray Data's prefetch, Ray Train's own) take it
then, and the training thread waits for it back: a log call measured 0.34 ms or 3.7 ms (a GIL switch interval),
2.25 ms on average at a log every step (``make bench``'s MLflow rows). Through a :class:`Sender` the training thread
only appends the call to a queue (microseconds, the GIL kept) and one daemon thread of the process submits the calls
in the order they were made. The order is Ray's too: an actor runs the calls of one process in the order they were
submitted, so a call that waits for its answer (a flush, a read) is made through :meth:`Sender.ask`, which first
waits until everything queued before it was submitted: it never overtakes a post made before it. A worker's training
function ends only once its posts are submitted (:func:`raytrn.train.entry.posts_submitted`: the driver reads the
board when Ray Train reports the workers done).

One sender a process (:func:`sender`): every client that posts to the same actor shares its order. An error a
submission raises (an argument Ray cannot serialize) is raised by the next call made through the sender, in the
caller's thread, as a direct call would have raised it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: How long a call that waits for its answer waits, at most, for the posts queued before it to be submitted.
DRAIN_TIMEOUT_S = 60.0


class Sender:
    """Submits ``method.remote(*args)`` for each :meth:`post`, in order, from a daemon thread started at the first."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._posted = 0
        self._sent = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def post(self, method: Any, *args: Any) -> None:
        """Queue ``method.remote(*args)`` (``method``: an actor handle's method) and return at once."""
        with self._cv:
            self._raise()
            self._queue.append((method.remote, args))
            self._posted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="raytrn-posts", daemon=True)
                self._thread.start()
            self._cv.notify()

    def ask(self, method: Any, *args: Any) -> Any:
        """``method.remote(*args)`` made now, in the caller's thread, after every post made before it was submitted:
        its ``ObjectRef`` (a call whose answer is waited for: it never overtakes a post)."""
        self.drain()
        return method.remote(*args)

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until every post made before this call was submitted (then a call made now comes after them)."""
        with self._cv:
            target = self._posted
            if not self._cv.wait_for(lambda: self._sent >= target or self._error is not None, timeout=timeout_s):
                raise TimeoutError(
                    f"{target - self._sent} fire-and-forget Ray call(s) not submitted after {timeout_s:.0f} s: "
                    "raytrn's sender thread is stuck in Ray (see the worker's stacks)"
                )
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                submit, args = self._queue.popleft()
            try:
                submit(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread at its next call
                log.debug("a fire-and-forget Ray call failed", exc_info=True)
                with self._cv:
                    self._error = self._error or e
            with self._cv:
                self._sent += 1
                self._cv.notify_all()


_SENDER: tuple[int, Sender] | None = None
_LOCK = threading.Lock()


def sender() -> Sender:
    """This process's sender (a forked child gets its own: the parent's thread is not in it)."""
    global _SENDER
    with _LOCK:
        if _SENDER is None or _SENDER[0] != os.getpid():
            _SENDER = (os.getpid(), Sender())
        return _SENDER[1]
