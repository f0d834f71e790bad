"""The step protocol: what the loop's components do when a step ends, in one documented order.

After each trained step the loop hands a :class:`StepEnd` to its :class:`StepProtocol`, which runs the registered
components in the order of :data:`PHASES`, whatever order they were registered in. Each component declares its
phase and what it does there (:meth:`Component.step_ended`); it reads what earlier phases left on the
:class:`StepEnd` (the agreed notice, the logged metrics, the scores) and leaves its own. At a log step the metrics
component asks every :class:`MetricSource` for its metrics; at a checkpoint step the checkpoint component saves.

The phases, and the collectives each may issue (every rank runs every phase, at every step, in this order; a
component whose collective depends on the step decides it from what every rank knows alike: the step, the job, an
agreed notice — never from its rank):

============  ==================================================================================================
guard         the non-finite guard counts the step's gradient norm (a host read at a settle step; no collective)
snapshot      the in-memory snapshot in flight is completed (a collective while one is in flight)
agreement     the preemption notice, a stop request and a lease take-over, agreed (one all-reduce, every step)
metrics       at a log step: the loss all-reduced, the ranks' own step times gathered; once a group, the memory
              probe's all-reduce
watchdog      the hang watch learns the step is done (no collective)
eval          at an eval step: the validation forward passes (the model's own collectives)
report        a sweep's trial: the step's metrics to Ray Tune through Ray Train (Ray Train's report, every rank)
checkpoint    at a checkpoint step or after a notice: the save (DCP's collectives), the in-memory snapshot staged
============  ==================================================================================================

With ``RAYTRN_CHECK_COLLECTIVES=1`` (the tests set it) every collective a phase issues through
``torch.distributed`` is first compared across the ranks (:class:`CollectiveCheck`, like torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` fingerprints): two ranks about to issue different collectives, or one issuing a
collective the other does not, raise :class:`CollectiveOrderError` on every rank, naming the phase, instead of a
hang or a mismatched reduction.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from raytrn.train.preemption import Notice
from raytrn.train.step import StepResult

#: The phases of a step's end, in the order they run (the order of their collectives).
PHASES = ("guard", "snapshot", "agreement", "metrics", "watchdog", "eval", "report", "checkpoint")

#: Set to 1 to compare every step-end collective across the ranks before it is issued.
CHECK_ENV = "RAYTRN_CHECK_COLLECTIVES"


@dataclass
class StepEnd:
    """One step's end, as the phases see it: what the loop knows (``step``, ``last``: the run's last step,
    ``saving``: a checkpoint step, ``logging``: a log step, ``result``: the train step's) and what the phases decide
    on the way (each writes its own fields)."""

    step: int
    last: bool
    saving: bool
    logging: bool
    result: StepResult
    #: agreement: the preemption notice every rank got (None: none), the step a stop request ends the run at
    notice: Notice | None = None
    stop_at: int = 0
    #: metrics: the log step's metrics ({} elsewhere); eval: the validation scores ({} elsewhere)
    logged: dict[str, Any] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    #: checkpoint: the group trains no further (a preemption notice's checkpoint is committed)
    stopping: bool = False


@runtime_checkable
class Component(Protocol):
    """A per-step concern of the loop: its phase (one of :data:`PHASES`), whether its work counts against the hang
    watch's longer bound (``long``), what of the goodput clock it is (``blocking``: ``checkpoint``, ``eval``, or
    None: the loop's other time), and what it does when a step ends."""

    phase: ClassVar[str]
    long: ClassVar[bool]
    blocking: ClassVar[str | None]

    def step_ended(self, end: StepEnd) -> None: ...


@runtime_checkable
class MetricSource(Protocol):
    """A component with metrics of its own at a log step (the checkpoints' failures, the guard's skipped steps, the
    in-memory snapshots' bytes): the metrics component adds them to the step's."""

    def metrics(self) -> dict[str, float]: ...


class StepProtocol:
    """The loop's components, run in :data:`PHASES` order when a step ends. ``working``: the hang watch's longer
    bound (a context); ``blocking``: the goodput clock's (a context by cause); ``check``: compare each collective
    across ranks (:class:`CollectiveCheck`; default: ``RAYTRN_CHECK_COLLECTIVES``)."""

    def __init__(
        self,
        components: Sequence[Component],
        *,
        working: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        blocking: Callable[[str], contextlib.AbstractContextManager[None]] = lambda cause: contextlib.nullcontext(),
        check: CollectiveCheck | None = None,
    ) -> None:
        unknown = [type(c).__name__ for c in components if c.phase not in PHASES]
        if unknown:
            raise ValueError(f"components with a phase not in PHASES {PHASES}: {', '.join(unknown)}")
        # stable: two components of one phase run in the order they were registered
        self.components = sorted(components, key=lambda c: PHASES.index(c.phase))
        self._working, self._blocking = working, blocking
        self.check = check if check is not None else CollectiveCheck.from_env()

    def step_ended(self, end: StepEnd) -> StepEnd:
        """Run every component's end of ``end.step``, in phase order; returns ``end`` with what they decided."""
        for c in self.components:
            with contextlib.ExitStack() as stack:
                if c.long:
                    stack.enter_context(self._working())
                if c.blocking is not None:
                    stack.enter_context(self._blocking(c.blocking))
                if self.check is not None:
                    stack.enter_context(self.check.phase(c.phase))
                c.step_ended(end)
        if self.check is not None:
            self.check.step_done(end.step)
        return end


class CollectiveOrderError(RuntimeError):
    """Two ranks were about to issue different collectives at a step's end (a rank-dependent branch in a phase)."""


#: The torch.distributed collectives a phase may issue (their calls are compared across ranks when checked).
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast_object_list",
    "reduce_scatter_tensor", "gather_object", "scatter_object_list", "all_to_all_single", "barrier", "reduce",
    "gather", "scatter",
)  # fmt: skip


class CollectiveCheck:
    """Compares, before each collective a phase issues, what every rank is about to issue (the phase and the
    collective's name), on a gloo group of its own; and at the step's end, that every rank ended it. A mismatch
    raises :class:`CollectiveOrderError` on every rank (a rank that issues nothing meets the others' fingerprint
    with its step's end, so a missing collective is found too, not a hang)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        self._group = dist.new_group(backend="gloo")  # every rank, at the same point: the loop's start
        self._phase: str | None = None
        self._inside = False
        self._thread = threading.get_ident()  # the loop's: a background thread's collectives (the in-memory
        # snapshots' writer, on a group of its own) are not the step's

    @classmethod
    def from_env(cls) -> CollectiveCheck | None:
        """A check when ``RAYTRN_CHECK_COLLECTIVES=1`` and the process group is up (more than one rank)."""
        if os.environ.get(CHECK_ENV) != "1":
            return None
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        return cls()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Inside: every collective through ``torch.distributed`` is compared first, as ``name``'s."""
        self._phase, self._thread = name, threading.get_ident()
        for op, original in self._originals.items():
            setattr(self._dist, op, self._wrapped(op, original))
        try:
            yield
        finally:
            for op, original in self._originals.items():
                setattr(self._dist, op, original)
            self._phase = None

    def step_done(self, step: int) -> None:
        """Every rank ended the step's end (compared as a fingerprint of its own)."""
        self._compare(f"the end of step {step}")

    def _wrapped(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._inside or threading.get_ident() != self._thread or not self._everyone(kwargs.get("group")):
                # a collective's own inner collectives are part of it; another thread's are not the step's; one on a
                # subgroup (a TP or expert group) is issued by its members only
                return original(*args, **kwargs)
            self._compare(f"{op} in phase '{self._phase}'")
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return call

    def _everyone(self, group: Any) -> bool:
        return group is None or self._dist.get_world_size(group) == self._dist.get_world_size()

    def _compare(self, mine: str) -> None:
        gather = self._originals["all_gather_object"]
        everyone: list[Any] = [None] * self._dist.get_world_size()
        gather(everyone, mine, group=self._group)
        if len(set(everyone)) > 1:
            lines = "; ".join(f"rank {r}: {what}" for r, what in enumerate(everyone))
            raise CollectiveOrderError(
                f"the ranks' step-end collectives differ ({lines}): a phase issued a collective on some ranks only "
                "(raytrn.train.protocol: decide collectives from what every rank knows alike, never the rank)"
            )
