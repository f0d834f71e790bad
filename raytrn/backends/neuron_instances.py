"""The Trainium instance table: each instance type's NeuronCores, EFA devices, HBM and logical-core default, with
where each figure comes from (trn3's are UNCONFIRMED), and which stack each family trains with. Pure: no torch, no
Ray; :mod:`raytrn.backends.neuron_env` builds the layout checks and the worker environment on it."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from raytrn.errors import BackendError


@dataclass(frozen=True)
class InstanceSpec:
    """A Trainium instance type as the layout sees it, and where its figures come from."""

    name: str
    #: Physical NeuronCores (trn1: NeuronCore-v2, trn2: NeuronCore-v3, trn3: NeuronCore-v4).
    physical_cores: int
    #: EFA devices; 0 means no EFA (single-node only).
    efa_devices: int
    #: Neuron devices (chips) as the Neuron device plugin counts ``aws.amazon.com/neuron``.
    neuron_devices: int
    #: The default logical NeuronCore config (trn2, trn3: 2 physical cores per logical core); None: no LNC.
    default_lnc: int | None = None
    #: Device memory (HBM) of one chip, GiB: a worker's share is this x chips / cores.
    hbm_gib_per_chip: int = 0
    #: False until AWS's instance-type pages list the type: whatever prints its layout says UNCONFIRMED.
    confirmed: bool = True
    #: Where each figure of an unconfirmed type comes from (the confirmed ones': the comment above INSTANCES).
    source: str = ""

    def worker_memory_bytes(self, lnc: int | None = None) -> int:
        """Device memory one worker (one logical NeuronCore) has: the node's HBM over its cores."""
        return self.hbm_gib_per_chip * (1 << 30) * self.neuron_devices // self.cores(lnc)

    @property
    def family(self) -> str:
        """``trn1``, ``trn2`` (trn2u included) or ``trn3`` (trn3p, trn3e included)."""
        match = re.match(r"trn\d+", self.name)
        assert match, self.name
        return match.group(0)

    @property
    def accelerator(self) -> str:
        """The ``scaling.accelerator`` this family trains with: ``neuron`` (TorchNeuron) or ``neuron-xla`` (trn1)."""
        return "neuron-xla" if self.family == "trn1" else "neuron"

    def cores(self, lnc: int | None = None) -> int:
        """NeuronCores the runtime exposes, i.e. workers a node can run (one per core)."""
        if self.default_lnc is None:
            return self.physical_cores
        return self.physical_cores // (lnc or self.default_lnc)

    def unconfirmed_note(self) -> str | None:
        """One line saying the layout is UNCONFIRMED and where it comes from; None for a confirmed type."""
        if self.confirmed:
            return None
        lnc = f", LNC {self.default_lnc} by default" if self.default_lnc else ""
        return (
            f"UNCONFIRMED: {self.name} is not on AWS's instance-type pages yet; raytrn's layout for it "
            f"({self.neuron_devices} chips, {self.physical_cores} physical NeuronCores{lnc}, {self.hbm_gib_per_chip} "
            f"GiB HBM a chip, {self.efa_devices} EFA devices) is from: {self.source}"
        )


#: Trainium3 (NEURON-NOTES, Instances). The names are in the Neuron driver's platform table (aws-neuron-driver,
#: v4/neuron_dhal_v4.c: trn3.48xlarge, trn3p.48xlarge as an UltraServer member, trn3e.24xlarge); AWS's instance-type
#: pages do not list them yet. A chip: 8 NeuronCore-v4, 144 GiB HBM, 671 dense BF16 TFLOPS (Neuron architecture
#: docs, trainium3, 2025-12). The default LNC 2 is UNCONFIRMED (NEURON-NOTES; trn2's default).
_TRN3_DRIVER = "the Neuron driver's platform table (aws-neuron-driver v4/neuron_dhal_v4.c)"
_TRN3_CHIP = "8 NeuronCore-v4 and 144 GiB HBM a chip: Neuron architecture docs (trainium3, 2025-12)"

# AWS Neuron docs: trn1-arch.rst, trn2-arch.rst, logical-neuroncore-config.rst,
# setup-trn1-multi-node-execution.rst ("trn1.32xlarge has 8 EFA devices, trn1n.32xlarge has 16").
INSTANCES: dict[str, InstanceSpec] = {
    spec.name: spec
    for spec in (
        # trn1: 2 NeuronCore-v2 per Trainium chip; trn2: 8 NeuronCore-v3 per Trainium2 chip.
        # HBM: 32 GiB a Trainium chip, 96 GiB a Trainium2 chip (trn1-arch, trn2-arch).
        InstanceSpec("trn1.2xlarge", physical_cores=2, efa_devices=0, neuron_devices=1, hbm_gib_per_chip=32),
        InstanceSpec("trn1.32xlarge", physical_cores=32, efa_devices=8, neuron_devices=16, hbm_gib_per_chip=32),
        InstanceSpec("trn1n.32xlarge", physical_cores=32, efa_devices=16, neuron_devices=16, hbm_gib_per_chip=32),
        InstanceSpec(
            "trn2.48xlarge", physical_cores=128, efa_devices=16, neuron_devices=16, default_lnc=2, hbm_gib_per_chip=96
        ),
        # The UltraServer member: the same server, four of them joined by NeuronLink (64 chips).
        InstanceSpec(
            "trn2u.48xlarge", physical_cores=128, efa_devices=16, neuron_devices=16, default_lnc=2, hbm_gib_per_chip=96
        ),
        # Trainium3, all UNCONFIRMED. trn3.48xlarge: 16 chips (the driver's 16-device routing table and 128-core map
        # for this platform; a Trn3 Gen1 UltraServer is 4 servers x 16 chips, trn3-arch). EFA: a Gen1 server has
        # 3.2 Tbps (12,800 Gbps / 4 servers, trn3-arch) but no published device count; 8 is the fewest devices that
        # carry it at 400 Gbps a device, assumed (trn2 carries the same 3.2 Tbps on 16). Fewer EFA interfaces than
        # the instance has only cost bandwidth, one more than it has fails the launch: hence the lower count.
        InstanceSpec(
            "trn3.48xlarge",
            physical_cores=128,
            efa_devices=8,
            neuron_devices=16,
            default_lnc=2,
            hbm_gib_per_chip=144,
            confirmed=False,
            source=f"name and 16 chips: {_TRN3_DRIVER}; {_TRN3_CHIP}; 8 EFA devices and LNC 2: assumed",
        ),
        # The UltraServer member (the driver's ULTRASERVER platform type): taken as the same server as trn3.48xlarge,
        # as trn2u is trn2's. A Gen2 UltraServer server has 4 chips (trn3-arch): if trn3p is one, this is wrong.
        InstanceSpec(
            "trn3p.48xlarge",
            physical_cores=128,
            efa_devices=8,
            neuron_devices=16,
            default_lnc=2,
            hbm_gib_per_chip=144,
            confirmed=False,
            source=f"name: {_TRN3_DRIVER}, an UltraServer member; {_TRN3_CHIP}; 16 chips (as trn3.48xlarge), "
            "8 EFA devices and LNC 2: assumed",
        ),
        # Half a trn3.48xlarge (24xlarge against 48xlarge), EFA halved too. The driver's routing table for this
        # platform type has 4 entries, which may mean 4 chips: another reason to treat it as unconfirmed.
        InstanceSpec(
            "trn3e.24xlarge",
            physical_cores=64,
            efa_devices=4,
            neuron_devices=8,
            default_lnc=2,
            hbm_gib_per_chip=144,
            confirmed=False,
            source=f"name: {_TRN3_DRIVER}; {_TRN3_CHIP}; 8 chips (half a trn3.48xlarge), 4 EFA devices and "
            "LNC 2: assumed",
        ),
    )
}

#: ``scaling.accelerator`` values that run on Trainium.
NEURON_ACCELERATORS = ("neuron", "neuron-xla")


def instance_spec(instance_type: str) -> InstanceSpec:
    """The spec of a Trainium instance type; BackendError naming the known ones (and a near miss)."""
    spec = INSTANCES.get(instance_type)
    if spec is None:
        near = difflib.get_close_matches(str(instance_type), list(INSTANCES), n=1, cutoff=0.6)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise BackendError(
            f"scaling.instance_type={instance_type!r}: unknown Trainium instance type.{hint} "
            f"Known: {', '.join(INSTANCES)}"
        )
    return spec


def check_stack(accelerator: str, instance_type: str) -> InstanceSpec:
    """The instance's spec; BackendError when ``accelerator`` is not the stack its family trains with."""
    if accelerator == "neuron-xla" and str(instance_type).startswith("trn3"):  # any trn3 name, known or not
        raise BackendError(
            f"scaling.accelerator='neuron-xla' is the PyTorch/XLA path, which never ran on Trainium3 ({instance_type}) "
            "and whose training support AWS ended with Neuron 2.30; trn3 trains with TorchNeuron (scaling.accelerator: "
            "neuron)"
        )
    spec = instance_spec(instance_type)
    if accelerator == spec.accelerator:
        return spec
    if accelerator == "neuron":  # trn1
        raise BackendError(
            f"scaling.accelerator='neuron' is TorchNeuron, which runs on trn2 and trn3 only; {instance_type} is "
            f"{spec.family}: use scaling.accelerator: neuron-xla (torch-neuronx's XLA build with neuronx-distributed, "
            "Neuron <= 2.29; frozen), or a trn2 instance type"
        )
    raise BackendError(
        f"scaling.accelerator={accelerator!r} is the PyTorch/XLA path, whose training support AWS ended with Neuron "
        f"2.30; {instance_type} ({spec.family}) trains with TorchNeuron: use scaling.accelerator: neuron"
    )


def cores_per_instance(instance_type: str, lnc: int | None = None) -> int:
    """NeuronCores one instance exposes: trn1 has fixed cores; trn2.48xlarge has 128 physical, 64 logical at LNC=2
    (trn3.48xlarge the same, UNCONFIRMED)."""
    spec = instance_spec(instance_type)
    if lnc is not None:
        if spec.default_lnc is None:
            raise BackendError(
                f"neuron.lnc={lnc}: the logical NeuronCore config applies only to trn2 and trn3; {instance_type} has "
                "none. Remove neuron.lnc"
            )
        if lnc not in (1, 2):
            raise BackendError(f"neuron.lnc={lnc}: must be 1 or 2")
    return spec.cores(lnc)


def efa_devices(instance_type: str) -> int:
    """EFA devices on one instance (0: no EFA, e.g. trn1.2xlarge)."""
    return instance_spec(instance_type).efa_devices


# ---------------------------------------------------------------------------------------------------
# Layout checks
