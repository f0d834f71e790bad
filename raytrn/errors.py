"""Errors raised for user mistakes.

Every user-facing failure is a :class:`RaytrnError`: the CLI prints its message (what, where, how to
fix) and exits with code 2 instead of showing a traceback. The classes are pickle-safe so they
survive crossing Ray actor boundaries.
"""

from __future__ import annotations


class RaytrnError(Exception):
    """A mistake the user can fix; the message says what, where and how."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # pickle-safe across Ray actor boundaries
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class ConfigError(RaytrnError):
    """The job spec (YAML file or --set override) is invalid."""


class DataError(RaytrnError):
    """A dataset, manifest, shard or tokenizer is missing or inconsistent."""


class BackendError(RaytrnError):
    """The requested accelerator backend is misconfigured for this job."""


class BackendUnavailableError(BackendError):
    """The accelerator's packages are not installed on this machine (e.g. torch-neuronx off a trn host)."""


class CheckpointError(RaytrnError):
    """A checkpoint cannot be resumed: incomplete, written for another model, or in a format this layout
    cannot read."""


class RunStopped(RaytrnError):
    """A state no restart of the worker group can fix (the run diverged again after its rollback, the checkpoint
    storage failed too many saves in a row). Raised on every rank alike, at the same step: the workers record it
    on the job's progress board and return, and the driver ends the run FAILED with this message, instead of Ray
    Train restarting the group ``scaling.max_failures`` times into the same failure."""


class CheckpointsFailing(CheckpointError, RunStopped):
    """``checkpoint.max_consecutive_failures`` saves in a row failed."""
