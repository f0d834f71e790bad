"""A Ray that ``ray.init`` starts in this process with its dashboard agent on a port the OS picks.

Ray 2.60 gives a head node's dashboard agent a fixed HTTP port (52365, ``RayParams``' default; its worker nodes get
one the OS picks). When another Ray on the machine holds it (a running cluster, a notebook's Ray, the tests'
session Ray), the new agent retries the bind 6 times with backoff, ~3.4 s in which nothing else starts, then gives
up and runs without its HTTP server (measured: ``raytrn train`` beside another local Ray, the first step 3.3 s
later, the machine idle meanwhile; docs/performance.md). ``ray.init`` does not take the port; ``ray start`` and
``ray.cluster_utils.Cluster`` do (``--dashboard-agent-listen-port``, ``dashboard_agent_listen_port``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

PRIVATE_NAMES = {"Ray node parameters (the dashboard agent's port)": "ray._private.parameter:RayParams"}

#: The parameter of ``RayParams`` that names the agent's HTTP port (0: the OS picks; Ray reads the bound one back).
AGENT_PORT = "dashboard_agent_listen_port"


@contextlib.contextmanager
def agent_on_any_port() -> Iterator[None]:
    """While open, a Ray started here (``ray.init(address="local")``) puts its dashboard agent's HTTP server on a
    port the OS picks, as Ray's own worker nodes do, instead of 52365; one that names a port keeps it.

    Wraps ``ray._private.parameter.RayParams.__init__`` (what ``ray.init`` builds its node from); public
    alternative: none for ``ray.init`` (``ray start --dashboard-agent-listen-port=0`` starts a cluster of its own).
    """
    from ray._private import parameter

    init = parameter.RayParams.__init__

    @functools.wraps(init)
    def any_port(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault(AGENT_PORT, 0)
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = any_port  # type: ignore[method-assign]
    try:
        yield
    finally:
        parameter.RayParams.__init__ = init  # type: ignore[method-assign]
