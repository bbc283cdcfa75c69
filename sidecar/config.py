"""The one typed config schema of the sidecar.

This schema is the contract between three parties:

* the operator, which renders a ``KVCache`` spec into a ConfigMap holding
  ``sidecar.yaml`` (``render`` side: :func:`dump_config`);
* the sidecar's loader (:func:`load_config`), which reads that YAML file,
  applies ``KVSTRATA_*`` environment overrides and refuses bad config with
  a message naming the field;
* the tests, which build configs in code.

Every field has a default, so ``kvstrata sidecar`` with no flags runs a
CPU + disk cache on the local machine.

Environment overrides use ``__`` as the nesting separator, for example
``KVSTRATA_L1__SIZE_BYTES=2Gi`` or ``KVSTRATA_SHARED__BACKEND=valkey``.
Values are parsed as YAML scalars (``true``, ``3``, ``0.5``, ``null``).

Sizes accept integers (bytes) or Kubernetes quantities (``512Mi``, ``4Gi``,
``1G``, ``500k``).

The schema is assembled here from sections; the shared tier's live in
:mod:`.config_shared` and the tenants' in :mod:`.tenant_config` (every
field is listed in the generated ``docs/configuration.md``).
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    model_validator,
)

from kvstrata.sidecar.config_base import ByteSize, ConfigSection
from kvstrata.sidecar.config_base import parse_quantity as parse_quantity  # re-exported

# The shared tier's sections, re-exported: the tiers import them from here.
from kvstrata.sidecar.config_shared import S3Config as S3Config
from kvstrata.sidecar.config_shared import SharedConfig as SharedConfig
from kvstrata.sidecar.config_shared import ValkeyConfig as ValkeyConfig
from kvstrata.sidecar.cpus import parse_cpu_list
from kvstrata.sidecar.endpoint import check_endpoint, default_endpoint, endpoint_is_local
from kvstrata.sidecar.tenant_config import TenantConfig, check_shared_budgets, check_tenants
from kvstrata.sidecar.transfer_mode import ModeSetting

ENV_PREFIX = "KVSTRATA_"
ENV_NESTING = "__"


class ConfigError(ValueError):
    """Bad sidecar configuration; the message names the offending field."""


def _default_l2_path() -> str:
    """``$XDG_CACHE_HOME/kvstrata/l2`` (``~/.cache`` for an unset ``XDG_CACHE_HOME``, the
    temporary directory where that cannot be written): the default ``l2.path``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.access(os.path.dirname(base.rstrip("/")) or "/", os.W_OK):
        base = tempfile.gettempdir()
    return os.path.join(base, "kvstrata", "l2")


_Section = ConfigSection


class L1Config(_Section):
    """L1: the pinned CPU arena (a shared-memory segment)."""

    size_bytes: ByteSize = Field(1 << 30, description="arena size")
    policy: Literal["lru", "lfu", "fifo", "s3fifo"] = Field(
        "lru",
        description="eviction policy (s3fifo: a small FIFO of ~10%, a main FIFO, a ghost queue)",
    )
    prefix_aware: bool = Field(
        True, description="within one prefix chain, evict the tail before the head"
    )
    shm_name: str | None = Field(
        None,
        description="shared-memory segment name; generated under a prefix owned by "
        "server.endpoint when unset (stale segments of that prefix are removed at start)",
    )
    fit_to_shm: bool = Field(
        False,
        description="when /dev/shm has less room than size_bytes, shrink the arena to fit "
        "(leaving 10% to others) instead of refusing to start",
    )
    pin_memory: bool = Field(True, description="register the arena as pinned when CUDA is present")
    namespace_quota_bytes: ByteSize | None = Field(
        None,
        description="most bytes one namespace (model/tenant fingerprint) may hold in L1; "
        "a store beyond it evicts that namespace's own chunks first",
    )


class L2Config(_Section):
    """L2: a capacity-bounded directory of chunk files on local disk."""

    enabled: bool = Field(True, description="keep a disk tier")
    path: str = Field(
        default_factory=_default_l2_path,
        description="directory for chunk files, XX/KEY.kvs (KEY: the key in hex, XX: its last "
        "2 digits), re-indexed from their headers at start",
    )
    size_bytes: ByteSize = Field(4 << 30, description="bytes of chunk files kept on disk")
    write_queue_depth: int = Field(64, ge=1, description="pending writes before drops")
    namespace_quota_bytes: ByteSize | None = Field(
        None,
        description="most file bytes one namespace (model/tenant fingerprint) may hold in L2; "
        "a write beyond it evicts that namespace's own least recent files first",
    )
    writer_threads: int = Field(2, ge=1, le=64, description="threads writing chunk files")
    direct_io: bool = Field(
        True,
        description="read and write chunk files past the page cache (O_DIRECT) where the "
        "filesystem allows it; false: through the page cache",
    )


class EncryptionConfig(_Section):
    """Encryption at rest of every object below L1 (AES-256-GCM; docs/security.md)."""

    mode: Literal["off", "on", "required"] = Field(
        "off",
        description="off: plaintext objects; on: seal new objects, still read plaintext "
        "ones (migration); required: refuse to start without a key and never serve a "
        "plaintext object",
    )
    key_dir: str | None = Field(
        None,
        description="folder of the keys (a mounted Secret: <id>.key files and keyring.json "
        "naming the writing key), re-read when it changes",
    )
    reload_seconds: float = Field(
        10.0, gt=0, description="how often the key folder is checked for a change"
    )


class ServerConfig(_Section):
    """The sidecar's endpoints."""

    endpoint: Annotated[str, AfterValidator(check_endpoint)] = Field(
        default_factory=default_endpoint,
        description="ZeroMQ endpoint: ipc://PATH, ipc://@NAME (abstract socket) or tcp://HOST:PORT",
    )
    socket_group: str | None = Field(
        None,
        description="group (name or gid) of the ipc:// socket files, created 0660; "
        "unset: the sidecar's own group",
    )
    http_host: str = Field(
        "0.0.0.0", description="all addresses: Prometheus and the kubelet reach the pod IP"
    )
    status_detail: bool = Field(
        False, description="/status lists each client (id, role, pid, leases); off: a count"
    )
    curve_secret_key_file: str | None = Field(
        None,
        description="ZeroMQ CURVE certificate of the server (public and secret key, as "
        "zmq.auth writes it, from a Secret); required for a tcp:// endpoint off loopback",
    )
    curve_client_keys_dir: str | None = Field(
        None, description="directory of the public certificates of the clients allowed in"
    )

    client_uids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="uids whose processes may open a session (HELLO), as the kernel "
        "reports them on the ipc:// socket; unset: the uid of the first client only "
        "(one client per sidecar). Not for tcp:// endpoints, which carry no uid",
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> ServerConfig:
        if self.client_uids is not None and not self.endpoint.startswith("ipc://"):
            raise ValueError(
                f"server.client_uids: {self.client_uids!r} needs an ipc:// endpoint "
                f"(server.endpoint is {self.endpoint!r}; tcp carries no peer uid)"
            )
        curve = (self.curve_secret_key_file, self.curve_client_keys_dir)
        if (curve[0] is None) != (curve[1] is None):
            raise ValueError(
                "server.curve_secret_key_file and server.curve_client_keys_dir go together"
            )
        if curve[0] is None and not endpoint_is_local(self.endpoint):
            raise ValueError(
                f"server.endpoint: {self.endpoint!r} is reachable from other machines; "
                "bind a loopback address or authenticate clients with "
                "server.curve_secret_key_file and server.curve_client_keys_dir"
            )
        return self

    http_port: int = Field(9464, ge=0, le=65535, description="/metrics /healthz /readyz /status")
    lease_seconds: float = Field(
        10.0,
        gt=0,
        description="a lease not released by then expires (a copy takes milliseconds; "
        "this bounds how long a client that never commits holds arena space)",
    )
    session_write_fraction: float = Field(
        0.25,
        gt=0,
        le=1,
        description="write bytes one session may hold, as a fraction of L1: its uncommitted "
        "write leases and its expired ones whose writer has not said it is done (their "
        "slots stay pinned until then); one chunk is always allowed; a PREPARE_STORE "
        'beyond it gets nil slots, counted in kvstrata_errors_total{kind="write_budget"}',
    )
    chunk_max_fraction: float = Field(
        0.25,
        gt=0,
        le=1,
        description="the largest chunk a PREPARE_STORE may ask for, as a fraction of L1: "
        "bounds what the one chunk a session is always allowed can pin; a larger one is "
        'refused as a bad request (kvstrata_errors_total{kind="bad_request"})',
    )
    client_timeout_seconds: float = Field(
        60.0, gt=0, description="a client silent this long has its leases reclaimed"
    )
    max_sessions_per_peer: int = Field(
        16,
        ge=1,
        description="sessions one ZeroMQ connection may hold open (a client says HELLO once "
        "per process; a HELLO beyond it is refused with error busy)",
    )
    max_sessions_per_uid: int = Field(
        256,
        ge=1,
        description="sessions the processes of one uid may hold open, where the ipc:// "
        "socket reports the uid (a vLLM pod's scheduler and workers share one); a HELLO "
        "beyond it is refused with error busy",
    )
    max_queued_reply_bytes: ByteSize = Field(
        64 << 20,
        ge=1 << 20,
        description="bytes of replies one connection may have waiting unread in the "
        "sidecar; a reply past it is dropped and the client gets a short busy error instead",
    )


class IpcConfig(_Section):
    """How ipc mode's copies reach the arena (``kvstrata bench transfer`` measures both)."""

    copy_path: Literal["zero_copy", "staging"] = Field(
        "zero_copy",
        description="zero_copy: the kernels read and write the pinned arena over PCIe; "
        "staging: the kernels use a device buffer, the copy engines move it to the arena",
    )
    staging_bytes: ByteSize = Field(
        256 << 20,
        ge=1 << 20,
        description="device memory per GPU for copy_path staging (at least 1Mi); a chunk "
        "larger than this is copied zero-copy",
    )
    max_ctas: int = Field(
        0,
        ge=0,
        le=65535,
        description="at most this many thread blocks per copy kernel (0: as many as fill "
        "the GPU); a few leave vLLM's kernels most of the SMs at some cost in copy speed",
    )


def _cpu_list(value: object) -> str | None:
    """A CPU list, checked; a bare number (``KVSTRATA_CPUS=1`` reads as one) as its text."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError("expected a CPU list such as '1' or '2-3,6'")
    text = str(value)
    parse_cpu_list(text)
    return text


class SidecarConfig(_Section):
    """The whole sidecar configuration."""

    chunk_size: int = Field(256, ge=1, description="tokens per chunk; a multiple of the block size")
    transfer_mode: ModeSetting = Field(
        ModeSetting.AUTO,
        description="auto: serve ipc mode where the csrc CUDA library finds a GPU, else host "
        "(the reason given to clients at HELLO); ipc: the same, logged as a warning when it "
        "cannot; host: copies through the shared-memory arena only",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="least severe level logged"
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="text, or json: one object per line with the request id"
    )
    cpus: Annotated[str | None, BeforeValidator(_cpu_list)] = Field(
        None,
        description="CPUs every sidecar thread runs on, a Linux CPU list ('1', '2-3,6'); unset: "
        "wherever the process may. On vLLM-CPU, the cores vLLM does not bind its compute "
        "threads to (see kvstrata.sidecar.cpus)",
    )
    young_eviction_seconds: float = Field(
        60.0,
        gt=0,
        description="an eviction from L1 or L2 of an object stored less than this long ago "
        "counts in kvstrata_young_evictions_total: the cache thrashing, the autoscaling "
        "signal (docs/autoscaling.md)",
    )
    l1: L1Config = Field(default_factory=L1Config)
    l2: L2Config = Field(default_factory=L2Config)
    shared: SharedConfig = Field(default_factory=SharedConfig)
    encryption: EncryptionConfig = Field(default_factory=EncryptionConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    ipc: IpcConfig = Field(default_factory=IpcConfig)
    tenants: Annotated[list[TenantConfig], AfterValidator(check_tenants)] = Field(
        default_factory=list,
        max_length=64,
        description="per-tenant retention (kvstrata.sidecar.tenant_config); requests no "
        "tenant matches follow the cache-wide settings",
    )

    @model_validator(mode="after")
    def _check_tiers(self) -> SidecarConfig:
        if self.l1.size_bytes < (1 << 20):
            raise ValueError("l1.size_bytes must be at least 1Mi")
        pinned = sum(t.budgets.l1_bytes or 0 for t in self.tenants if t.pinned)
        if pinned > self.l1.size_bytes // 2:
            raise ValueError(
                f"tenants: pinned tenants' budgets.l1_bytes add up to {pinned} bytes, more "
                f"than half of l1.size_bytes ({self.l1.size_bytes}): nothing would be left "
                "for everyone else"
            )
        shared = self.shared
        check_shared_budgets(self.tenants, shared.backend, shared.valkey.ttl_seconds is not None)
        return self


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid sidecar config ({source}):"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {field}: {_error_text(err)}")
    return "\n".join(lines)


def _error_text(err: Any) -> str:
    """One validation error as a user reads it: the value shown once, and the
    known key nearest to a misspelt one."""
    if err["type"] == "extra_forbidden":
        known = _known_keys(err["loc"][:-1])
        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1, cutoff=0.6)
        if close:
            parent = "".join(f"{p}." for p in err["loc"][:-1])
            return f"unknown key (did you mean {parent}{close[0]}?)"
        return "unknown key (known: " + ", ".join(known) + ")" if known else "unknown key"
    message = str(err["msg"]).removeprefix("Value error, ")
    if "got " in message:  # the validator quoted the value already
        return message
    return f"{message} (got {err.get('input')!r})"


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the section at ``loc`` (empty when it is no section)."""
    model: type[BaseModel] = SidecarConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_NESTING) if p]
        if not path or (len(path) == 1 and path[0] not in SidecarConfig.model_fields):
            # KVSTRATA_CONFIG and friends are not schema fields; a nested name
            # (SECTION__KEY) always is meant as one, so a misspelt section is
            # refused by validation, with the key it was probably meant to be.
            continue
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        try:
            node[path[-1]] = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            node[path[-1]] = raw
    return tree


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(data: Mapping[str, Any], source: str = "dict") -> SidecarConfig:
    """Validate a plain mapping; raise :class:`ConfigError` naming the field."""
    try:
        return SidecarConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> SidecarConfig:
    """Load the sidecar config: embedded defaults < YAML file < environment.

    ``path`` None means no file (``KVSTRATA_CONFIG`` names one if set).
    """
    env = os.environ if env is None else env
    if path is None and env.get("KVSTRATA_CONFIG"):
        path = env["KVSTRATA_CONFIG"]
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read sidecar config {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"sidecar config {path} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"sidecar config {path}: top level must be a mapping")
        data = loaded
    overrides = _env_overrides(env)
    if overrides:
        source += " + environment"
    return config_from_dict(_merge(data, overrides), source)


def dump_config(config: SidecarConfig) -> str:
    """Render a config as the YAML the loader reads back (the ConfigMap body)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=True)
