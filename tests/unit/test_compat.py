"""Every private Ray / MLflow API raytrn uses still exists in the installed versions (raytrn/compat/).

A failure here names the API that moved: fix raytrn/compat/ (and only it) before upgrading Ray or MLflow.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raytrn import compat

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("what", sorted(compat.PRIVATE_NAMES))
def test_private_name_still_exists(what: str) -> None:
    spec = compat.PRIVATE_NAMES[what]
    try:
        compat.resolve(spec)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{what}: {spec} is gone from the installed Ray/MLflow ({e}); update raytrn/compat/")


def test_resolve_names_what_moved() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        compat.resolve("ray.train:nope")
    with pytest.raises(ImportError):
        compat.resolve("ray.train.v2._internal.no_such_module")


def test_preemption_watcher_switch_is_rays() -> None:
    assert compat.resolve(compat.PRIVATE_NAMES["Ray Train preemption watcher switch"]) == compat.PREEMPTION_WATCHER_ENV


def test_prestart_setting_is_the_raylets() -> None:
    """The raylet reads its settings from the environment as ``RAY_<name>``: the name must be one of its own (a
    renamed setting would silently start the idle workers again)."""
    import mmap

    raylet = compat.resolve(compat.PRIVATE_NAMES["Ray's raylet executable"])
    name = compat.PRESTART_WORKERS_ENV.removeprefix("RAY_").encode()
    with open(raylet, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
        assert image.find(name) >= 0, f"{raylet} has no setting {name!r}: update raytrn.compat.PRESTART_WORKERS_ENV"
        assert image.find(b"prestart_worker_first_drive_") < 0  # the search itself can fail


def test_a_worker_that_died_with_its_preempted_node_is_charged_to_rays_preemption_budget() -> None:
    """As Ray Train's failure policy counts (raytrn's driver line says which budget a failure took): a worker whose
    node was preempted (a drained node taken away: Ray sets ``RayActorError.preempted``) is a preemption, also
    beside other ranks' collateral errors; a plain worker death or error is not."""
    from ray.exceptions import RayActorError
    from ray.train.v2.api.exceptions import PreemptionError, WorkerGroupError
    from ray.train.v2.api.preemption import PreemptionInfo

    preempted, died = RayActorError(preempted=True), RayActorError()
    assert compat.is_preemption_failure(WorkerGroupError("lost", {1: preempted, 0: RuntimeError("gloo: closed")}))
    assert not compat.is_preemption_failure(WorkerGroupError("lost", {1: died}))
    assert not compat.is_preemption_failure(WorkerGroupError("bug", {0: ValueError("a user's bug")}))
    notice = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"n1": [1]})
    assert compat.is_preemption_failure(PreemptionError(notice, drain_timed_out=True))


def test_hosted_trainer_drops_the_cleaner_and_datasets_callbacks_and_adds_its_events() -> None:
    """Outside an actor the controller runs in the calling process: no placement-group cleaner (the job's placement
    group goes with its driver), no datasets callback (raytrn passes no datasets); every other stock callback stays,
    and the events callback that feeds the listener comes last."""
    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    kwargs = {"scaling_config": ScalingConfig(num_workers=1)}
    stock = [type(c).__name__ for c in DataParallelTrainer(lambda: None, **kwargs)._create_default_callbacks()]
    assert {"PlacementGroupCleanerCallback", "DatasetsCallback"} <= set(stock)
    hosted = compat.hosted_trainer(DataParallelTrainer)
    assert issubclass(hosted, DataParallelTrainer) and hosted.__name__ == "HostedDataParallelTrainer"
    ours = [type(c).__name__ for c in hosted(lambda: None, **kwargs)._create_default_callbacks()]
    assert ours == [n for n in stock if n not in compat.HOSTED_SKIPPED_CALLBACKS] + ["Events"]


def test_the_hosted_preemption_watcher_polls_every_second_unless_rays_variable_says_otherwise(monkeypatch) -> None:
    import inspect

    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback

    from raytrn.compat.preemption import preemption_poll_s

    monkeypatch.delenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", raising=False)
    assert preemption_poll_s() == 1.0
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "3")
    assert preemption_poll_s() == 3.0 == PreemptionCallback()._poll_interval_s  # what stock reads
    # what the hosted callback replaces: stock builds its watcher with its own interval
    assert "poll_interval_s=self._poll_interval_s" in inspect.getsource(PreemptionCallback)


def test_a_committed_notice_checkpoint_ends_the_preempting_wait_at_once_and_is_told() -> None:
    """Every rank's report of :data:`NOTICE_COMMITTED` (the notice's checkpoint committed, nothing trained after it)
    ends the hosted controller's wait for the notice's deadline; before it, and in the next group, the deadline
    decides as in stock Ray Train."""
    import time
    from types import SimpleNamespace

    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    told: list[int] = []
    listener = SimpleNamespace(notice_committed=told.append, group_starting=lambda n: None)
    hosted = compat.hosted_trainer(DataParallelTrainer, listener=listener)  # type: ignore[arg-type]
    events = hosted(lambda: None, scaling_config=ScalingConfig(num_workers=2))._create_default_callbacks()[-1]
    controller = SimpleNamespace(_callbacks=[events])
    later = SimpleNamespace(deadline_ms=(time.time() + 600) * 1000)  # a notice's deadline 10 minutes away
    deadline_passed = hosted.controller_cls._is_preemption_deadline_exceeded
    assert not deadline_passed(controller, later, time.time())
    events.after_report(SimpleNamespace(checkpoint=None), [{"loss": 2.0}, {"loss": 2.0}])  # a log step's report
    assert not deadline_passed(controller, later, time.time()) and told == []
    events.after_report(SimpleNamespace(checkpoint=None), [{compat.NOTICE_COMMITTED: 12}] * 2)
    assert deadline_passed(controller, later, time.time()) and told == [12]
    events.before_worker_group_start(SimpleNamespace(num_workers=1))  # the restarted group: nothing committed
    assert not deadline_passed(controller, later, time.time())
    assert deadline_passed(controller, SimpleNamespace(deadline_ms=(time.time() - 1) * 1000), time.time())


def test_a_hosted_controllers_workers_import_ahead_as_they_are_constructed_when_asked() -> None:
    """``import_ahead``: every worker of the hosted controller's groups (replacements too) is raytrn's Ray Train worker
    (raytrn.compat.worker); without it, Ray's own class. raytrn's cpu/cuda backends ask for it, TorchNeuron's not."""
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from raytrn.backends import get_backend
    from raytrn.compat import worker
    from raytrn.config import load_job

    ours = compat.hosted_trainer(DataParallelTrainer, import_ahead=True).controller_cls.worker_group_cls
    stock = compat.hosted_trainer(DataParallelTrainer).controller_cls.worker_group_cls
    assert ours._worker_cls is worker.RayTrainWorker
    assert stock._worker_cls is worker.RayTrainWorker.__bases__[0]
    job = load_job(str(REPO / "jobs" / "tiny.yaml"), [])
    assert get_backend("cpu").ray_backend_config(job).import_at_construction


def test_a_worker_given_up_by_the_health_check_is_frozen_unless_its_node_is_lost() -> None:
    """Ray Train's health-check timeout on a worker whose node answers: a frozen process (killed by the hosted
    controller); on a node that does not answer while Ray still calls it alive: lost, left for Ray's node death
    (which fails it as a lost node's, a drained one's as a preemption). Other errors are neither."""
    import inspect

    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError
    from ray.train.v2._internal.execution.worker_group import WorkerGroup

    timed_out = WorkerHealthCheckTimeoutError("A worker health check has been hanging for 31.00 seconds.")
    polls = [(None, "n0"), (timed_out, "n1"), (RuntimeError("boom"), "n2"), (timed_out, "n3")]
    assert compat.replicas.frozen_workers(polls, WorkerHealthCheckTimeoutError, lambda ids: ids == ["n3"]) == (
        [1], [3],
    )  # fmt: skip
    assert compat.replicas.frozen_workers(polls, WorkerHealthCheckTimeoutError, None) == ([1, 3], [])
    assert compat.replicas.frozen_workers(polls[:1], WorkerHealthCheckTimeoutError, lambda ids: True) == ([], [])
    asked: list[list[str]] = []  # one probe per node and poll: two replicas on one silent node, one probe
    two = [(timed_out, "n5"), (timed_out, "n5")]
    lost = compat.replicas.frozen_workers(two, WorkerHealthCheckTimeoutError, lambda ids: asked.append(ids) or True)
    assert lost == ([], [0, 1]) and asked == [["n5"]]
    # why a frozen replica group is killed before another is replaced: Ray's replacement waits, without a bound, on
    # every other active replica group's answer
    assert "ray.get(clear_tasks)" in inspect.getsource(WorkerGroup._replace_replica_group_impl)


def test_a_hosted_controllers_resource_requests_expire_soon_after_their_last_renewal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's own coordinator client sends the expiry raytrn sets (its request recorded as the coordinator actor
    would get it; no Ray started: the client's ``ray.get`` hands the reply back): 45 s, not 180 s; never below two
    renewals and 5 s."""
    import types

    from ray.air.config import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as client

    sent: list[dict] = []

    class Coordinator:  # the coordinator actor's handle: records the request Ray's client makes
        class request_resources:  # noqa: N801
            @staticmethod
            def remote(**kwargs: object) -> None:
                sent.append(kwargs)

    monkeypatch.setattr(client, "ray", types.SimpleNamespace(get=lambda reply, timeout: reply))
    before = client.AUTOSCALING_REQUESTS_EXPIRE_TIME_S
    try:
        assert compat.controller.expire_resource_requests_after(compat.controller.REQUEST_EXPIRY_S) == 45
        requests = client.TrainAutoscalingCoordinatorClient("train-test")
        requests.__dict__["_autoscaling_coordinator"] = Coordinator()
        requests.send_resource_request(ScalingConfig(num_workers=2), 2)
        assert [r["expire_after_s"] for r in sent] == [45]
        assert compat.controller.expire_resource_requests_after(1) == 2 * client.AUTOSCALING_REQUESTS_INTERVAL_S + 5
    finally:
        client.AUTOSCALING_REQUESTS_EXPIRE_TIME_S = before


def test_what_the_hosted_controller_overrides_keeps_its_signature() -> None:
    """The hosted controller passes these by name: a Ray that renames one breaks it here, not in a job."""
    import inspect

    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker

    assert list(inspect.signature(WorkerGroup._init_train_context_on_workers).parameters) == [
        "self", "workers", "sync_actor", "train_context_args",
    ]  # fmt: skip
    worker_args = inspect.signature(RayTrainWorker.init_train_context).parameters
    assert {"train_run_context", "distributed_context", "synchronization_actor", "storage_context",
            "worker_callbacks", "controller_actor"} <= set(worker_args)  # fmt: skip
    assert list(inspect.signature(TrainController._execute_failure_decision).parameters) == [
        "self", "failure_decision", "training_failed_error", "invoke_failure_decision_callbacks",
    ]  # fmt: skip
    init = inspect.getsource(TrainController.__init__)
    assert "_worker_group_callbacks_to_propagate" in init and init.rstrip().endswith("self._start()")
    assert "_health_check_interval_s" in inspect.getsource(TrainController.__init__)
    # a live run's worker timeout: set after WorkerGroup.__init__ reads Ray's variable, read where polls hang
    assert "self._worker_health_check_timeout_s = float(" in inspect.getsource(WorkerGroup.__init__)
    assert "elapsed_time_s > self._worker_health_check_timeout_s" in inspect.getsource(
        WorkerGroup._poll_workers_and_collect_errors
    )
    assert "ray.actor.exit_actor()" in inspect.getsource(TrainController.abort)  # why abort_here exists
    source = inspect.getsource(WorkerGroup._init_train_context_on_workers)
    assert "controller_actor=ray.get_runtime_context().current_actor" in source
    # a replica group waiting for capacity: its ranks' statuses replaced in the polls' list, by world rank; a
    # status without an error that is not running is a finished worker; Ray's replacement starts its actors in line
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

    assert list(inspect.signature(WorkerGroup._poll_workers_and_collect_errors).parameters) == ["self", "timeout"]
    assert "worker_statuses=dict(enumerate(poll_results))" in inspect.getsource(WorkerGroup.poll_status)
    done = WorkerGroupPollStatus({0: WorkerStatus(running=False), 1: WorkerStatus(running=False)}, {0: 0, 1: 1})
    assert done.finished and not done.errors and not done.failing_replica_group_indices
    assert "ray.get([actor.get_metadata.remote() for actor in actors])" in inspect.getsource(
        WorkerGroup._create_workers
    )
    # raytrn's worker class (raytrn.compat.worker): set on the group, which makes every worker of it (a replacement
    # too), constructed without arguments
    assert "(self._worker_cls)" in inspect.getsource(WorkerGroup._create_workers)
    assert list(inspect.signature(RayTrainWorker.__init__).parameters) == ["self"]
    # a committed notice checkpoint restarts the group at once: the preempting state asks this (as a method) whether
    # to stop waiting, and then fails the group with a preemption (not one of max_failures); reports reach every
    # ReportCallback among the controller's callbacks with every rank's metrics
    preempting = inspect.getsource(TrainController._handle_preempting_state)
    assert "deadline_exceeded = self._is_preemption_deadline_exceeded(" in preempting
    assert "if worker_group_status.finished or deadline_exceeded:" in preempting and "PreemptionError(" in preempting
    assert list(inspect.signature(TrainController._is_preemption_deadline_exceeded).parameters) == [
        "preemption_info", "detected_at_s", "extra_grace_s",
    ]  # fmt: skip
    assert "isinstance(c, ReportCallback)" in inspect.getsource(TrainController.__init__)
    from ray.train.v2._internal.execution.callback import ReportCallback

    assert list(inspect.signature(ReportCallback.after_report).parameters) == ["self", "training_report", "metrics"]


def test_metric_objects_have_steps() -> None:
    from mlflow.entities import Metric, Run, RunData, RunInfo

    info = RunInfo("r", "0", "u", "RUNNING", 0, None, "active")
    run = Run(info, RunData(metrics=[Metric("system/x", 1.0, 0, 7), Metric("loss", 2.0, 0, 3)]))
    assert sorted((m.key, m.step) for m in compat.metric_objects(run)) == [("loss", 3), ("system/x", 7)]


def test_dataset_input_is_an_mlflow_entity() -> None:
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput

    dataset = MetaDataset(source=HTTPDatasetSource("http://127.0.0.1/x"), name="d", digest="abc")
    entity = compat.dataset_input(dataset, "train")
    assert isinstance(entity, DatasetInput)
    assert entity.dataset.digest == "abc" and [(t.key, t.value) for t in entity.tags] == [
        ("mlflow.data.context", "train")
    ]


def test_quiet_ray_train_logs_raises_their_level() -> None:
    compat.quiet_ray_train_logs()
    for name in compat.RAY_TRAIN_CHATTY_MODULES:
        assert logging.getLogger(name).getEffectiveLevel() >= logging.WARNING


def test_ray_datas_progress_bar_notice_is_quieted_where_it_is_logged(caplog) -> None:
    """Ray Data's "Progress bars disabled" warning (a training worker's own setting) comes from the logger
    quiet_ray_train_logs raises: fails when Ray Data moves the notice to another logger."""
    import importlib

    from ray.data.context import DataContext

    progress = importlib.import_module("ray.data._internal.progress")
    assert progress.logger.name in compat.RAY_DATA_CHATTY_LOGGERS
    ctx = DataContext.get_current().copy()
    ctx.enable_progress_bars = False
    from ray.util import debug

    debug._logged.discard("ray_data_progress_manager_disabled")  # log_once: a fresh process's first time
    logging.getLogger(progress.logger.name).setLevel(logging.NOTSET)
    with caplog.at_level(logging.WARNING, logger=progress.logger.name):
        progress.get_progress_manager(ctx, "d", {}, False)
    assert [r.name for r in caplog.records if "Progress bars disabled" in r.getMessage()] == [progress.logger.name]
    compat.quiet_ray_train_logs()
    assert not logging.getLogger(progress.logger.name).isEnabledFor(logging.WARNING)


def test_ray_trains_resume_notice_reaches_raytrns_handler_alone() -> None:
    """Ray Train's checkpoint manager logs its resume notice on the logger the hosted controller filters while it is
    built (fails when Ray moves the notice); the filter hands a record to raytrn's handler alone, at its level."""
    import importlib
    import inspect

    from raytrn.compat.controller import CHECKPOINT_MANAGER_LOGGER, ToHandler

    manager = importlib.import_module(CHECKPOINT_MANAGER_LOGGER)
    assert manager.logger.name == CHECKPOINT_MANAGER_LOGGER
    assert "A run snapshot was found" in inspect.getsource(manager)

    class Kept(logging.Handler):
        def __init__(self, level: int) -> None:
            super().__init__(level)
            self.records: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record.getMessage())

    parent, child = logging.getLogger("raytrn-test-parent"), logging.getLogger("raytrn-test-parent.child")
    rays, raytrns = Kept(logging.INFO), Kept(logging.WARNING)
    parent.addHandler(rays)
    child.setLevel(logging.INFO)
    routed = ToHandler(raytrns)
    child.addFilter(routed)
    try:
        child.info("a notice")
        child.warning("a warning")
    finally:
        child.removeFilter(routed)
        parent.removeHandler(rays)
    assert rays.records == [] and raytrns.records == ["a warning"]


def test_nothing_else_uses_a_private_ray_or_mlflow_name() -> None:
    """Private names (``_internal``, ``_private``, a leading underscore after ray./mlflow.) appear only in compat."""
    pattern = re.compile(
        r"(ray|mlflow)\.[\w.]*\._\w+|_create_default_callbacks|_resources_per_worker_not_none|_metric_objs|"
        r"_to_mlflow_entity|RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
    )
    out = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for rel in out:
        if rel.startswith("raytrn/compat/") or rel == "tests/unit/test_compat.py":
            continue
        for n, line in enumerate((REPO / rel).read_text().splitlines(), start=1):
            if pattern.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "private Ray/MLflow APIs outside raytrn/compat/:\n" + "\n".join(offenders)


def test_compat_imports_no_ray_or_mlflow_at_import_time() -> None:
    """raytrn.compat is imported by light modules (runtime, the loop): it must not import Ray or MLflow itself."""
    code = "import sys, raytrn.compat; print(any(m.split('.')[0] in ('ray', 'mlflow') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_rays_driver_prints_worker_output_through_one_function() -> None:
    """route_worker_output replaces ``print_to_stdstream`` before ray.init: ``connect`` binds it as the
    log-forwarding handler and ``listen_error_messages`` (the raylet's warnings) calls it by name."""
    import inspect

    import ray._private.worker as ray_worker

    assert "functools.partial(print_to_stdstream" in inspect.getsource(ray_worker.connect)
    assert "print_to_stdstream(" in inspect.getsource(ray_worker.listen_error_messages)
    assert list(inspect.signature(ray_worker.print_to_stdstream).parameters) == ["data", "ignore_prefix"]
    assert list(inspect.signature(ray_worker.print_worker_logs).parameters)[:3] == [
        "data",
        "print_file",
        "ignore_prefix",
    ]


def test_route_worker_output_hands_each_batch_to_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    monkeypatch.setattr(ray_worker, "print_to_stdstream", original)  # put back after the test
    seen: list = []
    compat.route_worker_output(lambda data, ignore_prefix, ray_print: seen.append((data, ignore_prefix, ray_print)))
    compat.route_worker_output(lambda data, ignore_prefix, ray_print: seen.append(("second", ray_print)))
    batch = {"lines": ["hello"], "pid": 7, "is_err": False}
    ray_worker.print_to_stdstream(batch, False)
    assert seen == [("second", original)]  # routed twice: the newest handler, still given Ray's own printer


def test_write_worker_lines_formats_as_ray_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")
    out = io.StringIO()
    compat.write_worker_lines({"lines": ["a", "b"], "pid": 7, "actor_name": "TrainController", "ip": "x"}, out)
    compat.write_worker_lines({"lines": ["warn"], "pid": "raylet", "ip": "x", "localhost": "x"}, out)
    assert out.getvalue().splitlines() == [
        "(TrainController pid=7, ip=x) a",
        "(TrainController pid=7, ip=x) b",
        "(raylet) warn",
    ]


def test_simulator_nodes_each_unpack_runtime_envs_into_their_own_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's provider gives each fake node ``runtime_resources_<id>`` (stock: the head's, which a node
    joining mid-job deletes under the job's driver); nodes started otherwise keep Ray's default."""
    import inspect

    from ray._private import parameter
    from ray.autoscaler._private.fake_multi_node import node_provider

    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    monkeypatch.setattr(parameter, "RayParams", parameter.RayParams)  # the provider replaces it: restored after
    provider = compat.simulator_node_provider()({"gcs_address": "127.0.0.1:1"}, "raytrn-test")
    assert isinstance(provider, node_provider.FakeMultiNodeProvider)
    node = parameter.RayParams(num_cpus=1, env_vars={compat.FAKE_NODE_ID_ENV: "ff01"})
    assert node.runtime_env_dir_name == "runtime_resources_ff01"
    assert parameter.RayParams(num_cpus=1).runtime_env_dir_name == "runtime_resources"
    # What the subclass relies on: the stock provider builds each node's RayParams, by attribute, with its id.
    source = inspect.getsource(node_provider.FakeMultiNodeProvider)
    assert "ray._private.parameter.RayParams(" in source and f'"{compat.FAKE_NODE_ID_ENV}"' in source


def test_dcp_stage_copies_into_kept_host_buffers_until_the_structure_changes() -> None:
    import torch

    state = {"w": torch.arange(4.0), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "step": 3}
    staged, host = compat.dcp_stage(state, None)
    assert torch.equal(staged["w"], state["w"]) and staged["w"].data_ptr() != state["w"].data_ptr()
    state["w"].add_(1)
    state["groups"][0]["lr"] = 0.2
    again, kept = compat.dcp_stage(state, host)
    assert kept is host and again["w"].data_ptr() == staged["w"].data_ptr()  # the same buffer, copied into
    assert torch.equal(again["w"], torch.arange(4.0) + 1) and again["groups"][0]["lr"] == 0.2 and again["step"] == 3
    state["bias"] = torch.zeros(2)  # another structure: new buffers
    moved, other = compat.dcp_stage(state, host)
    assert other is not host and torch.equal(moved["bias"], torch.zeros(2)) and torch.equal(moved["w"], state["w"])


def test_dcp_stage_copies_a_0_dim_tensor_and_passes_a_new_tensor_through_kept_plain_buffers() -> None:
    """AdamW's ``step`` is a 0-dim tensor: copied into its kept buffer. A value that was None when the buffers were
    made and is a tensor now is passed through as the live tensor (why LiveState builds its state again then)."""
    import torch

    state = {"step": torch.tensor(3.0), "momentum": None, "w": torch.ones(3)}
    staged, host = compat.dcp_stage(state, None)
    assert staged["step"].dim() == 0 and staged["step"].item() == 3.0 and staged["momentum"] is None
    state["step"].add_(1)
    again, kept = compat.dcp_stage(state, host)
    assert kept is host and again["step"].item() == 4.0 and again["step"].data_ptr() == staged["step"].data_ptr()
    state["momentum"] = torch.full((3,), 2.0)
    moved, _ = compat.dcp_stage(state, host)
    assert moved["momentum"] is state["momentum"]  # not copied: the caller must not pass these buffers
    fresh, _ = compat.dcp_stage(state, None)
    assert torch.equal(fresh["momentum"], state["momentum"]) and fresh["momentum"] is not state["momentum"]


def test_dcp_storage_info_is_what_dcps_file_reader_reads() -> None:
    info = compat.dcp_storage_info("__0_0.raw", 12, 34)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.raw", 12, 34)
    assert info.transform_descriptors is None  # no transform: the reader takes the bytes as they are


def _in_order(source: str, steps: list[str]) -> None:
    """Every one of ``steps`` is in ``source``, in that order."""
    at = [source.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at, strict=True))


def test_replicas_replaced_together_take_the_steps_of_rays_replacement_of_one() -> None:
    """raytrn.compat.replicas.replace_together does for several replica groups what Ray's replacement does for one,
    in its order: a Ray whose replacement takes other steps, or names them otherwise, breaks it here."""
    import inspect

    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group.execution_group import ReplicaGroup

    source = inspect.getsource(WorkerGroup._replace_replica_group_impl)
    steps = [
        "old_replica_group.shutdown()",
        "self._world_rank_to_ongoing_poll.pop(",
        "w.actor.clear_result_queue.remote()",
        "ray.get(sync_actor.reset.remote())",
        "new_workers = self._create_workers(",
        "starting_world_rank=replica_group_index,",
        "self._worker_group_state.replace_workers(",
        "new_replica_group = ReplicaGroup(",
        "self._init_train_context(new_workers, sync_actor)",
        "new_replica_group.start_training(self._worker_group_context)",
    ]
    _in_order(source, steps)
    assert list(inspect.signature(WorkerGroup._create_workers).parameters) == [
        "self", "num_workers", "placement_group", "resources_per_worker", "placement_group_bundle_indices",
        "starting_world_rank", "world_size", "replica_group_size",
    ]  # fmt: skip
    assert list(inspect.signature(ReplicaGroup).parameters) == ["workers", "resources_per_worker", "callbacks"]
    assert "self._replica_group_callbacks" in inspect.getsource(WorkerGroup.__init__)
    # a replacement whose worker dies as it starts: Ray's error for it, which its default failure policy retries
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.failure_handling.default import RETRYABLE_CONTROLLER_ERRORS

    assert "raise WorkerGroupStartupFailedError(error_msg) from actor_error" in source
    assert issubclass(WorkerGroupStartupFailedError, RETRYABLE_CONTROLLER_ERRORS)
    # the controller's failing groups: each through replace_replica_group (raytrn's checks), in one call it overrides
    from ray.train.v2._internal.execution.controller import TrainController

    assert list(inspect.signature(TrainController._replace_bad_workers).parameters) == ["self", "poll_status"]
    loop = inspect.getsource(TrainController._replace_bad_workers)
    assert (
        "for rg_index in failing_rg_indices:" in loop and "self._worker_group.replace_replica_group(rg_index)" in loop
    )


def test_replica_slots_create_workers_as_ray_train_does_with_a_placement_group_per_slot() -> None:
    """raytrn.compat.replica_slots repeats Ray Train's worker creation with a group per slot, and stands in for its
    placement-group handle: a Ray whose creation takes other steps, or that asks a handle for more, breaks it here."""
    import inspect

    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group.placement_group_handle import PlacementGroupHandle

    create = inspect.getsource(WorkerGroup._create_workers)
    steps = [
        "self._get_worker_runtime_env(",
        "custom_runtime_env=self._train_run_context.run_config.worker_runtime_env",
        "**bundle_to_remote_args(resources_per_worker),",
        ")(self._worker_cls)",
        "placement_group=placement_group, placement_group_bundle_index=i",
        "ray.get([actor.get_metadata.remote() for actor in actors])",
        "ray.kill(actor)",
        "raise WorkerGroupStartupFailedError(error_msg) from actor_error",
        "Worker(actor, meta, resources_per_worker, placement_group_bundle_index=idx)",
        "WorkerGroup._assign_worker_ranks(",
    ]
    _in_order(create, steps)
    ours = list(inspect.signature(compat.replica_slots.create_workers).parameters)
    theirs = [p for p in inspect.signature(WorkerGroup._create_workers).parameters if p != "placement_group"]
    assert ours[:2] == ["group", "slots"] and ours[2:] == theirs[1:], (ours, theirs)  # (the group for self)
    start = inspect.getsource(WorkerGroup._start_impl)
    assert "self._create_placement_group(" in start and "pg_handle.wait(" in start
    assert "pg_handle.placement_group" in start and "self._manages_replica_groups" in start
    # the handle's protocol, and nobody in Ray Train's worker group or controller asks a handle to be ready()
    abstract = {n for n, v in vars(PlacementGroupHandle).items() if getattr(v, "__isabstractmethod__", False)}
    assert abstract == {"placement_group", "ready", "wait", "shutdown"}, abstract
    assert abstract <= set(dir(compat.replica_slots.ReplicaSlots)), abstract
    for source in (inspect.getsource(inspect.getmodule(WorkerGroup)), inspect.getsource(TrainController)):
        assert "handle.ready()" not in source and "pg_handle.ready" not in source


class _Slots(compat.replica_slots.ReplicaSlots):
    """ReplicaSlots over stated groups (their state and node as placement_group_table gives them), counting the
    groups it removes and asks for anew."""

    def __init__(self, states: list[tuple[str, str | None]]) -> None:
        self.table = list(states)
        self.asked: list[int] = []
        self.removed: list[str] = []
        self.groups = [f"g{i}" for i in range(len(states))]

    def _request(self, slot: int) -> str:
        self.asked.append(slot)
        self.table[slot] = ("PENDING", None)
        return f"g{slot}-anew"

    def _remove(self, slot: int) -> None:
        self.removed.append(self.groups[slot])

    def state(self, slot: int) -> tuple[str, str | None]:
        return self.table[slot]


def test_a_lost_slot_is_asked_for_anew_once_and_waits_pending() -> None:
    slots = _Slots(
        [("CREATED", "n1"), ("RESCHEDULING", None), ("CREATED", "n3"), ("PENDING", None), ("PREPARED", None)]
    )
    assert slots.ready_on([0], {"n1", "n2"})  # placed on a usable node: replaced in place
    assert slots.asked == [] and slots.removed == []
    # rescheduling (its node dead) and placed on a draining one (n3, not usable): both asked for anew
    assert not slots.ready_on([1, 2], {"n1", "n2"})
    assert slots.removed == ["g1", "g2"] and slots.asked == [1, 2] and slots.groups[1:3] == ["g1-anew", "g2-anew"]
    # waiting or being placed: left alone (a group removed and requested again at every poll might never be placed)
    assert not slots.ready_on([1, 2, 3, 4], {"n1", "n2"}) and slots.asked == [1, 2]
    slots.table[1] = ("CREATED", "n2")  # capacity came back
    assert slots.ready_on([1], {"n1", "n2"})


def test_a_failed_request_leaves_the_slot_to_the_next_poll_and_a_half_made_set_is_removed() -> None:
    class Busy(_Slots):  # the GCS times out the first request
        def _request(self, slot: int) -> str:
            if not self.asked:
                self.asked.append(-1)
                raise TimeoutError("the GCS is busy")
            return super()._request(slot)

    slots = Busy([("RESCHEDULING", None)])
    assert not slots.ready_on([0], {"n1"}) and slots.removed == ["g0"] and slots.groups == ["g0"]
    slots.table[0] = ("REMOVED", None)  # (what its removed group reads)
    assert not slots.ready_on([0], {"n1"}) and slots.groups == ["g0-anew"]  # asked for at the next poll

    class Halfway(compat.replica_slots.ReplicaSlots):  # the second of three requests fails: the first is removed
        made: list[str] = []
        gone: list[str] = []

        def _request(self, slot: int) -> str:
            if slot == 1:
                raise TimeoutError("the GCS is busy")
            self.made.append(f"g{slot}")
            return f"g{slot}"

        def _remove(self, slot: int) -> None:
            self.gone.append(self.groups[slot])

    with pytest.raises(TimeoutError):
        Halfway({"CPU": 1}, 3)
    assert Halfway.made == Halfway.gone == ["g0"]


def test_the_slots_wait_gives_ray_whole_seconds_of_one_deadline() -> None:
    class Group:
        def __init__(self) -> None:
            self.asked: list[int] = []

        def wait(self, timeout_seconds: int) -> bool:
            self.asked.append(timeout_seconds)
            return True

    slots = _Slots([("PENDING", None)] * 2)
    slots.groups = [Group(), Group()]
    assert slots.wait(2.5)
    assert [g.asked for g in slots.groups] == [[3], [3]]  # (Ray's wait truncates to an int: 0 is never ready)
    assert slots.wait(0.0) and slots.groups[0].asked[-1] == 1


def test_a_ray_started_under_agent_on_any_port_lets_the_os_pick_its_agents_port() -> None:
    """``ray.init`` builds its node from ``RayParams``, whose agent port is Ray's fixed one unless named: under
    :func:`raytrn.compat.agent_on_any_port` it is 0 (the OS picks), a named one is kept, and after it Ray's own
    default is back. A Ray that renames the parameter fails here (``RayParams`` refuses an unknown keyword)."""
    import inspect

    from ray._private.parameter import RayParams

    from raytrn.compat.local_ray import AGENT_PORT

    default = inspect.signature(RayParams).parameters[AGENT_PORT].default
    assert default not in (0, None)  # Ray's fixed port: what a second Ray on the machine finds taken
    init = RayParams.__init__
    with compat.agent_on_any_port():
        assert getattr(RayParams(), AGENT_PORT) == 0
        assert getattr(RayParams(**{AGENT_PORT: 4242}), AGENT_PORT) == 4242
    assert RayParams.__init__ is init and getattr(RayParams(), AGENT_PORT) == default
    with pytest.raises(RuntimeError, match="boom"), compat.agent_on_any_port():  # restored on an error too
        raise RuntimeError("boom")
    assert RayParams.__init__ is init


def test_ray_init_builds_a_new_local_rays_node_from_ray_params() -> None:
    """:func:`raytrn.compat.agent_on_any_port` reaches ``ray.init`` only while it starts its node from
    ``ray._private.parameter.RayParams`` looked up at the call (not a name bound at import)."""
    import inspect

    import ray._private.worker as ray_worker

    source = inspect.getsource(inspect.unwrap(ray_worker.init))
    assert "ray._private.parameter.RayParams(" in source and "dashboard_agent_listen_port" not in source
