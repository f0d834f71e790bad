"""The shipped job specs load and say what their comments promise (so the examples never rot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrn.config import PRESETS, JobSpec, load_job, read_job_file
from raytrn.config.sizes import data_parallel_size, world_sizes
from raytrn.errors import ConfigError
from raytrn.models import model_stats
from raytrn.train.checks import check_job, check_parallel
from raytrn.train.precheck import XLA_ACCELERATORS

pytestmark = pytest.mark.unit

JOBS = Path(__file__).resolve().parents[2] / "jobs"
JOB_FILES = sorted(JOBS.glob("*.yaml"))


def _base(tmp: Path) -> str:
    """A directory standing for where the jobs run: with the demo model's config.json (what `make demo` exports and
    `make demo-finetune` copies to data/demo-model), which jobs/finetune-tiny.yaml reads its sizes from."""
    from raytrn.config import ModelConfig
    from raytrn.models.export import hf_config

    model = tmp / "data" / "demo-model"
    model.mkdir(parents=True, exist_ok=True)
    hf_config(ModelConfig(preset="tiny", vocab_size=4096)).save_pretrained(model)
    return str(tmp)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return _base(tmp_path_factory.mktemp("base"))


def load(name: str, base_dir: str = "/base") -> JobSpec:
    return load_job(JOBS / name, base_dir=base_dir)


def test_jobs_exist() -> None:
    assert {p.name for p in JOB_FILES} >= {"tiny.yaml", "llama3-8b-trn1.yaml", "llama3.2-1b-trn1.yaml"}


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: p.name)
def test_every_job_loads(path: Path, base: str) -> None:
    raw, _ = read_job_file(str(path))  # a sweep's file: the job without its sweep: section
    job = load_job(path, base_dir=base, raw=raw)
    assert job.source == str(path)
    assert job.data.seq_len <= job.model.max_position_embeddings
    assert job.optim.warmup_steps < job.run.max_steps
    assert job.checkpoint.every_n_steps <= job.run.max_steps
    # The batch shape works at every world size of the elastic range (node granularity).
    for n in world_sizes(job):  # micro-batches a replica (TP, PP and CP ranks share one)
        assert job.data.grad_accum_for(data_parallel_size(job, n)) >= 1
    # The parallel layout is valid; the frozen XLA path's jobs: tests/unit/test_xla_jobs.py.
    if job.scaling.accelerator not in XLA_ACCELERATORS:
        check_parallel(job)


def test_tiny() -> None:
    job = load("tiny.yaml")
    assert job.scaling.accelerator == "cpu"
    assert job.model.preset == "tiny"
    for key, value in PRESETS["tiny"].items():
        assert getattr(job.model, key) == value, key
    assert job.model.dtype == "float32"
    assert 10 <= job.run.max_steps <= 1000  # "trained on CPU in about a minute"
    assert job.optim.warmup_steps < job.run.max_steps
    assert job.data.seq_len == 128 and job.model.vocab_size == 4096  # the `data prepare` line in its comment
    assert not job.scaling.elastic
    assert model_stats(job.model, job.data.seq_len).num_params < 5e6


TRN_JOBS = ["llama3-8b-trn1.yaml", "llama3.2-1b-trn1.yaml"]


def _node_counts(name: str) -> list[int]:
    s = load(name).scaling
    return list(range(s.min_workers // 32, (s.max_workers or s.min_workers) // 32 + 1))


@pytest.mark.parametrize(
    ("name", "nodes"), [(n, k) for n in TRN_JOBS for k in _node_counts(n)], ids=lambda v: str(v).removesuffix(".yaml")
)
def test_global_batch_fits_every_node_count(name: str, nodes: int) -> None:
    job = load(name)
    workers = nodes * (job.scaling.workers_per_node or 1)
    d, gbs = job.data, job.data.global_batch_size
    assert gbs is not None
    # With tensor parallelism a TP group shares one batch: the global batch is micro x grad_accum x DP,
    # DP = workers / TP. This is the arithmetic the training loop must use (DP-aware).
    dp = data_parallel_size(job, workers)
    assert gbs % (d.micro_batch_size * dp) == 0
    assert gbs // (d.micro_batch_size * dp) * d.micro_batch_size * dp == gbs
    # DataConfig.grad_accum_for(world_size) as it is today divides by the world size; the batches are
    # chosen to be divisible that way too, so validate passes before and after the loop becomes DP-aware.
    accum = d.grad_accum_for(workers)
    assert accum * workers * d.micro_batch_size == gbs


@pytest.mark.parametrize(
    ("name", "tp", "dps"),
    [("llama3-8b-trn2.yaml", 4, (16, 32, 48, 64)), ("llama3.2-1b-trn2.yaml", 1, (64, 128, 192, 256)),
     ("qwen3-8b-trn2.yaml", 4, (16, 32, 48, 64))],
)  # fmt: skip
def test_trn2_jobs_validate_as_torchneuron(name: str, tp: int, dps: tuple[int, ...]) -> None:
    """The trn2 jobs: TorchNeuron, one worker per logical core (64 at LNC=2), FSDP (x TP), bf16 compute over fp32
    master weights, seq 8192, compiled; `raytrn validate --no-data` passes at every node count of 1-4."""
    job = load(name)
    s, p = job.scaling, job.parallel
    assert (s.accelerator, s.instance_type, s.workers_per_node, s.min_workers, s.max_workers) == (
        "neuron", "trn2.48xlarge", 64, 64, 256,
    )  # fmt: skip
    assert (p.data_parallel, p.tensor_parallel_size) == ("fsdp", tp)
    assert (job.model.dtype, job.model.autocast, job.data.seq_len, job.run.compile) == (
        "float32",
        "bfloat16",
        8192,
        True,
    )
    assert [data_parallel_size(job, n) for n in world_sizes(job)] == list(dps)
    lines = check_job(job, data=False)
    assert any(line.startswith("note: neuron layout: trn2.48xlarge (64 NeuronCores at LNC=2)") for line in lines)
    batch = next(line for line in lines if line.startswith("batch: "))
    assert batch.count("= 768 sequences/step") == 4
    assert not [line for line in lines if line.startswith("warning:")]


def test_finetune_tiny(base: str) -> None:
    job = load("finetune-tiny.yaml", base)
    assert job.model.init_from == f"{base}/data/demo-model" and job.model.hidden_size == 128  # from config.json
    assert job.model.lora is None and job.tracking.export == "merged"
    assert job.run.eval_every == job.checkpoint.every_n_steps  # every evaluated state kept
    assert job.scaling.accelerator == "cpu" and not job.scaling.elastic


def test_llama31_8b_sft_trn2() -> None:
    job = load("llama3.1-8b-sft-trn2.yaml")
    assert job.model.init_from and job.model.init_from.startswith("s3://")  # read on the cluster, sizes from preset
    assert job.model.rope_scaling == PRESETS["llama3.1-8b"]["rope_scaling"]
    assert job.scaling.accelerator == "neuron" and job.parallel.data_parallel == "fsdp"
    assert job.data.seq_len == 8192 and job.data.attention == "document" and job.run.eval_every
    check_job(job, data=False)


def test_qwen3_jobs() -> None:
    """The Qwen3 jobs: the 8B pre-training (FSDP x TP 4, as the Llama 8B's) and the 0.6B chat SFT from a checkpoint
    (its family and sizes from the preset, checked against the checkpoint's config.json where the job starts)."""
    pretrain = load("qwen3-8b-trn2.yaml")
    assert (pretrain.model.family, pretrain.model.head_size, pretrain.model.tie_word_embeddings) == (
        "qwen3",
        128,
        False,
    )
    assert model_stats(pretrain.model, seq_len=8192).num_params == 8_190_735_360
    sft = load("qwen3-0.6b-sft-trn2.yaml")
    assert sft.model.family == "qwen3" and sft.model.tie_word_embeddings and sft.model.init_from.startswith("s3://")
    assert sft.data.attention == "document" and sft.data.seq_len == 4096 and sft.run.eval_every
    assert (sft.scaling.accelerator, sft.parallel.data_parallel) == ("neuron", "fsdp")
    assert not [line for line in check_job(sft, data=False) if line.startswith("warning:")]


def test_sweep_tiny_plans_four_learning_rates_under_asha() -> None:
    """make demo-sweep's job: 4 trials of one worker, 2 at a time, ASHA on val_loss at steps 20 and 40."""
    from raytrn.sweep.plan import SweepOptions, plan_sweep

    plan = plan_sweep(SweepOptions(job_path=str(JOBS / "sweep-tiny.yaml")), check_data=False)
    s = plan.state.sched
    assert [t.values["optim.lr"] for t in plan.state.trials] == [1e-2, 3e-3, 1e-3, 1e-4]
    assert (s.kind, s.metric, s.mode, s.rungs()) == ("asha", "val_loss", "min", [20, 40])
    assert plan.state.max_concurrent == 2 and plan.base.scaling.max_workers == 1
    with pytest.raises(ConfigError, match="has a sweep: section"):
        load_job(JOBS / "sweep-tiny.yaml")


def test_qwen3_moe_jobs() -> None:
    """The Qwen3-MoE jobs: the tiny one on CPU (dropless) and Qwen3-30B-A3B on trn2 (FSDP over 64-256 workers, the
    capacity dispatch that Neuron needs); `raytrn validate --no-data` passes at every node count of 1-4, and the
    model line counts the active parameters."""
    tiny = load("tiny-moe.yaml")
    assert (tiny.model.family, tiny.model.num_experts, tiny.model.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert tiny.model.moe_capacity_factor is None and tiny.scaling.accelerator == "cpu"
    big = load("qwen3-30b-a3b-trn2.yaml")
    m, s = big.model, big.scaling
    assert (m.family, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == ("qwen3_moe", 128, 8, 768)
    assert m.moe_capacity_factor == 1.25 and (m.dtype, m.autocast) == ("float32", "bfloat16")
    assert (s.accelerator, s.instance_type, s.workers_per_node, s.min_workers, s.max_workers) == (
        "neuron", "trn2.48xlarge", 64, 64, 256,
    )  # fmt: skip
    assert [data_parallel_size(big, n) for n in world_sizes(big)] == [64, 128, 192, 256]
    stats = model_stats(m, seq_len=big.data.seq_len)
    assert stats.num_params == pytest.approx(30.5e9, rel=0.01) and stats.num_active_params == pytest.approx(
        3.35e9, rel=0.02
    )
    lines = check_job(big, data=False)
    assert not [line for line in lines if line.startswith("warning:")], lines
    assert any("active a token" in line for line in lines), lines
    with pytest.raises(ConfigError, match="needs model.moe_capacity_factor"):
        load_job(JOBS / "qwen3-30b-a3b-trn2.yaml", ["model.moe_capacity_factor=null"], base_dir="/base")


def test_a_local_ray_is_not_started_for_a_resource_it_would_surely_lack(tmp_path: Path) -> None:
    """`raytrn train` on a machine without the Neuron tools (or with a custom resource raytrn never gives a local
    Ray) refuses the job before starting Ray, with the line it gave after: nothing started first."""
    from raytrn.backends import get_backend
    from raytrn.errors import RaytrnError
    from raytrn.train.checks import check_local_resources, embedded_ray_lacks

    repo = Path(__file__).resolve().parents[2]
    neuron = load_job(repo / "jobs" / "tiny.yaml", ["scaling.resources_per_worker={neuron_cores: 1}"])
    backend = get_backend(neuron.scaling.accelerator)
    missing = str(tmp_path / "no-neuron-tools")
    lacks = embedded_ray_lacks(neuron, backend, environ={}, neuron_tools=missing)
    assert lacks == {"neuron_cores": 0.0}
    with pytest.raises(RaytrnError, match=r"needs 2 'neuron_cores' \(2 workers x 1\) but this local Ray has 0;"):
        check_local_resources(neuron, backend, lacks, partial=True)
    # With the Neuron tools Ray counts the cores itself (checked once it is up); RAY_OVERRIDE_RESOURCES decides too.
    assert embedded_ray_lacks(neuron, backend, environ={}, neuron_tools=str(tmp_path)) == {}
    overridden = {"RAY_OVERRIDE_RESOURCES": '{"neuron_cores": 2}'}
    assert embedded_ray_lacks(neuron, backend, environ=overridden, neuron_tools=missing) == {}
    custom = load_job(repo / "jobs" / "tiny.yaml", ["scaling.resources_per_worker={CPU: 1, trn_slot: 1}"])
    assert embedded_ray_lacks(custom, backend, environ={}, neuron_tools=missing) == {"trn_slot": 0.0}
    # The CPUs are Ray's to count: never refused before it starts; once up, what it has decides.
    cpu = load_job(repo / "jobs" / "tiny.yaml")
    assert embedded_ray_lacks(cpu, backend, environ={}, neuron_tools=missing) == {}
    check_local_resources(cpu, backend, {"CPU": 2.0})
    with pytest.raises(RaytrnError, match=r"needs 2 'CPU' .* but this local Ray has 1;"):
        check_local_resources(cpu, backend, {"CPU": 1.0})


def test_the_70b_and_64k_jobs_lay_out_as_their_comments_say() -> None:
    """jobs/llama3.1-70b-trn2.yaml: PP 8 x TP 8 x FSDP 8 on 8 nodes, a stage a node; jobs/llama3.1-8b-64k-trn2.yaml:
    CP 16 x TP 4 a node, 4,096 tokens a worker. Both fit their devices with the margin tests/unit/test_estimate.py
    asks of every trn2 job."""
    from raytrn.estimate.job import estimate_job

    big = load("llama3.1-70b-trn2.yaml")
    assert model_stats(big.model, big.data.seq_len).num_params == pytest.approx(70.55e9, rel=1e-3)
    assert check_parallel(big) == [
        "parallel: fsdp over 8 data-parallel rank(s), tensor parallel 8 (DTensor), pipeline parallel 8 (1f1b, 8 "
        "stages of 10/10/10/10/10/10/10/10 layers), full activation checkpointing"
    ]
    assert data_parallel_size(big, 512) == 8 and big.data.grad_accum_for(8) == 128
    est = estimate_job(big)
    assert est.pipeline is not None and est.memory_verdict == "fits"
    long = load("llama3.1-8b-64k-trn2.yaml")
    assert long.data.seq_len == 65536 and long.model.rope_scaling is not None  # Llama 3.1's 128k RoPE scaling
    assert data_parallel_size(long, 256) == 4 and long.data.grad_accum_for(4) == 16
    assert any("context parallel 16" in line for line in check_parallel(long))
    assert estimate_job(long).memory_verdict == "fits"
