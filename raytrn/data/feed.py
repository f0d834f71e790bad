"""A training worker's data feed: its rows of every global batch, from where the run stands, as micro-batches.

Every data-parallel rank takes its slice of each global batch of the job's one seeded global order
(:mod:`raytrn.data.order`), streamed by Ray Data's readers (:mod:`raytrn.data.source`); ranks of a tensor-parallel
group share a data-parallel rank and read the same rows. The first batch is fetched in the background at once, while
the model builds; until the first step is done the rows are read in this process (a Ray Data read task starts a
process: seconds), Ray Data's readers after it. With ``RAYTRN_SAMPLE_TRACE`` set, every
micro-batch's global row ids are written to a trace file (the exactly-once tests read it); with ``RAYTRN_PACE_S``
set, a micro-batch comes at most once per that many seconds (the chaos tests' pace).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from raytrn.data.batch import attention, to_torch
from raytrn.data.manifest import Manifest
from raytrn.data.order import SAMPLE_TRACE_ENV, Position, RankSlice, SampleOrder, pace_s
from raytrn.data.source import rank_batches

if TYPE_CHECKING:
    from raytrn.config import JobSpec


class DataFeed:
    """This worker's rows: its data-parallel rank's share of every global batch (``global_batch`` rows) in the job's
    global order."""

    def __init__(self, job: JobSpec, manifest: Manifest, *, dp: int, dp_rank: int, global_batch: int) -> None:
        self.job, self.manifest = job, manifest
        self.order = SampleOrder.for_job(manifest, job)
        self.part = RankSlice(rank=dp_rank, size=dp, global_batch=global_batch)
        self.row_len = job.data.seq_len + 1
        #: Attention kept inside each document: the rows' segment ids (instruction data) or their EOS (text).
        self.document = attention(job, manifest) == "document"
        #: Set at the first step: Ray Data's readers take over from reads in this process (raytrn.data.source)
        self.stepped = threading.Event()

    def advance(self, progress: Any) -> None:
        """One optimizer step consumed a global batch: ``progress``'s data position (``epoch``, ``epoch_samples``,
        what a checkpoint saves) moves with it."""
        position = Position(epoch=progress.epoch, samples=progress.epoch_samples)
        position.advance(self.part.global_batch, self.order.num_rows)
        progress.epoch, progress.epoch_samples = position.epoch, position.samples
        self.stepped.set()

    def start(self, progress: Any, rank: int, *, resumed_from: str | None = None) -> StartEarly:
        """:meth:`batches` from where ``progress`` says (epoch, rows consumed, step), the first batch fetched at once
        in the background."""
        position = Position(epoch=progress.epoch, samples=progress.epoch_samples)  # a copy: the loop moves on
        trace = SampleTrace.open(rank, progress.step, self, resumed_from=resumed_from)
        return StartEarly(lambda: self.batches(position, trace))

    def batches(self, position: Position, trace: SampleTrace | None = None) -> Iterator[torch.Tensor]:
        """Endless micro-batches of shape [micro_batch_size, seq_len + 1] from ``position`` (epoch, rows)."""
        mb = self.job.data.micro_batch_size
        pace, last = pace_s(os.environ), 0.0
        for batch in rank_batches(self.manifest, self.order, self.part, position, batch_rows=mb, handover=self.stepped):
            if trace is not None:
                trace.record(batch)
            if pace:
                time.sleep(max(0.0, last + pace - time.monotonic()))
                last = time.monotonic()
            yield to_torch(batch, document=self.document, eos_id=self.manifest.tokenizer.eos_id)


class SampleTrace:
    """``$RAYTRN_SAMPLE_TRACE/group-<first step>-dp<size>-<start ns>-rank<r>.jsonl``: one line per micro-batch,
    ``{"step", "dp_rank", "rows"}`` (global row ids, in order) and the first tokens of each row. An audit of
    what a run trained on; the exactly-once tests read it."""

    def __init__(self, path: str, first_step: int, grad_accum: int, dp_rank: int) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (one line per micro-batch, closed at exit)
        self._micro, self._first_step, self._accum, self._dp_rank = 0, first_step, grad_accum, dp_rank

    @classmethod
    def open(cls, rank: int, first_step: int, feed: DataFeed, *, resumed_from: str | None = None) -> SampleTrace | None:
        directory = os.environ.get(SAMPLE_TRACE_ENV)
        if not directory:
            return None
        os.makedirs(directory, exist_ok=True)
        # Ranks of one group agree on the step they start at and their number, not on a clock.
        name = f"group-{first_step:08d}-dp{feed.part.size}-{time.time_ns()}-rank{rank}.jsonl"
        path = os.path.join(directory, name)
        accum = feed.part.rows_per_step // feed.job.data.micro_batch_size
        trace = cls(path, first_step, accum, feed.part.rank)
        if resumed_from is not None:  # the first line: which committed checkpoint the group resumed from
            trace._file.write(json.dumps({"resumed_from": resumed_from, "step": first_step}) + "\n")
        return trace

    def record(self, batch: Any) -> None:
        step = self._first_step + self._micro // self._accum + 1
        heads = batch.tokens[:, :4].tolist()
        line = {"step": step, "dp_rank": self._dp_rank, "rows": batch.row_ids.tolist(), "heads": heads}
        self._file.write(json.dumps(line) + "\n")
        self._micro += 1


class StartEarly:
    """An iterator whose first item is fetched at once in a background thread (the first Ray Data read
    takes seconds); later items come from the same iterator in the caller's thread."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._first: list[Any] = []
        self._error: BaseException | None = None
        self._it: Iterator[Any] | None = None
        self._make = make
        self._thread = threading.Thread(target=self._fetch, name="raytrn-first-batch", daemon=True)
        self._thread.start()

    def _fetch(self) -> None:
        try:
            self._it = iter(self._make())
            self._first.append(next(self._it))
        except BaseException as e:  # re-raised in the caller's thread by __next__
            self._error = e

    def __iter__(self) -> StartEarly:
        return self

    def __next__(self) -> Any:
        self._thread.join()  # at once after the first item
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._first:
            return self._first.pop()
        assert self._it is not None
        return next(self._it)
