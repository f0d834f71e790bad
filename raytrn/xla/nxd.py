"""neuronx-distributed (NxD) on Trainium: tensor parallelism, ZeRO-1, sequence parallelism, checkpointing.

Two halves. The pure half runs anywhere (``raytrn validate`` on a laptop, unit tests):
:func:`check_parallel` validates the ``parallel`` section against the model and the elastic range, and
:func:`nxd_config_kwargs` maps a job onto ``neuronx_distributed.trainer.neuronx_distributed_config``.
The runtime half runs on a trn worker after the XLA process group exists: it builds NxD's
tensor-parallel Llama, its optimizer wrapper and sharded checkpoints. ``neuronx_distributed`` is only
imported there (it imports ``torch_xla``, whose import configures the Neuron runtime).

Rank layout (NxD ``parallel_state``): ranks form a row-major [PP, DP, TP] grid, TP fastest, so a
tensor-parallel group is ``tensor_parallel_size`` consecutive ranks and ``dp_rank = rank // TP``.

What a trn venv must provide: ``neuronx-distributed`` and ``torch-neuronx`` (the Neuron DLAMI's PyTorch
venv, or AWS's Neuron package index), and NxD's tensor-parallel Llama, which ships in the NxD
*repository*, not the package: ``examples/training/llama/modeling_llama_nxd.py`` from the
aws-neuron/neuronx-distributed tag matching the installed package, importable as
``modeling_llama_nxd`` (e.g. on ``PYTHONPATH``), with the ``transformers`` version that example pins
(``examples/training/llama/requirements.txt``: 4.48.0 at v2.28; it imports symbols later releases removed).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from raytrn.config.layout import refuse_nxd_only, refuse_on_xla
from raytrn.config.sizes import data_parallel_size, world_sizes
from raytrn.errors import BackendError, BackendUnavailableError, ConfigError
from raytrn.models.export import hf_config
from raytrn.train.optim import adamw_param_groups

if TYPE_CHECKING:
    import torch

    from raytrn.config import JobSpec

log = logging.getLogger(__name__)

#: Module name of NxD's example tensor-parallel Llama (``examples/training/llama/modeling_llama_nxd.py``).
NXD_LLAMA_MODULE = "modeling_llama_nxd"

_INSTALL = (
    "on a trn instance use the Neuron DLAMI's PyTorch virtual environment, or install it from AWS's Neuron "
    "package index (see the Neuron setup guide): pip install neuronx-distributed --extra-index-url <Neuron index>"
)

#: The key :func:`save_sharded_checkpoint` adds to ``user_content``: the layout the shards were saved at.
LAYOUT_KEY = "raytrn_parallel"


# ---------------------------------------------------------------------------------------------------
# Layout arithmetic (pure)


def uses_nxd(job: JobSpec) -> bool:
    """Whether the job runs through neuronx-distributed: a neuron-xla job that asks for any ``parallel`` feature."""
    p = job.parallel
    wants = p.tensor_parallel_size > 1 or p.zero1 or p.sequence_parallel or p.activation_checkpointing != "none"
    return job.scaling.accelerator == "neuron-xla" and wants


def kv_replication(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """How many times NxD replicates each kv head so the kv heads split evenly over the TP ranks.

    ``GQAQKVColumnParallelLinear(kv_size_multiplier=k)`` asserts ``TP % k == 0`` and
    ``(kv_heads * k) % TP == 0``; the smallest such k is ``TP / gcd(kv_heads, TP)``: 1 when TP divides the
    kv heads, ``TP / kv_heads`` when the kv heads divide TP (AWS's Llama-3-8B recipe: 8 kv heads, TP 32,
    ``--kv_replicator 4``).
    """
    return tensor_parallel_size // math.gcd(num_kv_heads, tensor_parallel_size)


# ---------------------------------------------------------------------------------------------------
# Validation (pure)


def check_parallel(job: JobSpec, *, require_installed: bool = True) -> list[str]:
    """Validate the ``parallel`` section of an XLA job (neuron-xla, xla-cpu); return info lines for ``raytrn
    validate``. The torch.distributed layouts (cpu, cuda, neuron) are checked by
    :func:`raytrn.train.checks.check_parallel`; this one is reached through the XLA backends' ``check_layout``.

    Raises ConfigError (field, values, fix) for a layout that cannot run, then, when
    ``require_installed`` and the job needs NxD, BackendUnavailableError if ``neuronx_distributed`` is
    not installed here (``check_job`` shows that as a note on a laptop; the message names the features).
    ``require_installed=False`` returns the info lines instead; :func:`require_nxd` is the guard alone.
    """
    p, where = job.parallel, job.source
    tp = p.tensor_parallel_size
    refuse_on_xla(job)
    _check_accelerator(job)
    if p.sequence_parallel and tp == 1:
        raise ConfigError(
            f"{where}: parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1 (it shards the "
            "activations of norms and dropout over the tensor-parallel ranks); set sequence_parallel: false "
            "or tensor_parallel_size to 2 or more"
        )
    _check_model_dims(job)
    if p.sequence_parallel and job.data.seq_len % tp:
        raise ConfigError(
            f"{where}: data.seq_len ({job.data.seq_len}) is not divisible by parallel.tensor_parallel_size ({tp}): "
            f"sequence parallelism splits every sequence over the TP ranks; use a seq_len that is a multiple of {tp}"
        )
    sizes = world_sizes(job)
    bad = [n for n in sizes if n % tp]
    if bad:
        step = job.scaling.workers_per_node
        raise ConfigError(
            f"{where}: parallel.tensor_parallel_size ({tp}) does not divide "
            f"{', '.join(map(str, bad))} worker(s), a world size the job can take "
            f"(scaling.min_workers={job.scaling.min_workers}, max_workers={job.scaling.max_workers}"
            f"{f', workers_per_node={step}' if step else ''}); every world size must hold whole tensor-parallel "
            f"groups: make min_workers, max_workers{' and workers_per_node' if step else ''} multiples of {tp}"
        )
    if not uses_nxd(job):
        return []  # plain replicas: nothing to say
    lines = _describe(job, sizes)
    if require_installed:
        require_nxd(job)
    return lines


def require_nxd(job: JobSpec) -> None:
    """BackendUnavailableError unless ``neuronx_distributed`` can be imported here (nothing is imported)."""
    if uses_nxd(job) and not _installed("neuronx_distributed"):
        raise BackendUnavailableError(
            f"neuronx-distributed is not installed here; the job needs it for {_features(job)}: {_INSTALL}"
        )


def _check_accelerator(job: JobSpec) -> None:
    """What each XLA accelerator's layout supports: neuron-xla does tensor parallel, ZeRO-1, sequence parallel and
    full activation checkpointing through neuronx-distributed; xla-cpu runs one plain worker."""
    acc, p = job.scaling.accelerator, job.parallel
    where = job.source
    if acc == "neuron-xla":
        if p.data_parallel != "ddp":  # fsdp, hsdp
            raise ConfigError(
                f"{where}: parallel.data_parallel={p.data_parallel} is not available on scaling.accelerator: "
                "neuron-xla (the XLA path, frozen): there tensor parallelism and ZeRO-1 are neuronx-distributed's. "
                "Use data_parallel: ddp with parallel.zero1: true to shard the optimizer state"
            )
        if p.activation_checkpointing == "selective":
            raise ConfigError(
                f"{where}: parallel.activation_checkpointing=selective is not available on scaling.accelerator: "
                "neuron-xla (neuronx-distributed checkpoints full layers): use full"
            )
        return
    refuse_nxd_only(job)
    if acc == "xla-cpu":
        asked = [
            name
            for name, on in (
                (f"parallel.data_parallel={p.data_parallel}", p.data_parallel != "ddp"),
                (f"parallel.tensor_parallel_size={p.tensor_parallel_size}", p.tensor_parallel_size > 1),
                (
                    f"parallel.activation_checkpointing={p.activation_checkpointing}",
                    p.activation_checkpointing != "none",
                ),
            )
            if on
        ]
        if asked:
            raise ConfigError(
                f"{where}: {', '.join(asked)}: scaling.accelerator xla-cpu runs one plain worker (the frozen XLA "
                "path on CPU); remove the parallel section"
            )
        return


def _check_model_dims(job: JobSpec) -> None:
    m, tp = job.model, job.parallel.tensor_parallel_size
    if tp == 1:
        return
    nxd = job.scaling.accelerator == "neuron-xla"
    dims = {
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
    }
    if nxd:  # NxD replicates kv heads TP / gcd(kv_heads, TP) times when TP does not divide them
        del dims["num_key_value_heads"]
    else:  # DTensor's plan splits q/k/v and o by heads, MLP by intermediate, embedding/head by vocab
        del dims["hidden_size"]
    problems = []
    for field, value in dims.items():
        if value % tp == 0:
            continue
        why = {
            "num_attention_heads": "each rank computes num_attention_heads / TP query heads",
            "num_key_value_heads": "each rank computes num_key_value_heads / TP kv heads (GQA groups stay whole)",
            "hidden_size": "the attention output and down projections are split along it",
            "intermediate_size": "the MLP gate/up/down projections are split along it",
            "vocab_size": "the embedding and the output head are split by vocabulary rows",
        }[field]
        if field == "vocab_size":
            why += f"; pad it to {-(-value // tp) * tp} (rows past the tokenizer's vocabulary are never used)"
        problems.append(f"model.{field} ({value}) % {tp} = {value % tp}: {why}")
    if problems:
        valid = [d for d in range(1, m.num_attention_heads + 1) if all(v % d == 0 for v in dims.values())]
        note = (
            f" (num_key_value_heads ({m.kv_heads}) needs no rule of its own: NxD replicates kv heads "
            "TP / gcd(kv_heads, TP) times when TP does not divide them.)"
            if nxd
            else ""
        )
        raise ConfigError(
            f"{job.source}: parallel.tensor_parallel_size ({tp}) must divide the model's sharded dimensions:\n  "
            + "\n  ".join(problems)
            + f"\n  tensor_parallel_size values this model allows: {', '.join(map(str, valid))}.{note}"
        )


def _features(job: JobSpec, *, tp: bool = True) -> str:
    p, m = job.parallel, job.model
    parts = [f"tensor parallel {p.tensor_parallel_size}"] if tp else []
    if p.zero1:
        master = " with FP32 master weights" if _mixed_precision_config(job)["use_master_weights"] else ""
        parts.append(f"ZeRO-1{master} (optimizer state sharded over DP)")
    if p.sequence_parallel:
        parts.append("sequence parallel")
    if p.activation_checkpointing != "none":
        parts.append("full activation checkpointing")
    k = kv_replication(m.kv_heads, p.tensor_parallel_size)
    if k > 1:
        parts.append(f"kv heads {m.kv_heads} replicated x{k} over TP {p.tensor_parallel_size}")
    return ", ".join(parts)


def _describe(job: JobSpec, sizes: list[int]) -> list[str]:
    tp, d = job.parallel.tensor_parallel_size, job.data
    dps = [data_parallel_size(job, n) for n in sizes]
    features = _features(job, tp=False)
    lines = [
        f"parallel: TP {tp} x DP {', '.join(map(str, dps))} = {', '.join(map(str, sizes))} workers "
        f"(neuronx-distributed){'; ' + features if features else ''}"
    ]
    if d.global_batch_size is not None and tp > 1:
        lines.append(
            "parallel batch: "
            + ", ".join(
                f"DP {dp}: {d.micro_batch_size} x {d.global_batch_size // (d.micro_batch_size * dp)} x {dp} = "
                f"{d.global_batch_size}"
                for dp in dps
            )
            + f" sequences/step (micro_batch x grad_accum x DP; each TP group of {tp} ranks shares a batch)"
        )
    if job.model.dtype == "bfloat16" and not _mixed_precision_config(job)["use_master_weights"]:
        if not job.neuron.stochastic_rounding:
            lines.append(
                "warning: bfloat16 parameters without FP32 master weights (parallel.zero1: false) and "
                "neuron.stochastic_rounding: false: round-to-nearest drops updates smaller than bf16's precision; "
                "enable stochastic_rounding or zero1"
            )
    return lines


def _installed(name: str) -> bool:
    """Importable without importing it (``neuronx_distributed`` imports ``torch_xla``, which starts the runtime)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------
# The NxD config (pure)


def nxd_config_kwargs(job: JobSpec) -> dict[str, Any]:
    """Keyword arguments of ``neuronx_distributed.trainer.neuronx_distributed_config`` for ``job``.

    Stochastic rounding is not among them: it is the runtime's ``NEURON_RT_STOCHASTIC_ROUNDING_EN``
    (``neuron.stochastic_rounding``, set in the worker environment).
    """
    p, clip = job.parallel, job.optim.grad_clip_norm
    optimizer_config: dict[str, Any] = {"zero_one_enabled": p.zero1, "grad_clipping": clip is not None}
    if clip is not None:
        # NxD reads it only when clipping; with ZeRO-1 it does not forward it at all (see build_parallel_optimizer).
        optimizer_config["max_grad_norm"] = clip
    return {
        "tensor_parallel_size": p.tensor_parallel_size,
        "pipeline_parallel_size": 1,
        "optimizer_config": optimizer_config,
        "sequence_parallel": p.sequence_parallel,
        "activation_checkpoint_config": "full" if p.activation_checkpointing != "none" else None,
        "mixed_precision_config": _mixed_precision_config(job),
        "lnc_size": _lnc_size(job),
    }


def _mixed_precision_config(job: JobSpec) -> dict[str, bool]:
    """FP32 master weights and FP32 gradient accumulation for bf16 parameters, when ZeRO-1 holds them.

    The master weights live in the ZeRO-1 optimizer's shards (NxD refuses them without ZeRO-1); for
    float32 parameters they would only duplicate the weights. They are saved in checkpoints: NxD loads
    the optimizer before the model, and ZeRO-1 rebuilds master shards from the parameters at that moment,
    so without saved masters a resumed run would continue from the pre-load weights.
    """
    master = job.parallel.zero1 and job.model.dtype == "bfloat16"
    return {"use_master_weights": master, "use_fp32_grad_acc": master, "use_master_weights_in_ckpt": master}


def _lnc_size(job: JobSpec) -> int:
    """NxD's ``lnc_size``: trn2's logical NeuronCore config (default 2); 1 elsewhere (trn1 has no LNC)."""
    instance = job.scaling.instance_type or ""
    if instance.startswith("trn1"):
        return 1
    default = 2 if instance.startswith("trn2") else 1
    return job.neuron.lnc or default


# ---------------------------------------------------------------------------------------------------
# Runtime on a trn worker (needs neuronx_distributed; call after the XLA process group is initialised)


def import_nxd(module: str = "neuronx_distributed.trainer") -> ModuleType:
    """A neuronx_distributed module, or BackendUnavailableError saying how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailableError(f"{module} cannot be imported ({e}); {_INSTALL}") from None


def build_nxd_config(job: JobSpec) -> dict[str, Any]:
    """The NxD config; also sets up NxD's TP/DP process groups when torch.distributed is initialised."""
    return import_nxd().neuronx_distributed_config(**nxd_config_kwargs(job))


def nxd_llama_config(job: JobSpec) -> Any:
    """The HF ``LlamaConfig`` plus the attributes NxD's example Llama reads (AWS's 8B recipe settings)."""
    import torch

    m, p = job.model, job.parallel
    config = hf_config(m)
    config.torch_dtype = torch.bfloat16 if m.dtype == "bfloat16" else torch.float32  # dtype of the parallel layers
    config.head_dim = m.hidden_size // m.num_attention_heads
    config.sequence_parallel_enabled = p.sequence_parallel
    # Full-layer checkpointing comes from the NxD config; the example's "selective" mode is not used.
    config.selective_checkpoint_enabled = False
    # One fused q/k/v projection that replicates kv heads when TP exceeds them (GQAQKVColumnParallelLinear).
    config.qkv_linear = True
    config.fuse_qkv = True
    config.kv_shared_group_size = kv_replication(m.kv_heads, p.tensor_parallel_size)
    # NKI flash attention: attention memory O(seq_len), which is what lets seq 8192 fit without recompute.
    config.use_flash_attention = True
    config.transpose_nki_inputs = True
    return config


def build_parallel_model(job: JobSpec, nxd_config: dict[str, Any], *, module: str = NXD_LLAMA_MODULE) -> Any:
    """NxD's tensor-parallel ``LlamaForCausalLM`` for ``job.model``, on the XLA device, wrapped as ``NxDModel``.

    Every rank draws the same full weight matrices from ``run.seed`` and keeps its slice. The forward
    returns vocab-parallel logits (``[batch, seq, vocab / TP]``): use :func:`vocab_parallel_loss`.
    """
    trainer = import_nxd()
    try:
        llama = importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailableError(
            f"NxD's tensor-parallel Llama ({module!r}) cannot be imported ({e}). It is not in the neuronx-distributed "
            "package: put examples/training/llama/modeling_llama_nxd.py from github.com/aws-neuron/neuronx-distributed "
            "(the tag matching the installed neuronx-distributed) on PYTHONPATH in the trn venv, with the transformers "
            "version its requirements.txt pins"
        ) from None
    config = nxd_llama_config(job)

    def model_fn() -> Any:
        import torch

        torch.manual_seed(job.run.seed)
        return llama.LlamaForCausalLM(config)

    return trainer.initialize_parallel_model(nxd_config, model_fn, True)  # include_buffers, as AWS's recipe


def build_parallel_optimizer(job: JobSpec, nxd_config: dict[str, Any], model: torch.nn.Module) -> Any:
    """``torch.optim.AdamW`` wrapped by NxD (``NxDOptimizer``; ZeRO-1 when ``parallel.zero1``).

    Its ``step()`` all-reduces gradients over DP (and SP), clips, and steps; read the pre-clip norm from
    ``optimizer.grad_norm`` afterwards. With ZeRO-1 the clip norm must be passed as ``max_norm``: NxD
    builds the ZeRO-1 optimizer without its ``max_grad_norm`` (torch-xla's default would be 1.0).
    """
    import torch

    o = job.optim
    defaults: dict[str, Any] = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if job.parallel.zero1 and o.grad_clip_norm is not None:
        defaults["max_norm"] = o.grad_clip_norm
    return import_nxd().initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, adamw_param_groups(model, o.weight_decay), **defaults
    )


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy from vocab-parallel logits (every TP rank gets the full loss)."""
    ce = import_nxd("neuronx_distributed.parallel_layers.loss_functions").parallel_cross_entropy
    return ce(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).mean()


def save_sharded_checkpoint(
    path: str,
    tag: str,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    user_content: dict[str, Any],
    keep_last: int | None,
) -> None:
    """Save this rank's model and optimizer shards under ``path/tag`` (a directory or ``s3://``); keep ``keep_last``.

    Every rank must call it, after the step's sync: NxD writes one file per (DP, TP) shard and
    rendezvouses. ``user_content`` (rank 0 writes it) gets :data:`LAYOUT_KEY` so a resume can tell the
    layout the shards were saved at.
    """
    trainer = import_nxd()
    content = {**user_content, LAYOUT_KEY: _layout()}
    trainer.save_checkpoint(
        path,
        tag,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        user_content=content,
        num_workers=8,
        use_xser=True,  # torch-xla serialization, as AWS's recipe (recorded in the checkpoint; load detects it)
        num_kept_ckpts=keep_last,
    )


def load_sharded_checkpoint(path: str, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any] | None:
    """Load the newest checkpoint under ``path`` into model, optimizer and scheduler; return its user content.

    None when there is none yet. The tensor-parallel size must equal the saved one. After an elastic
    resize the data-parallel size differs: ZeRO-1 optimizer shards are per DP rank and cannot be
    re-split, so then only the weights and the schedule load and the optimizer restarts its moments from
    the loaded weights (logged as a warning).
    """
    trainer = import_nxd()
    storage = import_nxd("neuronx_distributed.trainer.checkpoint_storage").create_checkpoint_storage(path)
    tags = storage.list_completed_checkpoint_tags()
    if not tags:
        return None
    tag = tags[-1]  # the newest, as NxD's load_checkpoint(tag=None) picks it
    saved = _saved_layout(storage, tag)
    now = _layout()
    if saved and saved["tensor_parallel_size"] != now["tensor_parallel_size"]:
        raise BackendError(
            f"{path}/{tag}: the checkpoint holds model shards for tensor_parallel_size "
            f"{saved['tensor_parallel_size']} but this run has {now['tensor_parallel_size']}; shards cannot be "
            f"re-split: set parallel.tensor_parallel_size: {saved['tensor_parallel_size']}, or use a new run name"
        )
    zero1 = bool(getattr(optimizer, "nxd_config", {}).get("optimizer_config", {}).get("zero_one_enabled"))
    if zero1 and saved and saved["data_parallel_size"] != now["data_parallel_size"]:
        log.warning(
            "checkpoint %s/%s was saved at data-parallel size %s, this run has %s: ZeRO-1 optimizer shards cannot "
            "be re-split, so the weights and schedule load and AdamW restarts its moments",
            path,
            tag,
            saved["data_parallel_size"],
            now["data_parallel_size"],
        )
        content = trainer.load_checkpoint(path, tag=tag, model=model, optimizer=None, scheduler=scheduler)
        optimizer.optimizer.init_zero()  # rebuild the FP32 master shards from the loaded weights
        return content
    return trainer.load_checkpoint(path, tag=tag, model=model, optimizer=optimizer, scheduler=scheduler)


def _layout() -> dict[str, int]:
    ps = import_nxd("neuronx_distributed.parallel_layers.parallel_state")
    return {
        "tensor_parallel_size": int(ps.get_tensor_model_parallel_size()),
        "data_parallel_size": int(ps.get_data_parallel_size()),
    }


def _saved_layout(storage: Any, tag: str) -> dict[str, int] | None:
    """The layout recorded in a checkpoint's user content (None for checkpoints raytrn did not write)."""
    name = f"{tag}/user_content.pt"
    if not storage.file_exists(name):
        return None
    content = storage.load_object(name, map_location="cpu")
    return content.get(LAYOUT_KEY) if isinstance(content, dict) else None
