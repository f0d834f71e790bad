"""MLflow tracking without Ray: secret redaction, the asynchronous logger, bad tracking input, system metrics.

The store is a real MLflow sqlite store in a temp dir; "unreachable" is a closed port on 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raytrn.config import load_job
from raytrn.errors import ConfigError
from raytrn.tracking.client import REDACTED, is_secret_key, redact, redact_uri, unreachable
from raytrn.tracking.logger import LOGGED_STEP_TAG, AsyncLogger, logged_step_of
from raytrn.tracking.mlflow_run import attach, end_run, plan_run
from raytrn.tracking.system import SystemSampler, node_label
from tests.conftest import mlflow_store

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
FIXTURE_REPORT = REPO / "tests" / "fixtures" / "neuron-monitor-report.json"


def _closed_port_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens once the socket is closed


def _job(tmp_path: Path, *overrides: str, store: bool = True):
    """jobs/tiny.yaml tracked in ``tmp_path/mlflow.db``: with ``store``, a migrated empty store copied there first
    (:func:`tests.conftest.mlflow_store`: not ~2-3 s of schema migrations a test), else only named."""
    uri = mlflow_store(tmp_path / "mlflow.db") if store else f"sqlite:///{tmp_path / 'mlflow.db'}"
    return load_job(
        REPO / "jobs" / "tiny.yaml",
        [
            f"checkpoint.storage={tmp_path / 'ckpt'}",
            f"tracking.mlflow_uri={uri}",
            "tracking.experiment=unit-tracking",
            "tracking.run_name=unit-run",
            *overrides,
        ],
    )


# -- secrets -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["HF_TOKEN", "auth.token", "tracking.password", "AWS_SECRET_ACCESS_KEY", "openai_api_key", "db.passwd"]
)
def test_secret_keys_are_redacted(key):
    assert is_secret_key(key)
    assert redact(key, "hunter2") == REDACTED


@pytest.mark.parametrize(
    "key", ["model.flops_per_token", "data.tokenizer", "tokens_per_s", "usd_per_1m_tokens", "optim.lr", "run.seed"]
)
def test_ordinary_keys_are_kept(key):
    assert not is_secret_key(key)
    assert redact(key, 3) == "3"


def test_passwords_in_uris_are_masked():
    assert redact_uri("postgresql://mlflow:s3cret@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert redact("tracking.mlflow_uri", "https://alice:pw@host/") == "https://alice:***@host/"
    assert redact_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


# -- the asynchronous logger --------------------------------------------------------------------------


def _run(tmp_path: Path) -> tuple[str, str]:
    uri = mlflow_store(tmp_path / "store.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("async", artifact_location=f"file://{tmp_path / 'art'}")
    return uri, client.create_run(exp).info.run_id


def test_async_logger_delivers_in_order_and_records_the_logged_step(tmp_path):
    uri, run_id = _run(tmp_path)
    logger = AsyncLogger(uri, run_id, batch_window_s=0.05)
    for step in range(1, 31):
        logger.log_metrics({"loss": 10.0 / step, "lr": 0.1}, step)
    logger.log_metrics({"system/node-x/cpu_utilization_percentage": 5.0}, 99, training=False)
    logger.set_tags({"checkpoint.latest": "/ckpt/checkpoint_00000030"})
    assert logger.close(timeout_s=30) == 0
    client = MlflowClient(uri)
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == list(range(1, 31))
    assert history[-1].value == pytest.approx(10.0 / 30)
    tags = client.get_run(run_id).data.tags
    assert tags["checkpoint.latest"] == "/ckpt/checkpoint_00000030"
    assert tags[LOGGED_STEP_TAG] == "30"  # system metrics' steps do not count
    assert logged_step_of(client.get_run(run_id)) == 30


def test_async_logger_sends_a_backlog_batch_after_batch_and_a_flush_at_once(tmp_path):
    """A batch gathers for the logger's window (here 60 s: one request per window, not one per metric), but a full
    batch queued (an outage's backlog, a long run's last metrics) goes at once, and so does the rest while a caller
    waits in flush(). Until 2026-12-04 every batch waited out the window: a backlog drained at one batch per window
    and request (the MLflow outage test's run waited ~13 s at its end for 1,700 steps' metrics)."""
    uri, run_id = _run(tmp_path)
    logger = AsyncLogger(uri, run_id, batch_window_s=60)
    try:
        for step in range(1, 1001):  # 3,000 metrics: 3 full batches of 900, then 300
            logger.log_metrics({"loss": 10.0 / step, "lr": 0.1, "tokens_per_s": 5.0}, step)
        deadline = time.monotonic() + 60
        while logger.pending > 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logger.delivered == 2700 and logger.pending == 300  # the full batches, none of the window's 60 s
        time.sleep(0.3)
        assert logger.pending == 300  # the rest gathers for its window...
        assert logger.flush(timeout_s=30)  # ...unless a caller waits for it
        assert logger.delivered == 3000
    finally:
        logger.close(timeout_s=5)
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")] == list(range(1, 1001))


def test_tracking_actor_knows_the_last_steps_across_restarts(tmp_path):
    """The actor class itself (no Ray): training and system-metric steps, queued here or read from the run."""
    from raytrn.tracking.actor import TrackingActor

    uri, run_id = _run(tmp_path)
    first = TrackingActor(uri, run_id)
    assert (first.max_step, first.next_step("system/node-a/")) == (0, 0)
    first.log_metrics({"loss": 1.0}, 7)
    first.log_metrics({"system/node-a/cpu_utilization_percentage": 5.0}, 0, False)
    first.log_metrics({"system/node-a/cpu_utilization_percentage": 6.0}, 1, False)
    first.log_metrics({"system/node-b/cpu_utilization_percentage": 6.0}, 4, False)
    assert first.max_step == 7
    assert (first.next_step("system/node-a/"), first.next_step("system/node-b/")) == (2, 5)
    assert first.next_step("system/node-c/") == 0
    assert first.close(30) == 0
    # A new driver (a resumed job) starts a new actor: it reads the same from the run, once.
    second = TrackingActor(uri, run_id)
    assert second.max_step == 7
    assert (second.next_step("system/node-a/"), second.next_step("system/node-b/")) == (2, 5)
    second.close(30)


def test_tracking_actor_drops_the_steps_a_restarted_group_repeats(tmp_path):
    """The worker does not wait for the actor: the actor itself drops training steps it has logged already."""
    from raytrn.tracking.actor import TrackingActor

    uri, run_id = _run(tmp_path)
    actor = TrackingActor(uri, run_id)
    for step in (5, 10, 15):
        actor.log_metrics({"loss": float(step)}, step)
    for step in (10, 15, 20):  # a worker group restarted from the step-5 checkpoint
        actor.log_metrics({"loss": 100.0 + step}, step)
    actor.log_metrics({"time_to_first_step_s": 9.0}, 6, False)  # not a training step: never dropped
    # A logged step was reached, even when its board update never came (rank 0 killed between the two calls): a
    # restart from step 5 trains 15 steps again.
    assert actor.step_reached == 20 and actor.restored("storage", 5, 0.1) is None  # (the first group: no restart)
    actor.group_started(5, 1)
    assert actor.restored("storage", 5, 0.1).steps_retrained == 15
    assert actor.close(30) == 0
    client = MlflowClient(uri)
    tags = client.get_run(run_id).data.tags
    assert (tags["raytrn.restore_source"], tags["raytrn.restore_passed_over"]) == ("storage:step_5", "none")
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [
        (5, 5.0), (10, 10.0), (15, 15.0), (20, 120.0),
    ]  # fmt: skip
    assert [m.step for m in client.get_metric_history(run_id, "time_to_first_step_s")] == [6]


def test_a_new_live_rank_0_sends_the_scores_the_lost_one_may_not_have_logged(tmp_path):
    """Live recovery: every replica evaluates; only rank 0 logs. The scores of step 10 reached the run (rank 0 sent
    them), step 20's did not (rank 0 lost after evaluating): the replica that becomes rank 0 sends both after its
    next step, and the run gets step 20's once, step 10's not twice (the actor itself, the real one, no Ray)."""
    from raytrn.tracking.actor import TrackingActor
    from raytrn.train.live.group import Generation, LiveGroup
    from raytrn.train.live_loop import RankZeroLogger

    uri, run_id = _run(tmp_path)
    actor = TrackingActor(uri, run_id)
    group = LiveGroup(store=None, member="b")  # type: ignore[arg-type]  # (membership only: no store read)
    group.generation = Generation(0, ("a", "b"))  # b is rank 1
    logger = RankZeroLogger(actor, group)
    actor.log_missing({"val_loss": 2.0}, 10)  # a (rank 0) logged step 10's
    logger.log_missing({"val_loss": 2.0}, 10)  # b kept them (not rank 0)
    logger.catch_up()  # (still not rank 0: nothing sent)
    logger.log_missing({"val_loss": 1.5}, 20)  # a evaluated step 20 and was lost before logging
    logger.set_tags({"best_val_step": "20"})
    group.generation = Generation(1, ("b",))  # b is rank 0 now
    logger.catch_up()
    logger.catch_up()  # (once)
    actor.log_missing({"val_loss": 2.0}, 10)  # already there: dropped
    assert actor.close(30) == 0
    # a later invocation of the job (a new actor) knows them too: a group restarted from an older checkpoint
    # evaluates step 20 again, and the run keeps one row
    again = TrackingActor(uri, run_id)
    again.log_missing({"val_loss": 1.5}, 20)
    again.log_missing({"val_loss": 1.25}, 30)
    assert again.close(30) == 0
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_loss")] == [
        (10, 2.0), (20, 1.5), (30, 1.25),
    ]  # fmt: skip
    assert client.get_run(run_id).data.tags["best_val_step"] == "20"


def test_world_size_history_stays_under_mlflows_tag_limit(tmp_path):
    """Thousands of restarts: the tag keeps the newest entries and counts the rest, and a new invocation
    continues the count from the run's tag."""
    from raytrn.tracking.actor import WORLD_SIZE_TAG, TrackingActor, WorldSizeHistory

    uri, run_id = _run(tmp_path)
    first = TrackingActor(uri, run_id)
    for step in range(3000):
        first.group_started(step * 10, 1 + step % 3)
    assert first.groups == 3000
    assert first.close(30) == 0
    tag = MlflowClient(uri).get_run(run_id).data.tags[WORLD_SIZE_TAG]
    assert len(tag) <= 4000 and tag.startswith("+") and tag.endswith(",29990:3")
    history = WorldSizeHistory.parse(tag)
    assert history.earlier + len(history.entries) == 3000
    second = TrackingActor(uri, run_id)
    second.group_started(30000, 3)
    assert second.groups == 1  # the first worker group of this invocation
    assert second.close(30) == 0
    again = WorldSizeHistory.parse(MlflowClient(uri).get_run(run_id).data.tags[WORLD_SIZE_TAG])
    assert again.earlier + len(again.entries) == 3001 and again.entries[-1] == "30000:3"


def test_checkpoint_tags_follow_keep_last_across_invocations(tmp_path):
    from raytrn.tracking.actor import TrackingActor

    uri, run_id = _run(tmp_path)
    first = TrackingActor(uri, run_id)
    for step in (5, 10, 15):
        first.checkpoint_saved(step, f"/ckpt/checkpoint_{step:08d}", 2)
    assert first.close(30) == 0
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["checkpoint.step_00000005"] == "deleted by checkpoint.keep_last=2: /ckpt/checkpoint_00000005"
    assert tags["checkpoint.step_00000015"] == tags["checkpoint.latest"] == "/ckpt/checkpoint_00000015"
    second = TrackingActor(uri, run_id)  # a resumed job: the run's tags say which checkpoints exist
    assert second.checkpoints == {10: "/ckpt/checkpoint_00000010", 15: "/ckpt/checkpoint_00000015"}
    second.checkpoint_saved(20, "/ckpt/checkpoint_00000020", 2)
    assert second.close(30) == 0
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["checkpoint.step_00000010"].startswith("deleted by checkpoint.keep_last=2")
    assert tags["checkpoint.latest_step"] == "20"


def test_with_keep_best_the_tags_mark_what_retention_deleted(tmp_path):
    """checkpoint.keep_best: Ray keeps every pointer, so the tags follow raytrn's retention (the steps it reports
    deleting), not keep_last: the best checkpoint's tag stays."""
    from raytrn.tracking.actor import TrackingActor

    uri, run_id = _run(tmp_path)
    actor = TrackingActor(uri, run_id)
    for step in (5, 10, 15, 20):
        actor.checkpoint_saved(step, f"/ckpt/checkpoint_{step:08d}", None, {15} if step == 20 else set())
    assert actor.close(30) == 0
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["checkpoint.step_00000015"] == "deleted by checkpoint.keep_last (keep_best): /ckpt/checkpoint_00000015"
    assert tags["checkpoint.step_00000005"] == "/ckpt/checkpoint_00000005"  # the best, kept
    assert tags["checkpoint.latest_step"] == "20"


def test_tracking_actor_remembers_the_running_cost(tmp_path):
    from raytrn.tracking.actor import TrackingActor

    uri, run_id = _run(tmp_path)
    first = TrackingActor(uri, run_id)
    assert first.last_value("cost_usd") == 0.0
    first.log_metrics({"loss": 1.0, "cost_usd": 1.5}, 10)
    first.log_metrics({"loss": 1.0, "cost_usd": 2.5}, 20)
    assert first.last_value("cost_usd") == 2.5
    assert first.close(30) == 0
    assert TrackingActor(uri, run_id).last_value("cost_usd") == 2.5  # read from the run by a new invocation


def test_plan_run_checks_the_server_and_writes_nothing(tmp_path):
    """The driver's part: no MLflow import, no store, no marker; the run is the tracking actor's to create."""
    import subprocess
    import sys

    job = _job(tmp_path, "tracking.experiment=planned", store=False)
    planned = plan_run(job, tags={"accelerator": "cpu"}, extra_params={"model.num_params": 7})
    assert planned is not None and planned.reachable and planned.run_id is None
    assert planned.params["model.num_params"] == 7 and planned.params["optim.lr"] == job.optim.lr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ckpt").exists()
    assert plan_run(_job(tmp_path, "tracking.enabled=false")) is None
    code = (
        "import sys; from raytrn.config import load_job; from raytrn.tracking.mlflow_run import plan_run; "
        f"plan_run(load_job({str(REPO / 'jobs' / 'tiny.yaml')!r}, ['tracking.mlflow_uri=sqlite:///{tmp_path}/x.db'])); "
        "assert 'mlflow' not in sys.modules, 'plan_run imported mlflow'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_tracking_actor_creates_the_planned_run(tmp_path):
    from raytrn.tracking.actor import TrackingActor

    job = _job(tmp_path, "tracking.experiment=made-by-actor")
    planned = plan_run(job, tags={"accelerator": "cpu"})
    assert planned is not None
    actor = TrackingActor(planned.uri, None, job, planned.tags, planned.params)
    ids = actor.ready()
    assert ids["run_id"] and ids["experiment_id"]
    actor.log_metrics({"loss": 2.0}, 1)
    assert actor.close(30) == 0
    run = MlflowClient(job.tracking.mlflow_uri).get_run(ids["run_id"])
    assert run.info.experiment_id == ids["experiment_id"] and run.data.tags["accelerator"] == "cpu"
    assert run.data.params["optim.lr"] == str(job.optim.lr) and run.data.metrics["loss"] == 2.0
    # A second actor for the same job (a resumed job) reattaches to that run (the marker by the checkpoints).
    again = TrackingActor(planned.uri, None, job, planned.tags, planned.params)
    assert again.ready()["run_id"] == ids["run_id"]
    again.close(5)


def test_tracking_actor_reports_a_refused_run(tmp_path):
    """MLflow refuses the run (here: a deleted experiment): ready() raises the ConfigError the driver stops
    the job with; metrics sent meanwhile are dropped without an exception, and no run exists."""
    from raytrn.tracking.actor import TrackingActor

    job = _job(tmp_path, "tracking.experiment=deleted-one")
    client = MlflowClient(job.tracking.mlflow_uri)
    client.delete_experiment(client.create_experiment("deleted-one"))
    planned = plan_run(job)
    assert planned is not None
    actor = TrackingActor(planned.uri, None, job, planned.tags, planned.params)
    with pytest.raises(ConfigError, match=r"tracking.experiment='deleted-one' is deleted in sqlite:.*restore it"):
        actor.ready()
    actor.log_metrics({"loss": 1.0}, 1)
    actor.close(0.5)
    assert client.search_runs([e.experiment_id for e in client.search_experiments(view_type=3)], run_view_type=3) == []


@pytest.fixture
def open_logger():
    """Opens AsyncLoggers against unreachable servers and closes them at teardown, passed or failed: a logger
    left open keeps dialling its port from its thread into the later tests of the same process (stop 65's CI:
    the evaluation harness's no-network check in the next file saw a failed test's logger)."""
    opened: list[AsyncLogger] = []

    def open_(*args, **kwargs) -> AsyncLogger:
        opened.append(AsyncLogger(*args, **kwargs))
        return opened[-1]

    yield open_
    for logger in opened:
        logger.close(timeout_s=0.1)


def _silent_server() -> socket.socket:
    """A listening socket that never accepts: connections wait in the kernel's backlog, requests get no answer
    (closing it resets them)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    return silent


def _wait_in_flight(logger: AsyncLogger, count: int) -> None:
    deadline = time.monotonic() + 10
    while logger._in_flight == 0 and time.monotonic() < deadline:  # the sender takes its first batch
        time.sleep(0.01)
    assert logger._in_flight == count


def test_async_logger_never_blocks_when_mlflow_is_unreachable(open_logger, monkeypatch):
    """Training never waits for MLflow. A server that refuses connections: 1,000 steps are queued, nothing is lost
    or delivered, close() gives up after its timeout and says how many. A server that never answers: while the
    sender is stuck in a request, 1,000 more steps are still only queued, where a log_metrics that sent would
    wait for the request's 30 s timeout at its first call (the bound, 15 s, is 10x what 1,000 calls take on a slow
    machine; stop 65's CI failed a bound of 1 s at 1.3 s)."""
    logger = open_logger(_closed_port_uri(), "0" * 32, batch_window_s=0.05)
    for step in range(1000):
        logger.log_metrics({"loss": 1.0, "lr": 0.1, "tokens_per_s": 5.0}, step)
    time.sleep(0.5)
    assert logger.pending == 3000 and logger.delivered == 0  # nothing lost, nothing delivered
    t0 = time.perf_counter()
    assert logger.close(timeout_s=1.0) == 3000  # bounded: gives up after the flush timeout, says how many
    assert time.perf_counter() - t0 < 20

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    with _silent_server() as silent:
        logger = open_logger(f"http://127.0.0.1:{silent.getsockname()[1]}", "0" * 32, batch_window_s=0.01)
        logger.log_metrics({"loss": 1.0}, 0)
        _wait_in_flight(logger, 1)
        t0 = time.monotonic()
        for step in range(1, 1001):
            logger.log_metrics({"loss": 1.0, "lr": 0.1, "tokens_per_s": 5.0}, step)
        assert time.monotonic() - t0 < 15
        assert logger._in_flight == 1 and logger.pending == 3001  # the sender is still waiting for its answer
    assert logger.close(timeout_s=0.1) == 3001  # the closed socket reset the request: nothing was delivered
    assert logger.delivered == 0


def test_async_logger_counts_the_batch_in_flight_when_closed(open_logger, monkeypatch):
    """close() while a batch is on its way to a server that never answers: that batch is not delivered either
    (stop 43's CI: a flush that timed out mid-request reported 2,100 of 3,000 undelivered)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with _silent_server() as silent:
        logger = open_logger(f"http://127.0.0.1:{silent.getsockname()[1]}", "0" * 32, batch_window_s=0.01)
        for step in range(1000):
            logger.log_metrics({"loss": 1.0, "lr": 0.1, "tokens_per_s": 5.0}, step)
        _wait_in_flight(logger, 900)  # the first batch (900) is sent
        assert logger.close(timeout_s=0.1) == 3000
        assert logger.delivered == 0


def test_async_logger_bounded_buffer_drops_the_oldest(open_logger):
    logger = open_logger(_closed_port_uri(), "0" * 32, max_buffered=100, batch_window_s=0.05)
    for step in range(300):
        logger.log_metrics({"loss": float(step)}, step)
    assert logger.pending <= 100
    assert logger.close(timeout_s=0.5) >= 200  # dropped + undelivered are reported


def test_async_logger_creates_a_pending_run_when_it_can(tmp_path):
    uri, run_id = _run(tmp_path)
    answers = iter([None, None, run_id])  # the server "comes back" on the third try
    logger = AsyncLogger(uri, None, resolve_run=lambda: next(answers, run_id), batch_window_s=0.05)
    logger.log_metrics({"loss": 1.0}, 1)
    assert logger.flush(timeout_s=30)
    assert logger.run_id == run_id
    logger.close(1)
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")] == [1]


# -- bad tracking input -------------------------------------------------------------------------------


def start_run(job, tags=None, extra_params=None):
    """What the driver and its tracking actor do between them: plan (check the server), then create or
    reattach the run when the server answers."""
    planned = plan_run(job, tags, extra_params)
    if planned is None or not planned.reachable:
        return planned
    return attach(job, planned.tags, planned.params)


def test_unreachable_server_is_an_error_when_required(tmp_path):
    job = _job(tmp_path, f"tracking.mlflow_uri={_closed_port_uri()}", "tracking.required=true")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"tracking.mlflow_uri=http://127.0.0.1:\d+: cannot connect.*required"):
        start_run(job)
    assert time.perf_counter() - t0 < 10  # no minutes of MLflow client retries
    assert not (tmp_path / "ckpt").exists()  # nothing written


def test_unreachable_server_gives_a_pending_run_and_a_warning(tmp_path, capsys):
    job = _job(tmp_path, f"tracking.mlflow_uri={_closed_port_uri()}")
    run = start_run(job, tags={"accelerator": "cpu"})
    assert run is not None and run.pending
    assert run.params["optim.lr"] == job.optim.lr  # what rank 0 will create the run with
    assert "unreachable" in capsys.readouterr().out
    assert end_run(run, "FINISHED", job=job) is None  # never created: nothing to mark, no exception


def test_unreachable_reports_why():
    assert "cannot connect" in (unreachable(_closed_port_uri(), timeout_s=1) or "")
    assert unreachable("sqlite:///x.db") is None


def test_unknown_experiment_is_created_and_a_rerun_reattaches(tmp_path):
    job = _job(tmp_path, "tracking.experiment=brand-new")
    first = start_run(job)
    assert first is not None and not first.resumed
    client = MlflowClient(job.tracking.mlflow_uri)
    assert client.get_experiment_by_name("brand-new") is not None
    second = start_run(job)
    assert second is not None and second.resumed and second.run_id == first.run_id


def test_explicit_run_id_that_does_not_exist_is_a_clear_error(tmp_path):
    job = _job(tmp_path, "tracking.run_id=0123456789abcdef0123456789abcdef")
    with pytest.raises(
        ConfigError, match="tracking.run_id: MLflow run 0123456789abcdef0123456789abcdef does not exist"
    ):
        start_run(job)


def test_marker_naming_a_deleted_run_is_a_clear_error(tmp_path):
    job = _job(tmp_path)
    run = start_run(job)
    assert run is not None and run.run_id
    MlflowClient(job.tracking.mlflow_uri).delete_run(run.run_id)
    with pytest.raises(ConfigError, match=r"raytrn-mlflow.json .*is deleted.*delete .*raytrn-mlflow.json"):
        start_run(job)


def test_params_are_redacted_and_versions_recorded(tmp_path):
    from raytrn.train.run_meta import versions

    job = _job(tmp_path)
    run = start_run(
        job,
        extra_params={**versions(), "env.HF_TOKEN": "hf_abc", "storage.uri": "s3://key:secret@bucket/x"},
    )
    assert run is not None and run.run_id
    params = MlflowClient(job.tracking.mlflow_uri).get_run(run.run_id).data.params
    assert params["env.HF_TOKEN"] == REDACTED
    assert params["storage.uri"] == "s3://key:***@bucket/x"
    assert params["versions.torch"].startswith("2.")
    assert params["versions.ray"] and params["versions.mlflow"]
    assert "hf_abc" not in json.dumps(params) and ":secret@" not in json.dumps(params)


def test_registration_and_evaluation_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="register: last needs log_model"):
        _job(tmp_path, "tracking.register_model=tiny", "tracking.log_model=false")
    with pytest.raises(ConfigError, match="register: best needs registered_model"):
        _job(tmp_path, "tracking.register=best")
    with pytest.raises(ConfigError, match="frozen XLA path's checkpoints are not the sharded ones"):
        _job(tmp_path, "tracking.register=best", "tracking.registered_model=x", "scaling.accelerator=xla-cpu")
    with pytest.raises(ConfigError, match="eval.tasks with scaling.accelerator neuron-xla"):
        _job(tmp_path, "eval.tasks=[stdlib_next_line]", "scaling.accelerator=neuron-xla")
    from types import SimpleNamespace

    from raytrn.errors import DataError
    from raytrn.train.checks import validation_set

    best = _job(tmp_path, "tracking.register=best", "tracking.registered_model=x")
    without = SimpleNamespace(validation_path=lambda: None)  # a training set prepared without a validation split
    with pytest.raises(
        DataError, match="register: best registers the checkpoint of the lowest val_loss, but there is no"
    ):
        validation_set(best, without)  # type: ignore[arg-type]
    old = _job(tmp_path, "tracking.register_model=tiny")  # the former spelling: the final model, as before
    assert old.tracking.registered_model == "tiny" and old.tracking.registers == "last"
    assert _job(tmp_path).tracking.registers == "none"


# -- system metrics -----------------------------------------------------------------------------------


class _Collect:
    run_id = None

    def __init__(self) -> None:
        self.calls: list[tuple[dict, int, bool]] = []

    def log_metrics(self, metrics, step, *, training=True):
        self.calls.append((metrics, step, training))


def test_system_sample_is_named_per_node():
    sampler = SystemSampler(_Collect(), node_label("a1b2c3d4e5f6"), 60)
    sample = sampler.sample()
    assert "system/node-a1b2c3d4/cpu_utilization_percentage" in sample
    assert "system/node-a1b2c3d4/system_memory_usage_megabytes" in sample
    assert all(k.startswith("system/node-a1b2c3d4/") for k in sample)
    # MLflow's names (what its own system-metrics monitor logs), all of them
    names = {k.rsplit("/", 1)[1] for k in sample}
    assert names == {
        "cpu_utilization_percentage",
        "system_memory_usage_megabytes",
        "system_memory_usage_percentage",
        "disk_usage_percentage",
        "disk_usage_megabytes",
        "disk_available_megabytes",
        "network_receive_megabytes",
        "network_transmit_megabytes",
    }
    assert 0 < sample["system/node-a1b2c3d4/system_memory_usage_percentage"] < 100


def test_system_sampler_does_not_import_mlflow_in_the_training_process():
    """Importing MLflow in a sampler thread held the GIL ~0.6 s mid-training (measured): CPU nodes never do."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from raytrn.tracking.system import SystemSampler\n"
        "class L:\n    def log_metrics(self, *a, **k): pass\n"
        "s = SystemSampler(L(), 'node-x', 60)\n"
        "assert s.sample()\n"
        "print('mlflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_system_sampler_includes_neuron_monitor_and_logs_non_training_steps(tmp_path, monkeypatch):
    report = json.loads(FIXTURE_REPORT.read_text())
    script = tmp_path / "neuron-monitor"
    script.write_text(
        f"#!{__import__('sys').executable}\nimport time\n"
        f"while True:\n    print({json.dumps(report)!r}, flush=True)\n    time.sleep(0.1)\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    logger = _Collect()
    sampler = SystemSampler.start(logger, "ffff0000aaaa", 0.3)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
            "system/node-ffff0000/neuroncore_0_utilization_percentage" in m for m, _, _ in logger.calls
        ):
            time.sleep(0.1)
    finally:
        sampler.close()
    metrics, step, training = next(
        c for c in logger.calls if "system/node-ffff0000/neuroncore_0_utilization_percentage" in c[0]
    )
    assert metrics["system/node-ffff0000/neuroncore_0_utilization_percentage"] == 91.5
    assert metrics["system/node-ffff0000/neuron_device_memory_used_bytes"] == 17179869184.0
    assert "system/node-ffff0000/cpu_utilization_percentage" in metrics
    assert training is False
    assert [c[1] for c in logger.calls] == list(range(len(logger.calls)))  # one step per sample
    assert sampler.neuron is not None and sampler.neuron._proc.poll() is not None  # stopped by close()


def test_tracking_actor_gets_the_drivers_mlflow_and_aws_settings():
    """A Ray the driver did not start lacks the driver's S3 endpoint and credentials; the actor needs them
    (it reads the run's pointer next to S3 checkpoints). It runs on the driver's node: the profile is kept."""
    from raytrn.tracking.actor import driver_env

    environ = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_PROFILE": "research",
        "MLFLOW_TRACKING_PASSWORD": "pw",
        "PATH": "/usr/bin",
        "HOME": "/home/u",
    }
    assert driver_env(environ) == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_PROFILE": "research",
        "MLFLOW_TRACKING_PASSWORD": "pw",
    }


def test_permanent_and_transient_mlflow_errors():
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    from raytrn.tracking.logger import is_permanent

    def rest(code: str) -> RestException:
        return RestException({"error_code": code, "message": "x"})

    assert is_permanent(rest("INVALID_PARAMETER_VALUE"))  # 400: a key too long, a deleted run
    assert is_permanent(rest("RESOURCE_DOES_NOT_EXIST"))  # 404
    assert is_permanent(MlflowException("bad", error_code=INVALID_PARAMETER_VALUE))  # a local store says so too
    assert not is_permanent(rest("REQUEST_LIMIT_EXCEEDED"))  # 429: back off and retry
    assert not is_permanent(rest("TEMPORARILY_UNAVAILABLE"))  # 503
    assert not is_permanent(MlflowException("API request failed: connection refused"))  # INTERNAL_ERROR, 500
    assert not is_permanent(OSError("connection reset")) and not is_permanent(TimeoutError())


def test_a_local_store_refusal_is_dropped_not_retried(tmp_path):
    """The same rule on a sqlite store: a tag key over the limit is refused; the metrics still arrive."""
    uri, run_id = _run(tmp_path)
    logger = AsyncLogger(uri, run_id, batch_window_s=0.05)
    for step in range(1, 6):
        logger.log_metrics({"loss": float(step)}, step)
    logger.set_tags({"k" * 300: "v"})
    assert logger.flush(30)
    assert logger.rejected == 1
    assert logger.close(10) == 0
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")] == [1, 2, 3, 4, 5]


def test_start_up_is_named_by_worker_group(tmp_path):
    """The first worker group's start-up counts from the launch; a restarted group's from its own start."""
    from raytrn.tracking.actor import TrackingActor

    uri, run_id = _run(tmp_path)
    actor = TrackingActor(uri, run_id)
    actor.group_started(0, 2)
    actor.first_step_done(1, 15.5, 9.0)
    actor.group_started(20, 1)  # a restart from the step-20 checkpoint
    actor.first_step_done(21, 95.0, 7.5)
    assert actor.first_step_s == 15.5  # the summary's start-up is the launch's
    assert actor.close(30) == 0
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "time_to_first_step_s")] == [(1, 15.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "restart_to_first_step_s")] == [(21, 7.5)]
