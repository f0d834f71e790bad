"""raytrn: Ray-based elastic training for AWS Trainium."""

__version__ = "0.1.0"
