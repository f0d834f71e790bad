"""CPU workers, gloo collectives."""

from raytrn.backends.base import Backend


class CpuBackend(Backend):
    name = "cpu"
    default_resources = {"CPU": 1}
    process_group_backend = "gloo"
    tune_malloc = True  # raytrn.backends.host_malloc: no page faults every step
