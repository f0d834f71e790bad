"""The training loop of ``scaling.recovery: live`` (:mod:`raytrn.train.live`), run by Ray Train on every worker.

Every worker is one whole model replica (hsdp with shard groups of one worker). The workers of a full start of the
group *found* a live group; a worker Ray Train starts to replace a lost one (when capacity returns) *joins* it and
receives the state from a live replica. Each step every replica reads the whole global batch (the same rows in the
same order as any other run of the job: :mod:`raytrn.data.order`) and trains its share of the micro-batches
(:func:`raytrn.train.live.step.share`); a replica lost mid-step makes the survivors re-form and redo that step, so
no survivor restarts, nothing is restored and every row is trained once per epoch in the job's order.

What it keeps of the restart path's loop (:mod:`raytrn.train.loop`): the checkpoints (found and restored at a full
start, saved at checkpoint steps by every live replica: DCP over the live group, synchronous), the metrics rank 0
logs at log steps, the evaluation (every replica evaluates the whole validation set on its own copy of the model: no
collective that a lost replica could break, the same scores at any number of replicas; the live rank 0 logs them),
the non-finite guard (a NaN/inf step's update is skipped on every replica alike; at ``run.max_nonfinite_steps`` in a
row, ``run.on_nonfinite: rollback`` rolls back *in place*: the live replicas load the newest committed checkpoint
and skip the diverging steps' global batches, no process restarts; once per job, as the restart path's), the final
model, preemption notices (:mod:`raytrn.train.live.notice`: a replica whose node is drained or that got a SIGTERM
trains its share of one more step and leaves; the others train on without it; when every replica has one, they
checkpoint that step and wait for their nodes to go, as the restart path does), the hang watchdog
(:func:`raytrn.train.watchdog.live_hang_watch`: a replica hung outside a collective, its heartbeat beating, dumps its
stacks and exits; Ray Train replaces it and the replacement joins live), the memory tier
(:mod:`raytrn.train.live_snapshots`: the live rank 0 snapshots its whole replica alone; a full start resumes from it).
Where the time goes is measured as the restart path's loop measures it (:class:`raytrn.train.goodput.GoodputClock`):
the attempts a lost replica aborted, the re-formations, the admissions and a rollback's load are the ledger's
``restart`` time, the steps trained again after a rollback its ``retrained`` time.
Each re-formation is logged to the MLflow run: ``raytrn.recovery: live`` and the replicas before and after as tags,
``live_recovery_s`` and ``replicas`` as metrics at the step it happened in.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import ray.train
import torch

from raytrn.backends import get_backend
from raytrn.backends.live_ray import JOINING_ENV, SESSION_ENV, STORE_ENV, draining_key
from raytrn.checkpoint.progress import Progress
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.sharded import DcpCheckpoints
from raytrn.config import JobSpec
from raytrn.config.sizes import global_batch
from raytrn.data.batch import TokenBatch
from raytrn.data.feed import DataFeed
from raytrn.errors import RunStopped
from raytrn.ray_output import worker_logging
from raytrn.sigterm import TRAINING
from raytrn.tracking.export import ExportAhead, log_final_model
from raytrn.tracking.goodput import GroupTimes
from raytrn.tracking.roles import ProgressPosts
from raytrn.train.build import build_training
from raytrn.train.checkpointer import Checkpointer
from raytrn.train.evaluate import Evaluation
from raytrn.train.goodput import GoodputClock
from raytrn.train.guard import NonFiniteError, NonFiniteGuard
from raytrn.train.live.group import Generation, GroupEnded, LeftOut, LiveGroup, Reformed
from raytrn.train.live.notice import LiveNotice
from raytrn.train.live.step import LiveStepResult, LiveTrainer
from raytrn.train.live_snapshots import LiveSnapshots
from raytrn.train.loss import masked_loss_sum
from raytrn.train.metrics import tracking_logger
from raytrn.train.plan import WorkerPlan
from raytrn.train.step import Training, forward, with_aux_loss
from raytrn.train.stopping import StopRequests
from raytrn.train.watchdog import live_hang_watch

log = logging.getLogger(__name__)

#: A replica whose heartbeat stands still this long is gone (killed, frozen, its node lost): survivors stop waiting
#: for it when the group re-forms.
DEAD_AFTER_S = 2.0
#: How long a newcomer waits to be admitted (the members admit it at their next step boundary).
JOIN_DEADLINE_S = 600.0


def live_place() -> tuple[str, str, int, bool]:
    """This worker's store host and port, session and whether it joins, as :mod:`raytrn.backends.live_ray` set them."""
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    return host, port, int(os.environ[SESSION_ENV]), os.environ.get(JOINING_ENV) == "1"


class LiveCheckpoints:
    """The run's DCP checkpoints as this live rank writes them (whole tensors on every replica: DCP writes each once;
    reshardable into fsdp, hsdp or ddp), made again once the group re-formed (the rank and size moved)."""

    LAYOUT = {"data_parallel": "hsdp", "tensor_parallel_size": 1, "hsdp_shard_size": 1}

    def __init__(self, job: JobSpec) -> None:
        self.job = job
        self._made: tuple[Generation | None, DcpCheckpoints] | None = None

    def of(self, group: LiveGroup) -> DcpCheckpoints:
        if self._made is None or self._made[0] != group.generation:
            made = DcpCheckpoints(self.job, rank=group.rank, plain_layout=True, layout=dict(self.LAYOUT))
            if self._made is not None:  # failed saves go on counting (max_consecutive_failures in a row), deleted
                made.carry_on(self._made[1])  # steps too, and the next save waits for a retention round in flight
            self._made = (group.generation, made)
        return self._made[1]

    @property
    def failed(self) -> int:
        """The saves that failed so far (the ``checkpoint_failures`` metric)."""
        return self._made[1].failed if self._made is not None else 0


def synchronous(job: JobSpec) -> JobSpec:
    """``job`` with synchronous checkpoints: an asynchronous save's background collectives would outlive the
    generation of the group they ran on."""
    if not job.checkpoint.async_:
        return job
    return job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"async_": False})})


class MicroLosses:
    """A step's micro-batches (all of the global batch: every replica reads them) and the loss of any one of them,
    normalised so that the live group's sum over the replicas' shares is the step's loss: the mean over the global
    batch's tokens (masked data: over the trained tokens of the whole global batch, counted here)."""

    def __init__(self, t: Training, micro: list[Any]) -> None:
        self.t, self.micro = t, micro
        masked = isinstance(micro[0], TokenBatch) and micro[0].loss_mask is not None
        self.total = sum(float(b.loss_mask[:, 1:].sum()) for b in micro) if masked else None

    def __call__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``k``'s objective (a MoE model's load-balancing loss added, weighted by
        ``router_aux_loss_coef``, as the restart path's step adds it) and its loss (what is logged: the language
        model's alone)."""
        t = self.t
        logits, targets, mask, out = forward(t, self.micro[k])
        with torch.autocast(logits.device.type, dtype=t.autocast_dtype) if t.autocast_dtype else nullcontext():
            if self.total is None:
                loss = t.loss_fn(logits, targets)
            else:
                assert mask is not None
                loss = masked_loss_sum(logits, targets, mask) * (len(self.micro) / max(self.total, 1.0))
        return with_aux_loss(t, loss, out), loss


def live_loop_per_worker(config: dict[str, Any]) -> None:
    """Train the plan's job on this worker as one replica of the live group, to ``run.max_steps``."""
    from torch.distributed import PrefixStore, TCPStore

    worker_logging()
    plan = WorkerPlan.from_config(config)
    job = synchronous(plan.job)
    ctx = ray.train.get_context()
    backend = get_backend(job.scaling.accelerator)
    tracker = tracking_logger(plan)
    host, port, session, joining = live_place()
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=JOIN_DEADLINE_S))
    member = f"{ray.util.get_node_ip_address()}:{os.getpid()}" if joining else f"w{ctx.get_world_rank()}"
    group = LiveGroup(
        PrefixStore(f"s{session}/", store), member, timeout_s=job.scaling.peer_timeout_s, dead_after_s=DEAD_AFTER_S
    )
    notice = LiveNotice(store, draining_key(ray.get_runtime_context().get_node_id()))
    snapshots = LiveSnapshots(job, plan.memory, group, ray.get_runtime_context().get_node_id(),
                              plan.board.rollbacks if plan.board is not None else None)  # fmt: skip
    rows = global_batch(job, job.scaling.max_size)  # one replica a worker: the data-parallel size is the full size
    micro_batches = rows // job.data.micro_batch_size

    t = build_training(job, backend, world_size=1, schedule=plan.schedule)  # a whole replica (no layout)
    trainer = LiveTrainer(group, t.model, t.optimizer, t.scheduler, grad_clip_norm=job.optim.grad_clip_norm)
    checkpoints = LiveCheckpoints(job)  # t.checkpoints is made current before every save (_save)
    restore_s, restored, board_group = 0.0, None, None
    guard_state: dict[str, Any] | None = None
    if joining:
        try:
            progress, guard_state = _taken(trainer.rejoin(JOIN_DEADLINE_S))
        except GroupEnded:  # a replacement for a replica lost (or hung) near the end: the run is over
            log.warning("live recovery: %s started after the live replicas finished the run; nothing to join", member)
            return
        log.info("live recovery: %s joined the live group at step %d (%d replicas)", member, progress.step, group.size)
        resumed_from: str | None = f"live:step_{progress.step}"
    else:
        group.found([f"w{i}" for i in range(ctx.get_world_size())])
        t.checkpoints = checkpoints.of(group)
        checkpointer = Checkpointer(job, backend, plan.schedule, rank=group.rank, world_size=group.size,
                                    logger=tracker if group.rank == 0 else None, memory=snapshots.restorer())  # fmt: skip
        start = checkpointer.find()
        progress = start.progress
        checkpointer.restore(t, start)
        snapshots.started()
        resumed_from, restore_s = start.location, checkpointer.restore_s
        if plan.board is not None and group.rank == 0:  # the board counts the groups (a full start is one)
            restored = plan.board.restarts.restored(
                checkpointer.restored_from, progress.step, checkpointer.restore_s, checkpointer.passed_over
            )
            board_group = plan.board.restarts.group_started(progress.step, group.size)
    feed = DataFeed(job, plan.manifest, dp=1, dp_rank=0, global_batch=rows)
    batches = backend.wrap_batches(feed.start(progress, ctx.get_world_rank(), resumed_from=resumed_from))
    end = job.run.max_steps
    reports = LiveMetrics(plan, job, tracker, rows)
    stops = StopRequests(plan.board.stops if plan.board is not None else None)  # rank 0 asks; the step tells all
    # where the time goes (the run's goodput ledger): every replica measures, the live rank 0 posts
    posts = RankZeroPosts(plan.board.progress, group) if plan.board is not None else None
    clock = GoodputClock(posts, world_size=group.size, restore_s=restore_s, start_step=progress.step,
                         restored=restored, group=board_group if board_group is not None else session)  # fmt: skip
    # every replica evaluates the whole validation set itself (dp 1: no collective), the live rank 0 logs
    # (at the job's global batch at its full size, as the restart path's evaluation reads it)
    scores_logger = RankZeroLogger(tracker, group)
    evaluation = Evaluation(_at_full_size(job, rows), plan.validation, progress, dp=1, dp_rank=0,
                            logger=scores_logger)  # fmt: skip
    guard = NonFiniteGuard.on_board(job, plan.board.rollbacks if plan.board is not None else None,
                                    enabled=backend.skips_nonfinite_steps)  # fmt: skip
    _restore_guard(guard, guard_state)  # a newcomer counts on from where the members are
    reports.guard, reports.checkpoints, reports.memory = guard, checkpoints, snapshots
    stopped: RunStopped | None = None
    left = False  # this replica left the live group on a preemption notice
    hangs = live_hang_watch(job, ctx.get_world_rank(), tracker)  # a hung replica exits: replaced, it joins again
    TRAINING.set()
    try:
        while progress.step < end:
            step = progress.step + 1
            if guard.skips(step) and step < end:  # a rollback's: its global batch drawn, not trained
                for _ in range(micro_batches):
                    next(batches)
                t.scheduler.step()
                guard.skipped_batches += 1
                progress.step = step
                feed.advance(progress)
                hangs.step_done(step)
                continue
            clock.step_started()
            started = time.perf_counter()
            micro = [next(batches) for _ in range(micro_batches)]
            data_wait = time.perf_counter() - started
            try:
                asked = float(stops.stop_at(progress.step)) if group.rank == 0 else 0.0
                result = trainer.step(step, micro_batches, MicroLosses(t, micro), shared=(asked,),
                                      leaving=notice.reason() is not None)  # fmt: skip
                clock.stepped(step, data_wait, result.recovery_s)
                stop_at = int(result.shared[0])
                if 0 < stop_at < end:  # every rank: the same end (`raytrn stop`), its checkpoint as the last's
                    end = max(stop_at, step)
                progress.step = step
                progress.tokens_seen += rows * job.data.seq_len
                feed.advance(progress)
                # every replica reports: a new rank 0 logs what the lost one had not
                lr = float(t.optimizer.param_groups[0]["lr"])
                reports.step_done(progress, result, list(result.reformed), time.perf_counter() - started, lr,
                                  rank0=group.rank == 0)  # fmt: skip
                scores_logger.catch_up()
                try:  # every replica: the same reduced norm and loss
                    guard.check(torch.tensor(result.grad_norm if result.finite else float("nan")), step)
                except NonFiniteError as e:  # roll back in place: the live replicas load the newest checkpoint
                    log.warning("live recovery: %s", e)
                    first = step - guard.in_a_row + 1
                    guard.rollbacks.append((first, step))  # (the board has it too, for a later full start)
                    guard.in_a_row = 0
                    with clock.blocking("recovery"), hangs.working():
                        progress = _rollback(t, group, job, backend, plan, checkpoints, progress, step)
                    if tracker is not None and group.rank == 0:
                        tracker.set_tags({"raytrn.rollback": f"steps {first}-{step}, in place to step {progress.step}"})
                    clock.retrains_until(step)
                    snapshots.rewound(first, progress.step)
                    batches = backend.wrap_batches(feed.start(progress, ctx.get_world_rank()))
                    evaluation.progress = progress
                    last = False
                else:
                    last = step >= end
                    # every replica has a notice: nobody trains on, this step's checkpoint is what the restart resumes
                    saving = last or step % job.checkpoint.interval == 0 or result.everyone_leaves
                    with clock.blocking("eval"), hangs.working():
                        pointer = RunDir.of(job).pointer(step) if saving else None
                        scores = evaluation.maybe_evaluate(t, backend, last=last, checkpoint=pointer)
                    if saving:
                        with clock.blocking("checkpoint"), hangs.working():
                            t.checkpoints = checkpoints.of(group)
                            _save(t, group, job, plan, progress, result, tracker, scores, last=last)
                    snapshots.step_done(t, progress, final=last or result.everyone_leaves, checkpoint=saving)
                if result.leaving and not last:  # after all of the above: the step is committed, logged, saved
                    with hangs.working():
                        parted = _part(group, result, reports, clock, member, step, notice)
                    if parted:
                        left = True
                        break
                if result.joins_waiting:  # last: a newcomer joins the state every member holds after all of the above
                    with clock.blocking("recovery"), hangs.working():
                        admitted = trainer.admit({**asdict(progress), GUARD_KEY: _guard_state(guard)})
                    if group.rank == 0:
                        reports.recovered(progress.step, [admitted])
            except LeftOut:  # the others re-formed without this replica (it was late): join again, take their state
                try:
                    with hangs.working():
                        progress, guard_state = _taken(trainer.rejoin(JOIN_DEADLINE_S))
                except GroupEnded:  # ... unless they finished the run meanwhile
                    log.warning("live recovery: %s was left out and the others finished the run", member)
                    left = True
                    break
                _restore_guard(guard, guard_state)
                batches = backend.wrap_batches(feed.start(progress, ctx.get_world_rank()))
                evaluation.progress = progress
                continue
            clock.iteration_done(final=last)
            hangs.step_done(progress.step)
    except RunStopped as e:  # every replica, at the same step (diverged again after the rollback)
        stopped = e
    finally:
        TRAINING.clear()
        hangs.close()
    if left:  # its node goes away at the notice's deadline (the process with it), or the run ends first
        notice.warn_if_held(member)
        snapshots.close()
        group.wait_for_end()
        return
    if stopped is not None:
        if plan.board is not None:
            plan.board.stops.stop(stopped)  # the driver ends the run FAILED with it; nothing is exported
        _end(group)
        return
    if job.tracking.log_model and tracker is not None and t.export is not None and group.rank == 0:
        log_final_model(job, t.model, t.export, tracker)  # a whole replica: no gathers, rank 0 alone
    _end(group)


def _end(group: LiveGroup) -> None:
    """The run's end on a member: rank 0 tells the replicas that left on a notice (they wait for it), then every
    member leaves."""
    if group.rank == 0:
        group.finish()
    group.leave()


def _part(
    group: LiveGroup, result: LiveStepResult, reports: LiveMetrics, clock: GoodputClock, member: str, step: int,
    notice: LiveNotice,
) -> bool:  # fmt: skip
    """After step ``step``, whose replicas ``result.leaving`` had a preemption notice: those leave the live group
    (True here: this replica left; every replica had one: none re-forms), the others re-form without them at once
    and train on."""
    if result.everyone_leaves:
        if group.rank == 0:  # one line for the group
            log.warning("live recovery: every replica has a preemption notice; step %d is checkpointed, the replicas "
                        "wait for their nodes to go (the run restarts from that checkpoint)", step)  # fmt: skip
        group.leave()
        return True
    with clock.blocking("recovery"):
        parted = group.part(result.leaving)
    if parted is None:
        log.warning("live recovery: %s left the live group after step %d (%s); the other replicas train on", member,
                    step, notice.reason())  # fmt: skip
        return True
    if group.rank == 0:
        reports.recovered(step, [parted])
    return False


def _rollback(
    t: Training, group: LiveGroup, job: JobSpec, backend: Any, plan: WorkerPlan, checkpoints: LiveCheckpoints,
    progress: Progress, step: int,
) -> Progress:  # fmt: skip
    """A non-finite rollback in place (every live replica, after step ``step``): the newest committed checkpoint
    (finite, as every one is) loaded over the live group, as a full start restores; returns its progress, the steps
    already logged kept. Agreed like a save: a replica lost during the load makes the others re-form and load again
    (a load that failed with every replica alive fails as any restore does)."""
    attempt = 0
    while True:
        attempt += 1
        here, error, restored = group.ready(step, what=f"rollback{attempt}-"), None, None
        if here:
            try:
                restored = _load_newest(t, group, job, backend, plan, checkpoints)
            except Exception as e:  # a lost replica broke the load's collectives, or the load failed
                error = e
        if group.agree(step, here and error is None, what=f"rollback{attempt}-") and restored is not None:
            break
        reformed = group.reform("lost")
        if not reformed.lost and error is not None:
            raise error
    restored.restored(progress)
    restored.best_val_loss = progress.best_val_loss  # (the best tags name checkpoints that exist)
    log.warning("live recovery: rolled back to step %d on %d live replicas; no process restarted", restored.step,
                group.size)  # fmt: skip
    return restored


def _load_newest(
    t: Training, group: LiveGroup, job: JobSpec, backend: Any, plan: WorkerPlan, checkpoints: LiveCheckpoints
) -> Progress:
    """The newest committed checkpoint's state in ``t`` (a collective over the live group), or the run's first state
    rebuilt from its seed when none is committed yet; its progress."""
    t.checkpoints = checkpoints.of(group)
    checkpointer = Checkpointer(job, backend, plan.schedule, rank=group.rank, world_size=group.size)
    start = checkpointer.find()
    if start.location is None:  # none committed yet: the run's first state, as a new run builds it (same seed)
        fresh = build_training(job, backend, world_size=1, schedule=plan.schedule)
        t.model.load_state_dict(fresh.model.state_dict())
        t.optimizer.load_state_dict(fresh.optimizer.state_dict())
        t.scheduler.load_state_dict(fresh.scheduler.state_dict())
    checkpointer.restore(t, start)
    return start.progress


#: Where a newcomer's state carries the members' non-finite guard (the steps in a row, the job's rollbacks), so that
#: every replica decides alike from its first step.
GUARD_KEY = "_guard"


def _guard_state(guard: NonFiniteGuard) -> dict[str, Any]:
    return {"in_a_row": guard.in_a_row, "rollbacks": [list(r) for r in guard.rollbacks], "total": guard.total}


def _restore_guard(guard: NonFiniteGuard, state: dict[str, Any] | None) -> None:
    if state is not None:
        guard.in_a_row, guard.total = int(state["in_a_row"]), int(state["total"])
        guard.rollbacks = [(int(a), int(b)) for a, b in state["rollbacks"]]


def _taken(shared: dict[str, Any]) -> tuple[Progress, dict[str, Any] | None]:
    """What a newcomer received with the live state: the progress, and the members' guard (None from an older
    sender)."""
    shared = dict(shared)
    guard = shared.pop(GUARD_KEY, None)
    return Progress.from_dict(shared), guard


def _at_full_size(job: JobSpec, rows: int) -> JobSpec:
    """``job`` with its global batch fixed at ``rows`` (the job's at its full size): what one replica evaluates, as
    the restart path's ranks together do at that size (``data.grad_accum`` alone would scale it down to one)."""
    data = job.data.model_copy(update={"global_batch_size": rows, "grad_accum": None})
    return job.model_copy(update={"data": data})


class RankZeroLogger:
    """The evaluation's logger: the tracker's, from whichever replica is rank 0 of the live group now. Every other
    replica keeps its last evaluation's scores (and best-checkpoint tags): a rank 0 lost after evaluating and before
    its scores reached the tracking actor leaves them to the replica that becomes rank 0 (:meth:`catch_up`), which
    sends those the run does not have yet."""

    def __init__(self, tracker: Any, group: LiveGroup) -> None:
        self.tracker, self.group = tracker, group
        self.pending: tuple[int, dict[str, float], dict[str, str]] | None = None

    def log_missing(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is None:
            return
        if self.group.rank == 0:
            self.tracker.log_missing(metrics, step)
            self.pending = None
        else:
            self.pending = (step, metrics, {})

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.tracker is None:
            return
        if self.group.rank == 0:
            self.tracker.set_tags(tags)
        elif self.pending is not None:
            self.pending[2].update(tags)

    def catch_up(self) -> None:
        """On rank 0 (after a step): the scores a lost rank 0 may not have logged, those the run does not have."""
        if self.pending is None or self.tracker is None or self.group.rank != 0:
            return
        step, metrics, tags = self.pending
        self.pending = None
        self.tracker.log_missing(metrics, step)
        if tags:
            self.tracker.set_tags(tags)


class RankZeroPosts:
    """The job's progress posts from whichever replica is rank 0 of the live group now (the goodput clock of every
    replica measures; only the live rank 0's reaches the board)."""

    def __init__(self, posts: ProgressPosts, group: LiveGroup) -> None:
        self.posts, self.group = posts, group

    def update(self, step: int, max_steps: int, metrics: dict[str, float]) -> None:
        if self.group.rank == 0:
            self.posts.update(step, max_steps, metrics)

    def reached(self, step: int) -> None:
        if self.group.rank == 0:
            self.posts.reached(step)

    def first_step_done(self, step: int, since_launch_s: float, since_group_start_s: float) -> None:
        if self.group.rank == 0:
            self.posts.first_step_done(step, since_launch_s, since_group_start_s)

    def goodput(self, times: GroupTimes) -> None:
        if self.group.rank == 0:
            self.posts.goodput(times)


class LiveMetrics:
    """Rank 0's reports: the step's metrics at log steps (MLflow and the job's board, which the driver's progress
    line and summary read), every re-formation when it happens, the first step's start-up time. Every replica keeps
    its last log step's metrics: a rank 0 lost after a step committed and before it logged it leaves that step to
    the replica that becomes rank 0, which logs it first (the tracking actor drops a step it has already)."""

    def __init__(self, plan: WorkerPlan, job: JobSpec, tracker: Any, rows: int) -> None:
        self.plan, self.job, self.tracker = plan, job, tracker
        self.tokens_per_step = rows * job.data.seq_len
        self.board = plan.board.progress if plan.board is not None else None
        self.started_at = time.time()
        self.first = True
        self.export_ahead = ExportAhead(job)
        #: The non-finite guard whose counts the log steps carry (``nonfinite_steps``, ``skipped_batches``).
        self.guard: NonFiniteGuard | None = None
        #: The checkpoints whose failed saves the log steps carry (``checkpoint_failures``).
        self.checkpoints: LiveCheckpoints | None = None
        #: The memory tier whose metrics rank 0's log steps carry (``memory_checkpoint_bytes``, ...).
        self.memory: LiveSnapshots | None = None
        #: The last log step's metrics while this replica is not rank 0 (sent when it becomes rank 0).
        self.pending: tuple[int, dict[str, float]] | None = None

    def step_done(
        self, progress: Progress, result: LiveStepResult, reformed: list[Reformed], seconds: float, lr: float, *,
        rank0: bool = True,
    ) -> None:  # fmt: skip
        step, job = progress.step, self.job
        logging_step = step % job.run.log_every == 0 or step == job.run.max_steps or bool(reformed)
        metrics = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": lr, "step_time_s": seconds,
                   "tokens_per_s": self.tokens_per_step / max(seconds, 1e-9), "tokens_seen": float(progress.tokens_seen),
                   "world_size": float(result.replicas), "replicas": float(result.replicas),
                   "epoch": float(progress.epoch), **(self.guard.metrics() if self.guard is not None else {}),
                   **({"checkpoint_failures": float(self.checkpoints.failed)} if self.checkpoints is not None else {}),
                   **(self.memory.metrics() if self.memory is not None else {}),
                   } if logging_step else {}  # fmt: skip
        if not rank0:
            if logging_step:
                self.pending = (step, metrics)
            return
        if self.pending is not None and self.tracker is not None and self.pending[0] < step:  # it just became rank 0
            self.tracker.log_metrics(self.pending[1], self.pending[0])  # what the lost rank 0 may not have logged
        self.pending = None
        if self.tracker is not None:  # rank 0: the final model's export imports, once the run's end is near
            self.export_ahead.step_done(step)
        if self.first and self.board is not None:
            self.first, now = False, time.time()
            self.board.first_step_done(step, now - (self.plan.started_at or now), now - self.started_at)
        self.recovered(step, reformed)
        if not logging_step:
            if self.board is not None:
                self.board.reached(step)
            return
        if self.tracker is not None and step > progress.last_logged_step:
            self.tracker.log_metrics(metrics, step)
        if self.board is not None:
            self.board.update(step, job.run.max_steps, metrics)
        progress.logged(step, metrics)

    def recovered(self, step: int, reformed: list[Reformed]) -> None:
        """Each re-formation at step ``step`` (a loss, or newcomers admitted): a line, the run's tags and metrics."""
        for r in reformed:
            lost = f"lost {', '.join(r.lost)}" if r.lost else f"admitted {', '.join(r.joined)}"
            if r.reason == "left":
                lost = f"{', '.join(r.lost)} left on a preemption notice"
            before, after = len(r.before.members), len(r.after.members)
            log.warning(
                "live recovery at step %d: %s (%d -> %d replicas, %.2f s)", step, lost, before, after, r.seconds
            )
            if self.tracker is not None:
                self.tracker.set_tags({"raytrn.recovery": "live", "raytrn.live_replicas": f"{before}->{after}"})
                metrics = {"live_recovery_s": r.seconds, "replicas": float(after)}
                self.tracker.log_metrics(metrics, step, training=False)


def _save(
    t: Training, group: LiveGroup, job: JobSpec, plan: WorkerPlan, progress: Progress, result: LiveStepResult,
    tracker: Any, scores: dict[str, float], *, last: bool,
) -> None:  # fmt: skip
    """A checkpoint by every live replica (DCP over the live group); rank 0 tags the run. Whether it counts is agreed
    like a step: a replica lost during the save breaks DCP's collectives on the others, so they re-form and go on
    without that checkpoint (the next one is due at the next interval); a save that failed with every replica
    alive fails as any save does (:class:`raytrn.checkpoint.sharded.DcpCheckpoints`)."""
    # (the step's validation scores too: keep_best and the best tags read them from the commit, as the restart path's)
    report = {"loss": result.loss, **scores, "step": progress.step, "tokens_seen": progress.tokens_seen}
    saved, error, here = [], None, group.ready(progress.step, what="save")  # every replica alive at the save
    if here:
        try:
            saved = t.checkpoints.save(t, progress, plan.schedule, report, final=last)
        except Exception as e:  # DCP's collectives broke (a lost replica), or this replica's save failed
            error = e
    if group.agree(progress.step, here and error is None, what="save"):
        if group.rank == 0 and tracker is not None:
            for s in saved:
                tracker.checkpoint_saved(s.step, RunDir.of(job).pointer(s.step), job.checkpoint.keep_last)
        return
    reformed = group.reform("lost")
    if not reformed.lost and error is not None:
        raise error
    log.warning(
        "live recovery: the checkpoint of step %d is skipped: %s lost during the save (%d replicas go on)",
        progress.step, ", ".join(reformed.lost) or "a replica", group.size,
    )  # fmt: skip
