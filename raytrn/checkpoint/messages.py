"""The in-memory tier's decisions, typed (they cross processes: a rank, its node's store, the keeper, rank 0).

- :class:`Refusal` (its kind a :class:`Refused`): why a snapshot's files, manifest or seal were not kept, or a
  snapshot not written; a stuck snapshot thread and the warnings' de-duplication read the kind.
- :class:`PassedOver` (its kind a :class:`Passed`): why a restart passed over a newer snapshot; the restart's record
  on the job's board carries :meth:`PassedOver.record` (JSON-compatible fields).
- :class:`SlabLocation`, :class:`ObjectLocation`: where a store holds a file (:meth:`RayStore.locate`).
- :class:`Holding`, :class:`Choice`, :class:`StoresRewound`: a store's holdings, the keeper's choice at a restart,
  its answer to a rewind (the actors' typed clients return them: :mod:`raytrn.checkpoint.memory_clients`).

Each is rendered to English once, by :func:`render`, where it is shown (a log line, the board's record).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Refused(Enum):
    """Why (part of) a snapshot was not kept."""

    STALE = "stale"  # sent by an older worker group (a newer one started since)
    NOT_NEWER = "not_newer"  # not newer than the store's complete snapshot
    NO_ROOM = "no_room"  # past the store's bound (checkpoint.memory_store_gib)
    NOT_ARRIVED = "not_arrived"  # the rank's objects did not reach the store
    SLAB_FREED = "slab_freed"  # the rank's slab was freed (or re-leased) before its files were kept
    NO_STORE = "no_store"  # no store on a node the copies belong on
    COPIES_FAILED = "copies_failed"  # the copies to the stores raised
    COPIES_LATE = "copies_late"  # the stores did not answer in time
    NOT_STAGED = "not_staged"  # the rank could not copy its state to host memory
    NOT_WRITTEN = "not_written"  # the rank's DCP write into memory raised
    NOT_AGREED = "not_agreed"  # the ranks' agreement on it failed (a rank gone)
    WRITE_LATE = "write_late"  # the rank's snapshot thread did not end in time (it may still be in a collective)
    SEAL_UNANSWERED = "seal_unanswered"  # a store did not answer the seal
    NOT_REWOUND = "not_rewound"  # the stores could not be rewound for a new worker group


@dataclass(frozen=True)
class Refusal:
    """A :class:`Refused` kind and its detail: the snapshot's ``step``, the ``rank`` concerned (None: the manifest,
    or the whole snapshot), and what the kind names (the other fields keep their defaults otherwise)."""

    kind: Refused
    step: int
    rank: int | None = None
    generation: int = 0  # STALE: the sender's worker group
    current: int = 0  # STALE: the stores' newest worker group
    sealed: int = 0  # NOT_NEWER: the complete snapshot's step
    nbytes: int = 0  # NO_ROOM: what the rank's files need
    held: int = 0  # NO_ROOM: what the store holds beside them
    capacity: int = 0  # NO_ROOM: the store's bound
    nodes: tuple[str, ...] = ()  # NO_STORE: the nodes without a store
    timeout_s: float = 0.0  # COPIES_LATE, WRITE_LATE
    error: str = ""  # the exception, as ``Type: message`` (NOT_ARRIVED: its type only)


#: What one rank's put, publish or snapshot reports: every refusal, in order; empty when everything was kept.
Refusals = tuple[Refusal, ...]


class Passed(Enum):
    """Why a restart passed over a newer snapshot."""

    NO_MANIFEST = "no_manifest"  # no live store holds its manifest
    RANKS_MISSING = "ranks_missing"  # no live store holds some rank's files
    UNASKED = "unasked"  # the stores could not be asked at all (``step`` None)


@dataclass(frozen=True)
class PassedOver:
    """A snapshot a restart passed over (``step``; None: the stores could not be asked) and why: its kind and the
    nodes concerned. ``complete``: it was sealed on a live store (so whole once); ``lost_nodes``: the lost nodes that
    held the only copies; ``gone_nodes``: the group's nodes that no longer answer; ``missing`` of ``world_size``: the
    ranks without files on a live store."""

    step: int | None
    kind: Passed
    complete: bool = False
    lost_nodes: tuple[str, ...] = ()
    gone_nodes: tuple[str, ...] = ()
    missing: tuple[int, ...] = ()
    world_size: int = 0
    error: str = ""  # UNASKED: the exception, as ``Type: message``

    def record(self) -> dict[str, Any]:
        """JSON-compatible fields for the job's board (and the English, ``why``)."""
        return {
            "step": self.step,
            "kind": self.kind.value,
            "complete": self.complete,
            "lost_nodes": list(self.lost_nodes),
            "gone_nodes": list(self.gone_nodes),
            "missing": list(self.missing),
            "world_size": self.world_size,
            "why": render(self),
        }


@dataclass(frozen=True)
class SlabLocation:
    """A file in a store's slab (:mod:`raytrn.checkpoint.slabs`): read it in place on the store's node."""

    path: str
    offset: int
    size: int


@dataclass(frozen=True)
class ObjectLocation:
    """A file as an object in Ray's object store (a uint8 array): ``ref``, its ObjectRef."""

    ref: Any


@dataclass
class Holding:
    """What one store holds of one snapshot: the ranks whose files it has, the manifest when it has it, and whether
    the snapshot was sealed there (complete: every rank's files and the manifest were kept everywhere)."""

    ranks: set[int] = field(default_factory=set)
    manifest: dict[str, Any] | None = None
    nbytes: int = 0
    sealed: bool = False


@dataclass(frozen=True)
class Choice:
    """The snapshot a restart can use (``step`` None: none), and why each newer one was passed over."""

    step: int | None
    manifest: dict[str, Any] | None
    skipped: tuple[PassedOver, ...]
    alive: tuple[str, ...] = ()  # the nodes whose stores answered (MemoryTier.choose)


@dataclass(frozen=True)
class StoresRewound:
    """The keeper's answer to a rewind (:meth:`MemoryTier.rewind`): the new worker group's ``generation`` (sent with
    each of its changes to the stores) and the nodes whose store did not answer in time (``late``)."""

    generation: int
    late: tuple[str, ...] = ()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def render(what: Refusal | Sequence[Refusal] | PassedOver) -> str:
    """The English for a refusal (several: joined with ``; ``) or a passed-over snapshot: the one place it is made."""
    if isinstance(what, PassedOver):
        return _passed(what)
    if not isinstance(what, Refusal):
        return "; ".join(render(r) for r in what)
    r, at = what, f"rank {what.rank}'s snapshot {what.step}"
    match r.kind:
        case Refused.STALE:
            stale = f"from an older worker group (generation {r.generation}; the stores are at {r.current})"
            return f"{at} refused: {stale}" if r.rank is not None else f"snapshot {r.step}'s manifest refused: {stale}"
        case Refused.NOT_NEWER:
            return f"snapshot {r.step} is not newer than the complete snapshot {r.sealed}"
        case Refused.NO_ROOM:
            return f"{at} needs {_mib(r.nbytes)} MiB; this node's store holds {_mib(r.held)} of {_mib(r.capacity)} MiB"
        case Refused.NOT_ARRIVED:
            return f"{at}: its files did not arrive ({r.error})"
        case Refused.SLAB_FREED:
            return f"{at}: its slab was freed before its files were kept"
        case Refused.NO_STORE:
            return f"no memory store on node(s) {', '.join(r.nodes)}"
        case Refused.COPIES_FAILED:
            return f"snapshot {r.step}: rank {r.rank}'s copies failed ({r.error})"
        case Refused.COPIES_LATE:
            return f"snapshot {r.step}: rank {r.rank}'s copies not kept within {r.timeout_s:.0f} s"
        case Refused.NOT_STAGED:
            return f"snapshot {r.step}: not staged on rank {r.rank} ({r.error})"
        case Refused.NOT_WRITTEN:
            return f"snapshot {r.step}: not written ({r.error})"
        case Refused.NOT_AGREED:
            return f"snapshot {r.step}: not agreed ({r.error})"
        case Refused.WRITE_LATE:
            return f"snapshot {r.step}: not written within {r.timeout_s:.0f} s"
        case Refused.SEAL_UNANSWERED:
            return f"snapshot {r.step}: a store did not answer the seal"
        case Refused.NOT_REWOUND:
            return f"could not rewind the stores to step {r.step} ({r.error})"


def _passed(p: PassedOver) -> str:
    match p.kind:
        case Passed.UNASKED:
            return f"could not ask the stores ({p.error})"
        case Passed.NO_MANIFEST:
            lost = ", ".join(p.lost_nodes)
            where = (
                f"{'complete, but ' if p.complete else ''}its only copies were on lost node(s) {lost}"
                if p.lost_nodes
                else "complete, but its only copies were on nodes that no longer answer"
                if p.complete
                else "never completed, or only on lost nodes"
            )
            return f"snapshot {p.step}: no manifest on a live node ({where})"
        case Passed.RANKS_MISSING:
            where = (
                f" (their only copies were on lost node(s) {', '.join(p.lost_nodes)})"
                if p.lost_nodes
                else f" (node(s) {', '.join(p.gone_nodes)} no longer answer: lost, with the copies they held)"
                if p.gone_nodes
                else ""
            )
            missing = ", ".join(map(str, p.missing))
            return f"snapshot {p.step}: rank(s) {missing} of {p.world_size} missing{where}"


def error_text(e: BaseException) -> str:
    """An exception as a refusal's ``error`` carries it: ``Type: message``."""
    return f"{type(e).__name__}: {e}"
