"""Peak host memory of ``model.init_from`` into a sharded model (not part of ``make bench``: ~12 GB, minutes).

A random llama3.2-1b Hugging Face checkpoint (bf16, 2.5 GB, written here) is loaded into 2 gloo processes holding
the model under FSDP (fp32). Each rank reads only the slices its shards hold (DCP's Hugging Face reader); its
resident memory is sampled during the load: the rise over the start is what loading costs that rank, against the
checkpoint, the rank's shard of the model and the largest tensor.

    python -m bench.init_memory
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from typing import Any

from bench.export_memory import _rss

_OVERRIDES = [
    "scaling.accelerator=cpu", "parallel={data_parallel: fsdp}", "scaling.instance_type=null",
    "scaling.workers_per_node=null", "scaling.min_workers=2", "scaling.max_workers=2", "data.global_batch_size=null",
    "data.grad_accum=1",
]  # fmt: skip


def _job(**model: Any) -> Any:
    from raytrn.config import load_job

    sets = [f"model.{k}={v}" for k, v in model.items()]
    return load_job("jobs/llama3.2-1b-trn1.yaml", [*_OVERRIDES, *sets], resolve=False)


def _write_checkpoint(directory: str) -> int:
    from raytrn.models import build_model
    from raytrn.models.export import save_hf

    job = _job(dtype="bfloat16")
    save_hf(job.model, build_model(job.model, seed=1).state_dict(), directory)
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


def _worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from raytrn.models import build_model
    from raytrn.models.hf import load_weights
    from raytrn.train.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        job = _job(dtype="float32")
        par = parallelize(build_model(job.model, seed=0), job, device=torch.device("cpu"), world_size=world)
        gc.collect()
        shard = sum(p.to_local().numel() * p.element_size() for p in par.model.parameters())  # type: ignore[attr-defined]
        peak, stop = [_rss()], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak.append(_rss())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        start = _rss()
        sampler.start()
        t0 = time.perf_counter()
        load_weights(par.model, ckpt, tied=job.model.tie_word_embeddings, source="bench")
        seconds = time.perf_counter() - t0
        stop.set()
        sampler.join()
        largest = max(v.numel() * 4 for v in build_model(job.model, seed=0, device="meta").state_dict().values())
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"rss_start": start, "rss_peak": max(peak), "load_s": seconds, "shard_bytes": shard,
                       "largest_tensor_bytes": largest}, f)  # fmt: skip
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "hf")
        os.mkdir(ckpt)
        size = _write_checkpoint(ckpt)
        out = os.path.join(d, "result.json")
        mp.start_processes(_worker, args=(2, port, ckpt, out), nprocs=2, start_method="spawn")
        results = [json.load(open(f"{out}.{r}")) for r in range(2)]  # noqa: SIM115
    for rank, r in enumerate(results):
        rise = r["rss_peak"] - r["rss_start"]
        print(
            f"rank {rank}: init_from of a {size / 1e9:.2f} GB bf16 checkpoint in {r['load_s']:.0f} s: RSS rose "
            f"{rise / 1e9:.2f} GB (its fp32 shard {r['shard_bytes'] / 1e9:.2f} GB; largest fp32 tensor "
            f"{r['largest_tensor_bytes'] / 1e9:.2f} GB; the whole model in fp32 {2 * size / 1e9:.2f} GB)"
        )


if __name__ == "__main__":
    main()
