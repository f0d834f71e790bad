"""Checkpoint to S3: raytrn's save (``save_state`` into a local directory, then the copy Ray Train makes to
``checkpoint.storage`` through raytrn's S3 filesystem) vs a raw boto3 ``put_object`` of the same bytes,
and the way back (raytrn: copy down + ``load_state``; boto3: ``get_object``). A moto server on
127.0.0.1 stands in for S3, started and stopped by PID here. Alternated, MB/s.
"""

from __future__ import annotations

import argparse
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


def _copy(src: str, dst: str, src_fs: Any, dst_fs: Any) -> None:
    """The copy Ray Train makes when it persists (or restores) a checkpoint directory."""
    from raytrn.compat import pyarrow_fs_copy_files

    pyarrow_fs_copy_files(src, dst, source_filesystem=src_fs, destination_filesystem=dst_fs)


def child_main(args: argparse.Namespace) -> None:
    import boto3
    import pyarrow.fs as pafs

    from raytrn import storage
    from raytrn.checkpoint import STATE_FILE, Progress, load_state, save_state

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="raytrn-bench-ckpt-") as tmp, moto_server(tmp) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint  # raytrn.storage honours it (pyarrow itself does not)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        local = pafs.LocalFileSystem()
        for name in args.models.split(","):
            model, opt, sched = _training_state(MODELS[name])
            rows: dict[str, list[float]] = {k: [] for k in ("save_s", "upload_s", "boto3_put_s", "restore_s",
                                                            "boto3_get_s")}  # fmt: skip
            size = 0
            for i in range(args.repeats):
                # raytrn: serialize into a local directory, then Ray's copy to s3:// through raytrn's filesystem
                d = os.path.join(tmp, f"{name}-{i}")
                t0 = time.perf_counter()
                save_state(d, model=model, optimizer=opt, scheduler=sched, progress=Progress(step=i))
                t1 = time.perf_counter()
                fs, path = storage.filesystem(f"s3://bench/raytrn/{name}/checkpoint_{i:08d}")
                _copy(d, path, local, fs)
                t2 = time.perf_counter()
                size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
                # boto3: the same bytes, one put_object
                with open(os.path.join(d, STATE_FILE), "rb") as f:
                    body = f.read()
                t3 = time.perf_counter()
                s3.put_object(Bucket="bench", Key=f"raw/{name}/{i}/{STATE_FILE}", Body=body)
                t4 = time.perf_counter()
                # and back: raytrn copies the directory down and loads it; boto3 reads the bytes
                back = os.path.join(tmp, f"{name}-{i}-restored")
                t5 = time.perf_counter()
                os.makedirs(back)
                _copy(path, back, fs, local)
                load_state(back, model=model, optimizer=opt, scheduler=sched)
                t6 = time.perf_counter()
                s3.get_object(Bucket="bench", Key=f"raw/{name}/{i}/{STATE_FILE}")["Body"].read()
                t7 = time.perf_counter()
                for k, v in zip(rows, (t1 - t0, t2 - t1, t4 - t3, t6 - t5, t7 - t6), strict=True):
                    rows[k].append(v)
                shutil.rmtree(d)
                shutil.rmtree(back)
            results[name] = {"bytes": size, **rows}
    emit({"models": results})


def run(*, models: tuple[str, ...], repeats: int) -> dict[str, Any]:
    try:
        import boto3  # noqa: F401

        from raytrn.checkpoint import save_state  # noqa: F401
    except ImportError as e:
        raise Skip(f"checkpoint benchmark needs boto3 and raytrn.checkpoint ({e})") from None
    r = run_child("checkpoint", ["--models", ",".join(models), "--repeats", str(repeats)], threads=1, timeout_s=400)
    out: dict[str, Any] = {}
    for name, m in r["models"].items():
        mb = m["bytes"] / 1e6

        def rate(key: str, mb: float = mb, m: dict = m) -> float | None:
            t = mean(m[key])
            return mb / t if t else None

        save_total = [a + b for a, b in zip(m["save_s"], m["upload_s"], strict=True)]
        out[name] = {
            "mb": mb,
            "raytrn_save_mb_per_s": mb / mean(save_total) if save_total else None,  # serialize + upload
            "raytrn_upload_mb_per_s": rate("upload_s"),
            "boto3_put_mb_per_s": rate("boto3_put_s"),
            "raytrn_restore_mb_per_s": rate("restore_s"),  # download + torch.load into the model
            "boto3_get_mb_per_s": rate("boto3_get_s"),
            "upload_over_boto3": mean([b / a for a, b in zip(m["upload_s"], m["boto3_put_s"], strict=True)]),
            "save_over_boto3": mean([b / a for a, b in zip(save_total, m["boto3_put_s"], strict=True)]),
            "raw_seconds": m,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint")
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--repeats", type=int, default=3)
    child_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
