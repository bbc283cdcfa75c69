"""The volumes an injected pod gets: the shared memory, L2 and the Secrets.

Why a module of its own: which volume backs L2 (an emptyDir, an ephemeral
claim, an existing claim), which Secret files the rendered config points at
and how the encryption keys reach the sidecar are each rules of their own,
apart from how the containers are built (:mod:`.sidecar_container`) and
from the decision to inject at all (:mod:`.mutate`).
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping
from typing import Any

from kvstrata.operator import encryption as E
from kvstrata.operator import spec as S
from kvstrata.operator.model import (
    ACCESS_KEY_ID_KEY,
    CA_KEY,
    PASSWORD_KEY,
    SECRET_ACCESS_KEY_KEY,
    KVCache,
    L2Volume,
)

__all__ = ["key_volumes", "l2_volume", "mebibytes", "secret_volumes", "shm_volume_of"]


def mebibytes(nbytes: int) -> str:
    """A Kubernetes quantity of at least ``nbytes``, in whole MiB."""
    return f"{math.ceil(nbytes / (1 << 20))}Mi"


def shm_volume_of(container: Mapping[str, Any]) -> str | None:
    for mount in container.get("volumeMounts") or []:
        if posixpath.normpath(str(mount.get("mountPath", ""))) == "/dev/shm":
            return str(mount.get("name"))
    return None


def l2_volume(volume: L2Volume, size_bytes: int) -> dict[str, Any]:
    size = mebibytes(size_bytes + size_bytes // 20)  # files + a little for directories
    if volume.type == "existingClaim":
        return {"name": "kvstrata-l2", "persistentVolumeClaim": {"claimName": volume.claim_name}}
    if volume.type == "ephemeral":
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": size}},
        }
        if volume.storage_class_name:
            claim["storageClassName"] = volume.storage_class_name
        return {"name": "kvstrata-l2", "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}
    empty: dict[str, Any] = {"sizeLimit": size}
    if volume.medium:
        empty["medium"] = volume.medium
    return {"name": "kvstrata-l2", "emptyDir": empty}


def _secret_volume(
    volume: str, secret: str | None, items: list[tuple[str, str]], mount_dir: str
) -> tuple[dict, dict]:
    """A Secret volume projecting ``items`` (key, file name); its sidecar mount at ``mount_dir``."""
    entry = {
        "name": volume,
        "secret": {
            "secretName": secret,
            "items": [{"key": k, "path": p} for k, p in items],
            # Readable by the sidecar's non-root user without an fsGroup;
            # the volume is mounted in the sidecar only.
            "defaultMode": 0o444,
        },
    }
    mount = {"name": volume, "mountPath": mount_dir, "readOnly": True}
    return entry, mount


def secret_volumes(kvcache: KVCache) -> list[tuple[dict, dict]]:
    """(volume, sidecar mount) for each Secret the rendered config names a file in.

    Each key is projected to the file name the config points at (the key's
    default name), whatever key the KVCache names.
    """
    shared = kvcache.spec.shared
    kind = shared.kind
    if kind == "valkey-managed" and shared.managed_valkey.auth_enabled:
        secret = S.valkey_auth_secret_name(kvcache.name)
        items = [(PASSWORD_KEY, PASSWORD_KEY)]
        return [_secret_volume("kvstrata-valkey-auth", secret, items, S.VALKEY_SECRET_DIR)]
    out: list[tuple[dict, dict]] = []
    external = shared.valkey_or_default.external
    if kind == "valkey-external" and external is not None:
        ref = external.password_secret_ref
        if ref is not None:
            items = [(ref.key, PASSWORD_KEY)]
            out.append(_secret_volume("kvstrata-valkey-auth", ref.name, items, S.VALKEY_SECRET_DIR))
        ca = external.tls.ca_secret_ref if external.tls is not None else None
        if ca is not None:
            items = [(ca.key, CA_KEY)]
            out.append(
                _secret_volume("kvstrata-valkey-tls", ca.name, items, S.VALKEY_TLS_SECRET_DIR)
            )
    elif kind == "s3" and shared.s3_or_default.credentials_secret_ref is not None:
        creds = shared.s3_or_default.credentials_secret_ref
        items = [
            (creds.access_key_id_key, ACCESS_KEY_ID_KEY),
            (creds.secret_access_key_key, SECRET_ACCESS_KEY_KEY),
        ]
        out.append(_secret_volume("kvstrata-s3", creds.name, items, S.S3_SECRET_DIR))
    return out


def key_volumes(kvcache: KVCache) -> list[tuple[dict, dict]]:
    """The encryption keys Secret, whole: a rotation adds files the pod must see
    (a Secret volume with ``items``, or a ``subPath`` mount, would never show them)."""
    if kvcache.spec.encryption.mode == "off":
        return []
    entry = {
        "name": "kvstrata-keys",
        "secret": {
            "secretName": E.keys_secret_name(kvcache.name),
            # As the other Secrets: the sidecar's user reads it without an fsGroup.
            "defaultMode": 0o444,
        },
    }
    mount = {"name": "kvstrata-keys", "mountPath": S.ENCRYPTION_KEY_DIR, "readOnly": True}
    return [(entry, mount)]
