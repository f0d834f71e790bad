"""raytrn sweep's search space and plan: flags and sweep: sections parsed, trials drawn reproducibly, every trial
validated before anything runs, the scheduler's settings checked against what the jobs log; bad input is one
ConfigError naming the flag."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from raytrn.errors import ConfigError
from raytrn.sweep.plan import Scheduler, SweepOptions, SweepState, TrialState, plan_sweep
from raytrn.sweep.space import Dimension, SearchSpace, dimensions_from_section, parse_flag

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobs" / "tiny.yaml"


def test_flags_parse_into_dimensions() -> None:
    grid = parse_flag("grid", "optim.lr=1e-4,3e-4,1e-3")
    assert grid == Dimension(field="optim.lr", kind="grid", values=(1e-4, 3e-4, 1e-3))  # 1e-4 is a number
    assert parse_flag("choice", "optim.betas=[[0.9, 0.95], [0.9, 0.99]]").values == ([0.9, 0.95], [0.9, 0.99])
    log = parse_flag("loguniform", "optim.lr=1e-5:1e-2")
    assert (log.low, log.high, log.integer) == (1e-5, 1e-2, False)
    assert parse_flag("uniform", "optim.warmup_steps=2:50").integer  # an int field draws ints
    assert parse_flag("grid", "model.preset=tiny,small").values == ("tiny", "small")


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("grid", "optim.lrr=1e-3", "--grid optim.lrr: unknown field. Did you mean 'optim.lr'?"),
        ("grid", "scaling.max_worker=1,2", "Did you mean 'scaling.max_workers'?"),
        ("grid", "optim.lr=", "no values"),
        ("grid", "optim.lr=1e-3,,3e-3", "an empty value between commas"),
        ("grid", "lr", "expected FIELD=VALUES"),
        ("uniform", "optim.lr=3e-3", "expected FIELD=LOW:HIGH"),
        ("uniform", "optim.lr=3:1", "LOW (3) must be below HIGH (1)"),
        ("loguniform", "optim.lr=0:1e-2", "a log-uniform range must be positive"),
        ("loguniform", "optim.lr=a:1", "'a' is not a finite number"),
        ("uniform", "optim.warmup_steps=1.2:1.8", "no integer lies in"),
        ("grid", "optim.lr.x=1", "optim.lr is a value, not a section"),
    ],
)
def test_bad_flags_are_one_clear_error(kind: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_flag(kind, text)  # type: ignore[arg-type]
    assert message in str(e.value)


def test_trials_are_the_grid_times_samples_and_reproducible() -> None:
    dims = (
        parse_flag("grid", "optim.lr=1e-3,3e-3"),
        parse_flag("grid", "data.micro_batch_size=8,16"),
        parse_flag("loguniform", "optim.weight_decay=1e-3:1e-1"),
        parse_flag("uniform", "optim.warmup_steps=2:20"),
    )
    space = SearchSpace(dims, samples=3, seed=7)
    trials = space.trials()
    assert space.num_trials == len(trials) == 12
    # the grid, first dimension slowest, repeated per sample
    assert [(t["optim.lr"], t["data.micro_batch_size"]) for t in trials[:4]] == [
        (1e-3, 8), (1e-3, 16), (3e-3, 8), (3e-3, 16)
    ]  # fmt: skip
    assert [(t["optim.lr"], t["data.micro_batch_size"]) for t in trials[4:8]] == [
        (t["optim.lr"], t["data.micro_batch_size"]) for t in trials[:4]
    ]
    for t in trials:
        assert 1e-3 <= t["optim.weight_decay"] <= 1e-1
        assert isinstance(t["optim.warmup_steps"], int) and 2 <= t["optim.warmup_steps"] <= 20
    assert len({t["optim.weight_decay"] for t in trials}) == 12  # every trial draws its own
    assert SearchSpace(dims, samples=3, seed=7).trials() == trials
    assert SearchSpace(dims, samples=3, seed=8).trials() != trials
    # a log-uniform draw is uniform in log space: about half of many draws fall below the geometric middle
    many = SearchSpace((parse_flag("loguniform", "optim.lr=1e-5:1e-1"),), samples=400, seed=0).trials()
    below = sum(t["optim.lr"] < 1e-3 for t in many)
    assert 160 < below < 240, below


def test_space_refusals() -> None:
    grid = parse_flag("grid", "optim.lr=1e-3,3e-3")
    with pytest.raises(ConfigError, match="nothing to sweep"):
        SearchSpace(())
    with pytest.raises(ConfigError, match="repeats identical trials"):
        SearchSpace((grid,), samples=2)
    with pytest.raises(ConfigError, match="already swept by --grid optim.lr"):
        SearchSpace((grid, parse_flag("loguniform", "optim.lr=1e-4:1e-2")))
    with pytest.raises(ConfigError, match="at most 1000"):
        SearchSpace((parse_flag("grid", "run.seed=" + ",".join(map(str, range(1001)))),))


def test_a_sweep_section_gives_the_same_dimensions() -> None:
    section = yaml.safe_load(
        """
grid: {optim.lr: [1e-4, 3e-4]}
loguniform: {optim: {weight_decay: [1e-3, 1e-1]}}
"""
    )
    dims = dimensions_from_section(section, "sweep.yaml")
    assert dims == [parse_flag("grid", "optim.lr=1e-4,3e-4"), parse_flag("loguniform", "optim.weight_decay=1e-3:1e-1")]
    with pytest.raises(ConfigError, match="sweep.grid.optim.lr: expected a list"):
        dimensions_from_section({"grid": {"optim.lr": 1e-3}}, "sweep.yaml")


def _manifest(root: Path, *, validation: bool) -> Path:
    """A dataset for jobs/tiny.yaml's shapes as `raytrn data prepare` writes it (two real Parquet shards of 100 rows,
    the tokenizer file its manifest hashes), with a validation split when asked; the plan checks the files, reads
    no rows."""
    import hashlib
    from dataclasses import replace

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.unit.test_manifest import _manifest as manifest_of

    root.mkdir(parents=True, exist_ok=True)
    m = manifest_of(root, num_shards=2)
    shards = []
    for s in m.shards:
        ids = [[(r + i) % 512 for i in range(129)] for r in range(100)]
        pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))}), root / s.path)
        shards.append(replace(s, rows=100, tokens=100 * 128, bytes=(root / s.path).stat().st_size))
    (root / "tokenizer.json").write_text("{}")
    tokenizer = replace(m.tokenizer, sha256=hashlib.sha256(b"{}").hexdigest())
    m = replace(
        m, seq_len=128, row_len=129, num_rows=200, num_tokens=200 * 128, rows_per_shard=100, shards=shards,
        tokenizer=tokenizer,
    )  # fmt: skip
    files = [m]
    if validation:
        val = replace(m, shards=shards[:1], num_rows=100, num_tokens=100 * 128, name="validation.json")
        m = replace(m, validation={"manifest": "validation.json", "fraction": 0.3, "num_rows": 100})
        files = [m, val]
    for f in files:
        (root / f.name).write_text(f.to_json())
    return root


def _opts(tmp_path: Path, *flags: tuple[str, str], validation: bool = True, **kw) -> SweepOptions:
    data = _manifest(tmp_path / "data", validation=validation)
    return SweepOptions(
        job_path=str(TINY),
        overrides=[f"data.manifest={data}", f"checkpoint.storage={tmp_path / 'ckpt'}"]
        + (["run.eval_every=10"] if validation else []),
        dimensions=[parse_flag(k, t) for k, t in flags],  # type: ignore[arg-type]
        **kw,
    )


def test_plan_validates_every_trial_before_anything_runs(tmp_path: Path) -> None:
    opts = _opts(tmp_path, ("grid", "data.global_batch_size=32,48,64"), ("grid", "data.grad_accum=null"), name="s1")
    with pytest.raises(ConfigError) as e:
        plan_sweep(opts)
    text = str(e.value)
    assert "1 of 3 trials are invalid; no trial was started" in text
    assert "trial t01 (data.global_batch_size=48 data.grad_accum=None)" in text
    assert not (tmp_path / "ckpt").exists()  # nothing written


def test_a_value_of_the_wrong_type_is_named_by_its_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--grid optim.lr: Input should be a valid number.*'fast'"):
        plan_sweep(_opts(tmp_path, ("grid", "optim.lr=1e-3,fast")))


def test_plan_defaults_and_metric_checks(tmp_path: Path) -> None:
    plan = plan_sweep(_opts(tmp_path, ("grid", "optim.lr=1e-3,3e-3"), scheduler="asha", name="s2"))
    s = plan.state.sched
    assert (s.metric, s.mode, s.kind) == ("val_loss", "min", "asha")  # the job validates: judged on val_loss
    assert s.grace_steps == 30 and s.rungs() == [30, 60]  # a quarter of 100 steps, on an eval step
    assert [t.run_name for t in plan.state.trials] == ["s2-t00", "s2-t01"]
    assert plan.state.trials[1].values == {"optim.lr": 3e-3}
    assert plan.state.trials[1].job_spec("x").optim.lr == 3e-3
    assert plan.state.trials[1].job_spec("x").tracking.run_name == "s2-t01"

    no_val = _opts(tmp_path / "b", ("grid", "optim.lr=1e-3,3e-3"), validation=False)
    assert plan_sweep(no_val).state.sched.metric == "loss"
    for kw, message in [
        ({"metric": "val_loss"}, "the job has no validation set"),
        ({"metric": "vall_loss"}, "Did you mean 'val_loss'?"),
        ({"metric": "mfu"}, "a CPU trial logs no MFU"),
        ({"mode": "up"}, "--mode 'up': min or max"),
        ({"scheduler": "hyperband"}, "choose one of none, asha"),
        ({"grace_steps": 5}, "--grace-steps applies to --scheduler asha"),
        ({"scheduler": "asha", "grace_steps": 100}, "below run.max_steps (100)"),
        ({"scheduler": "asha", "grace_steps": 5}, "first reported at step 10 (run.log_every)"),
        ({"scheduler": "asha", "reduction_factor": 1.0}, "must be above 1"),
        ({"name": "a/b"}, "a sweep's name becomes a directory"),
        ({"max_concurrent": 0}, "--max-concurrent 0: must be at least 1"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
            plan_sweep(SweepOptions(**{**no_val.__dict__, **kw}))


def test_asha_on_val_loss_needs_eval_every(tmp_path: Path) -> None:
    opts = _opts(tmp_path, ("grid", "optim.lr=1e-3,3e-3"), scheduler="asha")
    opts.overrides = [o for o in opts.overrides if not o.startswith("run.eval_every")]
    with pytest.raises(ConfigError, match="run.eval_every is unset"):
        plan_sweep(opts)


def test_a_sweep_section_in_the_job_file_with_flags_over_it(tmp_path: Path) -> None:
    spec = yaml.safe_load(TINY.read_text())
    spec["sweep"] = {
        "grid": {"optim.lr": [1e-3, 3e-3]},
        "scheduler": "asha",
        "grace_steps": 20,
        "name": "from-section",
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    opts = _opts(tmp_path, ("grid", "optim.lr=1e-4,1e-3,1e-2"))
    opts.job_path = str(path)
    plan = plan_sweep(opts)
    assert [t.values["optim.lr"] for t in plan.state.trials] == [1e-4, 1e-3, 1e-2]  # the flag replaces the section's
    assert plan.state.name == "from-section" and plan.state.sched.grace_steps == 20
    spec["sweep"]["grace_step"] = 3
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="sweep.grace_step: unknown key. Did you mean 'grace_steps'?"):
        plan_sweep(opts)


def test_state_round_trips_and_the_best_is_a_finished_trial(tmp_path: Path) -> None:
    sched = Scheduler(kind="asha", metric="val_loss", mode="min", grace_steps=10, reduction_factor=2, max_steps=40)
    trials = [
        TrialState(index=0, run_name="s-t00", values={"optim.lr": 1e-3}, job={}, status="finished",
                   last={"val_loss": 3.0, "step": 40.0}),
        TrialState(index=1, run_name="s-t01", values={"optim.lr": 1e-2}, job={}, status="stopped",
                   last={"val_loss": 2.0, "step": 10.0}, history=[[10, 2.0]]),
        TrialState(index=2, run_name="s-t02", values={"optim.lr": 1e-4}, job={}, status="finished",
                   last={"val_loss": math.nan, "step": 40.0}),
    ]  # fmt: skip
    space = SearchSpace((parse_flag("grid", "optim.lr=1e-3,1e-2,1e-4"),))
    state = SweepState(
        name="s", root=str(tmp_path / "s"), job_file="j.yaml", overrides=[], space=space.to_dict(),
        scheduler=sched.__dict__, max_concurrent=None, tracking_uri=None, experiment=None, trials=trials,
    )  # fmt: skip
    state.save()
    loaded = SweepState.load(str(tmp_path / "s"))
    assert (
        loaded is not None and loaded.trials[:2] == state.trials[:2] and math.isnan(loaded.trials[2].last["val_loss"])
    )
    assert (loaded.name, loaded.sched, loaded.search_space) == (state.name, sched, space)
    assert loaded.best().run_name == "s-t00"  # finished beats a better value at an earlier step; NaN never wins
    (tmp_path / "s" / "sweep.json").write_text(json.dumps({"name": "s"}))
    with pytest.raises(Exception, match="not a sweep state raytrn can read"):
        SweepState.load(str(tmp_path / "s"))
