"""The per-worker training loop that Ray Train runs on every worker.

It reads top to bottom: build, resume, then step until ``run.max_steps`` — accumulate micro-batches,
clip, step, and every ``log_every`` steps log; every ``every_n_steps`` save a checkpoint. The only
host-device syncs are marked; on XLA backends each one is a potential recompile.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from raytrn.backends import Backend, get_backend, host_malloc
from raytrn.checkpoint.finder import resume_point
from raytrn.checkpoint.manifest import describe as describe_commit
from raytrn.checkpoint.progress import META_FILE, Progress, parse_meta
from raytrn.checkpoint.rundir import RunDir
from raytrn.checkpoint.store import Saved
from raytrn.compat import quiet_ray_train_logs
from raytrn.config import JobSpec
from raytrn.data.order import SAMPLE_TRACE_ENV
from raytrn.errors import DataError
from raytrn.runtime import process_started_at
from raytrn.train.preemption import TRAINING, PreemptionWatch, exit_after_sigterm, sigterm_received, wait_for_teardown
from raytrn.train.preemption import describe as describe_notice
from raytrn.train.schedule import Schedule
from raytrn.train.sizes import data_parallel_rank, data_parallel_size
from raytrn.train.step import Training, attention, build_training, read_metrics, to_torch, train_step

log = logging.getLogger(__name__)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train

    quiet_ray_train_logs()
    job: JobSpec = config["job"]
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    backend = get_backend(job.scaling.accelerator)

    # -- data first: Ray Data's first read starts new processes (seconds), so it runs while the model builds.
    # Where the data resumes (epoch, rows consumed) comes from the checkpoint to resume, chosen before anything
    # else: the newest committed one whose files check out (raytrn.checkpoint.finder; all ranks agree), or, for a run
    # without commit manifests (an older raytrn, the XLA paths), Ray Train's latest.
    resume = resume_point(job, rank=rank, world_size=world_size) if backend.committed_checkpoints else None
    checkpoint = None if resume is not None else ray.train.get_checkpoint()
    progress = replace(resume.commit.progress) if resume is not None else _resume_progress(checkpoint)
    dp = data_parallel_size(job, world_size)
    data = _DataPlan(job, config["manifest"], dp=dp, dp_rank=data_parallel_rank(job, rank))
    first_batches = data.start(progress, rank, resumed_from=resume.location if resume is not None else None)

    # -- build ---------------------------------------------------------------------------------
    # The schedule was pinned by the driver (raytrn.train.schedule.resolve_schedule): the same on every worker
    # group of this job, and the horizon a resumed run started with.
    schedule = Schedule.from_dict(config["schedule"]) if config.get("schedule") else Schedule.from_job(job)
    t = build_training(job, backend, world_size=world_size, schedule=schedule, rank=rank)
    scheduler = t.scheduler
    max_steps = job.run.max_steps
    # Tokens per optimizer step over the job: one batch per model replica (data-parallel rank).
    tokens_per_step = t.grad_accum * job.data.micro_batch_size * job.data.seq_len * data_parallel_size(job, world_size)

    # -- resume --------------------------------------------------------------------------------
    loaded = _restore(t, resume, checkpoint, rank)
    # A new run starts from the Hugging Face checkpoint's weights; under LoRA every start does (the checkpoints hold
    # the adapters only).
    if job.model.init_from and (loaded is None or job.model.lora is not None):
        _load_init_from(job, t, rank)
    if loaded is not None:
        # The full state is the authority; the data pipeline already started where meta.json said.
        if (loaded.step, loaded.epoch, loaded.epoch_samples) != (progress.step, progress.epoch, progress.epoch_samples):
            log.warning(
                "checkpoint: meta.json and the saved state disagree on the step or data position; using the state"
            )
            progress.epoch, progress.epoch_samples, progress.step = loaded.epoch, loaded.epoch_samples, loaded.step
            first_batches = data.start(progress, rank)
        progress.step, progress.tokens_seen, progress.cost_usd = loaded.step, loaded.tokens_seen, loaded.cost_usd
        progress.last_logged_step = max(progress.last_logged_step, loaded.last_logged_step)
    # Rank 0 sends the training metrics to the job's tracking actor; the first worker of every node samples
    # its node's system metrics. Neither waits for MLflow.
    tracker = _tracker(config)
    sampler = _system_sampler(job, tracker, backend) if tracker and ctx.get_local_rank() == 0 else None
    logger = tracker if rank == 0 else None
    board = config.get("board") if rank == 0 else None
    group_started_at = process_started_at()
    if board is not None:  # the job's board counts the worker groups (and records world_size_history)
        board.group_started.remote(progress.step, world_size)
    if logger:  # (steps a restarted group repeats are dropped by the tracking actor: no waiting on it here)
        logger.set_tags({"worker.malloc": host_malloc.describe(os.environ)})  # run.tune_malloc, as the workers run
        if resume is not None:  # its tag may never have been sent (a group killed right after its save)
            location = RunDir.of(job).pointer(resume.commit.step)
            logger.checkpoint_saved(resume.commit.step, location, job.checkpoint.keep_last)
    batches = backend.wrap_batches(first_batches)

    efficiency = None
    if rank == 0:  # the run's cost so far: the checkpoint's, or what was logged since (a restart lost steps)
        logged = logger.last_value("cost_usd") if logger else None
        efficiency = _Efficiency(
            job, world_size, spent_usd=progress.cost_usd, logged_usd=logged, started_at=group_started_at
        )

    # Validation: this rank's fixed rows of the validation set, read once (raytrn.train.evaluate).
    evaluator = None
    if config.get("validation") is not None:
        from raytrn.train.evaluate import Evaluator

        evaluator = Evaluator(job, config["validation"], dp=dp, dp_rank=data_parallel_rank(job, rank))

    # -- train ---------------------------------------------------------------------------------
    # A spot interruption notice ends this group at a checkpoint (raytrn.train.preemption): agreed every step.
    watch = PreemptionWatch(world_size)
    #: In a sweep's trial (raytrn.sweep), the metrics of every log and eval step go to Ray Tune through Ray Train.
    report_metrics = bool(config.get("report_metrics"))
    TRAINING.set()  # from here a SIGTERM is a notice (raytrn.train.preemption)
    window_start, window_tokens, window_steps, data_wait = time.perf_counter(), 0, 0, 0.0
    first_step = True
    while progress.step < max_steps:
        result = train_step(t, batches, backend)
        progress.step += 1
        data.advance(progress)
        if first_step:  # start-up cost: launch (or restart) to the first step done, once per worker group
            first_step = False
            if board is not None:  # the board names it: time_to_first_step_s, or restart_to_first_step_s
                now = time.time()
                since_launch = now - config.get("started_at", now)
                board.first_step_done.remote(progress.step, since_launch, now - group_started_at)
        trained = result.trained_tokens if result.trained_tokens is not None else tokens_per_step  # masked: counted
        progress.tokens_seen += trained
        window_tokens += trained
        window_steps += 1
        data_wait += result.data_wait_s

        step = progress.step
        is_last = step == max_steps
        metrics: dict[str, Any] = {}
        if step % job.run.log_every == 0 or is_last:
            # Loss all-reduced over workers, then read: a host-device sync, after the step's graph.
            elapsed = time.perf_counter() - window_start
            metrics = {
                **read_metrics(result, world_size),
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": window_tokens / elapsed,
                "step_time_s": elapsed / window_steps,
                "data_wait_s": data_wait / window_steps,
                "tokens_seen": float(progress.tokens_seen),
                "world_size": float(world_size),
                "epoch": float(progress.epoch),
            }
            if efficiency is not None:
                metrics.update(efficiency.metrics(metrics["tokens_per_s"], progress.tokens_seen))
            if logger and step > progress.last_logged_step:
                logger.log_metrics(metrics, step)
            if board is not None:
                board.update.remote(step, max_steps, metrics)
            progress.last_logged_step = max(progress.last_logged_step, step)
            window_start, window_tokens, window_steps, data_wait = time.perf_counter(), 0, 0, 0.0

        checkpointing = step % job.checkpoint.every_n_steps == 0 or is_last
        scores: dict[str, float] = {}
        if evaluator is not None and (is_last or (job.run.eval_every and step % job.run.eval_every == 0)):
            # The validation loss, every rank (a collective): forward only, no random numbers, no data moved.
            scores = evaluator.evaluate(t, backend)
            best = progress.best_val_loss is None or scores["val_loss"] < progress.best_val_loss
            if best:
                progress.best_val_loss = scores["val_loss"]
            if logger and step > progress.last_logged_val_step:  # (the step's training metrics went first)
                logger.log_metrics(scores, step, training=False)
                if best:
                    logger.set_tags(_best_tags(job, step, scores["val_loss"], checkpointed=checkpointing))
            progress.last_logged_val_step = max(progress.last_logged_val_step, step)

        if report_metrics and (metrics or scores):  # a sweep's trial: Ray Tune judges it on these (every rank)
            import ray.train

            ray.train.report({**metrics, **scores, "step": step}, checkpoint=None)

        notice = watch.notice()  # a collective: every rank, every step
        preempted = notice is not None and not is_last
        if checkpointing or preempted:
            if efficiency is not None:
                progress.cost_usd = efficiency.cost_usd()
            report = {**metrics, "step": progress.step, "tokens_seen": progress.tokens_seen}
            # Synchronous at the end and on a notice: the checkpoint must exist before the group goes.
            for saved in t.checkpoints.save(t, progress, schedule, report, final=is_last or preempted):
                _report(job, rank, saved, logger)  # every worker (Ray Train counts the reports)
        if preempted:
            if rank == 0:
                log.warning(
                    "preemption notice (%s): checkpointed step %d; waiting for Ray Train to restart without the node",
                    describe_notice(notice),
                    step,
                )
            if sigterm_received():  # this worker was told to go: it does, now that its state is committed
                exit_after_sigterm(logger, job.tracking.flush_timeout_s, step)
            wait_for_teardown()  # the steps until the deadline would be trained again: train none

    TRAINING.clear()
    if sampler:
        sampler.close()
    if job.tracking.log_model and config.get("tracker") is not None and t.export is not None:
        if logger:
            logger.flush(job.tracking.flush_timeout_s)  # an outage near the end: wait (bounded) for the server
        log_final_model(job, t, logger)  # every rank: a sharded model's tensors are gathered one by one


class _DataPlan:
    """This worker's rows: its data-parallel rank's share of every global batch, in the job's one global order
    (:mod:`raytrn.data.order`), streamed by Ray Data (:mod:`raytrn.data.source`). Ranks of a tensor-parallel
    group share a data-parallel rank and read the same rows."""

    def __init__(self, job: JobSpec, manifest: Any, *, dp: int, dp_rank: int) -> None:
        from raytrn.data.order import RankSlice, SampleOrder
        from raytrn.train.sizes import global_batch

        self.job, self.manifest = job, manifest
        self.order = SampleOrder.for_job(manifest, job)
        self.part = RankSlice(rank=dp_rank, size=dp, global_batch=global_batch(job, dp))
        self.row_len = job.data.seq_len + 1
        #: Attention kept inside each document: the rows' segment ids (instruction data) or their EOS (text).
        self.document = attention(job, manifest) == "document"

    def advance(self, progress: Progress) -> None:
        """One optimizer step consumed a global batch: the counters a checkpoint saves move with it."""
        from raytrn.data.order import Position

        position = Position(epoch=progress.epoch, samples=progress.epoch_samples)
        position.advance(self.part.global_batch, self.order.num_rows)
        progress.epoch, progress.epoch_samples = position.epoch, position.samples

    def start(self, progress: Progress, rank: int, *, resumed_from: str | None = None) -> _StartEarly:
        """:meth:`batches` from where ``progress`` says, its first batch fetched at once in the background."""
        from raytrn.data.order import Position

        position = Position(epoch=progress.epoch, samples=progress.epoch_samples)  # a copy: the loop moves on
        trace = _SampleTrace.open(rank, progress.step, self, resumed_from=resumed_from)
        return _StartEarly(lambda: self.batches(position, trace))

    def batches(self, position: Any, trace: _SampleTrace | None = None) -> Iterator[torch.Tensor]:
        """Endless int64 micro-batches of shape [micro_batch_size, seq_len + 1] from ``position`` (epoch, rows)."""

        from raytrn.data.source import rank_batches

        mb = self.job.data.micro_batch_size
        for batch in rank_batches(self.manifest, self.order, self.part, position, batch_rows=mb):
            if trace is not None:
                trace.record(batch)
            yield to_torch(batch, document=self.document, eos_id=self.manifest.tokenizer.eos_id)


def rows_tensor(table: Any, row_len: int) -> torch.Tensor:
    """The ``input_ids`` rows of an Arrow table as one int64 tensor [rows, row_len]."""
    import numpy as np

    column = table.column("input_ids").combine_chunks()
    values = column.flatten().to_numpy()  # flatten: only the rows of a sliced table
    if len(values) != len(column) * row_len:
        raise DataError(
            f"dataset rows are not {row_len} tokens (data.seq_len + 1) long; prepare the data with the job's seq_len"
        )
    return torch.from_numpy(values.reshape(len(column), row_len).astype(np.int64))


class _SampleTrace:
    """``$RAYTRN_SAMPLE_TRACE/group-<first step>-dp<size>-<start ns>-rank<r>.jsonl``: one line per micro-batch,
    ``{"step", "dp_rank", "rows"}`` (global row ids, in order) and the first tokens of each row. An audit of
    what a run trained on; the exactly-once tests read it."""

    def __init__(self, path: str, first_step: int, grad_accum: int, dp_rank: int) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (one line per micro-batch, closed at exit)
        self._micro, self._first_step, self._accum, self._dp_rank = 0, first_step, grad_accum, dp_rank

    @classmethod
    def open(
        cls, rank: int, first_step: int, data: _DataPlan, *, resumed_from: str | None = None
    ) -> _SampleTrace | None:
        directory = os.environ.get(SAMPLE_TRACE_ENV)
        if not directory:
            return None
        os.makedirs(directory, exist_ok=True)
        # Ranks of one group agree on the step they start at and their number, not on a clock.
        name = f"group-{first_step:08d}-dp{data.part.size}-{time.time_ns()}-rank{rank}.jsonl"
        path = os.path.join(directory, name)
        accum = data.part.rows_per_step // data.job.data.micro_batch_size
        trace = cls(path, first_step, accum, data.part.rank)
        if resumed_from is not None:  # the first line: which committed checkpoint the group resumed from
            trace._file.write(json.dumps({"resumed_from": resumed_from, "step": first_step}) + "\n")
        return trace

    def record(self, batch: Any) -> None:
        step = self._first_step + self._micro // self._accum + 1
        heads = batch.tokens[:, :4].tolist()
        line = {"step": step, "dp_rank": self._dp_rank, "rows": batch.row_ids.tolist(), "heads": heads}
        self._file.write(json.dumps(line) + "\n")
        self._micro += 1


def _restore(t: Training, resume: Any, checkpoint: Any, rank: int) -> Progress | None:
    """Load the committed checkpoint ``resume``, else Ray Train's ``checkpoint``, into ``t``; its counters (None:
    nothing to resume)."""
    if resume is not None:
        loaded: Progress = t.checkpoints.load_committed(resume, t)  # type: ignore[attr-defined]
        if rank == 0:
            log.info("resumed from %s", describe_commit(resume))
        return loaded
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        return t.checkpoints.load(d, t)


def _best_tags(job: JobSpec, step: int, val_loss: float, *, checkpointed: bool) -> dict[str, str]:
    """The run's tags for a new best validation loss: the step, the loss, and the checkpoint of that step (when one
    is written there: evaluate at checkpoint steps to keep every candidate)."""
    location = RunDir.of(job).pointer(step) if checkpointed else "none (no checkpoint)"
    return {"best_val_loss": f"{val_loss:.6f}", "best_val_step": str(step), "best_checkpoint": location}


def _load_init_from(job: JobSpec, t: Training, rank: int) -> None:
    """``model.init_from``'s weights into the laid-out model (every rank reads the slices it holds)."""
    from raytrn.models.hf import load_weights

    started = time.perf_counter()
    n = load_weights(t.model, str(job.model.init_from), tied=job.model.tie_word_embeddings, source=job.source)
    if rank == 0:
        log.info("model.init_from: %d tensors from %s in %.1f s", n, job.model.init_from, time.perf_counter() - started)


def _resume_progress(checkpoint: Any) -> Progress:
    """The counters of Ray's checkpoint from its ``meta.json`` (cheap: no model state): the step, and where
    in the data the next step starts (epoch, rows consumed)."""
    if checkpoint is None:
        return Progress()
    try:
        with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{META_FILE}") as f:
            return parse_meta(f.read().decode()).progress
    except (OSError, ValueError) as e:  # the full state still restores the counters
        log.warning("checkpoint %s: no readable %s (%s)", checkpoint.path, META_FILE, e)
        return Progress()


class _StartEarly:
    """An iterator whose first item is fetched at once in a background thread (the first Ray Data read
    takes seconds); later items come from the same iterator in the caller's thread."""

    def __init__(self, make: Any) -> None:
        import threading

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

    def __iter__(self) -> _StartEarly:
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


class _Efficiency:
    """Running cost (USD, over the whole run), USD per 1M tokens, tokens per USD and MFU, for rank 0's metrics.

    ``spent_usd``: what the run cost before this worker group (the checkpoint's), raised to ``logged_usd`` (a
    future of the last value logged: a restart repeats steps whose time was paid for) when it is first needed;
    ``started_at``: when the group started (wall clock), from which its own cost runs.
    """

    def __init__(
        self,
        job: JobSpec,
        world_size: int,
        *,
        spent_usd: float = 0.0,
        logged_usd: Any = None,
        started_at: float | None = None,
    ) -> None:
        from raytrn.models import model_stats
        from raytrn.tracking.cost import CostTracker, peak_flops_per_worker, usd_per_hour

        s = job.scaling
        nodes = -(-world_size // s.workers_per_node) if s.workers_per_node else 1
        price = usd_per_hour(
            s.instance_type, override=job.tracking.usd_per_hour, spot_price=job.tracking.spot_usd_per_hour
        )
        self.cost = CostTracker(price, nodes, base_usd=spent_usd)
        gpu = None
        if s.accelerator == "cuda" and torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
        self.peak = peak_flops_per_worker(s.accelerator, s.instance_type, lnc=job.neuron.lnc, gpu=gpu)
        self.flops_per_token = model_stats(job.model, job.data.seq_len).flops_per_token
        self.world_size = world_size
        self.start = time.time() if started_at is None else started_at
        self._logged_usd = logged_usd

    def _spent(self) -> None:
        if self._logged_usd is not None:  # read once, at the first log step (never while the group starts)
            from raytrn.tracking.actor import resolve

            self.cost.base_usd = max(self.cost.base_usd, resolve(self._logged_usd, 0.0))
            self._logged_usd = None

    def metrics(self, tokens_per_s: float, tokens_total: int) -> dict[str, float]:
        """Cost metrics with ``tokens_total`` tokens trained over the run, MFU at ``tokens_per_s``."""
        from raytrn.tracking.cost import mfu

        self._spent()
        out = self.cost.update(time.time() - self.start, tokens_total)
        value = mfu(tokens_per_s, self.flops_per_token, self.world_size, self.peak)
        if value is not None:
            out["mfu"] = value
        return out

    def cost_usd(self) -> float:
        """The run's cost up to now (what a checkpoint stores)."""
        self._spent()
        self.cost.update(time.time() - self.start, 0)
        return self.cost.cost_usd


def _report(job: JobSpec, rank: int, saved: Saved, logger: Any) -> None:
    """Record a complete checkpoint with Ray Train: rank 0 passes the directory ``saved`` fills (the counters,
    and where the state is); every worker calls report."""
    import ray.train

    if rank != 0 or saved.write is None:
        ray.train.report(saved.report, checkpoint=None)
        return
    name = RunDir.pointer_name(saved.step)
    with tempfile.TemporaryDirectory(prefix="raytrn-ckpt-") as d:
        saved.write(d)
        ray.train.report(saved.report, checkpoint=ray.train.Checkpoint.from_directory(d), checkpoint_dir_name=name)
    if logger:  # the run's checkpoint tags (those keep_last deleted are marked so by the tracking actor)
        location = RunDir.of(job).pointer(saved.step)
        logger.checkpoint_saved(saved.step, location, job.checkpoint.keep_last)


def _tracker(config: dict[str, Any]) -> Any:
    """This worker's handle on the job's tracking actor (None when tracking is off)."""
    if config.get("tracker") is None:
        return None
    from raytrn.tracking.actor import RemoteLogger

    return RemoteLogger(config["tracker"], config["mlflow_uri"])


def _system_sampler(job: JobSpec, logger: Any, backend: Backend) -> Any:
    if not job.tracking.system_metrics:
        return None
    import ray

    from raytrn.tracking.system import SystemSampler

    return SystemSampler.start(
        logger,
        ray.get_runtime_context().get_node_id(),
        job.tracking.system_metrics_interval_s,
        device_memory=backend.device_memory,
    )


def log_final_model(job: JobSpec, t: Training, logger: Any) -> None:
    """The trained model (and the dataset's tokenizer) in Hugging Face format, as the run's ``model`` artifact.

    Every rank calls it: a sharded model's tensors are gathered one at a time (collectives) and streamed into
    the safetensors file by rank 0 (``logger``), which never holds the whole model.
    """
    from raytrn.data.manifest import load_manifest

    assert t.export is not None
    writing = logger is not None and logger.run_id is not None
    if logger is not None and not writing:
        log.warning("final model not logged: the MLflow run was never created (server unreachable)")
    specs = {name: (v.dtype, tuple(v.shape)) for name, v in getattr(t.model, "module", t.model).state_dict().items()}
    with tempfile.TemporaryDirectory(prefix="raytrn-model-") as d:
        try:
            _export(job, t.export(), d if writing else None, specs)
            if writing:
                _save_tokenizer(load_manifest(job.data.manifest, check_files=False).tokenizer_path, d)
                logger.client.log_artifacts(logger.run_id, d, "model")
        except Exception as e:  # tracking never fails a finished training
            log.warning("could not log the final model to MLflow: %s", e)


def _export(job: JobSpec, items: Any, out_dir: str | None, specs: dict[str, Any]) -> None:
    """The model's full tensors (gathered one at a time) as a Hugging Face checkpoint; under LoRA with the adapters
    merged (``tracking.export: merged``) or as a peft adapter directory (``adapter``)."""
    from raytrn.models.llama import save_hf

    lora = job.model.lora
    if lora is None:
        save_hf(job.model, items, out_dir, specs=specs)
        return
    from raytrn.models.lora import adapted_weights, export_specs, merged_items, save_adapter

    if job.tracking.export == "adapter":
        save_adapter(lora, items, out_dir, base=job.model.init_from)
        return
    scaling = lora.alpha / lora.rank
    save_hf(job.model, merged_items(items, scaling, adapted_weights(specs)), out_dir, specs=export_specs(specs))


def _save_tokenizer(path: str, out_dir: str) -> None:
    from transformers import PreTrainedTokenizerFast

    from raytrn import storage

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(storage.read_text(path) or "")
    try:
        PreTrainedTokenizerFast(tokenizer_file=f.name).save_pretrained(out_dir)
    finally:
        os.unlink(f.name)
