"""The Neuron worker environment and layout maths, pinned for real trn shapes (pure functions, no Ray)."""

from __future__ import annotations

import pytest

from raytrn.backends.neuron_env import (
    INSTANCES,
    cc_flags_for,
    check_layout,
    check_stack,
    check_tp_groups,
    compile_cache_env,
    cores_per_instance,
    efa_devices,
    instance_spec,
)
from raytrn.errors import BackendError

pytestmark = pytest.mark.unit

# --- instances -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance", "lnc", "cores", "efa"),
    [
        ("trn1.2xlarge", None, 2, 0),
        ("trn1.32xlarge", None, 32, 8),
        ("trn1n.32xlarge", None, 32, 16),
        ("trn2.48xlarge", None, 64, 16),
        ("trn2.48xlarge", 2, 64, 16),
        ("trn2.48xlarge", 1, 128, 16),
        # Trainium3: UNCONFIRMED layouts (16 chips x 8 NeuronCore-v4; trn3e half of it; EFA counts assumed).
        ("trn3.48xlarge", None, 64, 8),
        ("trn3.48xlarge", 2, 64, 8),
        ("trn3.48xlarge", 1, 128, 8),
        ("trn3p.48xlarge", None, 64, 8),
        ("trn3p.48xlarge", 1, 128, 8),
        ("trn3e.24xlarge", None, 32, 4),
        ("trn3e.24xlarge", 1, 64, 4),
    ],
)
def test_instance_table(instance: str, lnc: int | None, cores: int, efa: int) -> None:
    assert cores_per_instance(instance, lnc) == cores
    assert efa_devices(instance) == efa


def test_unknown_instance_lists_known_ones() -> None:
    with pytest.raises(BackendError) as e:
        cores_per_instance("trn1.32xlarg")
    msg = str(e.value)
    assert "scaling.instance_type='trn1.32xlarg': unknown Trainium instance type" in msg
    assert "Did you mean 'trn1.32xlarge'?" in msg
    assert "trn1.2xlarge, trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge" in msg
    with pytest.raises(
        BackendError, match=r"'trn3.48xlarg': unknown Trainium instance type. Did you mean 'trn3.48xlarge'"
    ):
        cores_per_instance("trn3.48xlarg")


@pytest.mark.parametrize("instance", ["trn1.2xlarge", "trn1.32xlarge", "trn1n.32xlarge"])
def test_lnc_on_trn1_is_refused(instance: str) -> None:
    with pytest.raises(BackendError, match=rf"neuron.lnc=2: .* applies only to trn2 and trn3; {instance} has none"):
        cores_per_instance(instance, lnc=2)


def test_trainium3_specs_are_unconfirmed_with_their_sources() -> None:
    """Issue 49 item 4: the trn3 types are in the table, marked unconfirmed, each figure's source named."""
    trn3 = instance_spec("trn3.48xlarge")
    assert (trn3.neuron_devices, trn3.physical_cores, trn3.default_lnc, trn3.hbm_gib_per_chip) == (16, 128, 2, 144)
    assert (trn3.family, trn3.accelerator) == ("trn3", "neuron")
    assert trn3.worker_memory_bytes() == 36 << 30 and trn3.worker_memory_bytes(1) == 18 << 30  # 144 / 8 x LNC GiB
    for name in ("trn3.48xlarge", "trn3p.48xlarge", "trn3e.24xlarge"):
        spec = INSTANCES[name]
        assert not spec.confirmed and spec.family == "trn3", name
        assert "Neuron driver's platform table" in spec.source and "Neuron architecture docs" in spec.source
        assert "assumed" in spec.source  # the EFA count and the LNC default
        note = spec.unconfirmed_note()
        assert note and note.startswith(f"UNCONFIRMED: {name} is not on AWS's instance-type pages yet")
        assert spec.source in note
    assert instance_spec("trn3e.24xlarge").neuron_devices == 8  # half a trn3.48xlarge
    for name in ("trn1.32xlarge", "trn2.48xlarge", "trn2u.48xlarge"):
        assert INSTANCES[name].confirmed and INSTANCES[name].unconfirmed_note() is None


@pytest.mark.parametrize("instance", ["trn3.48xlarge", "trn3p.48xlarge", "trn3e.24xlarge", "trn3x.48xlarge"])
def test_trainium3_trains_with_torchneuron_only(instance: str) -> None:
    with pytest.raises(BackendError, match=rf"never ran on Trainium3 \({instance}\).*trn3 trains with TorchNeuron"):
        check_stack("neuron-xla", instance)
    if instance in INSTANCES:
        assert check_stack("neuron", instance) is INSTANCES[instance]


# --- compiler flags ---------------------------------------------------------------------------------------------


def test_cc_flags_lnc_conflict() -> None:
    assert cc_flags_for("--lnc=1 -O1", 1) == "--lnc=1 -O1"
    assert cc_flags_for(None, None) is None
    with pytest.raises(BackendError, match="logical NeuronCore config to 2 but neuron.lnc=1"):
        cc_flags_for("--model-type transformer -lnc 2", 1)


# --- check_layout --------------------------------------------------------------------------------------------------


def layout(**kw) -> list[str]:
    args = dict(
        min_workers=32,
        max_workers=128,
        workers_per_node=32,
        instance_type="trn1.32xlarge",
        lnc=None,
        tensor_parallel_size=1,
    )
    args.update(kw)
    return check_layout(**args)  # type: ignore[arg-type]


def test_layout_notes() -> None:
    assert layout(tensor_parallel_size=8) == [
        "neuron layout: trn1.32xlarge (32 NeuronCores), 32 workers per node, 32, 64, 96, 128 workers on 1-4 "
        "node(s), tensor parallel 8 (data parallel 4, 8, 12, 16)"
    ]
    notes = layout(min_workers=16, max_workers=16, workers_per_node=16)
    assert "16 workers on 1 node(s)" in notes[0]
    assert "uses NeuronCores 0-15 of 32 on each node; do not share these nodes" in notes[1]
    assert (
        "(64 NeuronCores at LNC=2)"
        in layout(instance_type="trn2.48xlarge", workers_per_node=64, min_workers=64, max_workers=64)[0]
    )
    assert (
        "(128 NeuronCores at LNC=1)"
        in layout(instance_type="trn2.48xlarge", lnc=1, workers_per_node=128, min_workers=128, max_workers=256)[0]
    )


def test_an_unconfirmed_instance_says_so_once_with_its_source() -> None:
    notes = layout(instance_type="trn3.48xlarge", workers_per_node=64, min_workers=64, max_workers=128, lnc=None)
    assert notes[0].startswith("neuron layout: trn3.48xlarge (64 NeuronCores at LNC=2), 64 workers per node, 64, 128")
    unconfirmed = [n for n in notes if "UNCONFIRMED" in n]
    assert unconfirmed == [f"neuron layout: {instance_spec('trn3.48xlarge').unconfirmed_note()}"]
    assert "(16 chips, 128 physical NeuronCores, LNC 2 by default, 144 GiB HBM a chip, 8 EFA devices)" in notes[-1]
    assert "(128 NeuronCores at LNC=1)" in layout(instance_type="trn3.48xlarge", lnc=1, workers_per_node=128,
                                                  min_workers=128, max_workers=128)[0]  # fmt: skip
    assert not [n for n in layout(tensor_parallel_size=8) if "UNCONFIRMED" in n]  # trn1: confirmed


def test_layout_single_partial_node_is_fine() -> None:
    assert "8 workers on 1 node(s)" in layout(min_workers=8, max_workers=8)[0]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(workers_per_node=33), "scaling.workers_per_node=33 exceeds the 32 NeuronCores of trn1.32xlarge"),
        (dict(min_workers=48, max_workers=48), "scaling: 48 workers is not a whole number of nodes"),
        (dict(min_workers=16, max_workers=64), "scaling: 48 workers is not a whole number of nodes"),  # 16, 48, 64
        (dict(max_workers=100), "scaling: 100 workers is not a whole number of nodes"),
        (dict(tensor_parallel_size=64), "tensor_parallel_size=64 does not divide scaling.workers_per_node=32"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide scaling.workers_per_node=32"),
        (dict(min_workers=4, max_workers=4, tensor_parallel_size=8), "4 workers is not divisible by"),
        (dict(instance_type="trn3.48xlarge", workers_per_node=128), "exceeds the 64 NeuronCores of trn3.48xlarge"),
        (dict(lnc=1), "neuron.lnc=1: the logical NeuronCore config applies only to trn2"),
        (dict(instance_type="trn2.48xlarge", workers_per_node=128), "exceeds the 64 NeuronCores of trn2.48xlarge"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_layouts(kw: dict, message: str) -> None:
    with pytest.raises(BackendError) as e:
        layout(**kw)
    assert message in str(e.value)


def test_tp_message_suggests_divisors() -> None:
    with pytest.raises(BackendError, match=r"a tensor-parallel group would span two nodes.*\(1, 2, 4, 8, 16, 32\)"):
        layout(tensor_parallel_size=3)


# --- check_tp_groups -----------------------------------------------------------------------------------------------


def test_tp_groups_on_one_node_pass() -> None:
    nodes = ["a"] * 32 + ["b"] * 32
    check_tp_groups(nodes, 32)
    check_tp_groups(nodes, 8)
    check_tp_groups(nodes, 1)


def test_tp_group_across_nodes_is_named() -> None:
    nodes = ["a"] * 30 + ["b"] * 32 + ["c"] * 2  # an uneven placement
    with pytest.raises(BackendError, match=r"tensor-parallel group 3 \(ranks 24-31\) spans 2 nodes \(a, b\)"):
        check_tp_groups(nodes, 8)
    with pytest.raises(BackendError, match="64 workers is not divisible by parallel.tensor_parallel_size=5"):
        check_tp_groups(nodes, 5)


# --- compile cache -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cache", "url"),
    [
        ("s3://bucket/neuron-cache", "s3://bucket/neuron-cache"),
        ("/var/tmp/neuron-compile-cache", "/var/tmp/neuron-compile-cache"),
        ("/opt/cache/", "/opt/cache"),
        ("/fsx/neuron-cache", "/fsx/neuron-cache/ip-10-0-1-17"),
        ("/fsx", "/fsx/ip-10-0-1-17"),
        ("/efs/cache/", "/efs/cache/ip-10-0-1-17"),
        ("/mnt/efs/cache", "/mnt/efs/cache/ip-10-0-1-17"),
        ("/mnt/fsx/cache", "/mnt/fsx/cache/ip-10-0-1-17"),
        ("/shared/trn1_llama/neuron_cache", "/shared/trn1_llama/neuron_cache/ip-10-0-1-17"),
        ("/fsxdata/cache", "/fsxdata/cache"),  # a path component, not a string prefix
        ("/nfs/cache/{host}/neff", "/nfs/cache/ip-10-0-1-17/neff"),
        ("/fsx/{host}", "/fsx/ip-10-0-1-17"),  # explicit placeholder: no second subdirectory
    ],
)
def test_compile_cache_rules(cache: str, url: str) -> None:
    assert compile_cache_env(cache, hostname="ip-10-0-1-17") == {"NEURON_COMPILE_CACHE_URL": url}


def test_compile_cache_none_and_errors() -> None:
    assert compile_cache_env(None, hostname="h") == {}
    with pytest.raises(BackendError, match="use an absolute path"):
        compile_cache_env("cache", hostname="h")
    with pytest.raises(BackendError, match="an s3:// URI or a local/shared path"):
        compile_cache_env("gs://bucket/cache", hostname="h")
    with pytest.raises(BackendError, match="name a bucket"):
        compile_cache_env("s3://", hostname="h")
