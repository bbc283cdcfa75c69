"""What the Kubernetes API server checks on objects, beyond what a JSON schema shows.

Why this module exists: the operator's objects (ConfigMap, Secret, Services,
StatefulSet, the webhook's Pod patch) pass the OpenAPI schemas and can still
be refused at creation, e.g. a container port named ``kvstrata-metrics``
(16 characters: a port name is at most 15). Those rules live in the API
server's Go validation code, not in any schema; this module restates the
ones the operator's objects can break, so cluster-free tests find such
defects before a real API server (or a user) does.

Each rule cites where Kubernetes defines it. Paths are in kubernetes/kubernetes
(``pkg/apis/core/validation/validation.go`` as *core*,
``pkg/apis/apps/validation/validation.go`` as *apps*) and
kubernetes/apimachinery (``pkg/util/validation/validation.go`` as *util*,
``pkg/api/validation/objectmeta.go`` as *objectmeta*,
``pkg/api/resource/quantity.go`` as *quantity*); the API reference at
https://kubernetes.io/docs/reference/kubernetes-api/ says the same in prose.
Only rules of Kubernetes 1.29 and later that hold in every later version are
modelled (the strictest form where a later version relaxed one).

:func:`validate` returns a list of messages (empty: the API server would
take the object), each naming the field like the API server's own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# -- util: names --------------------------------------------------------------------

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # util IsDNS1123Label, <= 63
DNS1123_SUBDOMAIN = re.compile(  # util IsDNS1123Subdomain, <= 253
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # util IsDNS1035Label, <= 63
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")  # util, <= 63
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")  # util, <= 63
# util IsEnvVarName: "a valid environment variable name must consist of alphabetic
# characters, digits, '_', '-', or '.', and must not start with a digit".
ENV_VAR_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # util IsConfigMapKey, <= 253
# quantity: "<signedNumber><suffix>", suffix binary (Ki..Ei), decimal SI (n u m "" k M G T P E)
# or a decimal exponent (e|E followed by a signed integer).
QUANTITY = re.compile(
    r"^[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$"
)


def dns1123_label(value: Any, field: str) -> list[str]:
    if not isinstance(value, str) or len(value) > 63 or not DNS1123_LABEL.match(value):
        return [f"{field}: Invalid value: {value!r}: must be a lowercase RFC 1123 label (<= 63)"]
    return []


def dns1123_subdomain(value: Any, field: str) -> list[str]:
    if not isinstance(value, str) or len(value) > 253 or not DNS1123_SUBDOMAIN.match(value):
        return [
            f"{field}: Invalid value: {value!r}: must be a lowercase RFC 1123 subdomain (<= 253)"
        ]
    return []


def dns1035_label(value: Any, field: str) -> list[str]:
    if not isinstance(value, str) or len(value) > 63 or not DNS1035_LABEL.match(value):
        return [f"{field}: Invalid value: {value!r}: must be an RFC 1035 label (<= 63)"]
    return []


def port_name(value: Any, field: str) -> list[str]:
    """util IsValidPortName: an IANA_SVC_NAME (RFC 6335 section 5.1)."""
    if not isinstance(value, str):
        return [f"{field}: Invalid value: {value!r}: a port name is a string"]
    out = []
    if len(value) > 15:
        out.append(f"{field}: Invalid value: {value!r}: must be no more than 15 characters")
    if not re.match(r"^[-a-z0-9]+$", value):
        out.append(f"{field}: Invalid value: {value!r}: must contain only [-a-z0-9]")
    if not re.search(r"[a-z]", value):
        out.append(f"{field}: Invalid value: {value!r}: must contain at least one letter")
    if "--" in value:
        out.append(f"{field}: Invalid value: {value!r}: must not contain consecutive hyphens")
    if value.startswith("-") or value.endswith("-"):
        out.append(f"{field}: Invalid value: {value!r}: must not begin or end with a hyphen")
    return out


def port_number(value: Any, field: str) -> list[str]:
    """util IsValidPortNum: 1..65535."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        return [f"{field}: Invalid value: {value!r}: must be between 1 and 65535, inclusive"]
    return []


def port_num_or_name(value: Any, field: str) -> list[str]:
    """core ValidatePortNumOrName (probe ports, Service targetPort)."""
    return port_number(value, field) if isinstance(value, int) else port_name(value, field)


def qualified_name(key: Any, field: str) -> list[str]:
    """util IsQualifiedName: optional DNS-subdomain prefix and '/', then a name <= 63."""
    if not isinstance(key, str):
        return [f"{field}: Invalid value: {key!r}: a key is a string"]
    prefix, _, name = key.rpartition("/")
    out = []
    if "/" in key and (not prefix or dns1123_subdomain(prefix, field)):
        out.append(f"{field}: Invalid value: {key!r}: prefix must be a DNS subdomain")
    if len(name) > 63 or not QUALIFIED_NAME.match(name):
        out.append(f"{field}: Invalid value: {key!r}: name part must be a qualified name (<= 63)")
    return out


def label_value(value: Any, field: str) -> list[str]:
    """util IsValidLabelValue: <= 63, alphanumerics at both ends, '-_.' inside."""
    if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
        return [f"{field}: Invalid value: {value!r}: must be a valid label value (<= 63)"]
    return []


def labels(mapping: Any, field: str) -> list[str]:
    out: list[str] = []
    for key, value in (mapping or {}).items():
        out += qualified_name(key, f"{field}")
        out += label_value(value, f"{field}[{key}]")
    return out


def quantity(value: Any, field: str) -> list[str]:
    """quantity ParseQuantity: an integer (bytes, cores) or a quantity string."""
    if isinstance(value, int) and not isinstance(value, bool):
        return []
    if not isinstance(value, str) or not QUANTITY.match(value):
        return [f"{field}: Invalid value: {value!r}: quantities must match the regular expression"]
    return []


def _amount(value: Any) -> float:
    """A parsed quantity, for comparing requests with limits."""
    if isinstance(value, int):
        return float(value)
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    scale |= {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    scale |= {"P": 1e15, "E": 1e18}
    match = re.match(r"^([+-]?[\d.]+)(.*)$", value)
    assert match is not None
    number, suffix = match.groups()
    if suffix[:1] in ("e", "E") and suffix not in scale:
        return float(number) * 10 ** int(suffix[1:])
    return float(number) * scale.get(suffix, 1)


def parse_quantity(value: Any) -> float:
    """The value of a quantity the API server would take (bytes for memory)."""
    errors = quantity(value, "quantity")
    if errors:
        raise ValueError(errors[0])
    return _amount(value)


# -- objectmeta -----------------------------------------------------------------------


def object_meta(obj: Mapping[str, Any], name_rule=dns1123_subdomain) -> list[str]:
    """objectmeta ValidateObjectMeta: name by the kind's rule, namespace a label, labels."""
    meta = obj.get("metadata") or {}
    out = name_rule(meta.get("name"), "metadata.name")
    if meta.get("namespace") is not None:
        out += dns1123_label(meta["namespace"], "metadata.namespace")
    out += labels(meta.get("labels"), "metadata.labels")
    for key in meta.get("annotations") or {}:
        out += qualified_name(key, "metadata.annotations")
    return out


# -- core: pods -------------------------------------------------------------------------


def resources(spec: Any, field: str) -> list[str]:
    """core ValidateResourceRequirements: quantities; a request never above its limit."""
    out: list[str] = []
    spec = spec or {}
    for section in ("requests", "limits"):
        for key, value in (spec.get(section) or {}).items():
            out += qualified_name(key, f"{field}.{section}")
            out += quantity(value, f"{field}.{section}[{key}]")
    if out:
        return out
    limits = spec.get("limits") or {}
    for key, value in (spec.get("requests") or {}).items():
        if key in limits and _amount(value) > _amount(limits[key]):
            out.append(f"{field}.requests[{key}]: Invalid value: must be <= {key} limit")
    return out


def probe(spec: Any, field: str, ports: set[str], liveness_or_startup: bool) -> list[str]:
    """core validateProbe: one handler, a port that is a number or a name, thresholds >= 1.

    The kubelet resolves a named port among the container's ports; a name no
    port has makes the probe fail forever, so it is checked too.
    """
    out: list[str] = []
    handlers = [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if h in spec]
    if len(handlers) != 1:
        out.append(f"{field}: Required value: must specify exactly one handler type")
    for h in ("httpGet", "tcpSocket"):
        if h in spec:
            port = spec[h].get("port")
            out += port_num_or_name(port, f"{field}.{h}.port")
            if isinstance(port, str) and port not in ports:
                out.append(f"{field}.{h}.port: Invalid value: {port!r}: no container port of it")
    for key in ("periodSeconds", "failureThreshold", "successThreshold", "timeoutSeconds"):
        if key in spec and (not isinstance(spec[key], int) or spec[key] < 1):
            out.append(f"{field}.{key}: Invalid value: {spec[key]!r}: must be at least 1")
    if liveness_or_startup and spec.get("successThreshold", 1) != 1:
        out.append(f"{field}.successThreshold: Invalid value: must be 1")
    return out


def container(spec: Mapping[str, Any], field: str, volumes: set[str], init: bool) -> list[str]:
    """core validateContainers / validateInitContainers for one container."""
    out = dns1123_label(spec.get("name"), f"{field}.name")
    if not spec.get("image"):
        out.append(f"{field}.image: Required value")  # core: validateContainersOnlyForPod
    restartable = spec.get("restartPolicy")
    if restartable is not None and (not init or restartable != "Always"):
        # Only init containers take restartPolicy, and only "Always" (native
        # sidecars; SidecarContainers, beta and on from 1.29).
        out.append(f"{field}.restartPolicy: Forbidden: {restartable!r}")
    port_names: set[str] = set()
    for i, port in enumerate(spec.get("ports") or []):
        pfield = f"{field}.ports[{i}]"
        out += port_number(port.get("containerPort"), f"{pfield}.containerPort")
        if "name" in port:
            out += port_name(port["name"], f"{pfield}.name")
            if port["name"] in port_names:
                out.append(f"{pfield}.name: Duplicate value: {port['name']!r}")
            port_names.add(port["name"])
    for i, env in enumerate(spec.get("env") or []):
        name = env.get("name")
        if not isinstance(name, str) or not ENV_VAR_NAME.match(name):
            out.append(f"{field}.env[{i}].name: Invalid value: {name!r}: not a valid env var name")
        if "value" in env and "valueFrom" in env:
            out.append(f"{field}.env[{i}].valueFrom: Invalid value: may not be set with value")
    mount_paths: set[str] = set()
    for i, mount in enumerate(spec.get("volumeMounts") or []):
        if mount.get("name") not in volumes:
            out.append(f"{field}.volumeMounts[{i}].name: Not found: {mount.get('name')!r}")
        path = mount.get("mountPath")
        if not path:
            out.append(f"{field}.volumeMounts[{i}].mountPath: Required value")
        elif path in mount_paths:
            out.append(
                f"{field}.volumeMounts[{i}].mountPath: Invalid value: {path!r}: must be unique"
            )
        mount_paths.add(path)
    out += resources(spec.get("resources"), f"{field}.resources")
    for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
        if kind not in spec:
            continue
        if init and restartable != "Always":
            # core validateInitContainers: "may not be set for init containers
            # without restartPolicy=Always" (the refusal seen on 1.28 without the gate).
            out.append(
                f"{field}.{kind}: Forbidden: may not be set for init containers "
                "without restartPolicy=Always"
            )
            continue
        live_or_startup = kind != "readinessProbe"
        out += probe(spec[kind], f"{field}.{kind}", port_names, live_or_startup)
    return out


def volume(spec: Mapping[str, Any], field: str) -> list[str]:
    """core validateVolumes for the sources the operator uses."""
    out = dns1123_label(spec.get("name"), f"{field}.name")
    sources = [k for k in spec if k != "name"]
    if len(sources) != 1:
        out.append(f"{field}: Invalid value: must specify exactly one volume source")
    if "emptyDir" in spec and (spec["emptyDir"] or {}).get("sizeLimit") is not None:
        out += quantity(spec["emptyDir"]["sizeLimit"], f"{field}.emptyDir.sizeLimit")
    if "configMap" in spec:
        out += dns1123_subdomain(spec["configMap"].get("name"), f"{field}.configMap.name")
    if "secret" in spec:
        out += dns1123_subdomain(spec["secret"].get("secretName"), f"{field}.secret.secretName")
        mode = spec["secret"].get("defaultMode")
        if mode is not None and not 0 <= mode <= 0o777:
            out.append(f"{field}.secret.defaultMode: Invalid value: {mode!r}")
    if "persistentVolumeClaim" in spec:
        claim = spec["persistentVolumeClaim"].get("claimName")
        out += dns1123_subdomain(claim, f"{field}.persistentVolumeClaim.claimName")
    if "ephemeral" in spec:
        claim = ((spec["ephemeral"].get("volumeClaimTemplate") or {}).get("spec")) or {}
        storage = ((claim.get("resources") or {}).get("requests") or {}).get("storage")
        out += quantity(storage, f"{field}.ephemeral...requests.storage")
    return out


def pod_spec(
    spec: Mapping[str, Any], field: str = "spec", claim_volumes: Iterable[str] = ()
) -> list[str]:
    """core ValidatePodSpec: volumes, containers, names unique across all containers.

    ``claim_volumes``: a StatefulSet's volumeClaimTemplates, which its pods
    mount as volumes (apps ValidateStatefulSetSpec adds them the same way).
    """
    out: list[str] = []
    volume_names: set[str] = set(claim_volumes)
    for i, vol in enumerate(spec.get("volumes") or []):
        out += volume(vol, f"{field}.volumes[{i}]")
        if vol.get("name") in volume_names:
            out.append(f"{field}.volumes[{i}].name: Duplicate value: {vol.get('name')!r}")
        volume_names.add(vol.get("name"))
    names: set[str] = set()
    containers = spec.get("containers") or []
    if not containers:
        out.append(f"{field}.containers: Required value")
    for kind, init in (("initContainers", True), ("containers", False)):
        for i, c in enumerate(spec.get(kind) or []):
            out += container(c, f"{field}.{kind}[{i}]", volume_names, init)
            # core validateInitContainers: init and app container names share one namespace.
            if c.get("name") in names:
                out.append(f"{field}.{kind}[{i}].name: Duplicate value: {c.get('name')!r}")
            names.add(c.get("name"))
    return out


def pod(obj: Mapping[str, Any]) -> list[str]:
    meta = obj.get("metadata") or {}
    # A pod may come without a name (generateName, filled in before validation).
    rule = dns1123_subdomain if meta.get("name") is not None else (lambda v, f: [])
    return object_meta(obj, rule) + pod_spec(obj.get("spec") or {})


# -- core: services, config maps, secrets ----------------------------------------------


def service(obj: Mapping[str, Any]) -> list[str]:
    """core ValidateService: name an RFC 1035 label; ports named by DNS-1123 labels."""
    out = object_meta(obj, dns1035_label)
    spec = obj.get("spec") or {}
    ports = spec.get("ports") or []
    seen: set[str] = set()
    for i, port in enumerate(ports):
        field = f"spec.ports[{i}]"
        if len(ports) > 1 or "name" in port:
            out += dns1123_label(port.get("name"), f"{field}.name")
        if port.get("name") in seen:
            out.append(f"{field}.name: Duplicate value: {port.get('name')!r}")
        seen.add(port.get("name"))
        out += port_number(port.get("port"), f"{field}.port")
        if "targetPort" in port:
            out += port_num_or_name(port["targetPort"], f"{field}.targetPort")
    for key, value in (spec.get("selector") or {}).items():
        out += qualified_name(key, "spec.selector")
        out += label_value(value, f"spec.selector[{key}]")
    return out


def data_keys(obj: Mapping[str, Any]) -> list[str]:
    """core ValidateConfigMap / ValidateSecret: keys are config map keys (<= 253)."""
    out = object_meta(obj)
    for section in ("data", "binaryData", "stringData"):
        for key in obj.get(section) or {}:
            if len(key) > 253 or not CONFIG_MAP_KEY.match(key) or key in (".", ".."):
                out.append(f"{section}[{key}]: Invalid value: not a valid config key")
    return out


# -- apps --------------------------------------------------------------------------------

STATEFULSET_NAME_MAX = 52  # NAME-<10-char hash> must be a label value (kubernetes#64023)


def _selects(selector: Mapping[str, Any], template_labels: Mapping[str, Any]) -> bool:
    wanted = selector.get("matchLabels") or {}
    return bool(wanted) and all(template_labels.get(k) == v for k, v in wanted.items())


def workload(obj: Mapping[str, Any]) -> list[str]:
    """apps ValidateStatefulSet / ValidateDeployment: the pod template and its selector."""
    out = object_meta(obj)
    name = (obj.get("metadata") or {}).get("name") or ""
    if obj.get("kind") == "StatefulSet":
        # The StatefulSet name is used as a label value (controller-revision-hash)
        # and in every pod's hostname, so the controller's pods need it short.
        if len(name) > STATEFULSET_NAME_MAX:
            out.append(f"metadata.name: Invalid value: {name!r}: longer than 52 characters")
        out += dns1123_label(name, "metadata.name")
        service_name = (obj.get("spec") or {}).get("serviceName")
        if service_name is not None:
            out += dns1035_label(service_name, "spec.serviceName")
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    tmeta = template.get("metadata") or {}
    out += labels(tmeta.get("labels"), "spec.template.metadata.labels")
    if not _selects(spec.get("selector") or {}, tmeta.get("labels") or {}):
        out.append("spec.template.metadata.labels: Invalid value: `selector` does not match")
    out += labels((spec.get("selector") or {}).get("matchLabels"), "spec.selector.matchLabels")
    claims = spec.get("volumeClaimTemplates") or []
    claim_names = [(c.get("metadata") or {}).get("name") for c in claims]
    out += pod_spec(template.get("spec") or {}, "spec.template.spec", claim_names)
    for i, claim in enumerate(claims):
        out += dns1123_subdomain((claim.get("metadata") or {}).get("name"), f"claim[{i}].name")
        storage = (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get(
            "storage"
        )
        out += quantity(storage, f"spec.volumeClaimTemplates[{i}]...storage")
    return out


def custom_object(obj: Mapping[str, Any]) -> list[str]:
    """A custom resource (e.g. a ServiceMonitor): object meta only; the schema does the rest."""
    return object_meta(obj)


VALIDATORS = {
    "Pod": pod,
    "Service": service,
    "ConfigMap": data_keys,
    "Secret": data_keys,
    "StatefulSet": workload,
    "Deployment": workload,
}


def validate(obj: Mapping[str, Any]) -> list[str]:
    """The refusals the API server would give ``obj`` at creation (empty: none)."""
    check = VALIDATORS.get(str(obj.get("kind")), custom_object)
    return [
        f"{obj.get('kind')} {(obj.get('metadata') or {}).get('name')!r}: {e}" for e in check(obj)
    ]


def service_targets(service_obj: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """Each named targetPort of the Service is a port of a container in each pod it selects.

    Not an API server rule (Endpoints just stay empty); the symptom of a
    mismatch is a Service without endpoints, so nothing is scraped.
    """
    selector = (service_obj.get("spec") or {}).get("selector") or {}
    out: list[str] = []
    for p in pods:
        pod_labels = (p.get("metadata") or {}).get("labels") or {}
        if not selector or any(pod_labels.get(k) != v for k, v in selector.items()):
            out.append(f"Service {service_obj['metadata']['name']!r} does not select the pod")
            continue
        spec = p.get("spec") or {}
        named = {
            port.get("name")
            for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
            for port in c.get("ports") or []
        }
        for port in (service_obj.get("spec") or {}).get("ports") or []:
            target = port.get("targetPort")
            if isinstance(target, str) and target not in named:
                out.append(f"targetPort {target!r} is no container port of the pod ({named})")
    return out


# -- apimachinery: label selectors, as the API server evaluates a webhook's ---------------


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """apimachinery ``metav1.LabelSelectorAsSelector``: every term must hold; an empty
    selector matches everything. How the API server picks the namespaces (and objects)
    a webhook is sent (``namespaceSelector`` / ``objectSelector``)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for term in selector.get("matchExpressions") or []:
        key, op, values = term["key"], term["operator"], term.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True
