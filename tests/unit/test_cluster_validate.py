"""``raytrn cluster validate``: the shipped cluster-launcher YAMLs pass Ray's schema and raytrn's rules,
and every broken variant (built by loading a shipped file and mutating it) fails with the YAML path and
the fix in one ConfigError.
"""

from __future__ import annotations

import argparse
import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrn.cluster.cli import register
from raytrn.cluster.validate import ray_schema_path, validate_cluster_config, validate_cluster_file
from raytrn.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CLUSTER_FILES = sorted((REPO / "cluster").glob("*.yaml"))
#: The local trn-cluster simulator's config (fake_multinode provider, owned by the simulator work).
LOCAL_SIM = "local-sim.yaml"
TRN1 = REPO / "cluster" / "aws-trn1.yaml"
TRN2 = REPO / "cluster" / "aws-trn2.yaml"
#: Trainium3: its instance type and layout are UNCONFIRMED (raytrn.backends.neuron_env.INSTANCES).
TRN3 = REPO / "cluster" / "aws-trn3.yaml"


def load(path: Path) -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(path.read_text()))


def problems_of(config: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        validate_cluster_config(config, source="c.yaml")
    return str(info.value)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_shipped_cluster_files_validate(path: Path) -> None:
    if path.name == LOCAL_SIM:
        try:
            validate_cluster_file(str(path))
        except ConfigError as e:  # not ours to fix here; say so instead of failing
            pytest.skip(f"{LOCAL_SIM} (fake_multinode simulator config) does not pass: {e}")
        return
    notes = validate_cluster_file(str(path), template=True)  # a template: its REPLACE_ME values are noted
    assert any("neuron_cores" in n for n in notes)
    assert [n for n in notes if n.startswith("template: fill these before `ray up`")], notes


DLAMI = {
    TRN1: "resolve:ssm:/aws/service/neuron/dlami/pytorch-2.9/ubuntu-24.04/latest/image_id",
    TRN2: "resolve:ssm:/aws/service/neuron/dlami/torch-neuronx-2.14.0/ubuntu-24.04/latest/image_id",
    TRN3: "resolve:ssm:/aws/service/neuron/dlami/torch-neuronx-2.14.0/ubuntu-24.04/latest/image_id",  # TorchNeuron too
}


def test_shipped_files_exist_and_boot_their_stacks_dlami() -> None:
    assert TRN1 in CLUSTER_FILES and TRN2 in CLUSTER_FILES and TRN3 in CLUSTER_FILES
    for path in (TRN1, TRN2, TRN3):
        text = path.read_text()
        images = {nt["node_config"]["ImageId"] for nt in load(path)["available_node_types"].values()}
        assert images == {DLAMI[path]}, images  # head and workers alike
        assert "multi-framework" not in text.split("ImageId")[1]  # no PyTorch there since Neuron 2.32
        assert "ImageId: ami-" not in text  # no stale hard-coded AMI id
        assert "--dashboard-host=127.0.0.1" in text and "RAY_AUTH_MODE=token" in text
        # The Ray token file_mounts copies, made 0600 on every node.
        assert "~/.ray/auth_token: ~/.ray/auth_token" in text and "- chmod 600 ~/.ray/auth_token" in text, path


def test_each_shipped_file_activates_its_familys_venv() -> None:
    assert "source /opt/aws_neuronx_venv_torch_neuronx_2_14_0/bin/activate" in TRN2.read_text()
    assert "source /opt/aws_neuronx_venv_torch_neuronx_2_14_0/bin/activate" in TRN3.read_text()
    assert "source /opt/aws_neuronx_venv_pytorch_2_9_nxd_training/bin/activate" in TRN1.read_text()
    for path in (TRN1, TRN2, TRN3):
        assert not [n for n in validate_cluster_file(str(path), template=True) if n.startswith("warning:")]


@pytest.mark.parametrize(
    ("path", "venv", "expected"),
    [
        (TRN2, "/opt/aws_neuronx_venv_pytorch_2_9_nxd_training", "xlarge trains with scaling.accelerator "
         "neuron, but /opt/aws_neuronx_venv_pytorch_2_9_nxd_training is the neuron-xla venv (PyTorch/XLA + NxD); use "
         "/opt/aws_neuronx_venv_torch_neuronx_2_14_0"),
        (TRN1, "/opt/aws_neuronx_venv_torch_neuronx_2_14_0", "xlarge trains with scaling.accelerator "
         "neuron-xla, but /opt/aws_neuronx_venv_torch_neuronx_2_14_0 is the neuron venv (TorchNeuron); use "
         "/opt/aws_neuronx_venv_pytorch_2_9_nxd_training"),
        (TRN3, "/opt/aws_neuronx_venv_pytorch_2_9_nxd_training", "trn3.48xlarge trains with scaling.accelerator "
         "neuron, but /opt/aws_neuronx_venv_pytorch_2_9_nxd_training is the neuron-xla venv (PyTorch/XLA + NxD); use "
         "/opt/aws_neuronx_venv_torch_neuronx_2_14_0"),
    ],
)  # fmt: skip
def test_the_wrong_venv_for_the_instance_family_is_warned(path: Path, venv: str, expected: str) -> None:
    config = load(path)
    config["setup_commands"] = [f"echo 'source {venv}/bin/activate' >> ~/.bashrc"]
    warnings = [n for n in validate_cluster_config(config, source="c.yaml") if n.startswith("warning:")]
    assert warnings and all(expected in w for w in warnings)  # one per trn node type


@pytest.mark.parametrize(
    ("path", "image", "expected"),
    [
        (TRN2, DLAMI[TRN1], "trains with scaling.accelerator neuron, but its ImageId " + DLAMI[TRN1] + " is the "
         "neuron-xla stack's DLAMI (PyTorch/XLA); use " + DLAMI[TRN2].split()[0]),
        (TRN1, DLAMI[TRN2], "trains with scaling.accelerator neuron-xla, but its ImageId " + DLAMI[TRN2] + " is the "
         "neuron stack's DLAMI (TorchNeuron); use " + DLAMI[TRN1]),
        (TRN2, "resolve:ssm:/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id",
         "has no PyTorch venv (multi-framework and base DLAMIs since Neuron 2.32)"),
    ],
)  # fmt: skip
def test_the_wrong_dlami_for_the_instance_family_is_warned(path: Path, image: str, expected: str) -> None:
    config = load(path)
    trn = [nt for nt in config["available_node_types"].values() if nt["node_config"]["InstanceType"].startswith("trn")]
    for nt in trn:
        nt["node_config"]["ImageId"] = image
    config["available_node_types"]["ray.head.default"]["node_config"]["ImageId"] = image  # a CPU head: never checked
    warnings = [n for n in validate_cluster_config(config, source="c.yaml") if "ImageId" in n]
    assert len(warnings) == len(trn) and all(expected in w for w in warnings), warnings
    config = load(path)
    for nt in trn:
        nt["node_config"]["ImageId"] = "ami-0123456789abcdef0"  # an AMI id says nothing about its stack
    assert not [n for n in validate_cluster_config(config, source="c.yaml") if "ImageId" in n]


def test_shipped_files_pass_rays_own_validation() -> None:
    """Ray's full check (defaults filled, NetworkInterfaces folded), not just the schema."""
    from raytrn.compat import ray_validate_cluster_config

    for path in (TRN1, TRN2, TRN3):
        ray_validate_cluster_config(load(path))


def test_trn_node_types_match_the_instance_table() -> None:
    from raytrn.backends.neuron_env import INSTANCES

    seen = set()
    for path in (TRN1, TRN2, TRN3):
        config = load(path)
        for name, nt in config["available_node_types"].items():
            itype = nt["node_config"]["InstanceType"]
            if itype in INSTANCES:
                seen.add(itype)
                efa = [ni for ni in nt["node_config"]["NetworkInterfaces"] if ni["InterfaceType"] == "efa"]
                assert len(efa) == INSTANCES[itype].efa_devices, name
                assert nt["min_workers"] == 0
    assert seen == {"trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge", "trn3.48xlarge"}
    markets = {
        nt["node_config"].get("InstanceMarketOptions", {}).get("MarketType")
        for nt in load(TRN1)["available_node_types"].values()
    }
    assert "spot" in markets and None in markets


def test_an_unconfirmed_instance_type_validates_and_says_so_once() -> None:
    """Issue 49 item 4: trn3 node types are checked like trn2's (64 neuron_cores at LNC 2, 128 at LNC 1) and the
    notes say UNCONFIRMED with the table's source once, however many node types use the instance type."""
    from raytrn.backends.neuron_env import INSTANCES

    notes = validate_cluster_file(str(TRN3), template=True)
    unconfirmed = [n for n in notes if "UNCONFIRMED" in n]
    assert unconfirmed == [INSTANCES["trn3.48xlarge"].unconfirmed_note()]  # three trn3 node types, one note
    assert INSTANCES["trn3.48xlarge"].source in unconfirmed[0]
    assert any(
        n.startswith("trn3_48xl: trn3.48xlarge, neuron_cores 64 at LNC=2, 0-4 nodes, on-demand, 8 EFA") for n in notes
    )
    assert any(n.startswith("trn3_48xl_lnc1: trn3.48xlarge, neuron_cores 128 at LNC=1") for n in notes)
    assert not [n for n in validate_cluster_file(str(TRN2), template=True) if "UNCONFIRMED" in n]
    c = load(TRN3)
    c["available_node_types"]["trn3_48xl"]["resources"]["neuron_cores"] = 128  # LNC=2 default: 64
    assert (
        "trn3_48xl.resources.neuron_cores: 128 does not match trn3.48xlarge (64 NeuronCores at LNC=2)" in problems_of(c)
    )
    c = load(TRN2)  # another trn3 type in a trn2 file: its own note
    c["available_node_types"]["trn2_48xl_spot"]["node_config"]["InstanceType"] = "trn3p.48xlarge"
    notes = validate_cluster_config(c)
    assert [n for n in notes if "UNCONFIRMED" in n] == [INSTANCES["trn3p.48xlarge"].unconfirmed_note()]


def test_ray_schema_is_the_installed_one() -> None:
    import ray

    assert Path(ray_schema_path()).is_file()
    assert ray.__version__.startswith("2.60")


# ---------------------------------------------------------------------------------------------------
# Broken variants


def test_unknown_instance_type_suggests_the_near_miss() -> None:
    c = load(TRN1)
    c["available_node_types"]["trn1_32xl"]["node_config"]["InstanceType"] = "trn1.32xlarg"
    msg = problems_of(c)
    assert "available_node_types.trn1_32xl.node_config.InstanceType: unknown Trainium instance type" in msg
    assert "Did you mean 'trn1.32xlarge'?" in msg


def test_neuron_cores_mismatch() -> None:
    c = load(TRN1)
    c["available_node_types"]["trn1n_32xl"]["resources"]["neuron_cores"] = 16
    msg = problems_of(c)
    assert "available_node_types.trn1n_32xl.resources.neuron_cores: 16 does not match trn1n.32xlarge" in msg
    assert "set it to 32" in msg


def test_neuron_cores_missing() -> None:
    c = load(TRN1)
    del c["available_node_types"]["trn1_32xl"]["resources"]["neuron_cores"]
    assert "available_node_types.trn1_32xl.resources.neuron_cores: missing; set it to 32" in problems_of(c)


def test_trn2_lnc_rule() -> None:
    c = load(TRN2)
    assert c["available_node_types"]["trn2_48xl_lnc1"]["resources"]["neuron_cores"] == 128
    c["available_node_types"]["trn2_48xl"]["resources"]["neuron_cores"] = 128  # LNC=2 default: 64
    msg = problems_of(c)
    assert "trn2_48xl.resources.neuron_cores: 128 does not match trn2.48xlarge (64 NeuronCores at LNC=2)" in msg
    assert "NEURON_LOGICAL_NC_CONFIG" in msg
    c = load(TRN2)
    del c["available_node_types"]["trn2_48xl_lnc1"]["worker_setup_commands"]  # back to LNC=2
    assert "trn2_48xl_lnc1.resources.neuron_cores: 128 does not match trn2.48xlarge (64" in problems_of(c)


def test_missing_efa_and_placement_group() -> None:
    c = load(TRN1)
    node_config = c["available_node_types"]["trn1_32xl"]["node_config"]
    del node_config["NetworkInterfaces"]
    del node_config["Placement"]
    msg = problems_of(c)
    assert "2 problems" in msg
    assert "available_node_types.trn1_32xl.node_config.NetworkInterfaces: no EFA interface" in msg
    assert "InterfaceType: efa" in msg
    assert "available_node_types.trn1_32xl.node_config.Placement.GroupName: missing" in msg
    assert "create-placement-group" in msg


def test_single_node_type_needs_no_efa() -> None:
    c = load(TRN1)
    nt = c["available_node_types"]["trn1_32xl"]
    nt["max_workers"] = 1
    del nt["node_config"]["NetworkInterfaces"]
    del nt["node_config"]["Placement"]
    validate_cluster_config(c)


def test_fewer_efa_interfaces_is_a_note() -> None:
    c = load(TRN1)
    nc = c["available_node_types"]["trn1_32xl"]["node_config"]
    nc["NetworkInterfaces"] = nc["NetworkInterfaces"][:1]
    notes = validate_cluster_config(c)
    assert any("1 of trn1.32xlarge's 8 EFA devices" in n for n in notes)


@pytest.mark.parametrize(
    "rule",
    [
        {"FromPort": 8265, "ToPort": 8265, "IpProtocol": "TCP", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]},
        {"IpProtocol": "-1", "Ipv6Ranges": [{"CidrIpv6": "::/0"}]},
    ],
)
def test_dashboard_port_open_to_the_world(rule: dict[str, Any]) -> None:
    c = load(TRN1)
    ok = {"FromPort": 22, "ToPort": 22, "IpProtocol": "TCP", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
    c["provider"]["security_group"] = {"GroupName": "raytrn", "IpPermissions": [ok, rule]}
    msg = problems_of(c)
    assert "provider.security_group.IpPermissions[1]: opens 8265 (Ray dashboard / job submission API)" in msg
    assert "ray dashboard CLUSTER.yaml" in msg
    assert "IpPermissions[0]" not in msg  # SSH alone is allowed


@pytest.mark.parametrize(
    ("ranges", "ports", "shown"),
    [
        ([{"CidrIp": "0.0.0.0/1"}, {"CidrIp": "128.0.0.0/1"}], (8265, 8265), "8265 (Ray dashboard"),
        ([{"CidrIp": "0.0.0.0/00"}], (8265, 8265), "8265 (Ray dashboard"),
        ([{"CidrIp": "3.0.0.0/8"}], (10002, 19999), "10002-19999 (Ray worker ports)"),
        ([{"CidrIp": "0.0.0.0/0"}], (8077, 8100), "8080 (Ray metrics export)"),
        ([{"CidrIp": "0.0.0.0/0"}], (15000, 15000), "10002-19999 (Ray worker ports)"),
        ([{"CidrIp": "everyone"}], (6379, 6379), "6379 (Ray GCS)"),
    ],
    ids=["two-halves", "zero-padded", "a-slash-8", "metrics", "one-worker-port", "not-a-cidr"],
)
def test_sensitive_ports_open_to_the_internet_are_judged_by_prefix(ranges: list, ports: tuple, shown: str) -> None:
    c = load(TRN1)
    rule = {"FromPort": ports[0], "ToPort": ports[1], "IpProtocol": "TCP", "IpRanges": ranges}
    c["provider"]["security_group"] = {"IpPermissions": [rule]}
    msg = problems_of(c)
    assert f"provider.security_group.IpPermissions[0]: opens {shown}" in msg


def test_a_narrow_public_range_or_a_private_one_is_fine() -> None:
    c = load(TRN1)
    ranges = [{"CidrIp": "203.0.113.7/32"}, {"CidrIp": "198.51.100.0/24"}, {"CidrIp": "172.16.0.0/12"}]
    rule = {"FromPort": 8265, "ToPort": 8265, "IpProtocol": "TCP", "IpRanges": ranges}
    c["provider"]["security_group"] = {"IpPermissions": [rule]}
    validate_cluster_config(c)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "'::'"])
def test_a_dashboard_on_every_interface_without_token_auth_is_an_error(host: str) -> None:
    c = load(TRN1)
    cmds = [
        cmd.replace("--dashboard-host=127.0.0.1", f"--dashboard-host={host}") for cmd in c["head_start_ray_commands"]
    ]
    c["head_start_ray_commands"] = cmds
    notes = validate_cluster_config(c)  # token auth on: a note
    assert any("the dashboard listens on" in n and "(all interfaces)" in n for n in notes)
    c["head_start_ray_commands"] = [cmd.replace("RAY_AUTH_MODE=token ", "") for cmd in cmds]
    msg = problems_of(c)
    assert "the dashboard listens on" in msg and "with Ray token authentication off: anyone who reaches" in msg


def test_dashboard_port_open_to_a_private_range_is_fine() -> None:
    c = load(TRN1)
    rule = {"FromPort": 8265, "ToPort": 8265, "IpProtocol": "TCP", "IpRanges": [{"CidrIp": "10.0.0.0/8"}]}
    c["provider"]["security_group"] = {"IpPermissions": [rule]}
    validate_cluster_config(c)


def test_no_idle_timeout() -> None:
    c = load(TRN1)
    del c["idle_timeout_minutes"]
    assert "c.yaml: idle_timeout_minutes: not set" in problems_of(c)


def test_head_node_on_trainium() -> None:
    c = load(TRN1)
    c["available_node_types"]["ray.head.default"]["node_config"]["InstanceType"] = "trn1.32xlarge"
    msg = problems_of(c)
    assert "available_node_types.ray.head.default.node_config.InstanceType: the head node is a Trainium" in msg
    assert "use a CPU instance" in msg


def test_max_workers_below_min_sum_and_node_type_above_top() -> None:
    c = load(TRN1)
    c["max_workers"] = 3
    c["available_node_types"]["trn1_32xl"]["min_workers"] = 2
    c["available_node_types"]["trn1n_32xl"]["min_workers"] = 2
    msg = problems_of(c)
    assert "max_workers: 3 is below the sum of the node types' min_workers (4)" in msg
    assert "available_node_types.trn1_32xl.max_workers: 4 exceeds the cluster's max_workers (3)" in msg


def test_unknown_top_level_key_from_rays_schema() -> None:
    c = load(TRN1)
    c["max_worker"] = 4
    msg = problems_of(c)
    assert "max_worker: unknown field (Ray's cluster schema). Did you mean 'max_workers'?" in msg


def test_schema_errors_name_nested_paths() -> None:
    c = load(TRN1)
    c["available_node_types"]["trn1_32xl"]["max_worker"] = 2
    c["available_node_types"]["trn1_32xl_spot"]["resources"]["neuron_cores"] = "32"
    del c["provider"]["type"]
    msg = problems_of(c)
    assert (
        "available_node_types.trn1_32xl.max_worker: unknown field (Ray's cluster schema). Did you mean 'max_workers'?"
        in msg
    )
    assert "available_node_types.trn1_32xl_spot.resources.neuron_cores: must be of type integer (got '32')" in msg
    assert "provider.type: required field is missing" in msg


def test_head_node_type_not_a_node_type() -> None:
    c = load(TRN1)
    c["head_node_type"] = "ray.head.defualt"
    assert (
        "head_node_type: 'ray.head.defualt' is not one of available_node_types. Did you mean 'ray.head.default'?"
        in problems_of(c)
    )


def test_all_problems_in_one_message() -> None:
    c = load(TRN1)
    del c["idle_timeout_minutes"]
    c["available_node_types"]["trn1_32xl"]["resources"]["neuron_cores"] = 8
    c["bogus"] = 1
    msg = problems_of(c)
    assert msg.startswith("c.yaml: 3 problems:\n  ")


def test_malformed_yaml_reports_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster_name: x\nprovider:\n  type: aws\n  region: [us-east-1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+:\d+: YAML syntax error"):
        validate_cluster_file(str(bad))


def test_missing_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: cluster file not found"):
        validate_cluster_file(str(tmp_path / "nope.yaml"))
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="empty"):
        validate_cluster_file(str(empty))


def test_mutated_file_on_disk(tmp_path: Path) -> None:
    c = load(TRN2)
    c["available_node_types"]["trn2_48xl"]["node_config"]["InstanceType"] = "trn9.48xlarge"  # no such type
    path = tmp_path / "trn2.yaml"
    path.write_text(yaml.safe_dump(c))
    with pytest.raises(ConfigError) as info:
        validate_cluster_file(str(path))
    assert str(info.value).startswith(f"{path}: available_node_types.trn2_48xl.node_config.InstanceType")
    assert pickle.loads(pickle.dumps(info.value)).message == info.value.message


# ---------------------------------------------------------------------------------------------------
# The CLI piece


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrn")
    register(parser.add_subparsers(dest="command"))
    return parser


def test_cli_validate_prints_notes_and_ok(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["cluster", "validate", str(TRN1), "--template"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "trn1_32xl: trn1.32xlarge, neuron_cores 32" in out
    assert out.rstrip().endswith(f"{TRN1}: OK")


def test_placeholders_fail_a_file_to_launch_and_are_counted_once_per_place(tmp_path: Path) -> None:
    """Issue 46, item 14: a file with REPLACE_ME values left cannot be launched (exit 2, naming them), unless checked
    as a template; each place in the file counts once, however many times YAML aliases repeat it (the shipped
    files share one node_config between node types through an anchor)."""
    args = _parser().parse_args(["cluster", "validate", str(TRN1)])
    with pytest.raises(ConfigError) as e:
        args.func(args)
    message = str(e.value)
    assert message.startswith(f"{TRN1}: ") and "still hold REPLACE_ME" in message and "--template" in message
    text = TRN1.read_text()
    in_file = sum(line.split("#")[0].count("REPLACE_ME") for line in text.splitlines())
    assert f": {in_file} place(s) still hold REPLACE_ME" in message, (in_file, message)
    expanded = json.dumps(load(TRN1)).count("REPLACE_ME")  # the values, YAML's aliases expanded
    assert expanded > in_file  # (the file repeats its subnet and security group by alias)
    # filled in: launchable
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("REPLACE_ME", "filled"))
    assert not [n for n in validate_cluster_file(str(path)) if "REPLACE_ME" in n]


def test_cli_validate_raises_config_error(tmp_path: Path) -> None:
    c = load(TRN1)
    del c["idle_timeout_minutes"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(c))
    args = _parser().parse_args(["cluster", "validate", str(path)])
    with pytest.raises(ConfigError, match="idle_timeout_minutes: not set") as info:
        args.func(args)
    assert info.value.exit_code == 2


def test_cli_needs_a_subcommand() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["cluster"])
