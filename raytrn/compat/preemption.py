"""Ray Train's preemption handling, as raytrn's hosted controller uses it (private Ray Train APIs).

A preemption notice (a spot interruption: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) puts Ray Train's
controller in its preempting state until the notice's deadline. raytrn's workers checkpoint at the same step and
train no further (:mod:`raytrn.train.preemption`), then report :data:`NOTICE_COMMITTED`; the hosted controller
(:mod:`raytrn.compat.controller`) restarts the group without the draining node on that report, not at the deadline.
"""

from __future__ import annotations

#: The private names this module relies on (merged into :data:`raytrn.compat.PRIVATE_NAMES`).
PRIVATE_NAMES: dict[str, str] = {
    "Ray Train preemption budget": "ray.train.v2._internal.execution.failure_handling.default:_is_preemption_failure",
    "Ray Train preemption poll variable": "ray.train.v2._internal.constants:PREEMPTION_POLL_INTERVAL_S_ENV_VAR",
}

#: How often a hosted controller's preemption watcher asks Ray for the draining nodes (one GCS call, in a thread of
#: the driver; Ray's default 5 s): a notice is acted on at most this much later.
PREEMPTION_POLL_S = 1.0

#: The metric every worker of a group reports to Ray Train (``ray.train.report``, no checkpoint) once its preemption
#: notice's checkpoint is committed and it trains no further: the step. A hosted controller then restarts the group
#: without the draining node at once instead of waiting out the notice's deadline (stock Ray Train's workers may
#: still be training until then; raytrn's only idle: a spot notice's 2 minutes on every node).
NOTICE_COMMITTED = "raytrn_notice_committed"


def is_preemption_failure(error: BaseException) -> bool:
    """Whether Ray Train charges the failure ``error`` to ``FailureConfig.max_preemption_failures`` (unlimited by
    default) rather than to ``max_failures``: its controller's ``PreemptionError`` (it waited out a notice), or a
    worker group's failure in which a worker died with its node preempted (``RayActorError.preempted``: a drained
    node taken away, e.g. a live replica's that left on the notice).

    ``ray.train.v2._internal.execution.failure_handling.default._is_preemption_failure``; public alternative: none.
    """
    from ray.train.v2._internal.execution.failure_handling.default import _is_preemption_failure

    return bool(_is_preemption_failure(error))  # type: ignore[arg-type]  # (any error: False for others)


def preemption_poll_s() -> float:
    """The preemption watcher's poll interval: ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` when the user set it (Ray's
    variable, ``ray.train.v2._internal.constants``; public alternative: none), else :data:`PREEMPTION_POLL_S`."""
    import os

    from ray.train.v2._internal.constants import PREEMPTION_POLL_INTERVAL_S_ENV_VAR

    return float(os.environ.get(PREEMPTION_POLL_INTERVAL_S_ENV_VAR) or PREEMPTION_POLL_S)
