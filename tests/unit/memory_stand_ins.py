"""Stand-ins for the in-memory tier's actors in a unit test's process: they implement the same protocols as the
typed clients (raytrn.checkpoint.memory_clients: ``NodeStore``, ``SnapshotKeeper``), so a drift of a protocol fails
``tests/unit/test_memory_clients.py`` rather than a test that stands in for it with something else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from raytrn.checkpoint.memory_clients import Ensured, Leased, NodeStore
from raytrn.checkpoint.messages import Choice, Holding, ObjectLocation, Refusal, SlabLocation, StoresRewound
from raytrn.checkpoint.slabs import Lease
from raytrn.pending import Pending, Ready


class StandInStore:
    """A node's store: every answer at hand (nothing kept); ``locate`` answers ``located``, ``export`` ``exported``
    (each export's file name recorded); each seal answers ``held`` (None: refused); each seal's and drop's step
    recorded."""

    def __init__(
        self, located: SlabLocation | ObjectLocation | None = None, exported: ObjectLocation | None = None
    ) -> None:
        self.located, self.exported = located, exported
        self.held: int | None = 0
        self.sealed: list[int] = []
        self.dropped: list[int] = []
        self.exports: list[str] = []

    def lease(self, step: int, rank: int, sizes: Mapping[str, int], generation: int) -> Pending[Leased]:
        return Ready(Leased())

    def put_slab(self, step: int, rank: int, lease: Lease, generation: int) -> Pending[Refusal | None]:
        return Ready(None)

    def put(
        self, step: int, rank: int, refs: Mapping[str, Any], generation: int, sizes: Mapping[str, int]
    ) -> Pending[Refusal | None]:
        return Ready(None)

    def put_manifest(self, step: int, manifest: dict[str, Any], generation: int) -> Pending[Refusal | None]:
        return Ready(None)

    def seal(self, step: int, generation: int) -> Pending[int | None]:
        self.sealed.append(step)
        return Ready(self.held)

    def drop(self, step: int, generation: int) -> None:
        self.dropped.append(step)

    def holdings(self) -> Pending[dict[int, Holding]]:
        return Ready({})

    def rewind(self, step: int, generation: int) -> Pending[None]:
        return Ready(None)

    def locate(self, step: int, name: str) -> Pending[SlabLocation | ObjectLocation | None]:
        return Ready(self.located)

    def export(self, step: int, name: str) -> Pending[ObjectLocation | None]:
        self.exports.append(name)
        return Ready(self.exported)

    def close(self) -> Pending[None]:
        return Ready(None)


class StandInKeeper:
    """The run's keeper: a :class:`StandInStore` per node asked for, no snapshot to choose, each rewind answered
    ``rewound`` (its step recorded), or raising ``error`` (the keeper actor gone), and each retirement recorded (its
    stores forgotten)."""

    def __init__(self, rewound: StoresRewound | None = None, error: Exception | None = None) -> None:
        self.rewound, self.error = rewound or StoresRewound(1), error
        self.stores: dict[str, NodeStore] = {}
        self.rewinds: list[int] = []
        self.forgotten: list[int] = []
        self.retired: list[tuple[tuple[str, ...], int, int, int]] = []
        self.asks = 0

    def ensure(self, nodes: Sequence[str], *, timeout_s: float) -> Ensured:
        self.asks += 1
        for node in nodes:
            self.stores.setdefault(node, StandInStore())
        return Ensured(dict(self.stores), self.asks)

    def choose(self, *, timeout_s: float) -> Choice:
        return Choice(None, None, (), alive=tuple(sorted(self.stores)))

    def rewind(self, step: int, *, timeout_s: float) -> StoresRewound:
        if self.error is not None:
            raise self.error
        self.rewinds.append(step)
        return self.rewound

    def forget_rollback(self, first: int, *, timeout_s: float) -> None:
        self.forgotten.append(first)

    def retire(self, nodes: Sequence[str], step: int, generation: int, asked: int) -> None:
        self.retired.append((tuple(nodes), step, generation, asked))
        for node in nodes:
            self.stores.pop(node, None)
