"""Every benchmark module imports, and the code their measurements run through that is not Ray's works at tiny
sizes: a stand-in drifting from the real class it stands for (mypy checks bench/ against the protocols too) or a
renamed import fails here, not at the next `make bench`. The Ray Train paths themselves run in
tests/integration/test_bench_smoke.py."""

from __future__ import annotations

import importlib
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

MODULES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")


def test_the_mlflow_overhead_benchs_board_is_the_real_one_behind_the_real_clients() -> None:
    """bench/mlflow_overhead.py's stand-in for the board actor: what the loop posts, through the clients it uses."""
    from bench.mlflow_overhead import _Board, _plan
    from raytrn.tracking.roles import BoardClients

    board = _Board()
    clients = BoardClients.of(board)
    assert clients.restarts.restored(None, 0, 0.0).result() is None
    assert clients.restarts.group_started(0, 1).result() == 1
    before = time.perf_counter()
    clients.progress.update(1, 4, {"loss": 2.0})
    clients.progress.reached(2)
    assert [s for s, _ in board.points] == [1] and board.points[0][1] >= before  # the step's time, recorded
    assert clients.stops.order().result().at_step is None and clients.rollbacks.rollbacks() == []
    assert clients.reader.snapshot().last is not None
    # a warm-up segment, then on/off in ABBA order per log interval
    assert _plan(2, [5]) == [(False, 5), (True, 5), (False, 5), (False, 5), (True, 5)]


def test_the_guard_benchs_check_runs() -> None:
    from bench.guard import _check_cost_s

    assert _check_cost_s(20) > 0


def test_the_layout_benchs_measure_in_one_process_and_render_their_rows() -> None:
    """bench/pipeline.py and bench/context.py at tiny sizes in one process (their gloo spawns run in make bench):
    a step's seconds, the bytes saved for backward growing with the sequence; and the README rows they make."""
    from bench.context import measure_rank
    from bench.pipeline import step_rank
    from bench.report import _layout_rows

    assert len(step_rank(0, 1, 2, (), 2)["step_s"]) == 2
    saved = measure_rank(0, 1, [32, 64], 1)
    assert 0 < saved["32"]["saved_bytes"] < saved["64"]["saved_bytes"]
    pp = {"setup": "s", "m4": {"pp_tokens_per_s": 1900, "fsdp_tokens_per_s": 1700, "one_tokens_per_s": 1730,
                               "pp_over_fsdp": 1.11, "bubble_measured": 0.45, "bubble_theory": 0.2}}  # fmt: skip
    cp = {"setup": "c", "seq256": {"cp1_saved_mib": 21.9, "cp2_saved_mib": 11.5, "cp2_over_cp1": 0.523}}
    rows = _layout_rows(pp, cp)
    assert (
        "1,900 vs 1,700 vs 1,730 tokens/s (1.11x FSDP); bubble measured 45% (idle and overhead) vs theory 20%"
        in rows[0]
    )
    assert "256 tokens 11.5 vs 21.9 MiB (0.52x) | <= 0.55x (half, and the ring) met |" in rows[1]
    assert _layout_rows({"status": "failed", "message": "boom"}, {}) == ["| pipeline | failed: boom | |"]


def test_a_run_whose_benchmarks_were_all_skipped_renders_each_as_skipped() -> None:
    """`make bench` out of its time budget skips what it cannot start; the README block still renders, every row
    saying so (a skipped Trainium row once failed the whole render, after the other results had been measured)."""
    from bench.report import render
    from bench.run import ALL, machine

    report = {"date": "2026-11-29 00:00:00", "mode": "full", "machine": machine(), "load_start": [1.0], "load_end": [1.0],
              "wall_s": 60.0, "gpu": None,
              "results": {n: {"status": "skipped", "message": "time budget"} for n in ALL}}  # fmt: skip
    out = render(report)
    assert out.count("skipped") >= len(ALL) - 2, out  # (the peak and trainium rows are folded into others)


def test_the_live_rows_say_how_the_simulated_cluster_ran_rays_metrics() -> None:
    """bench.elastic.run_live runs its simulated cluster with Ray's metrics pipeline off (the head's agent would take
    the simulated worker nodes' cores: docs/elasticity.md); the node-back row says so, and says nothing for results
    recorded before it was a choice."""
    from bench.report import _metrics_note

    assert "off in the simulated cluster" in _metrics_note({"ray_metrics": False})
    assert _metrics_note({"ray_metrics": True}) == "; Ray's metrics on"
    assert _metrics_note({}) == ""


def test_the_live_node_back_row_is_judged_from_the_node_alive_and_shows_the_time_from_adding_it_too() -> None:
    """Issue 48's node-return goal (the restart path's resize interval + 5 s) is judged on the seconds from the
    moment Ray has the new node alive (the replacement's own part); the seconds from the call that adds it (Ray's
    start of the node's processes, on the simulated cluster's shared cores) are shown beside them; results recorded
    before the split keep their old row."""
    from bench.report import _live_back_row

    live = {"back_to_full_size_s": [12.0, 13.5, 15.0], "back_to_full_size_s_median": 13.5,
            "alive_to_full_size_s": [8.5, 9.8, 11.0], "alive_to_full_size_s_median": 9.8, "ray_metrics": False}  # fmt: skip
    row = _live_back_row(live, 4)
    assert "**9.8 s** (8.5, 9.8, 11.0)" in row and "median 13.5 s (12.0, 13.5, 15.0)" in row, row
    assert row.endswith("<= 9 s (resize interval + 5) **not met** |"), row
    met = _live_back_row({**live, "alive_to_full_size_s_median": 8.5}, 4)
    assert met.endswith("<= 9 s (resize interval + 5) met |"), met
    old = _live_back_row({"back_to_full_size_s": [10.7], "back_to_full_size_s_median": 10.7}, 4)
    assert old == "| elastic, live: node back -> 3 replicas training (no storage read) | median 10.7 s (10.7) | |"


def test_a_paced_live_run_gets_its_own_node_back_row_that_says_its_pace() -> None:
    """bench.elastic.run_live(pace_s=...) (the survivors' training paced, CPU left for the returning node as on a
    real cluster) is shown beside the flat-out row, never in its place: its row names the pace, the flat-out one
    does not."""
    from bench.report import _live_back_row

    live = {"back_to_full_size_s": [12.0], "back_to_full_size_s_median": 12.0, "alive_to_full_size_s": [11.0],
            "alive_to_full_size_s_median": 11.0, "ray_metrics": False, "pace_s": 0.0}  # fmt: skip
    flat = _live_back_row(live, 4)
    paced = _live_back_row({**live, "pace_s": 0.15, "alive_to_full_size_s_median": 6.0}, 4)
    assert "PACE" not in flat and flat.endswith("**not met** |"), flat
    assert "the survivors paced (`RAYTRN_PACE_S` 0.15" in paced and paced.endswith("met |"), paced
    assert "**6.0 s**" in paced, paced


def test_the_notice_row_says_where_its_seconds_start() -> None:
    """Since 2026-12-04 a notice's restart comes once its checkpoint is committed, and bench.elastic measures from the
    notice, with the harness's deadline; results recorded before keep their row (from a 10 s deadline), one line."""
    import json

    from bench.report import render

    report = json.loads((REPO / "bench" / "results" / "2026-12-04-vm-merged-1236.json").read_text())
    rows = [line for line in render(report).splitlines() if line.startswith("| elastic: spot notice")]
    assert rows == [
        "| elastic: spot notice (`ray drain-node`, 60 s deadline) -> next step logged (the group restarted once the "
        "notice's checkpoint was committed, not at the deadline) | 7.2 s (steps lost 0) | 0 steps lost |"
    ], rows
    for key in ("notice_measured_from", "notice_deadline_s"):
        del report["results"]["elastic"][key]
    rows = [line for line in render(report).splitlines() if line.startswith("| elastic: spot notice")]
    assert rows == [
        "| elastic: spot notice (`ray drain-node`, 10 s deadline) -> next step logged after the deadline | 7.2 s "
        "(steps lost 0) | 0 steps lost |"
    ], rows
