"""raytrn: Ray-based elastic training for AWS Trainium."""

from raytrn.telemetry import keep_off

__version__ = "0.1.0"

keep_off()  # third-party usage telemetry off in every raytrn process, unless the user set it (raytrn.telemetry)
