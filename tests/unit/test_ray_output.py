"""Ray's own lines go to the run's log file; raytrn's lines and the errors that need the user stay on the terminal
(raytrn.ray_output.route_ray_output)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrn import ray_output, runtime

pytestmark = pytest.mark.unit

#: Lines `make demo` printed between raytrn's own before the log file (issue 27, point 10).
PLUMBING = [
    "Attempting to start training worker group of size 2 with the following resources: [{'CPU': 1.0}] * 2",
    "Started training worker group of size 2: ",
    "- (ip=192.0.2.2, pid=26809) world_rank=0, local_rank=0, node_rank=0",
    "Setting up process group for: env:// [rank=0, world_size=2]",
    "Progress bars disabled. To enable, set `ray.data.DataContext.get_current().enable_progress_bars = True`.",
    "WARNING: 4 PYTHON worker processes have been started on node: abc with address: 192.0.2.2. This could be a "
    "result of using a large number of actors, or due to tasks blocked in ray.get() calls",
    "The actor PlacementGroupCleaner is dead because its owner has died.",
    "Requesting resources: {'CPU': 1.0} * 2",
    "Traceback (most recent call last):",
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
]


@pytest.fixture(autouse=True)
def _no_routing_left() -> Iterator[None]:
    """Routing asked for here never reaches a later test's ensure_ray."""
    yield
    ray_output._ray_log_path = None
    ray_output._log_file = None
    ray_output._verbose = False


def test_rays_plumbing_leaves_the_terminal_and_raytrns_lines_stay() -> None:
    assert ray_output.user_lines(PLUMBING) == []
    ours = [
        "raytrn: WARNING: MLflow at http://h:5000 unreachable (training continues, metrics are buffered): x",
        "raytrn: tiny-t00: llama 0.5M parameters",
        "Task was killed due to the node running low on memory.",
    ]
    assert ray_output.user_lines([PLUMBING[0], *ours, PLUMBING[3]]) == ours


def test_a_failed_workers_traceback_and_rays_stack_frames_go_to_the_log_not_the_terminal() -> None:
    """raytrn says one line per failure (raytrn.train.events); a dying worker's traceback, and the C++ frames Ray
    prints for a killed one, are Ray's account of it: the run's log file keeps them."""
    batch = [
        "Traceback (most recent call last):",
        "ValueError: boom",
        "*** SIGSEGV received at time=1795883681 on cpu 1 ***",
        "    @     0x7f1e0c0f2520  ray::core::CoreWorker::RunTaskExecutionLoop()",
    ]
    assert ray_output.user_lines(batch) == []


def test_the_router_writes_every_line_and_prints_only_the_users(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    router = ray_output._RayLines(ray_output._PlainFile(str(path)))
    printed = _Printed()
    lines = [PLUMBING[0], "\x1b[33mcoloured\x1b[0m", "raytrn: WARNING: w"]
    router({"lines": lines, "pid": 5, "actor_name": "RayTrainWorker", "is_err": True}, False, printed.append_pair)
    text = path.read_text()
    assert "(RayTrainWorker pid=5) " + PLUMBING[0] in text and "coloured" in text and "\x1b" not in text
    assert "raytrn: WARNING: w" in text
    kept = {"lines": ["raytrn: WARNING: w"], "pid": 5, "actor_name": "RayTrainWorker", "is_err": True}
    assert printed == [(kept, False)]


class _Printed(list):
    def append_pair(self, data, ignore_prefix) -> None:  # Ray's printer's signature
        self.append((data, ignore_prefix))


def test_raytrn_log_records_are_marked_on_every_line() -> None:
    formatter = ray_output._MarkedFormatter("%(levelname)s: %(message)s")
    record = logging.LogRecord("raytrn.x", logging.WARNING, __file__, 1, "two\nlines", None, None)
    assert formatter.format(record) == "raytrn: WARNING: two\nraytrn:   lines"
    assert ray_output.user_lines(formatter.format(record).splitlines()) == ["raytrn: WARNING: two", "raytrn:   lines"]


def test_a_routine_record_goes_to_the_log_file_not_the_terminal() -> None:
    """Retention's deletions at every save (``extra=ROUTINE``): the run's Ray log keeps them, the terminal does not;
    every other record of the same level stays on the terminal."""
    formatter = ray_output._MarkedFormatter("%(levelname)s: %(message)s")
    routine = logging.LogRecord("raytrn.x", logging.INFO, __file__, 1, "deleted checkpoints of steps [40]", None, None)
    for key, value in ray_output.ROUTINE.items():
        setattr(routine, key, value)
    event = logging.LogRecord("raytrn.x", logging.INFO, __file__, 1, "resumed from step 40", None, None)
    lines = formatter.format(routine).splitlines() + formatter.format(event).splitlines()
    assert lines == ["(raytrn) INFO: deleted checkpoints of steps [40]", "raytrn: INFO: resumed from step 40"]
    assert ray_output.user_lines(lines) == ["raytrn: INFO: resumed from step 40"]


def test_an_embedded_local_rays_token_notice_stays_off_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``raytrn data prepare`` starts a local Ray without a log file of its own: Ray's notice that token
    authentication is on (its own token: nothing to do) does not reach the terminal; its other warnings do."""
    ray_logger = logging.getLogger("ray")
    console = logging.StreamHandler(_Lines())
    monkeypatch.setattr(ray_logger, "handlers", [console])
    ray_output.quiet_local_token_notice()
    ray_output.quiet_local_token_notice()  # once per process: one filter
    assert len(console.filters) == 1
    child = logging.getLogger("ray._private.some_module")
    child.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    child.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert console.stream == ["Token authentication is disabled for this Ray cluster. Anyone with network access ..."]


class _Lines(list):
    def write(self, text: str) -> None:
        if text.strip():
            self.append(text.strip())

    def flush(self) -> None:
        pass


def test_marking_is_for_ray_actors_only() -> None:
    """The driver (and a test building an actor's class directly) keeps its logging: caplog still sees raytrn."""
    before = list(logging.getLogger("raytrn").handlers), logging.getLogger("raytrn").propagate
    ray_output.mark_raytrn_logs()
    assert (list(logging.getLogger("raytrn").handlers), logging.getLogger("raytrn").propagate) == before


def test_nothing_is_routed_when_verbose_or_on_a_connected_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert ray_output.route_ray_output("r", verbose=True, directory=str(tmp_path)) is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {}}')
    assert ray_output.route_ray_output("r", verbose=True, directory=str(tmp_path)) is None
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    # Routing waits for ensure_ray to start Ray: a connected Ray (or a job refused first) writes nothing.
    assert ray_output.route_ray_output("r", directory=str(tmp_path)) == str(tmp_path / "r.log")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert runtime.ensure_ray() is False
    assert not list(tmp_path.iterdir())


def test_a_bad_dashboard_value_is_refused_before_ray_or_its_log_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from raytrn.errors import RaytrnError

    def no_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called")

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv(runtime.DASHBOARD_ENV, "maybe")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_start)
    assert ray_output.route_ray_output("r", directory=str(tmp_path)) == str(tmp_path / "r.log")
    with pytest.raises(RaytrnError, match=f"{runtime.DASHBOARD_ENV}='maybe'"):
        runtime.ensure_ray()
    assert not list(tmp_path.iterdir())  # no log file for a run refused before Ray started


def test_routing_sends_rays_driver_warnings_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray
    import ray._private.worker as ray_worker

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)
    ray_logger = logging.getLogger("ray")
    monkeypatch.setattr(ray_logger, "handlers", list(ray_logger.handlers))
    levels = [(h, h.level) for h in ray_logger.handlers]
    try:
        path = ray_output.route_ray_output("tiny-1", directory=str(tmp_path / "logs"))
        assert path == str(tmp_path / "logs" / "tiny-1.log")
        assert not (tmp_path / "logs").exists() and capsys.readouterr().out == ""  # not before Ray starts
        ray_output.start_routing()  # what ensure_ray does before ray.init
        assert capsys.readouterr().out == f"raytrn: Ray's logs: {path}\n"
        logging.getLogger("ray.some.module").warning("Token authentication is enabled for this Ray cluster.")
        ray_worker.print_to_stdstream({"lines": ["4 PYTHON worker processes"], "pid": "raylet", "is_err": False}, False)
        captured = capsys.readouterr()
        assert "Token authentication" not in captured.err + captured.out
        assert "PYTHON worker" not in captured.err + captured.out
        text = Path(path).read_text()
        assert "Token authentication is enabled" in text and "(raylet) 4 PYTHON worker processes" in text
    finally:
        for handler, level in levels:
            handler.setLevel(level)


def test_a_ray_jobs_driver_routes_into_rays_log_directory_once_connected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under `ray job submit` / `raytrn submit` the job's log (the user's terminal) gets raytrn's lines too, not a
    killed worker's traceback and stack frames: those go to raytrn-<run>.log in Ray's log directory of the driver's
    node, named once connected (what arrives before waits in memory), its path and `ray logs` command printed."""
    import ray._private.worker as ray_worker

    logs: list[str | None] = [None]  # not connected yet
    monkeypatch.setattr(ray_output, "node_logs_dir", lambda: logs[0])
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {}}')
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)
    ray_logger = logging.getLogger("ray")
    monkeypatch.setattr(ray_logger, "handlers", list(ray_logger.handlers))
    levels = [(h, h.level) for h in ray_logger.handlers]
    try:
        assert ray_output.route_ray_output("tiny-1", directory=str(tmp_path / "cwd")) is None
        ray_output.start_routing()
        logging.getLogger("ray.x").warning("Token authentication is enabled for this Ray cluster.")  # during init
        assert capsys.readouterr().out == ""
        logs[0] = str(tmp_path / "session" / "logs")
        Path(logs[0]).mkdir(parents=True)
        ray_output.routing_started()  # what ensure_ray does after ray.init
        path = tmp_path / "session" / "logs" / "raytrn-tiny-1.log"
        assert (
            capsys.readouterr().out
            == f"raytrn: Ray's logs: {path} (on the driver's node: `ray logs raytrn-tiny-1.log`)\n"
        )
        batch = {"lines": ["Traceback (most recent call last):", "    @ 0x7f ray::core::CoreWorker::Exit()",
                           "raytrn: WARNING: w"], "pid": 7, "actor_name": "RayTrainWorker", "is_err": True}  # fmt: skip
        ray_worker.print_to_stdstream(batch, False)
        captured = capsys.readouterr()
        assert "ray::core" not in captured.out + captured.err and "raytrn: WARNING: w" in captured.out + captured.err
        text = path.read_text()
        assert text.index("Token authentication") < text.index("ray::core::CoreWorker::Exit()")
        assert not (tmp_path / "cwd").exists()
        # Ray's log directory not writable: the lines stay on the terminal, one line says why
        ray_output._log_file = None
        monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)
        logs[0] = str(tmp_path / "missing")
        ray_output.route_ray_output("tiny-2")
        ray_output.start_routing()
        ray_output.routing_started()
        assert "raytrn: Ray's lines stay on the terminal" in capsys.readouterr().err
        ray_worker.print_to_stdstream(batch, False)
        assert "ray::core" in "".join(capsys.readouterr())
    finally:
        for handler, level in levels:
            handler.setLevel(level)


def test_a_sweeps_embedded_ray_starts_with_its_dashboard_unless_the_user_said_otherwise() -> None:
    """Ray Train's PlacementGroupCleaner frees a stopped trial's placement group through the State API (the
    dashboard's): a sweep's embedded local Ray starts with it; the user's own value wins."""
    from raytrn.sweep.cli import sweep_ray_defaults

    environ: dict[str, str] = {}
    sweep_ray_defaults(environ)
    assert runtime.local_ray_dashboard(environ) is True
    environ = {runtime.DASHBOARD_ENV: "0"}
    sweep_ray_defaults(environ)
    assert runtime.local_ray_dashboard(environ) is False


def test_rays_colour_codes_are_off_when_stdout_is_not_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray colours the prefix of every line it prints for a worker, on a pipe or file too (`ray job logs`, a CI log):
    ``RAY_COLOR_PREFIX=0`` there, whatever is routed; a terminal keeps Ray's colours, and a value the user set stays."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    for verbose in (False, True):
        monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        ray_output.route_ray_output("r", verbose=verbose, directory=str(tmp_path))
        assert os.environ.get("RAY_COLOR_PREFIX") == "0"
        monkeypatch.delenv("RAY_COLOR_PREFIX")
        monkeypatch.setattr(sys, "stdout", Terminal())
        ray_output.route_ray_output("r", verbose=verbose, directory=str(tmp_path))
        assert "RAY_COLOR_PREFIX" not in os.environ
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    ray_output.route_ray_output("r", directory=str(tmp_path))
    assert os.environ["RAY_COLOR_PREFIX"] == "1"


def test_a_kept_line_reaches_a_pipe_without_rays_colour_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Ray's own printer (the one raytrn.compat.route_worker_output hands the router): a worker's raytrn line
    kept for the user, printed to a stdout that is a pipe."""
    import io

    import ray._private.worker as ray_worker

    from raytrn import compat

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # put back after the test
    printers: list = []
    compat.route_worker_output(lambda data, ignore_prefix, ray_print: printers.append(ray_print))
    ray_worker.print_to_stdstream({"lines": []}, False)
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    ray_output.route_ray_output("r", directory=str(tmp_path))
    batch = {"lines": ["raytrn: WARNING: kept"], "pid": 7, "actor_name": "RayTrainWorker", "is_err": False}
    ray_output._RayLines(ray_output._PlainFile(str(tmp_path / "r.log")))(batch, False, printers[0])
    assert out.getvalue() == "(RayTrainWorker pid=7) raytrn: WARNING: kept\n"
