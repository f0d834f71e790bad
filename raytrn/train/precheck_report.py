"""What ``raytrn precheck`` reports: per step, the graphs compiled, the host syncs and the graph hash, the verdict
and its reasons (:mod:`raytrn.train.precheck`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raytrn.config.stages import SCHEDULES

if TYPE_CHECKING:
    from raytrn.config import JobSpec

#: Said when the ring stops a block compiled with fullgraph=True (a context-parallel job on neuron).
RING_FIX = (
    "the job compiles its decoder blocks with fullgraph=True around a ring that must run eagerly "
    "(ring_attention is torch.compiler.disable'd: Dynamo cannot trace its point-to-point transfers), so on neuron "
    "the run stops at the first attention; raytrn/train/parallelize.py must compile around the ring (each block "
    "with fullgraph=False, before activation checkpointing)"
)


#: The frozen XLA path's precheck (:mod:`raytrn.xla.backend`).
XLA_MODE = "torch-xla, PJRT_DEVICE=CPU"


@dataclass(kw_only=True)
class StepRecord:
    step: int
    compiles: int
    host_syncs: int | None  # None: not measured (the torch.compile path has no lazy graph to cut)
    graph_hash: str
    input_shape: tuple[int, ...]
    logged: bool
    #: A pipelined job's: the graphs each stage compiled in this step (``compiles`` is their sum).
    stage_compiles: tuple[int, ...] = ()


@dataclass(kw_only=True)
class PrecheckReport:
    job: str
    warmup_steps: int
    records: list[StepRecord] = field(default_factory=list)
    data: str = ""
    model: str = ""
    memory: str = ""
    #: How the step ran: torch-xla's CPU device, or torch.compile on CPU.
    mode: str = XLA_MODE
    #: What a one-process check of a multi-process layout covered, and what not (pipeline, context parallel).
    scope: list[str] = field(default_factory=list)
    #: The torch.compile path: Dynamo's reason for the first graph break (the run stopped there).
    graph_break: str = ""
    #: A context-parallel job whose blocks were compiled with fullgraph=True: the graph break at the ring.
    ring_break: str = ""
    #: Graph breaks Dynamo took under fullgraph=False: reason -> count.
    breaks: dict[str, int] = field(default_factory=dict)
    #: A pipelined job's stages, in order: what each holds and which rank.
    stages: list[str] = field(default_factory=list)
    #: Modules no compiled graph ran (eager on the device), decoder layers folded (``model.layers.0-1``).
    eager: list[str] = field(default_factory=list)
    #: Whole decoder layers among them, and why (fails the check).
    uncompiled: str = ""

    @property
    def late_compiles(self) -> list[StepRecord]:
        return [r for r in self.records if r.step > self.warmup_steps and r.compiles]

    @property
    def distinct_graphs(self) -> int:
        return len({r.graph_hash for r in self.records})

    @property
    def stray_breaks(self) -> dict[str, int]:
        """Graph breaks away from the ring (the one place a context-parallel step may break)."""
        return {reason: n for reason, n in self.breaks.items() if not at_ring(reason)}

    @property
    def stage_graphs(self) -> list[int]:
        """A pipelined job's graphs compiled per stage over the run."""
        return [sum(r.stage_compiles[s] for r in self.records) for s in range(len(self.stages))]

    @property
    def failures(self) -> list[str]:
        found = [
            (self.graph_break, "graph break"),
            (self.ring_break, "graph break at the ring under fullgraph=True"),
            (self.stray_breaks, "graph break away from the ring"),
            (self.uncompiled, "decoder layers in no compiled graph"),
            (self.late_compiles, "recompiles after warm-up"),
        ]
        return [what for failed, what in found if failed]

    @property
    def ok(self) -> bool:
        return not self.failures

    def reasons(self, r: StepRecord) -> list[str]:
        """Why step ``r`` compiled, judged against the steady steps before it."""
        before = [x for x in self.records if x.step < r.step]
        why = []
        if before and r.input_shape != before[-1].input_shape:
            why.append(f"input shape changed from {list(before[-1].input_shape)} to {list(r.input_shape)}")
        steady_syncs = {
            x.host_syncs for x in before if x.step > self.warmup_steps and x.logged == r.logged and x.host_syncs
        }
        if r.host_syncs and (not steady_syncs or r.host_syncs > max(steady_syncs)):
            why.append(
                f"{r.host_syncs} host-device sync(s) in this step (a lazy tensor read with .item()/float()/print "
                "inside the step cuts the graph: read metrics after the step's sync, as the loop does)"
            )
        if r.host_syncs is None:  # torch.compile: a compile always adds a graph; Dynamo's guards say why
            return why or [
                "a Dynamo guard failed (a Python value the model reads changed): run with TORCH_LOGS=recompiles"
            ]
        if before and r.graph_hash != before[-1].graph_hash and not why:
            why.append("the step built a different graph (Python control flow depends on the step or on values)")
        return why or ["unknown: run with PT_XLA_DEBUG_LEVEL=2 for torch-xla's compilation analysis"]

    def render(self) -> str:
        lines = [f"== raytrn precheck: {self.job} ==", f"mode   {self.mode}", f"model  {self.model}"]
        lines += [f"data   {self.data}"] + [f"memory {self.memory} (estimated before the run)"] * bool(self.memory)
        lines += [f"scope  {line}" for line in self.scope]
        if self.ring_break:
            lines += ["", f"step 1: graph break at the ring (fullgraph=True stops the run here): {self.ring_break}"]
            lines.append(RING_FIX)
        lines += ["", "step  compiles  host-syncs  graph-hash        input      logged"]
        for r in self.records:
            syncs = "-" if r.host_syncs is None else str(r.host_syncs)
            lines.append(
                f"{r.step:>4}  {r.compiles:>8}  {syncs:>10}  {r.graph_hash}  "
                f"{'x'.join(map(str, r.input_shape)):<9}  {'yes' if r.logged else ''}"
            )
        if self.stages:
            lines += ["", "stage  graphs  after warm-up  holds"]
            for s, what in enumerate(self.stages):
                late = sum(r.stage_compiles[s] for r in self.late_compiles)
                lines.append(f"{s:>5}  {self.stage_graphs[s]:>6}  {late:>13}  {what}")
        steady = [r for r in self.records if r.step > self.warmup_steps and not r.logged]
        lines += [
            "",
            f"distinct step graphs: {self.distinct_graphs}; compiles during warm-up (steps 1-{self.warmup_steps}): "
            f"{sum(r.compiles for r in self.records if r.step <= self.warmup_steps)}; after warm-up: "
            f"{sum(r.compiles for r in self.late_compiles)}",
        ]
        if self.stages and self.records:
            graphs = self.stage_graphs
            lines.append(
                "one graph per stage"
                if set(graphs) == {1}
                else "graphs per stage: " + ", ".join(f"stage {s}: {n}" for s, n in enumerate(graphs))
            )
        if any(r.host_syncs is not None for r in self.records):
            lines.append(
                f"host-device syncs per steady step: {max((r.host_syncs or 0 for r in steady), default=0)} "
                "(metrics are read only on log steps)"
            )
        if self.breaks:
            ring = sum(n for reason, n in self.breaks.items() if at_ring(reason))
            lines.append(
                f"graph breaks (fullgraph=False): {ring} at the ring (ring_attention and the calls into it; the ring "
                "and its point-to-point transfers run eagerly)"
                + "".join(f"; {n} elsewhere: {reason}" for reason, n in self.stray_breaks.items())
            )
        if self.eager:
            lines.append(f"eager  {', '.join(self.eager)} (no compiled graph ran them: eager on the device)")
        if self.uncompiled:
            lines.append(self.uncompiled)
        for r in self.late_compiles:
            per_stage = ""
            if r.stage_compiles:
                per_stage = " (" + ", ".join(f"stage {s}: {n}" for s, n in enumerate(r.stage_compiles) if n) + ")"
            lines.append(f"step {r.step}: compiled {r.compiles} new graph(s){per_stage}: " + "; ".join(self.reasons(r)))
        if self.graph_break:
            step = len(self.records) + 1
            lines.append(f"step {step}: graph break (fullgraph=True stops the run here): {self.graph_break}")
        failures = self.failures
        lines.append(
            f"verdict: FAIL ({'; '.join(failures)})" if failures else "verdict: PASS (no recompiles after warm-up)"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class MemoryEstimate:
    """Host memory one precheck step needs on xla-cpu (the XLA "device" is host memory), in bytes."""

    state: int  # parameters, gradients and AdamW's two moments
    activations: int  # what the decoder layers keep for backward, attention scores included
    logits: int  # the output head's logits and the loss's fp32 copies
    runtime: int  # the Python process with torch and torch-xla loaded, and the compiler

    @property
    def total(self) -> int:
        return self.state + self.activations + self.logits + self.runtime

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"about {self.total / gib:.1f} GiB (weights, gradients and AdamW {self.state / gib:.1f} GiB, activations "
            f"{self.activations / gib:.1f} GiB, logits {self.logits / gib:.1f} GiB, runtime {self.runtime / gib:.1f} GiB)"
        )


def pipeline_stages(job: JobSpec) -> int:
    """The stages of ``job``'s pipeline (pipeline ranks x the schedule's stages a rank); 1 without one."""
    p = job.parallel
    return p.pipeline_parallel_size * SCHEDULES[p.pipeline_schedule][1] if p.pipeline_parallel_size > 1 else 1


def at_ring(reason: str) -> bool:
    """Whether a graph break is the ring's (:func:`~raytrn.models.context_parallel.ring_attention`, run eagerly)."""
    from raytrn.models.context_parallel import ring_attention

    return ring_attention.__name__ in reason
