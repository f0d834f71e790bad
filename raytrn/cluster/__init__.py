"""Ray clusters for raytrn: validation of cluster-launcher YAMLs and KubeRay manifests (see cluster/)."""

from raytrn.cluster.kuberay import validate_kuberay_file
from raytrn.cluster.validate import validate_cluster_file

__all__ = ["validate_cluster_file", "validate_kuberay_file"]
