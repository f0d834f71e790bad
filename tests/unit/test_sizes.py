"""World sizes and the global batch: an elastic job keeps its global batch at every size it can take, and
every enumeration over sizes is bounded (raytrn.config.sizes)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from raytrn.config import JobSpec, parse_job
from raytrn.config.sizes import MAX_WORKERS, data_parallel_sizes, describe_batch, describe_sizes, world_sizes
from raytrn.errors import ConfigError
from raytrn.train.checks import check_job, check_spec

pytestmark = pytest.mark.unit


def job(scaling: dict[str, Any], data: dict[str, Any] | None = None, parallel: dict[str, Any] | None = None) -> JobSpec:
    raw = {
        "parallel": parallel or {},
        "model": {"preset": "tiny"},
        "data": {"manifest": "unused", "seq_len": 16, "micro_batch_size": 8, **(data or {})},
        "optim": {"lr": 1e-3},
        "scaling": scaling,
        "run": {"max_steps": 10},
    }
    return parse_job(raw, source="job.yaml")


def error(j: JobSpec) -> str:
    with pytest.raises(ConfigError) as e:
        check_spec(j)
    return str(e.value)


def test_elastic_job_with_grad_accum_is_refused() -> None:
    """A resize would silently change the global batch: 8 x 2 x 1 = 16 sequences at 1 worker, 48 at 3."""
    msg = error(job({"min_workers": 1, "max_workers": 3}, {"grad_accum": 2}))
    assert msg.startswith("job.yaml: an elastic job (scaling.min_workers=1, max_workers=3) with data.grad_accum (2)")
    assert "8 x 2 x 1 = 16 sequences at DP 1 but 48 at DP 3" in msg
    assert "Set data.global_batch_size instead" in msg
    assert "needs a multiple of 48 (the least common multiple of 8, 16 and 24)" in msg
    assert "data.allow_variable_global_batch: true" in msg


def test_elastic_job_may_opt_into_a_variable_global_batch() -> None:
    j = job({"min_workers": 1, "max_workers": 3}, {"grad_accum": 2, "allow_variable_global_batch": True})
    check_spec(j)
    line = describe_batch(j)
    assert "1 worker: 8 x 2 x 1 (DP) = 16 sequences/step" in line and "3 workers: 8 x 2 x 3 (DP) = 48" in line


def test_fixed_size_jobs_may_use_grad_accum() -> None:
    check_spec(job({"min_workers": 2, "max_workers": 2}, {"grad_accum": 4}))
    check_spec(job({"min_workers": 2}, {"grad_accum": 4}))  # max_workers null: the same fixed size


def test_global_batch_must_divide_at_every_size_and_every_failing_size_is_listed() -> None:
    msg = error(job({"min_workers": 1, "max_workers": 4}, {"global_batch_size": 32}))
    # 32 / (8 x 3) is not whole: only 3 workers fails.
    assert "at 3 workers (DP 3: 8 x 3 = 24)" in msg
    assert "Every size of the elastic range needs a multiple of 96" in msg and "use 96" in msg
    msg = error(job({"min_workers": 1, "max_workers": 7}, {"global_batch_size": 16}))
    assert "at 3 workers (DP 3: 8 x 3 = 24), 4 workers (DP 4: 8 x 4 = 32), 5 workers" in msg
    assert "7 workers (DP 7: 8 x 7 = 56)" in msg
    check_spec(job({"min_workers": 1, "max_workers": 4}, {"global_batch_size": 96}))


def test_whole_nodes_only_need_divisibility_at_node_sizes() -> None:
    j = job({"min_workers": 4, "max_workers": 16, "workers_per_node": 4}, {"global_batch_size": 384})
    assert world_sizes(j) == [4, 8, 12, 16]
    check_spec(j)
    assert data_parallel_sizes(j) == {4: 4, 8: 8, 12: 12, 16: 16}


def test_a_range_no_practical_batch_fits_says_so() -> None:
    msg = error(job({"min_workers": 1, "max_workers": 60}, {"global_batch_size": 512}))
    assert "No global batch up to 16,777,216 sequences divides at every size of this elastic range" in msg
    assert "scaling.workers_per_node" in msg


@pytest.mark.parametrize("field", ["min_workers", "max_workers", "workers_per_node"])
def test_absurd_worker_counts_are_refused_at_once(field: str) -> None:
    scaling = {"min_workers": 1, "max_workers": 2, field: 1_000_000_000_000}
    if field == "min_workers":
        scaling["max_workers"] = 1_000_000_000_000
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        job(scaling)
    assert time.perf_counter() - t0 < 5  # bounded: nothing enumerates the range (measured in milliseconds)
    assert f"scaling.{field}: 1,000,000,000,000 workers is more than raytrn runs (100,000" in str(e.value)


def test_the_largest_allowed_range_is_checked_arithmetically() -> None:
    """100,000 workers, elastic from 1: the checks and the validate lines stay small and quick."""
    j = job({"min_workers": 1, "max_workers": MAX_WORKERS}, {"global_batch_size": 8})
    t0 = time.perf_counter()
    msg = error(j)
    assert time.perf_counter() - t0 < 10
    assert "and 99,991 more" in msg and len(msg) < 2000
    ok = job({"min_workers": 1, "max_workers": MAX_WORKERS}, {"grad_accum": 1, "allow_variable_global_batch": True})
    lines = check_job(ok, data=False)
    assert max(len(line) for line in lines) < 2000
    assert "... 99992 more sizes ..." in describe_batch(ok)


def test_elastic_sizes_are_whole_nodes_and_whole_tp_groups() -> None:
    # 2..9 workers, 4 per node: 4 and 8 only (2 is half a node, 9 two nodes and a bit).
    j = job({"min_workers": 2, "max_workers": 9, "workers_per_node": 4}, {"global_batch_size": 64})
    assert world_sizes(j) == [4, 8]
    assert (
        describe_sizes(j)
        == "elastic sizes: 4 and 8 workers (a multiple of 4: whole nodes (scaling.workers_per_node=4))"
    )
    tp = job(
        {"min_workers": 1, "max_workers": 7},
        {"global_batch_size": 48},
        {"data_parallel": "fsdp", "tensor_parallel_size": 2},
    )
    assert world_sizes(tp) == [2, 4, 6]
    check_spec(tp)  # DP 1, 2, 3: 48 divides at each
    assert "whole tensor-parallel groups (parallel.tensor_parallel_size=2)" in describe_sizes(tp)
    assert describe_sizes(job({"min_workers": 2})) == "size: fixed at 2 workers"
    assert (
        describe_sizes(job({"min_workers": 1, "max_workers": 3}, {"global_batch_size": 48}))
        == "elastic sizes: 1, 2 and 3 workers"
    )


def test_an_elastic_range_without_a_valid_size_says_why() -> None:
    msg = error(job({"min_workers": 5, "max_workers": 7, "workers_per_node": 4}, {"global_batch_size": 64}))
    assert msg == (
        "job.yaml: scaling: no worker count in min_workers..max_workers (5..7) is a multiple of 4: whole nodes "
        "(scaling.workers_per_node=4): widen the range to include a multiple of 4"
    )


def test_elastic_sizes_of_a_huge_range_are_bounded() -> None:
    start = time.monotonic()
    j = job({"min_workers": 64, "max_workers": MAX_WORKERS, "workers_per_node": 64}, {"global_batch_size": 64 * 8})
    assert len(world_sizes(j)) == MAX_WORKERS // 64
    assert "and 1,554 more" in describe_sizes(j)
    assert time.monotonic() - start < 5
