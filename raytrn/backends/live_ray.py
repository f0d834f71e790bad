"""raytrn's Ray Train backend for ``scaling.recovery: live``: replica groups of one worker, and the store they re-form on.

Ray Train V2 (2.60) replaces only a failing *replica group* when the backend class says ``has_replica_groups`` and
the scaling policy keeps the group's size (``TrainController._execute_resize_decision``; otherwise it restarts the
whole group): the survivors' actors, processes and state stay, and the replacement worker is created in the lost
one's slot, a placement group of its own asked for anew off the lost node (:mod:`raytrn.compat.replica_slots`;
raytrn's controller waits for it to be placed). Ray
makes replica groups of exactly one worker (its own TODO: larger ones later), which is what raytrn's live recovery
trains with today (hsdp with shard groups of one worker: :mod:`raytrn.config.layout`).

What this backend adds to Ray's: the c10d ``TCPStore`` the replicas re-form their process group on
(:mod:`raytrn.train.live.group`), served by this backend object, which lives as long as the controller (in the
driver's process: :func:`raytrn.compat.hosted_trainer`), so it outlives every worker; and each worker's place in it:
a *session* per full start of the group (a restart begins a new live group), and whether the worker founds the
session's group (a full start) or joins it (a replacement). ``has_replica_groups`` is a class attribute of Ray's
public ``Backend`` that Ray does not document: set by :func:`raytrn.compat.with_replica_groups`, listed in
:data:`raytrn.compat.PRIVATE_NAMES` (its test fails when it moves). The torch process group is formed by the workers themselves (no ``init_process_group`` here).

Ray's controller runs no preemption watcher for replica groups, so this backend watches in its place: a thread polls
Ray's draining nodes (:func:`raytrn.compat.drain_deadlines`) every :data:`DRAIN_POLL_S` and sets each one's key in the
store (:func:`draining_key`, its value the drain's deadline), which the replica on that node reads at its next step
and leaves the live group (:mod:`raytrn.train.live.notice`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.train.backend import Backend as RayBackend

from raytrn.ahead import import_ahead
from raytrn.backends.ray_backend import ProcessGroupConfig, prepare_worker, warn_without_handler
from raytrn.compat import drain_deadlines, with_replica_groups

#: The environment a live worker reads its store and place from (:func:`raytrn.train.live_loop.live_place`).
STORE_ENV, SESSION_ENV, JOINING_ENV = "RAYTRN_LIVE_STORE", "RAYTRN_LIVE_SESSION", "RAYTRN_LIVE_JOINING"
#: How often the driver asks Ray which nodes are draining (one GCS call).
DRAIN_POLL_S = 1.0


def draining_key(node_id: str) -> str:
    """The store key (outside every session's prefix) set while Ray drains node ``node_id``."""
    return f"live-draining/{node_id}"


def watch_draining(
    store: Any, alive: Callable[[], bool], poll_s: float = DRAIN_POLL_S,
    draining: Callable[[], dict[str, float | None]] = drain_deadlines,
) -> threading.Thread:  # fmt: skip
    """Start a daemon thread that sets :func:`draining_key` in ``store`` for every node ``draining()`` names (node id
    -> the drain's deadline, epoch seconds, or None), every ``poll_s``, while ``alive()``: the key's value is the
    deadline (``"0"``: none). A failed poll (Ray busy) is tried again at the next."""

    def watch() -> None:
        seen: set[str] = set()
        while alive():
            try:
                for node, deadline in draining().items():
                    if node in seen:
                        continue
                    store.set(draining_key(node), f"{deadline or 0:.3f}")
                    seen.add(node)
            except Exception:  # the GCS did not answer this time, or the store is closing: the next poll tries
                pass
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="raytrn-live-drain-watch", daemon=True)
    thread.start()
    return thread


@dataclass
class LiveGroupConfig(ProcessGroupConfig):
    """``scaling.recovery: live``'s backend: the process groups' backend (gloo) and, as ``timeout_s``, the job's
    ``scaling.peer_timeout_s`` (the workers form their groups themselves: :mod:`raytrn.train.live.group`)."""

    @property
    def backend_cls(self) -> type:
        return LiveGroupBackend

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "recovery": "live"}

    @property
    def worker_timeout_s(self) -> float | None:
        """A frozen replica (SIGSTOP, a hung host) is given up, killed and replaced after as long as the others'
        collectives wait for it (Ray's 600 s would keep its slot and the run's end waiting)."""
        return self.timeout_s


@with_replica_groups  # Ray Train V2 replaces only the failing replica group (one worker), not every worker
class LiveGroupBackend(RayBackend):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self._store: Any = None
        self._address = ""
        self._session = 0

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        """A full start (a ``WorkerGroup``: it has replica groups) begins a new session whose workers found its live
        group; a replica group's start (a replacement) joins the current one."""
        if self._store is None:
            self._address = self._serve()
        joining = not hasattr(worker_group, "get_replica_groups")
        if not joining:
            self._session += 1
        setup = (backend_config.worker_env, backend_config.tune_malloc, backend_config.ahead)
        warn_without_handler(worker_group.execute(start_live_worker, self._address, self._session, joining, *setup))

    def _serve(self) -> str:
        """Start the store's server in this process (the controller's: the driver's), on a free port."""
        from datetime import timedelta

        import ray
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        backend = weakref.ref(self)  # the watch ends with this backend (the trainer's) or Ray
        watch_draining(self._store, lambda: backend() is not None and ray.is_initialized())
        return f"{host}:{self._store.port}"


def start_live_worker(
    address: str,
    session: int,
    joining: bool,
    env: dict[str, str] | None = None,
    tune_malloc: bool = False,
    ahead: tuple[str, ...] = (),
) -> bool:
    """On a worker's main thread: the driver's variables and the allocator (:func:`prepare_worker`), where its live
    group's store is, its session, whether it joins; the SIGTERM handler. Returns whether the handler is installed."""
    from raytrn.sigterm import install_sigterm_handler

    prepare_worker(env or {}, tune_malloc)
    os.environ.update({STORE_ENV: address, SESSION_ENV: str(session), JOINING_ENV: "1" if joining else "0"})
    installed = install_sigterm_handler()
    import_ahead(ahead)  # a replacement's imports beside Ray Train's set-up of it (import_ahead)
    return installed
