"""How much CPU Ray's GCS spends while a placement group's lost bundle has no place (docs/elasticity.md).

Under ``scaling.recovery: live`` a lost replica's slot is a bundle of the worker group's placement group; Ray
reschedules it when capacity returns, and Ray 2.60's GCS retries that rescheduling with no backoff meanwhile
(ray-project/ray#65007 proposed one). This probe shows it without raytrn: a local Ray of a head (no CPU) and two
one-CPU nodes, a placement group of one CPU on each, one node removed; the GCS's CPU (user + system, from
``/proc``) over ``--seconds`` before and after. Run it when the Ray pin moves::

    .venv/bin/python tools/pg_spin_probe.py

Measured on 2026-12-05 (Ray 2.60.0, 2 cores): 0.8% of a core before, 100% after, for as long as the bundle waits.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import time


def gcs_cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each window's length (default 10)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_enable_metrics_collection", "0")  # the dashboard agent's replay aside (elasticity.md)
    import psutil
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        ray.init(address=cluster.address)
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD")
        ray.get(pg.ready(), timeout=60)
        gcs = next(p.pid for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server")  # this Ray's

        def window(label: str) -> None:
            before = gcs_cpu_s(gcs)
            time.sleep(args.seconds)
            share = (gcs_cpu_s(gcs) - before) / args.seconds
            print(f"{label}: the GCS used {share:.1%} of a core over {args.seconds:g} s", flush=True)

        window("placement group placed")
        cluster.remove_node(nodes[1])
        window("one bundle's node removed, no capacity for it")
        state = ray.util.placement_group_table(pg)["state"]
        print(f"placement group state: {state}")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
