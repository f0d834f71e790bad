"""raytrn runs compare against a real MLflow sqlite store: table, best markers, filters, plot and errors."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import pytest

from raytrn.errors import RaytrnError
from raytrn.tracking import compare as cmp
from raytrn.tracking import compare_sweeps, runs_cli
from tests.conftest import _free_port, mlflow_store

pytestmark = pytest.mark.unit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000_000  # ms

# name -> (params, {metric: [values per step]}), created oldest first
RUNS = {
    "lr-1e-3": (
        {"model.preset": "tiny", "scaling.accelerator": "cpu", "scaling.max_workers": "2", "optim.lr": "0.001"},
        {
            "loss": [5.0, 4.0, 3.0],
            "tokens_per_s": [900.0, 1000.0, 1100.0],
            "mfu": [0.1, 0.2, 0.3],
            "estimate_error_memory": [-0.08],
        },
    ),
    "lr-3e-4": (
        {"model.preset": "tiny", "scaling.accelerator": "cpu", "scaling.max_workers": "2", "optim.lr": "0.0003"},
        {
            "loss": [5.0, 4.5, 2.5],
            "tokens_per_s": [800.0, 900.0, 950.0],
            "mfu": [0.1, 0.15, 0.2],
            "estimate_error_memory": [0.03],
        },
    ),
    "big": (
        {"model.preset": "small", "scaling.accelerator": "neuron", "scaling.max_workers": "4", "optim.lr": "0.001"},
        {
            "loss": [6.0, 3.5],
            "tokens_per_s": [20000.0, 25000.0],  # no mfu logged
            "estimate_error_tokens_per_s": [-0.2],
            "estimate_error_memory": [-0.05],
        },
    ),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlruns")
    uri = mlflow_store(root / "mlflow.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("sweep", artifact_location=(root / "artifacts").as_uri())
    client.create_experiment("empty", artifact_location=(root / "artifacts").as_uri())
    for i, (name, (params, metrics)) in enumerate(RUNS.items()):
        start = T0 + i * 60_000
        run_id = client.create_run(exp, run_name=name, start_time=start).info.run_id
        history = [
            Metric(key, value, start + step * 1000, step)
            for key, values in metrics.items()
            for step, value in enumerate(values)
        ]
        client.log_batch(run_id, metrics=history, params=[Param(k, v) for k, v in params.items()])
        client.set_terminated(run_id, "FINISHED", end_time=start + 90_000)
    return uri


def _compare(store: str, **kw) -> cmp.Comparison:
    kw.setdefault("experiment", "sweep")
    kw.setdefault("metrics", ["loss", "tokens_per_s", "mfu"])
    return cmp.compare_runs(tracking_uri=store, **kw)


def _line(table: str, name: str) -> str:
    (line,) = [ln for ln in table.splitlines() if ln.startswith(name + " ")]
    return line


def test_table_newest_first_final_values_and_best_markers(store: str) -> None:
    c = _compare(store)
    assert [r.name for r in c.rows] == ["big", "lr-3e-4", "lr-1e-3"]
    assert c.rows[0].metrics == {"loss": 3.5, "tokens_per_s": 25000.0}  # final (latest step) values
    assert c.rows[0].duration_s == 90.0 and c.rows[0].status == "FINISHED"
    table = c.render()
    header = table.splitlines()[1].split()
    assert header == ["run", "id", "status", "duration", "preset", "accel", "workers", "seq_len", "lr"] + [
        "loss",
        "tokens_per_s",
        "mfu",
    ]
    assert _line(table, "lr-3e-4").split()[-3:] == ["2.5*", "950", "0.2"]  # lowest loss
    assert _line(table, "big").split()[-3:] == ["3.5", "25,000*", "-"]  # highest throughput, no mfu
    assert _line(table, "lr-1e-3").split()[-3:] == ["3", "1,100", "0.3*"]  # highest mfu
    big = _line(table, "big").split()
    assert big[2:9] == ["FINISHED", "1m30s", "small", "neuron", "4", "-", "0.001"]
    assert "loss lower" in table and "tokens_per_s higher" in table
    # aligned: each metric's values end (before the marker slot) where its header ends
    rows = [ln.ljust(200) for ln in table.splitlines()[2:-1]]
    for metric in ["loss", "tokens_per_s", "mfu"]:
        end = table.splitlines()[1].index(metric) + len(metric)
        assert all(r[end - 2] in "0123456789-" and r[end - 1] in "* " for r in rows), (metric, table)


def test_unknown_metrics_are_lower_is_better_and_missing_shows_dash(store: str) -> None:
    c = _compare(store, metrics=["tokens_per_s", "usd_per_1m_tokens", "step_time_s"])
    assert c.best("usd_per_1m_tokens") is None
    table = c.render()
    assert _line(table, "lr-1e-3").split()[-3:] == ["1,100", "-", "-"]
    assert "loss" not in table.splitlines()[1]
    c2 = _compare(store, metrics=["loss", "custom"])
    assert c2.best("loss") == 2.5


def test_estimates_show_how_far_raytrn_estimate_was_best_closest_to_zero(store: str, capsys) -> None:
    c = _compare(store, metrics=["loss"], estimates=True)
    assert c.metrics == ["loss", "estimate_error_tokens_per_s", "estimate_error_memory"]
    assert c.best("estimate_error_memory") == 0.03 and c.best("estimate_error_tokens_per_s") == -0.2
    table = c.render()
    assert _line(table, "lr-3e-4").split()[-2:] == ["-", "0.03*"] and _line(table, "big").split()[-2:] == [
        "-0.2*",
        "-0.05",
    ]
    assert "estimate_error_memory closer to 0" in table
    args = _parser().parse_args(["runs", "compare", "--experiment", "sweep", "--tracking-uri", store, "--estimates"])
    assert args.func(args) == 0
    header = capsys.readouterr().out.splitlines()[1].split()
    assert header[-3:] == ["mfu", "estimate_error_tokens_per_s", "estimate_error_memory"]


def test_filter_on_dotted_param(store: str) -> None:
    c = _compare(store, filter_string="params.`optim.lr` = '0.001'")
    assert sorted(r.name for r in c.rows) == ["big", "lr-1e-3"]
    c = _compare(store, filter_string="params.`model.preset` = 'tiny' and metrics.loss < 2.8")
    assert [r.name for r in c.rows] == ["lr-3e-4"]
    assert _compare(store, max_runs=1).rows[0].name == "big"


def test_no_runs_is_a_message_not_an_error(store: str) -> None:
    assert _compare(store, experiment="empty").render() == "experiment empty has no runs"
    c = _compare(store, filter_string="params.`optim.lr` = '42'")
    assert c.render() == "no runs of experiment sweep match the filter \"params.`optim.lr` = '42'\""
    with pytest.raises(RaytrnError, match="nothing to plot"):
        cmp.plot(c, "/nonexistent/x.png")


def test_errors_are_one_clear_line(store: str, tmp_path: Path) -> None:
    with pytest.raises(RaytrnError, match=r"no experiment named nope at sqlite:.*; experiments there: .*empty, sweep"):
        _compare(store, experiment="nope")
    with pytest.raises(RaytrnError, match=r"--filter 'params.optim.lr ==== 1': .*backticks"):
        _compare(store, filter_string="params.optim.lr ==== 1")
    with pytest.raises(RaytrnError, match="no MLflow database at"):
        _compare(f"sqlite:///{tmp_path / 'missing.db'}")
    assert not (tmp_path / "missing.db").exists()
    port = _free_port()
    with pytest.raises(RaytrnError, match=f"cannot reach the MLflow tracking server at http://127.0.0.1:{port}"):
        _compare(f"http://127.0.0.1:{port}")
    with pytest.raises(RaytrnError, match="at least one metric"):
        _compare(store, metrics=[" "])


def test_plot_writes_a_png_atomically(store: str, tmp_path: Path) -> None:
    out = tmp_path / "plots" / "cmp.png"
    written = cmp.plot(_compare(store), str(out))
    assert written == str(out)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    assert [p.name for p in out.parent.iterdir()] == ["cmp.png"]  # no temp file left behind


def test_plot_without_matplotlib_says_how_to_fix(store: str, tmp_path: Path, monkeypatch) -> None:
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RaytrnError, match="pip install matplotlib"):
        cmp.plot(_compare(store), str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_tracking_uri_resolution(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert runs_cli.resolve_tracking_uri(None, str(tmp_path)) == f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert runs_cli.resolve_tracking_uri(None, str(tmp_path)) == "http://127.0.0.1:5000"
    assert runs_cli.resolve_tracking_uri("sqlite:///x.db", str(tmp_path)) == f"sqlite:///{tmp_path}/x.db"
    assert runs_cli.resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"
    assert runs_cli.resolve_tracking_uri("runs", str(tmp_path)) == str(tmp_path / "runs")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrn")
    sub = parser.add_subparsers(dest="command")
    runs_cli.register(sub)
    return parser


def test_cli_handler(store: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "c.png"
    argv = ["runs", "compare", "--experiment", "sweep", "--tracking-uri", store, "--metrics", "loss,mfu"]
    args = _parser().parse_args([*argv, "--filter", "params.`optim.lr` = '0.001'", "--plot", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "lr-1e-3" in printed and "lr-3e-4" not in printed and "tokens_per_s" not in printed.splitlines()[1]
    assert f"plot: {out}" in printed and out.read_bytes()[:8] == PNG_MAGIC

    args = _parser().parse_args(["runs", "compare", "--experiment", "empty", "--tracking-uri", store])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == "experiment empty has no runs"

    args = _parser().parse_args([*argv[:2], "--experiment", "nope", "--tracking-uri", store])
    with pytest.raises(RaytrnError, match="experiments there"):
        args.func(args)


def test_free_port_is_closed() -> None:  # the unreachable-server test relies on nothing listening there
    port = _free_port()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_val_loss_comes_first_by_default_when_a_run_has_it(tmp_path: Path) -> None:
    """A fine-tuning experiment: runs compared by their held-out loss, the LoRA rank shown; the plot adds a
    val_loss panel."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = mlflow_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("ft", artifact_location=(tmp_path / "artifacts").as_uri())
    for i, (name, rank, val) in enumerate([("full", None, [2.0, 1.5]), ("lora", "8", [2.1, 1.4])]):
        run_id = client.create_run(exp, run_name=name, start_time=T0 + i).info.run_id
        params = [Param("model.lora.rank", rank)] if rank else []
        metrics = [Metric("loss", 1.0, T0, 1)] + [Metric("val_loss", v, T0 + s, s) for s, v in enumerate(val)]
        client.log_batch(run_id, metrics=metrics, params=params)
    c = cmp.compare_runs(tracking_uri=uri, experiment="ft")
    assert c.metrics == ["val_loss", *cmp.DEFAULT_METRICS]
    table = c.render()
    assert (
        table.splitlines()[1].split()[-5:]
        == ["lora_r", "val_loss", "loss", "tokens_per_s", "usd_per_1m_tokens", "mfu"][-5:]
    )
    assert "lora_r" in table.splitlines()[1]
    assert _line(table, "lora").split()[-5] == "1.4*"
    assert cmp.compare_runs(tracking_uri=uri, experiment="ft", metrics=["loss"]).metrics == ["loss"]
    plotted = cmp.plot(c, str(tmp_path / "ft.png"))
    assert Path(plotted).read_bytes()[:8] == PNG_MAGIC
    no_val = _compare_default(tmp_path)
    assert no_val == list(cmp.DEFAULT_METRICS)


def _compare_default(tmp_path: Path) -> list[str]:
    from mlflow.tracking import MlflowClient

    uri = mlflow_store(tmp_path / "plain.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("plain", artifact_location=(tmp_path / "a2").as_uri())
    client.log_metric(client.create_run(exp, run_name="r").info.run_id, "loss", 1.0)
    return cmp.compare_runs(tracking_uri=uri, experiment="plain").metrics


def test_a_trial_stopped_by_asha_shows_the_step_it_was_stopped_at(tmp_path: Path) -> None:
    """The sweep table said ``steps 10`` for a trial "stopped early (ASHA at step 20)": ASHA's stop kills the
    trial with its tracking actor before the step-20 loss reaches MLflow; the sweep logs the stopping report's
    metric at step 20 (end_trial_run), and the table counts the steps from it too."""
    from types import SimpleNamespace

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from raytrn.sweep.driver import end_trial_run
    from raytrn.sweep.plan import TrialState

    uri = mlflow_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("s", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(exp, run_name="lr", tags={"raytrn.sweep": "lr", "raytrn.kind": "sweep"}).info.run_id
    client.log_param(parent, "sweep.metric", "val_loss")
    client.log_param(parent, "sweep.mode", "min")
    tags = {"mlflow.parentRunId": parent, "raytrn.trial": "t01"}
    child = client.create_run(exp, run_name="lr-t01", tags=tags).info.run_id
    # What the trial's tracking actor delivered before the stop killed it: the step-10 report only.
    client.log_batch(child, metrics=[Metric("loss", 5.0, T0, 10), Metric("val_loss", 5.1, T0, 10)])
    reason = "ASHA at step 20: val_loss 4.9 was not in the best 1/2 of the trials that reached step 20"
    trial = TrialState(
        index=1, run_name="lr-t01", values={}, job={}, run_id=child, status="stopped", reason=reason,
        history=[[10, 5.1], [20, 4.9]], last={"step": 20.0, "loss": 4.8, "val_loss": 4.9},
    )  # fmt: skip
    end_trial_run(SimpleNamespace(tracking_uri=uri, sched=SimpleNamespace(metric="val_loss")), trial)
    (row,) = compare_sweeps.compare_sweep(tracking_uri=uri, parent=parent).rows
    stopped = (compare_sweeps.Ending.STOPPED_EARLY, "ASHA at step 20")
    assert row.status == "KILLED" and (row.ending, row.detail) == stopped
    assert row.steps == 20 and row.metric == 4.9


def test_goodput_compares_each_runs_ledger_and_plots_it_stacked(tmp_path: Path, capsys) -> None:
    """--goodput: goodput (higher is better), the wall time, then the seconds of each cause some run lost time to;
    --plot: a stacked bar per run. A run without a ledger shows dashes; --metrics does not go with it."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = mlflow_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("ledgers", artifact_location=(tmp_path / "artifacts").as_uri())
    ledgers = {
        "clean": {"goodput": 0.8, "wall_s": 100.0, "goodput_s": 80.0, "badput_startup_s": 15.0, "badput_shutdown_s": 5.0,
                  "badput_restart_s": 0.0},
        "restarted": {"goodput": 0.5, "wall_s": 120.0, "goodput_s": 60.0, "badput_startup_s": 15.0,
                      "badput_restart_s": 40.0, "badput_shutdown_s": 5.0},
        "old": {"loss": 3.0},
    }  # fmt: skip
    for i, (name, metrics) in enumerate(ledgers.items()):
        run_id = client.create_run(exp, run_name=name, start_time=T0 - i * 60_000).info.run_id
        client.log_batch(run_id, metrics=[Metric(k, v, T0, 10) for k, v in metrics.items()])
    c = cmp.compare_runs(tracking_uri=uri, experiment="ledgers", goodput=True)
    assert c.metrics == ["goodput", "wall_s", "goodput_s", "badput_startup_s", "badput_restart_s", "badput_shutdown_s"]
    table = c.render()
    assert _line(table, "clean").split()[-6:] == ["0.8*", "100*", "80*", "15*", "0*", "5*"]
    assert _line(table, "restarted").split()[-6:] == ["0.5", "120", "60", "15*", "40", "5*"]
    assert _line(table, "old").split()[-6:] == ["-"] * 6
    out = tmp_path / "goodput.png"
    argv = ["runs", "compare", "--experiment", "ledgers", "--tracking-uri", uri, "--goodput", "--plot", str(out)]
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    assert f"plot: {out}" in capsys.readouterr().out and out.read_bytes()[:8] == PNG_MAGIC
    both = _parser().parse_args([*argv, "--metrics", "loss"])
    with pytest.raises(RaytrnError, match="--goodput compares the runs' goodput ledgers: it takes no --metrics"):
        both.func(both)
    from raytrn.tracking.compare_goodput import plot_goodput

    with pytest.raises(RaytrnError, match="no run of experiment ledgers has a goodput ledger"):
        plot_goodput(cmp.compare_runs(tracking_uri=uri, experiment="ledgers", filter_string="attributes.run_name = 'old'",
                                      goodput=True), str(tmp_path / "none.png"))  # fmt: skip


def _row(tag: str, ending: compare_sweeps.Ending, detail: str = "", metric: float = 1.0) -> compare_sweeps.TrialRow:
    return compare_sweeps.TrialRow(tag=tag, run_id=tag, status="FINISHED", steps=10, values={"lr": "0.1"},
                                   metric=metric, ending=ending, detail=detail)  # fmt: skip


def test_a_trials_note_is_rendered_from_how_it_ended() -> None:
    Ending = compare_sweeps.Ending
    assert _row("a", Ending.STOPPED_EARLY, "ASHA at step 20").note == "stopped early (ASHA at step 20)"
    assert _row("a", Ending.STOPPED_EARLY).note == "stopped early"
    assert _row("a", Ending.FAILED, "worker died").note == "failed: worker died"
    assert _row("a", Ending.RAN).note == ""
    stopped = compare_sweeps._ending("ASHA at step 20: val_loss 4.9 was not ...", None)
    assert stopped == (Ending.STOPPED_EARLY, "ASHA at step 20")
    assert compare_sweeps._ending(None, "OSError: gone\ntraceback") == (Ending.FAILED, "OSError: gone")
    assert compare_sweeps._ending(None, None) == (Ending.RAN, "")


def test_the_plot_marks_only_trials_the_sweep_stopped_early(tmp_path: Path, monkeypatch) -> None:
    """It read "stopped" in the note: a failed trial whose error said "stopped" was drawn as stopped early."""
    from matplotlib.axes import Axes

    Ending = compare_sweeps.Ending
    sweep = compare_sweeps.SweepComparison(name="s", parent_run_id=None, metric="loss", mode="min", fields=["lr"])
    sweep.rows = [_row("t1", Ending.FAILED, "the worker stopped responding"), _row("t2", Ending.STOPPED_EARLY)]
    drawn: dict[str, int] = {}
    scatter = Axes.scatter

    def counted(self: Axes, x, y, *args, label: str = "", **kwargs):  # type: ignore[no-untyped-def]
        drawn[label] = len(x)
        return scatter(self, x, y, *args, label=label, **kwargs)

    monkeypatch.setattr(Axes, "scatter", counted)
    compare_sweeps.plot_sweep(sweep, str(tmp_path / "s.png"))
    assert drawn == {"ran to the end": 1, "stopped early": 1}
