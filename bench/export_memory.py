"""Peak host memory of the Hugging Face export from a sharded model (not part of ``make bench``: ~12 GB, minutes).

2 gloo processes hold the llama3.2-1b config under FSDP (fp32: 4.9 GB of weights, 2.5 GB per rank); the
export gathers each tensor in turn and rank 0 streams it into ``model.safetensors``. Rank 0's resident memory
is sampled during the export: its rise over the start is what the export costs, against the size of the
whole model (what gathering a full state dict on rank 0 would cost) and of the largest tensor.

    python -m bench.export_memory
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from typing import Any


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from raytrn.config import load_job
    from raytrn.models import build_model
    from raytrn.models.export import save_hf
    from raytrn.train.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        job = load_job(
            "jobs/llama3.2-1b-trn1.yaml",
            ["scaling.accelerator=cpu", "parallel={data_parallel: fsdp}", "scaling.instance_type=null",
             "scaling.workers_per_node=null", "scaling.min_workers=2", "scaling.max_workers=2",
             "data.global_batch_size=null", "data.grad_accum=1", "model.dtype=float32"],
            resolve=False,
        )  # fmt: skip
        par = parallelize(build_model(job.model, seed=0), job, device=torch.device("cpu"), world_size=world)
        import gc

        gc.collect()
        specs = {n: (v.dtype, tuple(v.shape)) for n, v in par.model.state_dict().items()}
        peak, stop = [_rss()], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak.append(_rss())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        start = _rss()
        sampler.start()
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="raytrn-export-") as d:
            save_hf(job.model, par.full_state_items(), d if rank == 0 else None, specs=specs)
            size = os.path.getsize(os.path.join(d, "model.safetensors")) if rank == 0 else 0
        stop.set()
        sampler.join()
        if rank == 0:
            largest = max(v.numel() * v.element_size() for v in par.model.state_dict().values())
            with open(out, "w") as f:
                json.dump(
                    {"rss_start": start, "rss_peak": max(peak), "export_s": time.perf_counter() - t0,
                     "file_bytes": size, "largest_tensor_bytes": largest},
                    f,
                )  # fmt: skip
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.start_processes(_worker, args=(2, port, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            r: dict[str, Any] = json.load(f)
    rise = r["rss_peak"] - r["rss_start"]
    print(
        f"export of {r['file_bytes'] / 1e9:.2f} GB in {r['export_s']:.0f} s: rank 0's RSS rose {rise / 1e9:.2f} GB "
        f"(largest tensor {r['largest_tensor_bytes'] / 1e9:.2f} GB; the whole model {r['file_bytes'] / 1e9:.2f} GB)"
    )


if __name__ == "__main__":
    main()
