"""Everything the operator creates passes what the API server checks beyond the schemas.

The rules are :mod:`kvstrata.testing.apirules` (each citing the Kubernetes
validation code it restates). The first tests pin the rules to refusals a
real API server gave; the rest run them over the objects reconcile renders
and the pods the webhook injects, for many generated KVCaches, names and
namespaces, the longest legal ones included.
"""

from __future__ import annotations

import copy
import string

import jsonpatch
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstrata.operator import reconcile as rec
from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod
from kvstrata.testing import apirules

from .conftest import InMemoryCluster, make_kvcache, make_pod

# -- the rules, against refusals a real API server gives -----------------------------


def test_a_port_name_over_15_characters_is_refused_as_the_api_server_does():
    # kube-apiserver v1.28.7: 'spec.ports[0].targetPort: Invalid value: "kvstrata-metrics":
    # must be no more than 15 characters'
    assert apirules.port_name("kvstrata-metrics", "targetPort") == [
        "targetPort: Invalid value: 'kvstrata-metrics': must be no more than 15 characters"
    ]
    assert apirules.port_name("metrics", "p") == []
    assert apirules.port_name("123", "p") and apirules.port_name("a--b", "p")
    assert apirules.port_name("-ab", "p") and apirules.port_name("Metrics", "p")


def test_probes_on_an_init_container_without_restart_policy_always_are_forbidden():
    # kube-apiserver v1.28.7 without SidecarContainers dropped restartPolicy, then:
    # 'spec.initContainers[1].livenessProbe: Forbidden: may not be set for init
    # containers without restartPolicy=Always'
    init = {"name": "side", "image": "i", "livenessProbe": {"tcpSocket": {"port": 80}}}
    pod = {"spec": {"initContainers": [init], "containers": [{"name": "c", "image": "i"}]}}
    errors = apirules.pod_spec(pod["spec"])
    assert errors == [
        "spec.initContainers[0].livenessProbe: Forbidden: may not be set for init "
        "containers without restartPolicy=Always"
    ]
    init["restartPolicy"] = "Always"
    assert apirules.pod_spec(pod["spec"]) == []


@pytest.mark.parametrize(
    ("rule", "good", "bad"),
    [
        (apirules.dns1123_label, ["a", "a-1", "0a", "a" * 63], ["A", "a.b", "-a", "a" * 64]),
        (
            apirules.dns1123_subdomain,
            ["a.b-c", "0.1", ".".join(["a" * 63] * 3) + "." + "a" * 61],
            ["a..b", "a_b", "a" * 254],
        ),
        (apirules.dns1035_label, ["a", "a-1", "a" * 63], ["0a", "a.b", "a-", "a" * 64]),
        (apirules.label_value, ["", "A_b.c-1", "a" * 63], ["-a", "a/b", "a" * 64]),
        (
            apirules.quantity,
            ["1Gi", "512Mi", "500m", "0.5", "1e3", 7, "+1"],
            ["1GiB", "Gi", "1 Gi"],
        ),
    ],
)
def test_name_and_quantity_rules(rule, good, bad):
    for value in good:
        assert rule(value, "f") == [], value
    for value in bad:
        assert rule(value, "f") != [], value


def test_env_var_names_follow_the_api_servers_rule():
    def errors(name: str) -> list[str]:
        pod = {"containers": [{"name": "c", "image": "i", "env": [{"name": name, "value": "v"}]}]}
        return apirules.pod_spec(pod)

    for name in ("PYTHONHASHSEED", "_x", "a.b-c", "-dash"):
        assert errors(name) == [], name
    for name in ("1ABC", "A=B", "A B", ""):
        assert errors(name), name


def test_duplicate_container_port_and_volume_names_are_refused():
    spec = {
        "volumes": [{"name": "v", "emptyDir": {}}, {"name": "v", "emptyDir": {}}],
        "initContainers": [{"name": "c", "image": "i", "restartPolicy": "Always"}],
        "containers": [
            {
                "name": "c",
                "image": "i",
                "ports": [
                    {"name": "metrics", "containerPort": 1},
                    {"name": "metrics", "containerPort": 2},
                ],
            }
        ],
    }
    found = " ".join(apirules.pod_spec(spec))
    assert "volumes[1].name: Duplicate" in found
    assert "containers[0].name: Duplicate" in found
    assert "ports[1].name: Duplicate" in found


# -- the operator's objects, over many KVCaches ------------------------------------------

LABEL_CHARS = string.ascii_lowercase + string.digits


def dns_label(max_size: int = 63) -> st.SearchStrategy[str]:
    inner = st.text(LABEL_CHARS + "-", max_size=max(0, max_size - 2))
    edge = st.sampled_from(LABEL_CHARS)
    return st.builds(lambda a, m, b: (a + m + b)[:max_size].rstrip("-") or a, edge, inner, edge)


def dns_subdomain() -> st.SearchStrategy[str]:
    return (
        st.lists(dns_label(), min_size=1, max_size=5)
        .map(lambda ls: ".".join(ls)[:253])
        .map(lambda s: s.rstrip("-."))
    )


SIZES = st.sampled_from(["64Mi", "256Mi", "1Gi", "8Gi", "64Gi", 1 << 30, "512Gi"])

SHARED = st.one_of(
    st.just({}),
    st.builds(
        lambda auth, replicas, persist: {
            "backend": "valkey",
            "valkey": {
                "managed": {
                    "replicas": replicas,
                    "auth": {"enabled": auth},
                    "persistence": {"enabled": persist, "size": "2Gi"},
                    "maxMemory": "1Gi",
                }
            },
        },
        st.booleans(),
        st.integers(1, 3),
        st.booleans(),
    ),
    st.builds(
        lambda secret, ca: {
            "backend": "valkey",
            "valkey": {
                "external": {
                    "url": "rediss://valkey.cache.svc:6380/0",
                    "passwordSecretRef": {"name": secret, "key": "pw.key"},
                    "tls": {"caSecretRef": {"name": ca}},
                }
            },
        },
        dns_subdomain(),
        dns_subdomain(),
    ),
    st.builds(
        lambda secret: {
            "backend": "s3",
            "s3": {"bucket": "kv", "credentialsSecretRef": {"name": secret}},
        },
        dns_subdomain(),
    ),
)

L2 = st.one_of(
    st.just({"enabled": False}),
    st.builds(lambda size: {"size": size}, SIZES),
    st.builds(
        lambda sc: {"size": "2Gi", "volume": {"type": "ephemeral", "storageClassName": sc}},
        dns_subdomain(),
    ),
    st.builds(
        lambda claim: {"volume": {"type": "existingClaim", "claimName": claim}}, dns_subdomain()
    ),
)

SPECS = st.fixed_dictionaries(
    {
        "l1": st.builds(lambda size: {"size": size}, SIZES),
        "l2": L2,
        "shared": SHARED,
        "transferMode": st.sampled_from(["auto", "host", "ipc"]),
        "metrics": st.builds(
            lambda port, sm: {"port": port, "serviceMonitor": {"enabled": sm}},
            st.integers(1024, 65535),
            st.booleans(),
        ),
    }
)

LONGEST_LABEL = "k" + "x" * 61 + "9"  # 63: the longest RFC 1123 label
LONGEST_SUBDOMAIN = ".".join(["a" * 63] * 3) + "." + "b" * 61  # 253


def render_all(kvcache: dict, pod: dict) -> tuple[list[dict], dict]:
    """What reconcile applies for ``kvcache``, and ``pod`` as the webhook returns it."""
    cluster = InMemoryCluster(kinds={("monitoring.coreos.com/v1", "ServiceMonitor")})
    objects, _, _ = rec.desired_objects(kvcache, cluster)
    result = mutate_pod(pod, kvcache, pod["metadata"]["namespace"])
    assert result.injected, result.skipped
    return objects, jsonpatch.apply_patch(copy.deepcopy(pod), result.patch)


def assert_api_server_takes(objects: list[dict], pod: dict) -> None:
    errors = [e for obj in [*objects, pod] for e in apirules.validate(obj)]
    for service in (
        o for o in objects if o["kind"] == "Service" and "metrics" in o["spec"]["ports"][0]["name"]
    ):
        errors += apirules.service_targets(service, [pod])
    assert errors == []


@pytest.mark.parametrize(
    ("name", "namespace"),
    [
        ("demo", "ml"),
        (LONGEST_LABEL, "n" * 63),
        (LONGEST_SUBDOMAIN, "n" * 63),
        ("0cache.v2", "ml"),  # starts with a digit, has a dot: legal for a KVCache
    ],
)
def test_every_object_for_a_managed_valkey_cache_is_one_the_api_server_takes(name, namespace):
    spec = {
        "shared": {"backend": "valkey", "valkey": {"managed": {"replicas": 2}}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }
    kvcache = make_kvcache(name, namespace, **spec)
    objects, pod = render_all(kvcache, make_pod({S.CACHE_ANNOTATION: name}, namespace=namespace))
    assert_api_server_takes(objects, pod)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ConfigMap",
        "Secret",
        "Service",
        "Service",
        "Service",
        "ServiceMonitor",
        "StatefulSet",
    ]


def test_derived_names_are_stable_and_distinct_for_long_names_sharing_a_head():
    a, b = LONGEST_LABEL, LONGEST_LABEL[:-1] + "8"
    assert S.metrics_service_name(a) == S.metrics_service_name(a)
    assert S.metrics_service_name(a) != S.metrics_service_name(b)
    assert S.valkey_name(a) != S.valkey_name(b)
    assert S.configmap_name("demo") == "demo-sidecar"  # short names are kept as they were


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.one_of(dns_label(), dns_subdomain()),
    namespace=dns_label(),
    spec=SPECS,
    inject_package=st.booleans(),
    gpu=st.booleans(),
    own_shm=st.booleans(),
)
@example(
    name=LONGEST_SUBDOMAIN,
    namespace="n" * 63,
    spec={},
    inject_package=True,
    gpu=True,
    own_shm=False,
)
@example(
    name=LONGEST_LABEL, namespace="n" * 63, spec={}, inject_package=False, gpu=False, own_shm=True
)
def test_any_kvcache_renders_objects_and_pods_the_api_server_takes(
    name, namespace, spec, inject_package, gpu, own_shm
):
    annotations = {S.CACHE_ANNOTATION: name}
    if not inject_package:
        annotations[S.INJECT_PACKAGE_ANNOTATION] = "false"
    vllm = {"name": "vllm", "image": "vllm/vllm-openai:v0.8.0", "args": ["--model", "m"]}
    if gpu:
        vllm["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    volumes = []
    if own_shm:
        vllm["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    pod = make_pod(annotations, [vllm], namespace=namespace, volumes=volumes)
    assert apirules.validate(pod) == []  # the pod as submitted is a legal one
    objects, injected = render_all(make_kvcache(name, namespace, **spec), pod)
    assert_api_server_takes(objects, injected)
