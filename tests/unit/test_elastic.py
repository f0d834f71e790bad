"""The elastic size rule (raytrn.train.elastic) and the policy built on Ray's private ElasticScalingPolicy."""

from __future__ import annotations

import inspect
import socket
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from raytrn import compat
from raytrn.train.elastic import SizeChooser, reachable_nodes

pytestmark = pytest.mark.unit

TRN2 = {"neuron_cores": 1.0}


def test_whole_nodes_only() -> None:
    choose = SizeChooser(resources=TRN2, sizes=(64, 128, 192), workers_per_node=64)
    assert choose({"a": {"neuron_cores": 64}, "b": {"neuron_cores": 64}, "c": {"neuron_cores": 64}}) == 192
    # A node with 40 free cores holds no whole node's worth: two nodes, not 168 workers.
    assert choose({"a": {"neuron_cores": 64}, "b": {"neuron_cores": 64}, "c": {"neuron_cores": 40}}) == 128
    # Two half-free nodes add up to 64 cores but hold no whole node: nothing to start.
    assert choose({"a": {"neuron_cores": 32}, "b": {"neuron_cores": 32}}) == 0
    assert choose({}) == 0


def test_largest_valid_size_that_fits() -> None:
    # The job may run at 1, 2, 3 or 6 workers: 5 free slots run 3, never 4 or 5.
    choose = SizeChooser(resources={"CPU": 1.0, "neuron_cores": 1.0}, sizes=(1, 2, 3, 6))
    assert choose({"a": {"CPU": 2, "neuron_cores": 1}, "b": {"CPU": 8, "neuron_cores": 4}}) == 3
    assert choose({"a": {"CPU": 0.5, "neuron_cores": 1}}) == 0  # every resource must fit
    assert choose({f"n{i}": {"CPU": 1, "neuron_cores": 1} for i in range(7)}) == 6


def test_workers_that_need_nothing_take_the_largest_size() -> None:
    assert SizeChooser(resources={"CPU": 0.0}, sizes=(2, 4))({"a": {}}) == 4


@pytest.fixture
def raylets() -> Iterator[tuple[int, int]]:
    """Two raylet ports on 127.0.0.1: one listening (a live raylet), one where nothing listens any more (a refused
    connection, like a killed raylet's)."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    try:
        yield listening.getsockname()[1], dead_port
    finally:
        listening.close()


def test_a_lost_node_ray_still_calls_alive_holds_its_replacement_back(
    monkeypatch: pytest.MonkeyPatch, raylets: tuple[int, int]
) -> None:
    """``lost_nodes_unconfirmed``: a node whose raylet refuses connections while Ray's node table still calls it
    alive is a loss Ray has not confirmed (its replacement waits), a live one (its raylet answers: a killed worker
    process on it) is not, nor a lost one Ray already marked dead. ``ray.nodes`` is a stand-in returning the
    table's entries as Ray does; the raylets are real sockets."""
    import ray

    from raytrn.train.elastic import lost_nodes_unconfirmed

    live_port, dead_port = raylets
    reads = {"n": 0}

    def nodes() -> list[dict]:
        reads["n"] += 1
        return [
            {"NodeID": "up", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": live_port},
            {"NodeID": "gone", "Alive": reads["n"] < 3, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": dead_port},
        ]  # fmt: skip

    monkeypatch.setattr(ray, "nodes", nodes)
    assert not lost_nodes_unconfirmed(["up"])  # read 1
    assert lost_nodes_unconfirmed(["gone", "up"])  # read 2: Ray still calls it alive, its raylet refuses
    assert not lost_nodes_unconfirmed(["gone"])  # read 3: marked dead


def test_reachable_nodes_probes_the_raylet_port(raylets: tuple[int, int]) -> None:
    live_port, dead_port = raylets
    nodes = [
        {"NodeID": "up", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": live_port},
        {"NodeID": "gone", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": dead_port},
        {"NodeID": "dead", "Alive": False, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": live_port},
        {"NodeID": "odd", "Alive": True},
    ]
    assert reachable_nodes(nodes, timeout_s=2) == {"up"}
    assert reachable_nodes([]) == set()


# --- the Ray internals the policy relies on (raytrn/compat/) -----------------------------------------------


def test_ray_elastic_policy_internals_are_where_the_policy_expects_them() -> None:
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    ElasticScalingPolicy = compat.resolve(compat.PRIVATE_NAMES["Ray Train elastic policy"])
    coordinator_reservations = compat.resolve(compat.PRIVATE_NAMES["Ray autoscaling coordinator reservations"])

    assert list(inspect.signature(ElasticScalingPolicy._count_possible_workers).parameters) == [
        "self",
        "reserved_resources",
    ]
    assert list(inspect.signature(ElasticScalingPolicy._get_reserved_resources).parameters) == ["self"]
    assert list(inspect.signature(ElasticScalingPolicy.make_decision_for_non_running_worker_group).parameters) == [
        "self"
    ]
    assert ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S > 0
    init = inspect.getsource(ElasticScalingPolicy.__init__)
    assert "self._latest_reserved_resources_query_time" in init and "self._latest_reserved_resources" in init
    # Both decisions size the group through _count_possible_workers(_get_reserved_resources()).
    for decision in ("make_decision_for_non_running_worker_group", "make_decision_for_running_worker_group"):
        source = inspect.getsource(getattr(ElasticScalingPolicy, decision))
        assert "self._get_reserved_resources()" in source and "self._count_possible_workers(" in source, decision
    assert "recompute" in inspect.signature(coordinator_reservations).parameters
    # fit() hands the policy to the controller through this hook, as a keyword.
    assert "scaling_policy=" in inspect.getsource(DataParallelTrainer.fit)
    assert "controller_init_kwargs" in inspect.signature(DataParallelTrainer._initialize_and_run_controller).parameters


def test_policy_counts_with_the_chooser_and_travels_to_the_controller() -> None:
    import ray.cloudpickle
    from ray.train.v2.api.config import ScalingConfig

    ElasticScalingPolicy = compat.resolve(compat.PRIVATE_NAMES["Ray Train elastic policy"])

    choose = SizeChooser(resources=TRN2, sizes=(64, 128), workers_per_node=64)
    config = ScalingConfig(num_workers=(64, 128), resources_per_worker=dict(TRN2))
    policy = compat.elastic_scaling_policy(config, choose, reachable_nodes)
    assert isinstance(policy, ElasticScalingPolicy)
    reserved = {"a": {"neuron_cores": 64.0}, "b": {"neuron_cores": 63.0}}
    # Ray's own count: 127 workers (capped at 128); the chooser's: one whole node.
    assert ElasticScalingPolicy(config)._count_possible_workers(reserved) == 127
    assert policy._count_possible_workers(reserved) == 64
    copy = ray.cloudpickle.loads(ray.cloudpickle.dumps(policy))  # the controller is an actor
    assert copy._count_possible_workers(reserved) == 64


def test_a_running_group_only_grows() -> None:
    """Ray's decision for a running group, with the cluster view replaced: one node fewer (draining: the
    preemption flow shrinks the group after its checkpoint) is no resize; one node more is."""
    from ray.train.v2.api.config import ScalingConfig

    resize = compat.resolve(compat.PRIVATE_NAMES["Ray Train scaling decisions"])
    noop = compat.resolve(compat.PRIVATE_NAMES["Ray Train no-op decision"])
    config = ScalingConfig(num_workers=(1, 3), resources_per_worker={"neuron_cores": 1.0})
    policy = compat.elastic_scaling_policy(
        config, SizeChooser(resources={"neuron_cores": 1.0}, sizes=(1, 2, 3)), reachable_nodes
    )
    policy._maybe_send_resource_request = lambda: None  # no autoscaling coordinator in a unit test
    running = SimpleNamespace(start_time=float("-inf"), num_workers=2)
    for nodes, expected in ((1, noop), (2, noop), (3, resize)):
        policy._latest_monitor_time = float("-inf")
        policy._get_reserved_resources = lambda n=nodes: {f"n{i}": {"neuron_cores": 1.0} for i in range(n)}
        decision = policy.make_decision_for_running_worker_group(running, None)
        assert type(decision) is expected, (nodes, decision)
    assert decision.num_workers == 3


def test_a_restart_right_after_a_resize_check_is_sized_from_the_cluster_after_the_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray keeps a view of the cluster for a second. A node lost 0.35 s after a running group's resize check took
    one: the restart must not reuse that view (it counted the lost node: a start at the old size waits out Ray's 60 s
    start timeout; the chaos suite, 2026-12-04), but take a new one; a second decision right after reuses that."""
    import ray
    from ray.train.v2.api.config import ScalingConfig

    resize = compat.resolve(compat.PRIVATE_NAMES["Ray Train scaling decisions"])
    live = {"n0", "n1", "n2"}
    asked: list[bool] = []

    class Coordinator:  # the autoscaling coordinator's reservation: every node's slot, lost ones too (Ray lags)
        class get_reserved_resources:  # noqa: N801 - an actor method's handle
            @staticmethod
            def remote(requester: str, recompute: bool = False) -> dict[str, dict[str, float]]:
                asked.append(recompute)
                return {n: {"neuron_cores": 1.0} for n in ("n0", "n1", "n2")}

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": True} for n in ("n0", "n1", "n2")])
    monkeypatch.setattr(compat, "draining_nodes", lambda: set())
    config = ScalingConfig(num_workers=(1, 3), resources_per_worker={"neuron_cores": 1.0})
    policy = compat.elastic_scaling_policy(
        config,
        SizeChooser(resources={"neuron_cores": 1.0}, sizes=(1, 2, 3)),
        lambda nodes: {str(n["NodeID"]) for n in nodes} & live,  # the raylets that answer
    )
    policy._maybe_send_resource_request = lambda: None
    policy._coordinator_client = SimpleNamespace(_autoscaling_coordinator=Coordinator())  # (its one use here)
    running = SimpleNamespace(start_time=float("-inf"), num_workers=3)
    policy._latest_monitor_time = float("-inf")
    assert policy.make_decision_for_running_worker_group(running, None).__class__.__name__ == "NoopDecision"
    live.discard("n2")  # lost now, well within the second Ray keeps that view
    decision = policy.make_decision_for_non_running_worker_group()
    assert type(decision) is resize and decision.num_workers == 2, decision
    assert len(asked) == 2
    policy.make_decision_for_non_running_worker_group()  # (waiting for its start: Ray's second of reuse again)
    assert len(asked) == 2


@pytest.mark.parametrize(
    "accelerator, sets",
    [
        ("cpu", []),
        ("cpu", ["scaling.min_workers=1", "scaling.max_workers=3", "scaling.workers_per_node=1"]),
        ("cpu", ["scaling.resources_per_worker={CPU: 2, neuron_cores: 1}"]),
        ("cpu", ["scaling.resources_per_worker={neuron_cores: 1}"]),
        ("cuda", []),
    ],
)
def test_the_cpus_the_driver_asks_ray_for_are_the_scaling_configs(accelerator: str, sets: list[str]) -> None:
    """The driver starts (or checks) Ray with the CPUs its workers take before Ray Train is imported (that import
    runs beside Ray's start): the same number Ray Train's ScalingConfig counts, elastic sizes at their largest."""
    from pathlib import Path

    from raytrn.backends import get_backend
    from raytrn.config import load_job
    from raytrn.train.trainer import _cpus_needed, _scaling

    job = load_job(
        Path(__file__).resolve().parents[2] / "jobs" / "tiny.yaml", [f"scaling.accelerator={accelerator}", *sets]
    )
    backend = get_backend(accelerator)
    assert _cpus_needed(job, backend) == _scaling(job, backend).total_resources.get("CPU", 0)
