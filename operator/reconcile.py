"""Reconcile one KVCache: render, apply, check the shared tier, roll workloads, report.

Why this module exists: the kopf handlers stay a few lines; everything they
decide lives here, in plain functions over a :class:`Cluster` (the real one
is :class:`kvstrata.operator.kube.KubeCluster`), so tests drive it without a
cluster.

The status it writes, ``KVCache.status`` (patched whole on every pass)::

    status:
      observedGeneration: 3            # metadata.generation this status describes
      configHash: "9f1c2e0a7b3d4c5e"   # digest of sidecar.yaml + spec; on pod templates
      configMap: "demo-sidecar"        # the ConfigMap holding sidecar.yaml
      sharedTier: "valkey-managed"     # none | valkey-managed | valkey-external | s3
      endpoints:
        sidecar: "ipc:///var/run/kvstrata/sidecar.sock"
        valkey: "redis://demo-valkey.ns.svc:6379/0"     # only with a Valkey tier
        s3: "s3://bucket/prefix/"                       # only with an S3 tier
      injectedPods: 4                  # pods labelled kvstrata.io/cache=NAME
      conditions:                      # Ready, SharedTierReady, Degraded
      - type: Ready
        status: "True"                 # "True" | "False" | "Unknown"
        reason: Reconciled             # CamelCase, see the reasons below
        message: "config 9f1c2e0a applied; shared tier valkey-managed ready"
        observedGeneration: 3
        lastTransitionTime: "2026-01-01T00:00:00Z"   # changes only when status flips

Reasons: ``Reconciled`` and ``AllTiersReady`` (all good); ``InvalidSpec``
(the sidecar's loader refused the rendered config; the message is the
loader's, naming the field); ``NoSharedTier``, ``ValkeyStarting``,
``ValkeyReady``, ``ValkeyReachable``, ``ValkeyUnreachable``, ``BucketReady``,
``BucketCreated``, ``BucketMissing``, ``S3Unreachable`` (shared tier);
``LifecycleNotApplied``, ``SweepFailed`` (an S3 tier usable but not bounded
as its spec asks). ``Ready`` is True when the config is applied and the
shared tier usable; ``Degraded`` is True for a bad spec, an unreachable tier
or an unbounded S3 prefix, not while Valkey starts.

Outcomes: a spec the sidecar's loader refuses gives ``Ready=False`` with
reason ``InvalidSpec`` and the loader's message, and ``permanent`` set (the
handler raises ``kopf.PermanentError``); a shared tier not yet ready gives
``retry_after`` (the handler raises ``kopf.TemporaryError``).
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstrata.operator import encryption as E
from kvstrata.operator import resources as R
from kvstrata.operator import sharedtier
from kvstrata.operator import spec as S
from kvstrata.operator.cluster import Cluster, Event
from kvstrata.operator.model import PASSWORD_KEY, KVCache, KVCacheLike
from kvstrata.operator.rollout import roll_workloads

logger = logging.getLogger(__name__)

CONVERGE_DELAY_S = 10.0  # retry while the managed Valkey starts
UNREACHABLE_DELAY_S = 30.0  # retry while an external tier does not answer
SERVICEMONITOR_API = ("monitoring.coreos.com/v1", "ServiceMonitor")


@dataclass(slots=True)
class Outcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    retry_after: float | None = None  # converging: try again after this many seconds
    permanent: str | None = None  # the spec is wrong: retrying will not help
    s3_sweep: sharedtier.Sweep | None = None  # the S3 size sweep of this pass, when it ran


@dataclass(frozen=True, slots=True)
class Probes:
    """How reconcile reaches shared tiers (replaceable in tests by other real servers)."""

    ping_valkey: Callable[[str, str | None], sharedtier.Probe] = sharedtier.ping_valkey
    ensure_s3: Callable[[sharedtier.S3Target, str], sharedtier.Probe] = sharedtier.ensure_s3


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]],
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> None:
    """Upsert one condition; keep lastTransitionTime unless the status flips."""
    status = "True" if ok else "False"
    for cond in conditions:
        if cond.get("type") == ctype:
            if cond.get("status") != status:
                cond["lastTransitionTime"] = now
            cond.update(status=status, reason=reason, message=message)
            cond["observedGeneration"] = generation
            return
    conditions.append(
        {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": now,
        }
    )


def secret_value(cluster: Cluster, namespace: str, name: str | None, key: str) -> str | None:
    """Decode one key of a Secret; None when the Secret or the key is absent."""
    if not name:
        return None
    secret = cluster.get("v1", "Secret", namespace, name)
    raw = ((secret or {}).get("data") or {}).get(key)
    return base64.b64decode(raw).decode() if raw else None


def desired_objects(kvcache: KVCacheLike, cluster: Cluster) -> tuple[list[dict], str, str]:
    """Every object this KVCache owns, the config hash, and the sidecar.yaml text.

    Raises :class:`~kvstrata.operator.spec.SpecError` for a spec the sidecar refuses.
    """
    kvcache = KVCache.parse(kvcache)
    _, text = S.render_sidecar_config(kvcache)
    digest = S.config_hash(kvcache, text)
    objects = [R.render_configmap(kvcache, text, digest)]
    shared = kvcache.spec.shared
    if shared.kind == "valkey-managed":
        if shared.managed_valkey.auth_enabled:
            objects.append(R.render_valkey_secret(kvcache, _stable_password(kvcache, cluster)))
        objects += R.render_valkey_services(kvcache)
        objects.append(R.render_valkey_statefulset(kvcache))
    service, monitor = R.render_metrics_objects(kvcache)
    objects.append(service)  # scraped by this ServiceMonitor or the chart's cluster-wide one
    if kvcache.spec.metrics.service_monitor_enabled:
        objects.append(monitor)
    return objects, digest, text


def _stable_password(kvcache: KVCache, cluster: Cluster) -> str:
    """The password already stored in the auth Secret, else a new one (kept from then on)."""
    name = S.valkey_auth_secret_name(kvcache.name)
    stored = secret_value(cluster, kvcache.namespace, name, PASSWORD_KEY)
    return stored or R.new_password()


def ensure_keys(kvcache: KVCache, cluster: Cluster, now: str, events: list[Event]) -> None:
    """Create, rotate and prune the KVCache's encryption keys (:mod:`.encryption`).

    Apart from :func:`desired_objects` because the keys Secret depends on the
    clock and its own current content, and never on the config hash: a
    rotation must not roll the workloads (the sidecars re-read the mount).
    Raises :class:`~kvstrata.operator.spec.SpecError` for a bad ``rotateEvery``.
    """
    name = E.keys_secret_name(kvcache.name)
    existing = cluster.get("v1", "Secret", kvcache.namespace, name)
    moment = dt.datetime.strptime(now, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    secret, changes = E.desired_keys_secret(kvcache, existing, moment)
    if secret is None:
        return
    cluster.apply(secret)
    events.extend(Event("Normal", "EncryptionKeys", change) for change in changes)


def apply_objects(cluster: Cluster, objects: list[dict], events: list[Event]) -> None:
    """Apply each object; record an Event for the ones that were created or changed."""
    for obj in objects:
        meta = obj["metadata"]
        before = cluster.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        after = cluster.apply(obj)
        old_rv = ((before or {}).get("metadata") or {}).get("resourceVersion")
        new_rv = (after.get("metadata") or {}).get("resourceVersion")
        if before is None:
            events.append(Event("Normal", "Created", f"created {obj['kind']} {meta['name']}"))
        elif old_rv != new_rv:
            events.append(Event("Normal", "Updated", f"updated {obj['kind']} {meta['name']}"))


def check_shared_tier(
    kvcache: KVCacheLike, cluster: Cluster, probes: Probes
) -> tuple[sharedtier.Probe, dict[str, str]]:
    """Is the shared tier usable? Also the endpoints to report in status."""
    kvcache = KVCache.parse(kvcache)
    shared = kvcache.spec.shared
    kind = shared.kind
    endpoints: dict[str, str] = {"sidecar": S.ENDPOINT}
    if kind == "none":
        return sharedtier.Probe(True, "NoSharedTier", "no shared tier configured"), endpoints
    if kind == "s3":
        target = _s3_target(kvcache, cluster)
        endpoints["s3"] = f"s3://{target.bucket}/{target.prefix}"
        return probes.ensure_s3(target, f"{kvcache.namespace}/{kvcache.name}"), endpoints
    url = S.valkey_url(kvcache)
    endpoints["valkey"] = url
    if kind == "valkey-managed":
        return _managed_valkey_ready(cluster, kvcache.namespace, kvcache.name), endpoints
    external = shared.valkey_or_default.external  # valkey-external: always set
    ref = external.password_secret_ref if external is not None else None
    password = (
        secret_value(cluster, kvcache.namespace, ref.name, ref.key) if ref is not None else None
    )
    return probes.ping_valkey(url, password), endpoints


def _s3_target(kvcache: KVCache, cluster: Cluster) -> sharedtier.S3Target:
    """The bucket as the operator reaches it, with the credentials the KVCache names."""
    s3 = kvcache.spec.shared.s3_or_default
    creds = s3.credentials_secret_ref
    access_key_id = secret_access_key = None
    if creds is not None:
        access_key_id = secret_value(
            cluster, kvcache.namespace, creds.name, creds.access_key_id_key
        )
        secret_access_key = secret_value(
            cluster, kvcache.namespace, creds.name, creds.secret_access_key_key
        )
    return sharedtier.S3Target(
        bucket=str(s3.bucket),
        prefix=S.s3_prefix(kvcache),
        region=s3.region,
        endpoint=s3.endpoint or None,
        access_key_id=access_key_id,
        secret_access_key=secret_access_key,
        create_bucket=s3.create_bucket,
        expiry_days=s3.expiry_days,
        max_size_bytes=S.s3_max_size_bytes(kvcache),
    )


def _managed_valkey_ready(cluster: Cluster, namespace: str, name: str) -> sharedtier.Probe:
    sts = cluster.get("apps/v1", "StatefulSet", namespace, S.valkey_name(name)) or {}
    want = int((sts.get("spec") or {}).get("replicas", 1))
    ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
    if ready >= want:
        return sharedtier.Probe(True, "ValkeyReady", f"{ready}/{want} Valkey pods ready")
    return sharedtier.Probe(False, "ValkeyStarting", f"{ready}/{want} Valkey pods ready")


@dataclass(slots=True)
class StatusReport:
    """The ``status`` one pass writes: recomputed whole, conditions upserted in place.

    Starts from the stored conditions so that ``lastTransitionTime`` survives
    a pass that does not flip a condition.
    """

    generation: int
    now: str
    status: dict[str, Any]

    @classmethod
    def start(cls, kvcache: Mapping[str, Any], now: str) -> StatusReport:
        generation = int((kvcache.get("metadata") or {}).get("generation", 1))
        old = kvcache.get("status") or {}
        conditions = [dict(c) for c in old.get("conditions") or []]
        return cls(generation, now, {"observedGeneration": generation, "conditions": conditions})

    def set(self, ctype: str, ok: bool, reason: str, message: str) -> None:
        set_condition(
            self.status["conditions"], ctype, ok, reason, message, self.generation, self.now
        )

    def reason(self, ctype: str) -> str | None:
        """The reason the condition ``ctype`` has now (None when it is not set)."""
        found = next((c for c in self.status["conditions"] if c.get("type") == ctype), {})
        return found.get("reason")

    def invalid_spec(self, message: str) -> None:
        self.set("Ready", False, "InvalidSpec", message)
        self.set("Degraded", True, "InvalidSpec", message)

    def shared_tier(self, probe: sharedtier.Probe, digest: str, tier: str) -> None:
        """SharedTierReady from the probe; Ready and Degraded from it and the applied config."""
        self.set("SharedTierReady", probe.ok, probe.reason, probe.message)
        if probe.ok:
            msg = f"config {digest} applied; shared tier {tier} ready"
            self.set("Ready", True, "Reconciled", msg)
            if probe.reason in sharedtier.USABLE_BUT_DEGRADED:
                self.set("Degraded", True, probe.reason, f"{msg}; {probe.message}")
            else:
                self.set("Degraded", False, "AllTiersReady", msg)
            return
        msg = f"config {digest} applied; shared tier {tier}: {probe.message}"
        self.set("Ready", False, probe.reason, msg)
        # A starting Valkey is converging, not degraded.
        self.set("Degraded", not _converging(probe), probe.reason, msg)


def _converging(probe: sharedtier.Probe) -> bool:
    return probe.reason == "ValkeyStarting"


def retry_delay(probe: sharedtier.Probe) -> float | None:
    """Seconds until the next try: None for a usable tier, soon while Valkey starts, else later."""
    if probe.ok:
        return None
    return CONVERGE_DELAY_S if _converging(probe) else UNREACHABLE_DELAY_S


def shared_tier_event(before_reason: str | None, probe: sharedtier.Probe) -> Event | None:
    """The Event for a shared tier that is not usable (or not bounded): once per new
    reason, not every retry."""
    if probe.ok and probe.reason not in sharedtier.USABLE_BUT_DEGRADED:
        return None
    if before_reason == probe.reason:
        return None
    return Event("Normal" if _converging(probe) else "Warning", probe.reason, probe.message)


def _servable(objects: list[dict], cluster: Cluster, events: list[Event]) -> list[dict]:
    """The objects whose kinds the cluster serves (a ServiceMonitor needs its CRD)."""
    if any(o["kind"] == "ServiceMonitor" for o in objects) and not cluster.has_kind(
        *SERVICEMONITOR_API
    ):
        events.append(
            Event("Warning", "ServiceMonitorSkipped", "the ServiceMonitor CRD is not installed")
        )
        return [o for o in objects if o["kind"] != "ServiceMonitor"]
    return objects


def reconcile(
    kvcache: Mapping[str, Any],
    cluster: Cluster,
    probes: Probes | None = None,
    now: str | None = None,
    webhook_config: str | None = None,
) -> Outcome:
    """One reconcile pass; safe to repeat (apply is idempotent, status is recomputed)."""
    now = now or now_iso()
    report = StatusReport.start(kvcache, now)
    events: list[Event] = []
    try:
        parsed = KVCache.parse(kvcache)
        objects, digest, _ = desired_objects(parsed, cluster)
        # Before the objects: a pod the new config admits finds its keys mounted.
        ensure_keys(parsed, cluster, now, events)
    except S.SpecError as exc:
        report.invalid_spec(str(exc))
        events.append(Event("Warning", "InvalidSpec", str(exc)))
        return Outcome(status=report.status, events=events, permanent=str(exc))
    apply_objects(cluster, _servable(objects, cluster, events), events)
    probe, endpoints = check_shared_tier(parsed, cluster, probes or Probes())
    skipped: list[str] = []
    roll_workloads(cluster, parsed.namespace, parsed.name, digest, events, webhook_config, skipped)
    selector = f"{S.CACHE_LABEL}={S.cache_label_value(parsed.name)}"
    pods = cluster.list("v1", "Pod", parsed.namespace, selector)
    tier = parsed.spec.shared.kind
    report.status.update(
        configHash=digest,
        configMap=S.configmap_name(parsed.name),
        sharedTier=tier,
        endpoints=endpoints,
        injectedPods=len(pods),
        notRolled=skipped,
    )
    before = report.reason("SharedTierReady")
    report.shared_tier(probe, digest, tier)
    event = shared_tier_event(before, probe)
    if event is not None:
        events.append(event)
    return Outcome(
        status=report.status,
        events=events,
        retry_after=retry_delay(probe),
        s3_sweep=probe.sweep,
    )
