"""Every path of a run's directory, named in one place: ``<checkpoint.storage>/<run>/...``.

A run's directory (a local path or an ``s3://`` URI) holds:

- ``dcp/step_<N>``: the sharded checkpoint of step N (:mod:`raytrn.checkpoint.sharded`), committed once its
  ``commit.json`` is written (:mod:`raytrn.checkpoint.manifest`); without it the directory is staging.
- ``checkpoint_<N>``: Ray Train's record of a checkpoint (its pointer: ``meta.json``, saying where the state is),
  named by step.
- ``nxd``: neuronx-distributed's shards (the frozen XLA path, :mod:`raytrn.xla`).
- ``raytrn-mlflow.json``: the marker naming the run's MLflow run (:mod:`raytrn.tracking.mlflow_run`).
- ``raytrn-lease.json``: the lease of the job training the run (:mod:`raytrn.checkpoint.lease`).

No other module joins a run's directory by hand: a change of layout is an edit here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from raytrn import storage
from raytrn.errors import CheckpointError

if TYPE_CHECKING:
    from raytrn.config import JobSpec

#: The directory of a run's sharded (DCP) checkpoints.
DCP_DIR = "dcp"
#: The directory of neuronx-distributed's shards (the frozen XLA path).
NXD_DIR = "nxd"
#: The marker file that names the run's MLflow run.
MLFLOW_MARKER = "raytrn-mlflow.json"
#: The lease of the job that trains the run.
LEASE_FILE = "raytrn-lease.json"
#: A step as raytrn writes it in a name (:func:`step_digits`): 8 digits, zero-padded, below 10^8; the step's own
#: digits above. Only these: another spelling of a step (``step_000000020``) would be a second name for it.
STEP_NUMBER = r"(\d{8}|[1-9]\d{8,})"
#: ``dcp/step_<N>``: raytrn's sharded checkpoint directories.
STEP_DIR = re.compile(rf"^step_{STEP_NUMBER}$")
#: ``checkpoint_<N>``: Ray Train's checkpoint directories (raytrn names them by step).
POINTER_DIR = re.compile(rf"^checkpoint_{STEP_NUMBER}$")


def step_digits(step: int) -> str:
    """``step`` as it appears in every name raytrn gives by step: 8 digits, zero-padded (``00000020``), as runs
    have always been named, and as many as it takes from 10^8 on (``100000000``); listings order them by number."""
    return f"{step:08d}"


@dataclass(frozen=True)
class RunDir:
    """The directory of run ``run`` under ``storage`` (``checkpoint.storage``), and every path in it."""

    storage: str
    run: str

    @classmethod
    def of(cls, job: JobSpec) -> RunDir:
        """The run directory of ``job`` (``checkpoint.storage`` and the run's name)."""
        return cls(job.checkpoint.storage, job.run_name)

    @property
    def root(self) -> str:
        return storage.join(self.storage, self.run)

    # -- sharded checkpoints -------------------------------------------------------------------------
    @property
    def dcp(self) -> str:
        """Where the run's sharded checkpoints are (``<run>/dcp``)."""
        return storage.join(self.root, DCP_DIR)

    @staticmethod
    def step_name(step: int) -> str:
        return f"step_{step_digits(step)}"

    def dcp_step(self, step: int) -> str:
        """The sharded checkpoint of ``step`` (``<run>/dcp/step_<N>``): staging until committed."""
        return storage.join(self.dcp, self.step_name(step))

    def own_dcp(self, location: str) -> str:
        """The sharded checkpoint a pointer's ``meta.json`` names (its ``dcp`` entry), taken only as a step of
        *this* run: ``<run>/dcp/step_<N>`` for the ``step_<N>`` it ends in, wherever the pointer says that is (a
        run directory moved or copied elsewhere resumes from its own files; a meta.json edited to point anywhere
        else reads nothing outside the run). CheckpointError when it does not end in ``step_<N>``."""
        name = location.rstrip("/").rsplit("/", 1)[-1]
        if not STEP_DIR.match(name):
            raise CheckpointError(
                f"checkpoint meta.json names {location!r} as its sharded checkpoint: not a step of a raytrn run "
                f"(<run>/dcp/step_<N>); refusing to read it. Checkpoint storage must be writable only by the people "
                f"who may run code on the cluster (SECURITY.md)"
            )
        return storage.join(self.dcp, name)

    def dcp_steps(self) -> list[int]:
        """The steps of the ``dcp/step_<N>`` directories (raytrn's own only), ascending; empty when missing,
        CheckpointError when the storage cannot be listed."""
        return _steps(self.dcp, STEP_DIR)

    # -- Ray Train's pointers ------------------------------------------------------------------------
    @staticmethod
    def pointer_name(step: int) -> str:
        """The name raytrn gives Ray Train's checkpoint directory of ``step`` (``checkpoint_dir_name``)."""
        return f"checkpoint_{step_digits(step)}"

    def pointer(self, step: int) -> str:
        """Ray Train's checkpoint directory of ``step`` (``<run>/checkpoint_<N>``)."""
        return storage.join(self.root, self.pointer_name(step))

    def pointer_steps(self) -> list[int]:
        """The steps of the checkpoints Ray Train records for the run (its ``checkpoint_<N>`` directories),
        ascending; empty when the directory is missing, CheckpointError when it cannot be listed."""
        return _steps(self.root, POINTER_DIR)

    # -- the rest ------------------------------------------------------------------------------------
    @property
    def pins(self) -> str:
        """Checkpoints an evaluation is reading, kept from retention (``<run>/pins/step_<N>.json``:
        :mod:`raytrn.checkpoint.pins`)."""
        return storage.join(self.root, "pins")

    @property
    def nxd(self) -> str:
        """neuronx-distributed's shards (the frozen XLA path): ``<run>/nxd``."""
        return storage.join(self.root, NXD_DIR)

    @property
    def lease(self) -> str:
        """The lease of the job training the run (``<run>/raytrn-lease.json``)."""
        return storage.join(self.root, LEASE_FILE)

    @property
    def mlflow_marker(self) -> str:
        """The file naming the run's MLflow run (``<run>/raytrn-mlflow.json``)."""
        return storage.join(self.root, MLFLOW_MARKER)


def _steps(directory: str, pattern: re.Pattern[str]) -> list[int]:
    """The steps of ``directory``'s entries named by ``pattern``; none when it does not exist. CheckpointError
    when it cannot be listed (storage unreachable, access denied): a run that took that for "no checkpoints"
    would start over, and its first save would then overwrite them."""
    fs, path = storage.filesystem(directory)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.storage: cannot list {directory} ({str(e).strip().splitlines()[0]}); not going on as if the "
            "run had no checkpoints (it would start over). Check that the storage is reachable and the credentials "
            "allow listing it, then run again"
        ) from None
    return sorted(
        int(m.group(1)) for i in infos if i.type == pafs.FileType.Directory and (m := pattern.match(i.base_name))
    )
