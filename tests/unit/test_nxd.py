"""neuronx-distributed: parallel-layout validation, the NxD config mapping, and the runtime helpers' calls.

neuronx-distributed cannot be installed off a trn host, so the runtime helpers are tested against a fake
``neuronx_distributed`` package put into ``sys.modules``. The fakes only record; the assertions check the
values raytrn derives from the job (TP, kv replication, clip norm, param groups, checkpoint layout).
"""

from __future__ import annotations

import copy
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

from raytrn.config import JobSpec, apply_overrides, parse_job
from raytrn.config.sizes import data_parallel_rank, data_parallel_size, describe_sizes, world_sizes
from raytrn.errors import BackendError, BackendUnavailableError, ConfigError
from raytrn.train.checks import check_spec
from raytrn.xla import nxd
from raytrn.xla.nxd import (
    LAYOUT_KEY,
    build_nxd_config,
    build_parallel_model,
    build_parallel_optimizer,
    check_parallel,
    kv_replication,
    load_sharded_checkpoint,
    nxd_config_kwargs,
    require_nxd,
    save_sharded_checkpoint,
    uses_nxd,
    vocab_parallel_loss,
)

pytestmark = pytest.mark.unit

JOBS = Path(__file__).resolve().parents[2] / "jobs"
_RAW = {name: yaml.safe_load((JOBS / name).read_text()) for name in ("llama3-8b-trn1.yaml", "llama3.2-1b-trn1.yaml")}


def job(name: str = "llama3.2-1b-trn1.yaml", *overrides: str) -> JobSpec:
    """A shipped trn job with ``--set``-style overrides applied (source "job.yaml" for messages)."""
    raw = copy.deepcopy(_RAW[name])
    apply_overrides(raw, list(overrides))
    return parse_job(raw, source="job.yaml")


def job_8b(*overrides: str) -> JobSpec:
    return job("llama3-8b-trn1.yaml", *overrides)


def config_error(j: JobSpec) -> str:
    """The ConfigError of the checks every command runs on a spec (the parallel layout, then the batch)."""
    with pytest.raises(ConfigError) as e:
        check_spec(j)
    return str(e.value)


# ---------------------------------------------------------------------------------------------------
# Layout arithmetic


@pytest.mark.parametrize(
    ("kv", "tp", "expected"),
    [(8, 32, 4), (8, 16, 2), (8, 8, 1), (8, 4, 1), (8, 1, 1), (1, 8, 8), (6, 4, 2)],
)
def test_kv_replication_is_the_smallest_factor_nxd_accepts(kv: int, tp: int, expected: int) -> None:
    k = kv_replication(kv, tp)
    assert k == expected
    # GQAQKVColumnParallelLinear's two assertions hold.
    assert tp % k == 0 and (kv * k) % tp == 0


def test_data_parallel_size_and_rank() -> None:
    j8, j1 = job_8b(), job()
    assert [data_parallel_size(j8, n) for n in (32, 64, 96, 128)] == [1, 2, 3, 4]
    assert [data_parallel_size(j1, n) for n in (32, 64, 96, 128)] == [4, 8, 12, 16]
    # TP ranks are consecutive: ranks 0-7 are replica 0, 8-15 replica 1, ...
    assert [data_parallel_rank(j1, r) for r in (0, 7, 8, 33, 127)] == [0, 0, 1, 4, 15]
    assert [data_parallel_rank(j8, r) for r in (0, 31, 32, 127)] == [0, 0, 1, 3]
    with pytest.raises(ConfigError, match=r"36 workers is not divisible by parallel.tensor_parallel_size \(8\)"):
        data_parallel_size(j1, 36)


def test_uses_nxd() -> None:
    assert uses_nxd(job()) and uses_nxd(job_8b())
    plain = "parallel={tensor_parallel_size: 1, zero1: false, sequence_parallel: false}"
    assert not uses_nxd(job("llama3.2-1b-trn1.yaml", plain))
    assert uses_nxd(job("llama3.2-1b-trn1.yaml", plain, "parallel.zero1=true"))
    assert uses_nxd(job("llama3.2-1b-trn1.yaml", plain, "parallel.activation_checkpointing=true"))


# ---------------------------------------------------------------------------------------------------
# check_parallel: the shipped jobs


def test_check_parallel_8b_lines() -> None:
    assert check_parallel(job_8b(), require_installed=False) == [
        "parallel: TP 32 x DP 1, 2, 3, 4 = 32, 64, 96, 128 workers (neuronx-distributed); ZeRO-1 with FP32 master "
        "weights (optimizer state sharded over DP), sequence parallel, kv heads 8 replicated x4 over TP 32",
        "parallel batch: DP 1: 1 x 768 x 1 = 768, DP 2: 1 x 384 x 2 = 768, DP 3: 1 x 256 x 3 = 768, "
        "DP 4: 1 x 192 x 4 = 768 sequences/step (micro_batch x grad_accum x DP; each TP group of 32 ranks shares "
        "a batch)",
    ]


def test_check_parallel_1b_lines() -> None:
    lines = check_parallel(job(), require_installed=False)
    assert lines[0] == (
        "parallel: TP 8 x DP 4, 8, 12, 16 = 32, 64, 96, 128 workers (neuronx-distributed); ZeRO-1 with FP32 master "
        "weights (optimizer state sharded over DP), sequence parallel"
    )  # 8 kv heads over TP 8: no replication
    assert lines[1].startswith("parallel batch: DP 4: 1 x 96 x 4 = 384, DP 8: 1 x 48 x 8 = 384, DP 12: 1 x 32 x 12")


def test_plain_jobs_have_nothing_to_say() -> None:
    plain = "parallel={tensor_parallel_size: 1, zero1: false, sequence_parallel: false}"
    assert check_parallel(job("llama3.2-1b-trn1.yaml", plain)) == []  # neuron, plain DP: no NxD needed
    # cpu: tests/unit/test_layout_checks.py


# ---------------------------------------------------------------------------------------------------
# check_parallel: every ConfigError


PLAIN = "parallel={tensor_parallel_size: 1, zero1: false, sequence_parallel: false}"


@pytest.mark.parametrize(
    ("accelerator", "overrides", "expected"),
    [
        ("xla-cpu", ["parallel.data_parallel=fsdp"], "parallel.data_parallel=fsdp: scaling.accelerator xla-cpu runs one plain worker"),
        ("xla-cpu", ["parallel.activation_checkpointing=true"], "parallel.activation_checkpointing=full: scaling.accelerator xla-cpu"),
        ("neuron-xla", ["parallel.data_parallel=fsdp"], "parallel.data_parallel=fsdp is not available on scaling.accelerator: neuron-xla"),
        ("neuron-xla", ["parallel.activation_checkpointing=selective"], "activation_checkpointing=selective is not available"),
    ],
)  # fmt: skip
def test_each_accelerator_refuses_the_layouts_it_cannot_run(
    accelerator: str, overrides: list[str], expected: str
) -> None:
    msg = config_error(job("llama3.2-1b-trn1.yaml", PLAIN, f"scaling.accelerator={accelerator}", *overrides))
    assert msg.startswith("job.yaml: ") and expected in msg, msg


def test_sequence_parallel_needs_tensor_parallel() -> None:
    msg = config_error(job("llama3.2-1b-trn1.yaml", "parallel.tensor_parallel_size=1"))
    assert msg.startswith("job.yaml: parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1")
    assert "set sequence_parallel: false" in msg


def test_tp_must_divide_heads_hidden_and_mlp() -> None:
    msg = config_error(
        job("llama3.2-1b-trn1.yaml", "parallel.tensor_parallel_size=3", "parallel.sequence_parallel=false")
    )
    assert msg.startswith("job.yaml: parallel.tensor_parallel_size (3) must divide the model's sharded dimensions:")
    assert "model.num_attention_heads (32) % 3 = 2: each rank computes num_attention_heads / TP query heads" in msg
    assert "model.hidden_size (2048) % 3 = 2" in msg
    assert "model.intermediate_size (8192) % 3 = 2" in msg
    assert "model.vocab_size" not in msg  # 128256 = 3 x 42752
    assert "tensor_parallel_size values this model allows: 1, 2, 4, 8, 16, 32." in msg
    assert "NxD replicates kv heads TP / gcd(kv_heads, TP) times" in msg


def test_tp_larger_than_the_heads() -> None:
    msg = config_error(job("llama3.2-1b-trn1.yaml", "parallel.tensor_parallel_size=64", "scaling.workers_per_node=64"))
    assert "model.num_attention_heads (32) % 64 = 32" in msg


def test_tp_must_divide_the_vocabulary_with_a_padding_fix() -> None:
    msg = config_error(job("llama3.2-1b-trn1.yaml", "model.vocab_size=128257"))
    assert "model.vocab_size (128257) % 8 = 1: the embedding and the output head are split by vocabulary rows" in msg
    assert "pad it to 128264" in msg


def test_tp_must_divide_the_mlp() -> None:
    msg = config_error(job("llama3.2-1b-trn1.yaml", "model.intermediate_size=8196"))
    assert "model.intermediate_size (8196) % 8 = 4: the MLP gate/up/down projections are split along it" in msg
    assert "values this model allows: 1, 2, 4." in msg


def test_kv_heads_never_block_a_tp_that_divides_the_query_heads() -> None:
    # 8 kv heads, TP 16 and 32: NxD replicates them x2 / x4 instead of failing.
    for tp in (16, 32):
        lines = check_parallel(
            job("llama3.2-1b-trn1.yaml", f"parallel.tensor_parallel_size={tp}"), require_installed=False
        )
        assert f"kv heads 8 replicated x{tp // 8} over TP {tp}" in lines[0]


def test_sequence_parallel_needs_seq_len_divisible_by_tp() -> None:
    msg = config_error(job("llama3.2-1b-trn1.yaml", "data.seq_len=8188"))
    assert msg == (
        "job.yaml: data.seq_len (8188) is not divisible by parallel.tensor_parallel_size (8): sequence parallelism "
        "splits every sequence over the TP ranks; use a seq_len that is a multiple of 8"
    )


def test_tp_must_divide_every_world_size_of_the_elastic_range() -> None:
    # 12 per node: sizes 12, 24, 36; TP 8 divides only 24.
    msg = config_error(
        job("llama3.2-1b-trn1.yaml", "scaling.workers_per_node=12", "scaling.min_workers=12", "scaling.max_workers=36")
    )
    assert msg.startswith("job.yaml: parallel.tensor_parallel_size (8) does not divide 12, 36 worker(s)")
    assert "scaling.min_workers=12, max_workers=36, workers_per_node=12" in msg
    assert "make min_workers, max_workers and workers_per_node multiples of 8" in msg


def test_a_ragged_top_of_the_range_is_never_a_size() -> None:
    # 32 per node: 100 workers is three nodes and a bit; the job runs at 32, 64 or 96, and says so.
    j = job("llama3.2-1b-trn1.yaml", "scaling.max_workers=100")
    assert world_sizes(j) == [32, 64, 96]
    assert (
        describe_sizes(j)
        == "elastic sizes: 32, 64 and 96 workers (a multiple of 32: whole nodes (scaling.workers_per_node=32))"
    )


def test_global_batch_must_divide_by_micro_batch_times_data_parallel_size() -> None:
    # AWS's 1024 does not split over 3 nodes (DP 3) of TP 32.
    msg = config_error(job_8b("data.global_batch_size=1024"))
    assert msg == (
        "job.yaml: data.global_batch_size (1024) is not divisible by micro_batch_size x data-parallel size at 96 "
        "workers (DP 3: 1 x 3 = 3); with tensor_parallel_size 32 the ranks of a TP group share each batch, so DP = "
        "workers / TP. Every size of the elastic range needs a multiple of 12 (the least common multiple of 1, 2, 3 "
        "and 4): use 1020 or 1032."
    )


def test_bf16_without_master_weights_or_stochastic_rounding_warns() -> None:
    j = job("llama3.2-1b-trn1.yaml", "parallel.zero1=false", "neuron.stochastic_rounding=false")
    lines = check_parallel(j, require_installed=False)
    assert any(line.startswith("warning: bfloat16 parameters without FP32 master weights") for line in lines)
    lines = check_parallel(job("llama3.2-1b-trn1.yaml", "parallel.zero1=false"), require_installed=False)
    assert not any(line.startswith("warning:") for line in lines)


# ---------------------------------------------------------------------------------------------------
# The import guard


def test_guard_raises_when_neuronx_distributed_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "neuronx_distributed", None)  # import would fail
    with pytest.raises(BackendUnavailableError) as e:
        check_parallel(job_8b())
    msg = str(e.value)
    assert msg.startswith("neuronx-distributed is not installed here; the job needs it for tensor parallel 32, ZeRO-1")
    assert "Neuron DLAMI" in msg and "AWS's Neuron package index" in msg
    with pytest.raises(BackendUnavailableError):
        require_nxd(job_8b())
    # Config errors come first: a broken layout is reported even where NxD is missing.
    with pytest.raises(ConfigError):
        check_parallel(job_8b("data.seq_len=8190"))
    # Jobs that do not need NxD do not need it installed.
    plain = "parallel={tensor_parallel_size: 1, zero1: false, sequence_parallel: false}"
    assert check_parallel(job("llama3.2-1b-trn1.yaml", plain)) == []


def test_guard_passes_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "neuronx_distributed", types.ModuleType("neuronx_distributed"))
    assert check_parallel(job_8b()) == check_parallel(job_8b(), require_installed=False)


def test_check_parallel_does_not_import_neuronx_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "neuronx_distributed", raising=False)
    with pytest.raises(BackendUnavailableError):
        check_parallel(job_8b())
    assert "neuronx_distributed" not in sys.modules


# ---------------------------------------------------------------------------------------------------
# nxd_config_kwargs


def test_nxd_config_kwargs_8b() -> None:
    assert nxd_config_kwargs(job_8b()) == {
        "tensor_parallel_size": 32,
        "pipeline_parallel_size": 1,
        "optimizer_config": {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        "sequence_parallel": True,
        "activation_checkpoint_config": None,
        "mixed_precision_config": {
            "use_master_weights": True,
            "use_fp32_grad_acc": True,
            "use_master_weights_in_ckpt": True,
        },
        "lnc_size": 1,
    }


def test_nxd_config_kwargs_variants() -> None:
    k = nxd_config_kwargs(
        job("llama3.2-1b-trn1.yaml", "optim.grad_clip_norm=0.5", "parallel.activation_checkpointing=true")
    )
    assert k["tensor_parallel_size"] == 8
    assert k["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 0.5}
    assert k["activation_checkpoint_config"] == "full"

    k = nxd_config_kwargs(job("llama3.2-1b-trn1.yaml", "optim.grad_clip_norm=null"))
    assert k["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": False}

    no_master = {"use_master_weights": False, "use_fp32_grad_acc": False, "use_master_weights_in_ckpt": False}
    # NxD refuses master weights without ZeRO-1; float32 weights need none.
    assert (
        nxd_config_kwargs(job("llama3.2-1b-trn1.yaml", "parallel.zero1=false"))["mixed_precision_config"] == no_master
    )
    assert nxd_config_kwargs(job("llama3.2-1b-trn1.yaml", "model.dtype=float32"))["mixed_precision_config"] == no_master
    assert (
        nxd_config_kwargs(job("llama3.2-1b-trn1.yaml", "parallel.sequence_parallel=false"))["sequence_parallel"]
        is False
    )


@pytest.mark.parametrize(
    ("instance", "lnc", "expected"),
    [("trn1.32xlarge", None, 1), ("trn2.48xlarge", None, 2), ("trn2.48xlarge", 1, 1), ("trn2.48xlarge", 2, 2)],
)
def test_nxd_config_lnc_size(instance: str, lnc: int | None, expected: int) -> None:
    sets = [f"scaling.instance_type={instance}"] + ([f"neuron.lnc={lnc}"] if lnc else [])
    assert nxd_config_kwargs(job("llama3.2-1b-trn1.yaml", *sets))["lnc_size"] == expected


# ---------------------------------------------------------------------------------------------------
# Runtime helpers against a fake neuronx_distributed


class FakeStorage:
    """NxD's checkpoint storage as raytrn reads it: completed tags and the objects saved under them."""

    def __init__(self, tags: list[str], files: dict[str, Any]) -> None:
        self.tags, self.files = tags, files

    def list_completed_checkpoint_tags(self) -> list[str]:
        return list(self.tags)

    def file_exists(self, name: str) -> bool:
        return name in self.files

    def load_object(self, name: str, map_location: Any = None) -> Any:
        assert map_location == "cpu"
        return self.files[name]


class FakeNxD:
    """Records every call into the fake neuronx_distributed modules."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.storage = FakeStorage([], {})
        self.layout = {"tp": 8, "dp": 4}
        self.built_configs: list[Any] = []
        self.seeds: list[int] = []

    def record(self, name: str, result: Any = None) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result

        return fn

    def called(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for n, a, k in self.calls if n == name]

    def save(self, path: str, tag: str, *, user_content: Any = None, **kwargs: Any) -> None:
        """As NxD's save_checkpoint: the tag completes, and rank 0's user content is stored as given."""
        self.storage.tags.append(tag)
        if user_content is not None:
            self.storage.files[f"{tag}/user_content.pt"] = user_content

    def load(self, path: str, tag: str | None = None, **kwargs: Any) -> Any:
        """As NxD's load_checkpoint: the user content saved with the tag, unchanged (None without one)."""
        tag = tag or self.storage.tags[-1]
        return self.storage.files.get(f"{tag}/user_content.pt")


@pytest.fixture
def fake_nxd(monkeypatch: pytest.MonkeyPatch) -> FakeNxD:
    fake = FakeNxD()

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    module("neuronx_distributed")
    module(
        "neuronx_distributed.trainer",
        neuronx_distributed_config=fake.record("config", lambda **kw: {"nxd": kw}),
        initialize_parallel_model=fake.record("model", lambda cfg, fn, buffers: ("nxd-model", fn())),
        initialize_parallel_optimizer=fake.record("optimizer", "nxd-optimizer"),
        save_checkpoint=fake.record("save", fake.save),
        load_checkpoint=fake.record("load", fake.load),
    )
    module(
        "neuronx_distributed.trainer.checkpoint_storage",
        create_checkpoint_storage=fake.record("storage", lambda path: fake.storage),
    )
    module("neuronx_distributed.parallel_layers")
    module(
        "neuronx_distributed.parallel_layers.parallel_state",
        get_tensor_model_parallel_size=lambda: fake.layout["tp"],
        get_data_parallel_size=lambda: fake.layout["dp"],
    )
    module(
        "neuronx_distributed.parallel_layers.loss_functions",
        parallel_cross_entropy=lambda logits, target: F.cross_entropy(logits, target, reduction="none"),
    )

    class LlamaForCausalLM:
        def __init__(self, config: Any) -> None:
            fake.built_configs.append(config)
            fake.seeds.append(torch.initial_seed())

    module(nxd.NXD_LLAMA_MODULE, LlamaForCausalLM=LlamaForCausalLM)
    return fake


def test_build_nxd_config_passes_the_mapping(fake_nxd: FakeNxD) -> None:
    j = job_8b()
    assert build_nxd_config(j) == {"nxd": nxd_config_kwargs(j)}
    assert fake_nxd.called("config") == [((), nxd_config_kwargs(j))]


@pytest.mark.parametrize(
    ("name", "kv_group", "head_dim"), [("llama3-8b-trn1.yaml", 4, 128), ("llama3.2-1b-trn1.yaml", 1, 64)]
)
def test_build_parallel_model(fake_nxd: FakeNxD, name: str, kv_group: int, head_dim: int) -> None:
    j = job(name)
    model = build_parallel_model(j, {"cfg": 1})
    [(args, kwargs)] = fake_nxd.called("model")
    assert args[0] == {"cfg": 1} and args[2] is True and kwargs == {}  # include_buffers, as AWS's recipe
    assert model[0] == "nxd-model"
    [config] = fake_nxd.built_configs
    m = j.model
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        m.num_layers,
        m.hidden_size,
        m.intermediate_size,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (32, 8, 128256)
    assert config.tie_word_embeddings is m.tie_word_embeddings
    assert config.use_cache is False
    assert config.torch_dtype is torch.bfloat16
    assert config.head_dim == head_dim
    assert config.sequence_parallel_enabled is True
    assert config.selective_checkpoint_enabled is False
    assert config.qkv_linear is True and config.fuse_qkv is True
    assert config.kv_shared_group_size == kv_group  # 8 kv heads over TP 32: x4; over TP 8: none
    assert config.use_flash_attention is True and config.transpose_nki_inputs is True
    assert fake_nxd.seeds == [j.run.seed]  # every rank draws the same full weights


def test_build_parallel_model_without_the_example_module(fake_nxd: FakeNxD, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, nxd.NXD_LLAMA_MODULE, None)
    with pytest.raises(BackendUnavailableError) as e:
        build_parallel_model(job(), {})
    msg = str(e.value)
    assert "'modeling_llama_nxd'" in msg and "examples/training/llama/modeling_llama_nxd.py" in msg
    assert "PYTHONPATH" in msg and "transformers" in msg
    assert fake_nxd.called("model") == []


def test_runtime_helpers_without_neuronx_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "neuronx_distributed", None)
    monkeypatch.setitem(sys.modules, "neuronx_distributed.trainer", None)
    with pytest.raises(BackendUnavailableError, match="neuronx_distributed.trainer cannot be imported"):
        build_nxd_config(job())
    with pytest.raises(BackendUnavailableError, match="AWS's Neuron package index"):
        build_parallel_model(job(), {})


def _tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


def test_build_parallel_optimizer_zero1(fake_nxd: FakeNxD) -> None:
    model = _tiny_model()
    j = job("llama3.2-1b-trn1.yaml", "optim.grad_clip_norm=0.5")
    assert build_parallel_optimizer(j, {"cfg": 1}, model) == "nxd-optimizer"
    [(args, kwargs)] = fake_nxd.called("optimizer")
    cfg, cls, groups = args
    assert cfg == {"cfg": 1} and cls is torch.optim.AdamW
    linear, norm = model[0], model[1]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["params"] == [linear.weight]  # matrices decay
    assert groups[1]["params"] == [linear.bias, norm.weight, norm.bias]  # 1-D parameters do not
    # NxD builds the ZeRO-1 optimizer without optimizer_config's max_grad_norm: raytrn passes max_norm.
    assert kwargs == {"lr": 4.0e-4, "betas": (0.9, 0.95), "eps": 1.0e-8, "weight_decay": 0.1, "max_norm": 0.5}


def test_build_parallel_optimizer_without_zero1_or_clipping(fake_nxd: FakeNxD) -> None:
    build_parallel_optimizer(job("llama3.2-1b-trn1.yaml", "parallel.zero1=false"), {}, _tiny_model())
    build_parallel_optimizer(job("llama3.2-1b-trn1.yaml", "optim.grad_clip_norm=null"), {}, _tiny_model())
    for _, kwargs in fake_nxd.called("optimizer"):
        assert "max_norm" not in kwargs  # plain AdamW would reject it; NxDOptimizer clips itself


def test_vocab_parallel_loss_is_the_mean_token_loss(fake_nxd: FakeNxD) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    assert torch.allclose(vocab_parallel_loss(logits, targets), expected)


def test_save_sharded_checkpoint(fake_nxd: FakeNxD) -> None:
    save_sharded_checkpoint("s3://b/ckpt/run", "step_00000200", "M", "O", "S", {"step": 200}, 3)
    [(args, kwargs)] = fake_nxd.called("save")
    assert args == ("s3://b/ckpt/run", "step_00000200")
    assert kwargs == {
        "model": "M",
        "optimizer": "O",
        "scheduler": "S",
        "user_content": {"step": 200, LAYOUT_KEY: {"tensor_parallel_size": 8, "data_parallel_size": 4}},
        "num_workers": 8,
        "use_xser": True,
        "num_kept_ckpts": 3,
    }


class Zero1Optimizer:
    """Stands for NxDOptimizer(NeuronZero1Optimizer): its nxd_config and the inner optimizer's init_zero."""

    def __init__(self, zero1: bool) -> None:
        self.nxd_config = {"optimizer_config": {"zero_one_enabled": zero1}}
        self.optimizer = types.SimpleNamespace(init_zero=self.init_zero)
        self.reinitialised = 0

    def init_zero(self) -> None:
        self.reinitialised += 1


def _saved(fake: FakeNxD, tp: int, dp: int) -> None:
    fake.storage = FakeStorage(
        ["step_100", "step_200"],
        {"step_200/user_content.pt": {"step": 200, LAYOUT_KEY: {"tensor_parallel_size": tp, "data_parallel_size": dp}}},
    )


def test_load_without_a_checkpoint(fake_nxd: FakeNxD) -> None:
    assert load_sharded_checkpoint("s3://b/run", "M", Zero1Optimizer(True), "S") is None
    assert fake_nxd.called("load") == []


def test_load_the_newest_checkpoint(fake_nxd: FakeNxD) -> None:
    _saved(fake_nxd, tp=8, dp=4)
    opt = Zero1Optimizer(True)
    # NxD hands back the user content as saved: raytrn's counters and its layout key.
    assert load_sharded_checkpoint("s3://b/run", "M", opt, "S") == {
        "step": 200,
        LAYOUT_KEY: {"tensor_parallel_size": 8, "data_parallel_size": 4},
    }
    assert fake_nxd.called("storage") == [(("s3://b/run",), {})]
    assert fake_nxd.called("load") == [
        (("s3://b/run",), {"tag": "step_200", "model": "M", "optimizer": opt, "scheduler": "S"})
    ]
    assert opt.reinitialised == 0


def test_load_after_a_resize_restarts_zero1_moments(fake_nxd: FakeNxD, caplog: pytest.LogCaptureFixture) -> None:
    _saved(fake_nxd, tp=8, dp=8)  # saved on 2 nodes, resumed on 1 (DP 4)
    opt = Zero1Optimizer(True)
    with caplog.at_level(logging.WARNING, logger="raytrn.xla.nxd"):
        load_sharded_checkpoint("s3://b/run", "M", opt, "S")
    assert fake_nxd.called("load") == [
        (("s3://b/run",), {"tag": "step_200", "model": "M", "optimizer": None, "scheduler": "S"})
    ]
    assert opt.reinitialised == 1
    assert "saved at data-parallel size 8, this run has 4" in caplog.text


def test_load_after_a_resize_without_zero1_loads_everything(fake_nxd: FakeNxD) -> None:
    _saved(fake_nxd, tp=8, dp=8)
    opt = Zero1Optimizer(False)  # replicated optimizer state: any DP size can load it
    load_sharded_checkpoint("s3://b/run", "M", opt, "S")
    assert fake_nxd.called("load")[0][1]["optimizer"] is opt


def test_load_refuses_another_tensor_parallel_size(fake_nxd: FakeNxD) -> None:
    _saved(fake_nxd, tp=32, dp=1)
    with pytest.raises(BackendError, match=r"tensor_parallel_size 32 but this run has 8; shards cannot be re-split"):
        load_sharded_checkpoint("s3://b/run", "M", Zero1Optimizer(True), "S")
    assert fake_nxd.called("load") == []
