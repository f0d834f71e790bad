"""``checkpoint.async``'s staging beside the next step: the copy of the state to host memory is not waited for at the
save but before the next optimizer step, the first thing that changes the state in place.

A save with ``checkpoint.async`` used to copy every tensor of the state to host memory before the training thread
went on (torch DCP's ``async_save`` with its default stager), then write that copy in a background thread: the step
waited for the copy (~8 ms of the tiny model's ~35 ms blocked on S3; most of the rest was making an S3 filesystem,
now kept: :func:`raytrn.storage.s3_filesystem`). Now DCP's own stager copies in a thread of its own
(``StagingOptions(use_async_staging=True)``) while the next step's forward and backward read the weights, which they
do not change; an optimizer step pre-hook (:meth:`torch.optim.Optimizer.register_step_pre_hook`) waits for the copy
before the optimizer updates the weights and its state in place, and so does a restore into the same tensors
(:meth:`Staging.wait`). The write then runs as before, from the copy. What the step still waits for is the part of
the copy its forward and backward did not cover (:attr:`Staging.waited_s`).

One stager for a training's saves: it keeps its host buffers from one save to the next (DCP's ``StateDictStager``
caches them by the source tensor's storage), so the next save copies into memory already faulted in; the next save
starts only once the previous one's write is done (:class:`raytrn.checkpoint.sharded.DcpCheckpoints`), so its copy
never overwrites buffers still being written.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from typing import Any

import torch

log = logging.getLogger(__name__)


def staging_or_none() -> Staging | None:
    """A :class:`Staging`, or None where DCP's stager cannot be made here (its thread makes a ``torch.Stream`` on any
    accelerator torch reports): the save then copies before it returns, as before, with one warning."""
    try:
        return Staging()
    except Exception as e:  # noqa: BLE001 - the copy at the save is the fallback, never a failed job
        log.warning(
            "checkpoint.async: the state is copied to host memory at each save (staging beside the step: %s)", e
        )
        return None


class Staging:
    """A training's asynchronous staging: the stager DCP's ``async_save`` is given, and the copy in flight."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,  # host memory that stays mapped: pinning is for a GPU's DMA
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        self._copy: Future[Any] | None = None
        self._hooked: tuple[torch.optim.Optimizer, Any] | None = None
        #: Seconds the training thread waited for copies (at optimizer steps and restores), and how often.
        self.waited_s = 0.0
        self.waits = 0

    def started(self, copy: Future[Any], optimizer: torch.optim.Optimizer) -> None:
        """A save's copy is in flight: ``optimizer``'s next step waits for it first."""
        self.wait()  # (a copy in flight is waited for by every caller before it saves again; this is the backstop)
        self._copy = copy
        if self._hooked is None or self._hooked[0] is not optimizer:
            if self._hooked is not None:
                self._hooked[1].remove()
            self._hooked = (optimizer, optimizer.register_step_pre_hook(lambda *_: self.wait()))

    def wait(self) -> None:
        """Wait for the copy in flight, if any (its error, if it failed, is the write's: the save's future raises
        it)."""
        copy, self._copy = self._copy, None
        if copy is None:
            return
        if not copy.done():
            t0 = time.perf_counter()
            with contextlib.suppress(Exception):
                copy.result()
            self.waited_s += time.perf_counter() - t0
            self.waits += 1

    def close(self) -> None:
        """Wait for the copy, unhook the optimizer and stop the stager's thread (its host buffers go with it)."""
        self.wait()
        if self._hooked is not None:
            self._hooked[1].remove()
            self._hooked = None
        self.stager.close()
