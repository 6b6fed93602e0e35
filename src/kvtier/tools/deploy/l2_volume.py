"""The replicas' L2 on a shared volume: which one, its claim, and the file system it is.

`l2_volume` picks the volume of a file-system L2 (a new claim, curvine, juicefs, or the user's
existingClaim; None for no L2 or Valkey), mounted at `L2_MOUNT` on every replica;
`file_system` names its kind for the connector's L2 profile; `volume_patches` sizes the new
claim and points the shipped StorageClasses at the file's cluster. Pure functions of the file:
a volume that does not go with the backend is a `ConfigError`.
"""

from __future__ import annotations

import math
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import FleetSpec
from kvtier.tools.deploy.patches import inline

__all__ = ["L2_MOUNT", "claim_spec", "file_system", "l2_volume", "volume_patches"]

L2_MOUNT = "/mnt/kvtier-l2"


def l2_volume(spec: FleetSpec) -> str | None:
    """claim | curvine | juicefs | existingClaim; None: no volume (no L2, or Valkey)."""
    if not spec.cache.l2_enabled or spec.cache.l2.kind == "valkey":
        return None
    chosen = spec.kubernetes.l2_volume
    if spec.cache.l2.kind == "juicefs":
        if chosen not in (None, "juicefs"):
            raise ConfigError(
                f"kubernetes.l2Volume: {chosen} does not go with l2CacheBackend juicefs"
            )
        return "juicefs"
    return chosen or "claim"


def file_system(spec: FleetSpec) -> str:
    volume = l2_volume(spec)
    default = volume if volume in ("curvine", "juicefs") else "nfs"
    return spec.kubernetes.l2_file_system or default


def claim_spec(spec: FleetSpec, default_gib: float) -> dict[str, Any]:
    """A new claim's size (`l2ClaimGiB`, else `default_gib` rounded up) and class."""
    k8s = spec.kubernetes
    size = k8s.l2_claim_gib or math.ceil(default_gib)
    claim: dict[str, Any] = {"resources": {"requests": {"storage": f"{size}Gi"}}}
    if k8s.l2_storage_class is not None:
        claim["storageClassName"] = k8s.l2_storage_class
    return claim


def volume_patches(spec: FleetSpec, volume: str | None) -> list[dict[str, Any]]:
    """Inline patches of the `volume` component's objects: the new claim's size and class,
    curvine's masters, and where juicefs's StorageClass finds its Secrets (the namespace)."""
    k8s = spec.kubernetes
    patches = []
    if volume is not None and volume != "existingClaim":
        claim = {"spec": claim_spec(spec, spec.cache.l2.size_gib * 1.25)}
        patches.append(inline("PersistentVolumeClaim", "kvtier-l2", claim))
    if volume == "curvine":
        parameters = {"master-addrs": k8s.curvine_master_addrs}
        patches.append(inline("StorageClass", "kvtier-curvine", {"parameters": parameters}))
    if volume == "juicefs":
        parameters = {
            f"csi.storage.k8s.io/{role}-secret-namespace": k8s.namespace
            for role in ("provisioner", "node-publish")
        }
        patches.append(inline("StorageClass", "kvtier-juicefs", {"parameters": parameters}))
    return patches
