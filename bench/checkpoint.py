"""Checkpoint to S3: raytrn's save (a DCP checkpoint written straight to ``s3://`` through pyarrow's S3
filesystem, :mod:`raytrn.checkpoint.dcp`) vs a raw boto3 multipart upload (``upload_fileobj``, boto3's managed
transfer with its defaults) of the same files, and the way back (raytrn: ``dcp.load`` into the model and
optimizer; boto3: ``download_fileobj``); ``checkpoint.async``: how
long the step is blocked (staging to host memory) against the whole save; and retention after a commit on S3 (a
checkpoint of 256 ranks' shard files deleted), which runs beside the steps, not in the commit. A moto server on 127.0.0.1 stands
in for S3, started and stopped by PID here. Alternated, MB/s.

Where AWS's ``s3torchconnector`` is installed (not a raytrn dependency: ``pip install s3torchconnector``), its DCP
writer and reader (``S3StorageWriter``/``S3StorageReader``, on the same endpoint, path-style) are timed on the same
state beside raytrn's: the measurement behind raytrn's choice of its own S3 storage (docs/performance.md).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
from typing import Any

from bench.common import Skip, emit, mean, moto_server, run_child

#: (name, model fields): the tiny job's model and a wider one whose state is ~100 MB.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"preset": "tiny", "vocab_size": 4096},
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 16000,
        "max_position_embeddings": 512,
    },
}


def _training_state(fields: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Model, AdamW with its moments filled (one step) and schedule: the full state a checkpoint holds."""
    import torch

    from raytrn.config import ModelConfig
    from raytrn.models import build_model

    model = build_model(ModelConfig(family="llama", **fields), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(input_ids=torch.randint(0, 100, (1, 8))).logits.sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt, sched


#: Files a checkpoint of many ranks has (a shard file a rank, and DCP's ``.metadata``): what retention deletes.
RETENTION_FILES = 256


def _retention(s3: Any, rounds: int, files: int) -> dict[str, list[float]]:
    """Rank 0's saves of the tiny job with ``checkpoint.keep_last`` 1 on S3, each followed by the retention round
    it starts (the listing, the manifests' reads, the previous checkpoint's files deleted: padded to ``files``,
    as a checkpoint of that many ranks has them): the save's time and the round's, waited for at once here. The
    round runs beside the steps after the commit (the commit waited for it before 2026-12-02)."""
    from raytrn.backends.cpu import CpuBackend
    from raytrn.checkpoint.progress import Progress
    from raytrn.checkpoint.rundir import RunDir
    from raytrn.config import load_job
    from raytrn.train.build import build_training
    from raytrn.train.schedule import Schedule

    job = load_job(
        "jobs/tiny.yaml",
        ["data.manifest=unused", "model.vocab_size=512", "scaling.min_workers=1", "scaling.max_workers=1",
         "checkpoint.storage=s3://bench/retention", "checkpoint.keep_last=1", "tracking.run_name=retention"],
        resolve=False,
    )  # fmt: skip
    t = build_training(job, CpuBackend(), world_size=1)
    run, schedule = RunDir.of(job), Schedule.from_job(job)
    out: dict[str, list[float]] = {"save_s": [], "round_s": []}
    for step in range(1, rounds + 2):
        t0 = time.perf_counter()
        t.checkpoints.save(t, Progress(step=step), schedule, {}, final=False)
        t1 = time.perf_counter()
        t.checkpoints.settle()
        t2 = time.perf_counter()
        if step > 1:  # (the first round has nothing to delete)
            out["save_s"].append(t1 - t0)
            out["round_s"].append(t2 - t1)
        prefix = run.dcp_step(step).removeprefix("s3://bench/")
        for rank in range(1, files - 1):  # (rank 0's file and .metadata are DCP's own)
            s3.put_object(Bucket="bench", Key=f"{prefix}/__{rank}_0.distcp", Body=b"shard")
    if sorted(t.checkpoints.deleted) != list(range(1, rounds + 1)):
        raise AssertionError(f"retention deleted {sorted(t.checkpoints.deleted)}")
    return out


#: The next step's micro-batch beside an async save's copy: the tiny job's (8 rows of 128 tokens).
STEP_ROWS, STEP_TOKENS = 8, 128


def _async_beside_a_step(model: Any, opt: Any, sched: Any, name: str, i: int, staging: Any) -> tuple[float, float]:
    """``checkpoint.async`` as the loop runs it: the save, then the next step's forward and backward beside its copy
    to host memory, then its optimizer step, which waits for what is left of the copy. The seconds the step was
    blocked (the save's call and that wait) and the save's own (its call to its write done)."""
    import torch

    from raytrn.checkpoint import dcp
    from raytrn.checkpoint.rundir import RunDir

    state = dcp.training_state(model, opt, sched)
    tokens = torch.randint(0, 100, (STEP_ROWS, STEP_TOKENS))
    waited, written = staging.waited_s, []
    t0 = time.perf_counter()
    future, _, copy = dcp.async_save(
        state, RunDir("s3://bench/raytrn-async", name).dcp_step(i), process_group=None, staging=staging
    )
    staging.started(copy, opt)
    future.add_done_callback(lambda _: written.append(time.perf_counter()))
    t1 = time.perf_counter()
    model(input_ids=tokens).logits.float().mean().backward()
    opt.step()  # the pre-hook: waits for the copy
    opt.zero_grad()
    future.result()
    return t1 - t0 + staging.waited_s - waited, written[0] - t0


def _s3_connector() -> Any:
    """``(uri, endpoint, write) -> S3StorageWriter | S3StorageReader`` of AWS's s3torchconnector on ``endpoint``
    (path-style, as moto needs), or None where it is not installed."""
    try:
        from s3torchconnector import S3ClientConfig, S3ReaderConstructor
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter
    except ImportError:
        return None

    def make(uri: str, endpoint: str, *, write: bool) -> Any:
        # Its storage classes take no endpoint: their file system is rebuilt on a client that has one.
        client = S3Client("us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
        if write:
            writer = S3StorageWriter("us-east-1", uri)
            writer.fs = S3FileSystem("us-east-1", s3_client=client)
            writer.path = writer.fs.init_path(uri)
            return writer
        reader = S3StorageReader("us-east-1", uri, reader_constructor=S3ReaderConstructor.dcp_optimized())
        reader.fs = S3FileSystem("us-east-1", s3_client=client, reader_constructor=reader._reader_constructor)
        reader.path = reader.fs.init_path(uri)
        return reader

    return make


def child_main(args: argparse.Namespace) -> None:
    import boto3
    import torch.distributed.checkpoint as torch_dcp

    from raytrn.checkpoint import dcp
    from raytrn.checkpoint.rundir import RunDir
    from raytrn.checkpoint.staging import Staging

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    results: dict[str, Any] = {}
    keys = ("save_s", "boto3_put_s", "restore_s", "boto3_get_s", "async_blocked_s", "async_total_s",
            "copied_blocked_s", "copied_total_s")  # fmt: skip
    connector = _s3_connector()
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-ckpt-") as tmp, moto_server(tmp) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint  # raytrn.storage honours it (pyarrow itself does not)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        for name in args.models.split(","):
            model, opt, sched = _training_state(MODELS[name])
            staging = Staging()  # a training's: its host buffers kept from one save to the next
            rows: dict[str, list[float]] = {k: [] for k in keys}
            size = 0
            for i in range(args.repeats):
                state = dcp.training_state(model, opt, sched)
                # raytrn: DCP straight to S3 (one file per rank; one rank here)
                location = RunDir("s3://bench/raytrn", name).dcp_step(i)
                t0 = time.perf_counter()
                dcp.save(state, location)
                t1 = time.perf_counter()
                # boto3: the same files (written locally first, untimed), one managed (multipart) upload each
                local = os.path.join(tmp, f"{name}-{i}")
                dcp.save(state, local)
                files = {}
                for f in sorted(os.listdir(local)):
                    with open(os.path.join(local, f), "rb") as fh:
                        files[f] = fh.read()
                size = sum(len(b) for b in files.values())
                t2 = time.perf_counter()
                for f, body in files.items():
                    s3.upload_fileobj(io.BytesIO(body), "bench", f"raw/{name}/{i}/{f}")
                t3 = time.perf_counter()
                dcp.load(location, model, opt, sched, source="bench")
                t4 = time.perf_counter()
                for f in files:
                    s3.download_fileobj("bench", f"raw/{name}/{i}/{f}", io.BytesIO())
                t5 = time.perf_counter()
                # checkpoint.async before 2026-12-02: the save returned once the state was copied to host memory
                state = dcp.training_state(model, opt, sched)
                t6 = time.perf_counter()
                future, _, _ = dcp.async_save(
                    state, RunDir("s3://bench/raytrn-copied", name).dcp_step(i), process_group=None
                )
                t7 = time.perf_counter()
                future.result()
                t8 = time.perf_counter()
                # checkpoint.async: the copy beside the next step's forward and backward; its optimizer step waits
                # for what is left of it (raytrn.checkpoint.staging)
                blocked, total = _async_beside_a_step(model, opt, sched, name, i, staging)
                times = (t1 - t0, t3 - t2, t4 - t3, t5 - t4, blocked, total, t7 - t6, t8 - t6)
                for k, v in zip(keys, times, strict=True):
                    rows[k].append(v)
                if connector is not None:  # AWS's DCP writer and reader on the same state and endpoint
                    uri = f"s3://bench/s3torchconnector/{name}/{i}"
                    state = dcp.training_state(model, opt, sched)
                    t9 = time.perf_counter()
                    torch_dcp.save(state, storage_writer=connector(uri, endpoint, write=True))
                    t10 = time.perf_counter()
                    state = dcp.training_state(model, opt, sched)
                    t11 = time.perf_counter()
                    torch_dcp.load(state, storage_reader=connector(uri, endpoint, write=False))
                    t12 = time.perf_counter()
                    rows.setdefault("connector_save_s", []).append(t10 - t9)
                    rows.setdefault("connector_restore_s", []).append(t12 - t11)
                shutil.rmtree(local)
            results[name] = {"bytes": size, **rows}
        retention = _retention(s3, args.repeats, RETENTION_FILES)
    emit({"models": results, "retention": {"files": RETENTION_FILES, **retention}})


def run(*, models: tuple[str, ...], repeats: int) -> dict[str, Any]:
    try:
        import boto3  # noqa: F401

        from raytrn.checkpoint import dcp  # noqa: F401
    except ImportError as e:
        raise Skip(f"checkpoint benchmark needs boto3 and raytrn.checkpoint.dcp ({e})") from None
    r = run_child("checkpoint", ["--models", ",".join(models), "--repeats", str(repeats)], threads=1, timeout_s=400)
    out: dict[str, Any] = {}
    for name, m in r["models"].items():
        mb = m["bytes"] / 1e6

        def rate(key: str, mb: float = mb, m: dict = m) -> float | None:
            t = mean(m[key])
            return mb / t if t else None

        out[name] = {
            "mb": mb,
            "raytrn_save_mb_per_s": rate("save_s"),  # serialize + upload
            "boto3_put_mb_per_s": rate("boto3_put_s"),
            "raytrn_restore_mb_per_s": rate("restore_s"),  # download + load into model and optimizer
            "boto3_get_mb_per_s": rate("boto3_get_s"),
            "save_over_boto3": mean([b / a for a, b in zip(m["save_s"], m["boto3_put_s"], strict=True)]),
            "restore_over_boto3": mean([b / a for a, b in zip(m["restore_s"], m["boto3_get_s"], strict=True)]),
            "async_blocked_fraction": mean(
                [a / b for a, b in zip(m["async_blocked_s"], m["async_total_s"], strict=True)]
            ),
            # the same before 2026-12-02 (the save returned once the state was copied), in the same run
            "copied_blocked_fraction": mean(
                [a / b for a, b in zip(m["copied_blocked_s"], m["copied_total_s"], strict=True)]
            ),
            "raw_seconds": m,
        }
        if "connector_save_s" in m:  # s3torchconnector's time over raytrn's, each in the same repeat (> 1: slower)
            out[name]["s3torchconnector_save_over_raytrn"] = mean(
                [c / r for c, r in zip(m["connector_save_s"], m["save_s"], strict=True)]
            )
            out[name]["s3torchconnector_restore_over_raytrn"] = mean(
                [c / r for c, r in zip(m["connector_restore_s"], m["restore_s"], strict=True)]
            )
    if "retention" in r:  # rank 0's round beside the steps: what every rank's commit waited for before
        ret = r["retention"]
        out["retention"] = {"files": ret["files"], "round_s": mean(ret["round_s"]), "save_s": mean(ret["save_s"]),
                            "raw_seconds": ret}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint")
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--repeats", type=int, default=3)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
