"""What both cluster-file validators share: bounded YAML loading, reading unvalidated YAML, problem lists,
placeholder notes, and the NeuronCore count a Trainium node exposes."""

from __future__ import annotations

import re
from typing import Any

from raytrn.backends.neuron_env import InstanceSpec
from raytrn.config import read_config_text, safe_load_yaml
from raytrn.errors import ConfigError

PLACEHOLDER = "REPLACE_ME"

#: The Neuron DLAMI's PyTorch virtual environments and the ``scaling.accelerator`` each one trains with:
#: ``aws_neuronx_venv_torch_neuronx_<version>`` is TorchNeuron (trn2/trn3, Neuron 2.33+),
#: ``aws_neuronx_venv_pytorch_<version>[_nxd_training]`` the PyTorch/XLA + NxD stack (trn1, Neuron <= 2.29).
DLAMI_VENVS = (
    (re.compile(r"/opt/aws_neuronx_venv_torch_neuronx_[0-9_]+"), "neuron"),
    (re.compile(r"/opt/aws_neuronx_venv_pytorch_[0-9A-Za-z_]+"), "neuron-xla"),
)
#: The venv to name in a fix, by accelerator.
DLAMI_VENV_FOR = {
    "neuron": "/opt/aws_neuronx_venv_torch_neuronx_2_14_0 (DLAMI 'Deep Learning AMI Neuron torch-neuronx 2.14.0')",
    "neuron-xla": "/opt/aws_neuronx_venv_pytorch_2_9_nxd_training (a Neuron 2.28/2.29 DLAMI)",
}
#: The Neuron DLAMIs' SSM parameters (``resolve:ssm:/aws/service/neuron/dlami/<framework>-<version>/<os>/...``)
#: and the ``scaling.accelerator`` each one's PyTorch trains with; None: no PyTorch venv at all (the
#: multi-framework DLAMIs since Neuron 2.32). An ``ami-...`` id says nothing about its stack: not checked.
DLAMI_IMAGES = (
    (re.compile(r"/aws/service/neuron/dlami/torch-neuronx-[0-9.]+/"), "neuron"),
    (re.compile(r"/aws/service/neuron/dlami/pytorch-[0-9.]+/"), "neuron-xla"),
    (re.compile(r"/aws/service/neuron/dlami/(multi-framework|base)/"), None),
)
#: The DLAMI to name in a fix, by accelerator.
DLAMI_IMAGE_FOR = {
    "neuron": "resolve:ssm:/aws/service/neuron/dlami/torch-neuronx-2.14.0/ubuntu-24.04/latest/image_id",
    "neuron-xla": "resolve:ssm:/aws/service/neuron/dlami/pytorch-2.9/ubuntu-24.04/latest/image_id (or a Neuron "
    "2.28 DLAMI's AMI id)",
}
_LNC_SETTING = re.compile(r"NEURON_LOGICAL_NC_CONFIG\s*=\s*[\"']?(\d+)")


def venv_stacks(texts: list[str]) -> dict[str, str]:
    """Every DLAMI venv path named in ``texts`` (commands, env values), with the accelerator it trains with."""
    found: dict[str, str] = {}
    for text in texts:
        for pattern, accelerator in DLAMI_VENVS:
            for path in pattern.findall(text):
                found.setdefault(path, accelerator)
    return found


def stack_warnings(where: str, spec: InstanceSpec, texts: list[str]) -> list[str]:
    """A warning per DLAMI venv in ``texts`` that is not the stack ``spec``'s family trains with."""
    return [
        f"warning: {where}: {spec.name} trains with scaling.accelerator {spec.accelerator}, but {path} is the "
        f"{accelerator} venv ({'TorchNeuron' if accelerator == 'neuron' else 'PyTorch/XLA + NxD'}); use "
        f"{DLAMI_VENV_FOR[spec.accelerator]}"
        for path, accelerator in venv_stacks(texts).items()
        if accelerator != spec.accelerator
    ]


def image_warnings(where: str, spec: InstanceSpec, image: Any) -> list[str]:
    """A warning when ``image`` (a node's ImageId) is a Neuron DLAMI whose PyTorch is not the stack ``spec``'s
    family trains with, or that has no PyTorch at all."""
    if not isinstance(image, str):
        return []
    for pattern, accelerator in DLAMI_IMAGES:
        if not pattern.search(image) or accelerator == spec.accelerator:
            continue
        what = "has no PyTorch venv (multi-framework and base DLAMIs since Neuron 2.32)"
        if accelerator is not None:
            what = f"is the {accelerator} stack's DLAMI ({'TorchNeuron' if accelerator == 'neuron' else 'PyTorch/XLA'})"
        return [
            f"warning: {where}: {spec.name} trains with scaling.accelerator {spec.accelerator}, but its ImageId "
            f"{image} {what}; use {DLAMI_IMAGE_FOR[spec.accelerator]}"
        ]
    return []


def load_yaml_documents(path: str, *, what: str) -> list[Any]:
    """Every YAML document of ``path`` (empty ones dropped); ConfigError with ``file:line:col`` on bad YAML,
    and for files too large or too deeply nested to be a cluster config."""
    text = read_config_text(path, what=what, examples="cluster/")
    docs = safe_load_yaml(text, path, documents=True)
    if not docs:
        raise ConfigError(f"{path}: {what} is empty")
    return list(docs)


def mapping_at(node: Any, *keys: str) -> dict[str, Any]:
    """``node[k1][k2]...`` when every step is a mapping, else ``{}`` (for reading unvalidated YAML)."""
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def as_list(value: Any) -> list[Any]:
    """``value`` when it is a list, else ``[]`` (for reading unvalidated YAML: a string or a bool is no list)."""
    return value if isinstance(value, list) else []


def raise_problems(source: str, problems: list[str]) -> None:
    """One ConfigError listing every problem (file first), or nothing."""
    if problems:
        head = f"{source}: " if len(problems) == 1 else f"{source}: {len(problems)} problems:\n  "
        raise ConfigError(head + "\n  ".join(problems))


def expected_neuron_cores(spec: InstanceSpec, commands: list[str]) -> tuple[int, int | None]:
    """NeuronCores a node of ``spec`` exposes given the commands run on it, and the LNC they imply.

    Rule: on instances with a logical NeuronCore config (trn2, trn3) the count is at the default LNC (2: 64
    on trn2.48xlarge, and on trn3.48xlarge, UNCONFIRMED) unless a command sets ``NEURON_LOGICAL_NC_CONFIG=N``; the
    last setting wins.
    """
    lnc = None
    if spec.default_lnc is not None:
        for cmd in commands:
            for value in _LNC_SETTING.findall(cmd):
                if value in ("1", "2"):
                    lnc = int(value)
    return spec.cores(lnc), (lnc or spec.default_lnc)


def placeholder_places(text: str) -> list[tuple[str, int, str]]:
    """``(key path, line, value)`` of every place in a YAML file's text whose value still holds ``REPLACE_ME``: each
    place once, however many times YAML aliases repeat it (the node tree, not the expanded values), in file order."""
    import yaml

    out: list[tuple[str, int, str]] = []
    seen: set[int] = set()

    def walk(node: Any, path: str) -> None:
        if id(node) in seen:  # an alias of a node already visited: the same place in the file
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                walk(value, f"{path}.{name}" if path else name)
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                walk(value, f"{path}[{i}]")
        elif isinstance(node, yaml.ScalarNode) and PLACEHOLDER in str(node.value):
            value = str(node.value)
            line = node.start_mark.line + 1
            if node.style in ("|", ">"):  # a block: its text starts on the line after the indicator
                line += 1 + value[: value.index(PLACEHOLDER)].count("\n")
            out.append((path, line, value))

    try:
        for i, doc in enumerate(yaml.compose_all(text, Loader=yaml.SafeLoader)):
            walk(doc, f"[{i}]" if i else "")
    except yaml.YAMLError:  # (the file was parsed already: its errors were reported there)
        return out
    return sorted(out, key=lambda place: place[1])


def placeholder_text(places: list[tuple[str, int, str]]) -> str:
    """``REPLACE_ME_SUBNET (line 40: provider.subnet_id; 2 more places)`` for each distinct placeholder token."""
    found: dict[str, list[tuple[str, int]]] = {}
    for path, line, value in places:
        for token in re.findall(rf"[^\s\"']*{PLACEHOLDER}[^\s\"']*", value):
            found.setdefault(token, []).append((path, line))
    return "; ".join(
        f"{token} (line {where[0][1]}: {where[0][0]}{f'; {len(where) - 1} more place(s)' if len(where) > 1 else ''})"
        for token, where in found.items()
    )
