"""``raytrn sweep``: many training jobs as one experiment (Ray Tune), early-stopped and compared in MLflow."""
