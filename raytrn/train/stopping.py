"""Stop requests: a run asked to end early ends at a step every rank agrees on, checkpointed, FINISHED.

``raytrn stop RUN`` (or :func:`request_stop`) leaves the request on the run's progress board, a named actor (:func:`raytrn.tracking.board.board_name`); rank 0
asks the board at most every :data:`POLL_S` without waiting for the answer (a future it looks at each step), and
the step's preemption agreement carries it to every rank (:meth:`raytrn.train.preemption.PreemptionWatch.agree`), so
all of them make the step it names their last: the final checkpoint, evaluation and export as at
``run.max_steps``. The learning-rate schedule stays the job's (``run.max_steps``): training the same job again
resumes there and goes on. Tests end a run this way once what they measure is done, instead of guessing how many
steps a machine trains meanwhile.
"""

from __future__ import annotations

import time

from raytrn.errors import RaytrnError
from raytrn.pending import Pending
from raytrn.tracking.board import BOARD_NAMESPACE, BOARD_PREFIX, StopAsked, StopOrder
from raytrn.tracking.roles import StopMailbox, StopMailboxClient

#: Rank 0 asks the board at most this often.
POLL_S = 1.0


class StopRequests:
    """Rank 0's view of the run's stop request (``board``: the job's stop mailbox; None on other ranks, which learn
    it in the agreement)."""

    def __init__(self, board: StopMailbox | None) -> None:
        self.board = board
        self._pending: Pending[StopOrder] | None = None
        self._asked_at = 0.0
        self._requested: int | None = None  # the board's answer: -1 "at the next step", else a step
        #: The board's word that the run must stop at once (its lease was taken over), or None.
        self.abort: str | None = None

    def stop_at(self, step: int) -> int:
        """The step the run was asked to end at, as of the step ``step`` just trained (0: no request)."""
        if self.board is not None:
            self._poll()
        if self._requested is None:
            return 0
        return step + 1 if self._requested <= step else self._requested

    def _poll(self) -> None:
        assert self.board is not None
        if self._pending is not None:
            if not self._pending.done():
                return
            try:
                answer: StopOrder | None = self._pending.result()
            except Exception:  # the board is best effort here: ask again later
                answer = None
            self._pending = None
            if answer is not None:
                if answer.at_step is not None:
                    self._requested = int(answer.at_step)
                self.abort = answer.abort
        if self.abort is None and time.monotonic() - self._asked_at >= POLL_S:
            self._pending = self.board.order()
            self._asked_at = time.monotonic()


def request_stop(run_name: str, at_step: int | None = None, *, timeout_s: float = 30) -> StopAsked:
    """Ask ``run_name``, training on the Ray this process is connected to, to end at step ``at_step`` (None: the next
    step every rank can agree on). Returns the board's answer (the step it reached, the step asked); RaytrnError when
    no such run trains there."""
    import ray
    from ray.util import list_named_actors

    prefix = f"{BOARD_PREFIX}{run_name}:"
    names = [a["name"] for a in list_named_actors(all_namespaces=True) if a.get("namespace") == BOARD_NAMESPACE]
    for name in sorted(n for n in names if n.startswith(prefix)):
        try:
            board = ray.get_actor(name, namespace=BOARD_NAMESPACE)
            return StopMailboxClient(board).request(at_step, timeout_s=timeout_s)
        except (ValueError, ray.exceptions.RayActorError):  # a previous invocation's, going away
            continue
    raise RaytrnError(
        f"no run named {run_name!r} is training on this Ray cluster: check the name (`raytrn train` prints it) and "
        "the cluster (RAY_ADDRESS, or --address)"
    )
