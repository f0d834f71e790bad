"""``raytrn precheck``: run the real training step on torch-xla (CPU) and catch recompiles before a trn node is rented.

Every new graph shape is a Neuron compile (minutes each). The precheck runs the job's own step
(:func:`raytrn.train.step.train_step`, same batch shape, the job's logging cadence) ``steps`` times on
``PJRT_DEVICE=CPU`` and reports per step: graphs compiled, graph hash at the step's end, host-device
transfers (``.item()`` and friends), and the input shape. A compile after the warm-up steps fails the
check, with the step and the likely cause.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from raytrn.config import JobSpec
from raytrn.errors import ConfigError

SHRINK_MAX_LAYERS = 2
SHRINK_HIDDEN = 256


@dataclass(kw_only=True)
class StepRecord:
    step: int
    compiles: int
    host_syncs: int
    graph_hash: str
    input_shape: tuple[int, ...]
    logged: bool


@dataclass(kw_only=True)
class PrecheckReport:
    job: str
    warmup_steps: int
    records: list[StepRecord] = field(default_factory=list)
    data: str = ""
    model: str = ""

    @property
    def late_compiles(self) -> list[StepRecord]:
        return [r for r in self.records if r.step > self.warmup_steps and r.compiles]

    @property
    def distinct_graphs(self) -> int:
        return len({r.graph_hash for r in self.records})

    @property
    def ok(self) -> bool:
        return not self.late_compiles

    def reasons(self, r: StepRecord) -> list[str]:
        """Why step ``r`` compiled, judged against the steady steps before it."""
        before = [x for x in self.records if x.step < r.step]
        why = []
        if before and r.input_shape != before[-1].input_shape:
            why.append(f"input shape changed from {list(before[-1].input_shape)} to {list(r.input_shape)}")
        steady_syncs = {x.host_syncs for x in before if x.step > self.warmup_steps and x.logged == r.logged}
        if r.host_syncs and (not steady_syncs or r.host_syncs > max(steady_syncs)):
            why.append(
                f"{r.host_syncs} host-device sync(s) in this step (a lazy tensor read with .item()/float()/print "
                "inside the step cuts the graph: read metrics after the step's sync, as the loop does)"
            )
        if before and r.graph_hash != before[-1].graph_hash and not why:
            why.append("the step built a different graph (Python control flow depends on the step or on values)")
        return why or ["unknown: run with PT_XLA_DEBUG_LEVEL=2 for torch-xla's compilation analysis"]

    def render(self) -> str:
        lines = [f"== raytrn precheck: {self.job} ==", f"model  {self.model}", f"data   {self.data}", ""]
        lines.append("step  compiles  host-syncs  graph-hash        input      logged")
        for r in self.records:
            lines.append(
                f"{r.step:>4}  {r.compiles:>8}  {r.host_syncs:>10}  {r.graph_hash}  "
                f"{'x'.join(map(str, r.input_shape)):<9}  {'yes' if r.logged else ''}"
            )
        steady = [r for r in self.records if r.step > self.warmup_steps and not r.logged]
        lines += [
            "",
            f"distinct step graphs: {self.distinct_graphs}; compiles during warm-up (steps 1-{self.warmup_steps}): "
            f"{sum(r.compiles for r in self.records if r.step <= self.warmup_steps)}; after warm-up: "
            f"{sum(r.compiles for r in self.late_compiles)}",
            f"host-device syncs per steady step: {max((r.host_syncs for r in steady), default=0)} "
            "(metrics are read only on log steps)",
        ]
        for r in self.late_compiles:
            lines.append(f"step {r.step}: compiled {r.compiles} new graph(s): " + "; ".join(self.reasons(r)))
        lines.append(
            "verdict: PASS (no recompiles after warm-up)" if self.ok else "verdict: FAIL (recompiles after warm-up)"
        )
        return "\n".join(lines)


def shrink(job: JobSpec) -> JobSpec:
    """The job with a small model (depth and width) but the same vocabulary, sequence and batch shapes."""
    m = job.model
    heads = 4
    kv = heads if m.kv_heads == m.num_attention_heads else 2
    small = m.model_copy(
        update={
            "num_layers": min(m.num_layers, SHRINK_MAX_LAYERS),
            "hidden_size": min(m.hidden_size, SHRINK_HIDDEN),
            "intermediate_size": min(m.intermediate_size, 3 * SHRINK_HIDDEN),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
        }
    )
    return job.model_copy(update={"model": small})


def precheck(
    job: JobSpec,
    *,
    steps: int = 12,
    warmup_steps: int = 3,
    small: bool = False,
    batches: Iterator[Any] | None = None,
) -> PrecheckReport:
    """Run the job's step ``steps`` times on xla-cpu and record compiles, syncs and graph hashes per step."""
    if steps <= warmup_steps:
        raise ConfigError(f"precheck: --steps ({steps}) must be greater than --warmup ({warmup_steps})")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from raytrn.backends.xla import import_torch_xla

    import_torch_xla()
    import torch_xla.debug.metrics as met

    from raytrn.models import model_stats
    from raytrn.train.step import build_training, read_metrics, train_step

    if small:
        job = shrink(job)
    backend = _recording_backend()
    t = build_training(job, backend, world_size=job.scaling.min_workers if job.data.global_batch_size else 1)
    # Each micro-batch is its own graph on XLA: 2 of them show the first-vs-accumulating variants.
    t.grad_accum = min(t.grad_accum, 2)
    host_batches, data = (batches, "given batches") if batches is not None else _job_batches(job)
    shapes: list[tuple[int, ...]] = []
    # Record shapes as the step consumes them (the device loader prefetches ahead of the step).
    device_batches = _shape_recorder(backend.wrap_batches(host_batches), shapes)
    report = PrecheckReport(
        job=job.source, warmup_steps=warmup_steps, data=data, model=model_stats(job.model, job.data.seq_len).describe()
    )

    def counters() -> tuple[int, int]:
        transfers = met.metric_data("TransferFromDeviceTime")
        return int(met.counter_value("UncachedCompile") or 0), int(transfers[0] if transfers else 0)

    for step in range(1, steps + 1):
        compiles0, syncs0 = counters()
        n_shapes = len(shapes)
        result = train_step(t, device_batches, backend)
        logged = step % job.run.log_every == 0
        if logged:
            read_metrics(result, 1)  # the loop's metric read, at the loop's cadence
        compiles1, syncs1 = counters()
        report.records.append(
            StepRecord(
                step=step,
                compiles=compiles1 - compiles0,
                host_syncs=syncs1 - syncs0,
                graph_hash=backend.last_hash,
                input_shape=_odd_one_out(shapes[n_shapes:], shapes[0]),
                logged=logged,
            )
        )
    return report


def _recording_backend() -> Any:
    """xla-cpu, noting the hash of the graph that updates the parameters at the end of each step."""
    from raytrn.backends.xla import XlaCpuBackend

    class RecordingBackend(XlaCpuBackend):
        last_hash = "-"
        _params: list[Any] = []

        def reduce_gradients(self, optimizer: Any) -> None:
            self._params = [p for group in optimizer.param_groups for p in group["params"]]
            super().reduce_gradients(optimizer)

        def sync(self) -> None:
            import torch_xla

            self.last_hash = hashlib.sha1(bytes(torch_xla._XLAC._get_graph_hash(self._params))).hexdigest()[:16]
            super().sync()

    return RecordingBackend()


def _odd_one_out(step_shapes: list[tuple[int, ...]], usual: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batch shape of a step: one that differs from the usual shape if there is one."""
    return next((s for s in step_shapes if s != usual), usual)


def _shape_recorder(batches: Iterator[Any], shapes: list[tuple[int, ...]]) -> Iterator[Any]:
    for b in batches:
        shapes.append(tuple(b.shape))
        yield b


def _job_batches(job: JobSpec) -> tuple[Iterator[Any], str]:
    """Micro-batches of the job's shape: from its dataset when it is readable here, else random ids."""
    import torch

    mb, row = job.data.micro_batch_size, job.data.seq_len + 1
    try:
        from raytrn.train.checks import check_data

        manifest = check_data(job)
    except Exception as e:  # no local dataset: the shapes are what matters
        gen = torch.Generator().manual_seed(job.run.seed)

        def synthetic() -> Iterator[Any]:
            while True:
                yield torch.randint(0, job.model.vocab_size, (mb, row), generator=gen)

        return synthetic(), f"synthetic token ids [{mb} x {row}] (dataset not readable here: {e.__class__.__name__})"

    import numpy as np
    import pyarrow.parquet as pq

    from raytrn import storage

    def rows() -> Iterator[Any]:
        while True:
            for path in manifest.shard_paths():
                fs, inner = storage.filesystem(path)
                table = pq.read_table(inner, filesystem=fs, columns=["input_ids"])
                ids = np.stack(table.column("input_ids").to_numpy(zero_copy_only=False))
                for i in range(0, len(ids) - mb + 1, mb):  # drop_last, as the loop does
                    yield torch.from_numpy(ids[i : i + mb].astype(np.int64))

    return rows(), f"{manifest.root} ({manifest.num_rows:,} rows), micro-batches [{mb} x {row}]"
