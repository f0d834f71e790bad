"""How much CPU Ray's GCS spends while a placement group waits for capacity (docs/elasticity.md).

A lost bundle of a placement group is rescheduled when capacity returns, and Ray 2.60's GCS retries that with no
backoff meanwhile (ray-project/ray#65007 proposed one); a group asked for anew waits as ``PENDING`` instead. So under
``scaling.recovery: live`` each replica has a placement group of its own, asked for anew when its node is lost
(raytrn/compat/replica_slots.py). This probe shows both
without raytrn: a local Ray of a head (no CPU) and two one-CPU nodes, a one-CPU placement group on each; one node
removed (its group ``RESCHEDULING``); that group removed and a new one requested (``PENDING``); then a node added.
The GCS's CPU (user + system) is measured over ``--seconds`` in each state. Run it when the Ray pin moves::

    .venv/bin/python tools/pg_spin_probe.py

Measured on 2026-12-05 (Ray 2.60.0, 2 cores): 0.6% of a core placed, 100% rescheduling, 0.4-0.6% pending; the new
group placed 0.4-0.8 s after the node was added (two runs).
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each window's length (default 10)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_enable_metrics_collection", "0")  # the dashboard agent's replay aside (elasticity.md)
    import psutil
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        ray.init(address=cluster.address)
        gcs = next(p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server")  # this Ray's

        def window(label: str) -> None:
            before = sum(gcs.cpu_times()[:2])
            time.sleep(args.seconds)
            share = (sum(gcs.cpu_times()[:2]) - before) / args.seconds
            print(f"{label}: the GCS used {share:.1%} of a core over {args.seconds:g} s", flush=True)

        groups = [placement_group([{"CPU": 1}]) for _ in nodes]
        ray.get([g.ready() for g in groups], timeout=60)
        window("both groups placed")
        cluster.remove_node(nodes[1])
        time.sleep(1)  # (the GCS learns of the removal)
        lost = [g for g in groups if placement_group_table(g)["state"] != "CREATED"]
        window(f"a node removed, its group {placement_group_table(lost[0])['state'] if lost else '?'}")
        for g in lost:
            remove_placement_group(g)
        again = placement_group([{"CPU": 1}])
        time.sleep(1)
        window(f"that group removed, a new one {placement_group_table(again)['state']}")
        cluster.add_node(num_cpus=1)
        t = time.monotonic()
        ray.get(again.ready(), timeout=60)
        print(f"the new group placed {time.monotonic() - t:.1f} s after a node was added")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
