"""Stand-ins for the unit tests of the Trainium Ray backends: Ray Train's worker placement and worker group."""

from __future__ import annotations

import ast
import inspect
from typing import Any

import raytrn.backends.neuron_ray as neuron_ray
from raytrn.backends.neuron_ray import WorkerInfo


def workers(nodes: list[int], *, world_size: int | None = None, visible_cores: bool = False) -> list[WorkerInfo]:
    """WorkerInfo as Ray Train assigns it: ranks node by node, ``nodes[i]`` workers on node i (``visible_cores``:
    Ray gave worker ``local`` NeuronCore ``local``)."""
    n = world_size or sum(nodes)
    out, rank = [], 0
    for node, count in enumerate(nodes):
        for local in range(count):
            out.append(
                WorkerInfo(
                    world_rank=rank,
                    local_rank=local,
                    node_rank=node,
                    world_size=n,
                    local_world_size=count,
                    node_id=f"node-{node}",
                    node_ip=f"10.0.0.{node + 1}",
                    hostname=f"ip-10-0-0-{node + 1}",
                    visible_cores=str(local) if visible_cores else None,
                )
            )
            rank += 1
    return out


class FakeWorkerGroup:
    """Stands in for Ray Train's worker group: runs the backend's worker functions as the workers would."""

    def __init__(self, infos: list[WorkerInfo]) -> None:
        self.infos = infos
        self.applied: dict[int, dict[str, str]] = {}
        self.calls: list[tuple[str, int | None]] = []

    def __len__(self) -> int:
        return len(self.infos)

    def _run(self, index: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((fn.__name__, index))
        if fn is neuron_ray.describe_worker:
            return self.infos[index]
        if fn is neuron_ray.free_ports:
            return self.infos[index].node_ip, [29500 + index, 41000 + index]
        if fn is neuron_ray.apply_env:
            self.applied[index] = args[0]
            return None
        return None

    def execute(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return [self._run(i, fn, *args, **kwargs) for i in range(len(self.infos))]

    execute_async = execute

    def execute_single(self, index: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self._run(index, fn, *args, **kwargs)

    execute_single_async = execute_single


def assert_never_kills(module: Any) -> None:
    tree = ast.parse(inspect.getsource(module))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docstrings]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    assert not [s for s in strings if isinstance(s, str) and "kill" in s]
    assert not {"kill", "killpg", "subprocess", "system", "Popen"} & (names | imported)
