"""RAY_ADDRESS handling: clear, fast errors instead of ray.init retrying for minutes."""

from __future__ import annotations

import socket

import pytest

from raytrn.errors import RaytrnError
from raytrn.runtime import _check_reachable

pytestmark = pytest.mark.unit


def test_dashboard_url_is_not_a_cluster_address() -> None:
    with pytest.raises(RaytrnError, match=r"dashboard \(job submission\) URL.*ray job submit --address http://h:8265"):
        _check_reachable("http://h:8265")


@pytest.mark.parametrize("address", ["nonsense", "host:port", ":6379"])
def test_malformed_address(address: str) -> None:
    with pytest.raises(RaytrnError, match="expected HOST:PORT"):
        _check_reachable(address)


def test_unreachable_address_fails_fast() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RaytrnError, match=rf"cannot reach the Ray cluster at RAY_ADDRESS='127.0.0.1:{port}'"):
        _check_reachable(f"127.0.0.1:{port}", timeout_s=2)


def test_listening_address_passes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        _check_reachable(f"127.0.0.1:{s.getsockname()[1]}")
    _check_reachable("auto")  # resolved by Ray itself


def test_local_ray_defaults_keep_the_users_values():
    from raytrn.compat import PREEMPTION_WATCHER_ENV, PRESTART_WORKERS_ENV
    from raytrn.runtime import set_local_ray_defaults

    env = {}
    set_local_ray_defaults(env)
    # nothing to preempt on one machine; no idle workers started beside the run's start
    assert env == {PREEMPTION_WATCHER_ENV: "0", PRESTART_WORKERS_ENV: "0"}
    env = {PREEMPTION_WATCHER_ENV: "1", PRESTART_WORKERS_ENV: "1"}
    set_local_ray_defaults(env)
    assert env == {PREEMPTION_WATCHER_ENV: "1", PRESTART_WORKERS_ENV: "1"}


def test_an_embedded_local_rays_dashboard_is_off_unless_asked_for() -> None:
    from raytrn.runtime import DASHBOARD_ENV, local_ray_dashboard

    assert local_ray_dashboard({}) is False
    assert [local_ray_dashboard({DASHBOARD_ENV: v}) for v in ("1", "true", " Yes ", "on")] == [True] * 4
    assert [local_ray_dashboard({DASHBOARD_ENV: v}) for v in ("", "0", "false", "NO", "off")] == [False] * 5
    with pytest.raises(RaytrnError, match=rf"{DASHBOARD_ENV}='maybe': expected 1 .* or 0 .*--ray-dashboard"):
        local_ray_dashboard({DASHBOARD_ENV: "maybe"})


def test_ray_dashboard_flag_sets_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``raytrn train`` and ``raytrn sweep`` take ``--ray-dashboard``; given, it sets the variable; absent, a user's
    value stays."""
    import os

    from raytrn.cli import build_parser
    from raytrn.cli_args import use_ray_dashboard_option
    from raytrn.runtime import DASHBOARD_ENV

    parser = build_parser()
    for argv in (["train", "job.yaml"], ["sweep", "sweep.yaml"]):
        monkeypatch.delenv(DASHBOARD_ENV, raising=False)
        use_ray_dashboard_option(parser.parse_args(argv))
        assert DASHBOARD_ENV not in os.environ
        use_ray_dashboard_option(parser.parse_args([*argv, "--ray-dashboard"]))
        assert os.environ[DASHBOARD_ENV] == "1"
