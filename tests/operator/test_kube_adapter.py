"""KubeCluster's HTTP requests, over a real socket, as an API server receives them.

No API server runs on this machine, so a loopback HTTP server records each
request and answers like one (200 with an object, 404, 409); the ``k8s``
suite covers the real thing. What is checked here is our side of the wire:
paths, verbs, server-side-apply content type and query, label selectors,
error handling.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvstrata.operator.kube import FIELD_MANAGER, KubeCluster


class RecordingAPIServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.answers: dict[tuple[str, str], tuple[int, Any]] = {}


class _Handler(BaseHTTPRequestHandler):
    server: RecordingAPIServer

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path, _, query = self.path.partition("?")
        self.server.requests.append(
            {
                "method": self.command,
                "path": path,
                "query": query,
                "content_type": self.headers.get("Content-Type"),
                "body": json.loads(body) if body else None,
            }
        )
        status, payload = self.server.answers.get((self.command, path), (404, {"kind": "Status"}))
        if payload == "echo":
            payload = json.loads(body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[RecordingAPIServer]:
    server = RecordingAPIServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def kube(api) -> KubeCluster:
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{api.server_address[1]}"
    return KubeCluster(client.ApiClient(config))


CM = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ml"}}


def test_apply_is_a_forced_server_side_apply_patch(api, kube):
    api.answers[("PATCH", "/api/v1/namespaces/ml/configmaps/c")] = (200, "echo")
    assert kube.apply(CM) == CM
    (request,) = api.requests
    assert request["method"] == "PATCH"
    assert request["content_type"] == "application/apply-patch+yaml"
    assert sorted(request["query"].split("&")) == [f"fieldManager={FIELD_MANAGER}", "force=true"]
    assert request["body"] == CM


def test_a_missing_object_reads_as_none_and_a_grouped_kind_uses_apis(api, kube):
    assert kube.get("apps/v1", "StatefulSet", "ml", "v") is None
    assert api.requests[0]["path"] == "/apis/apps/v1/namespaces/ml/statefulsets/v"
    api.answers[("GET", "/apis/kvstrata.io/v1alpha1/namespaces/ml/kvcaches/demo")] = (
        200,
        {"kind": "KVCache", "metadata": {"name": "demo"}},
    )
    assert kube.get("kvstrata.io/v1alpha1", "KVCache", "ml", "demo")["kind"] == "KVCache"


def test_list_sends_the_label_selector_and_patch_a_merge_patch(api, kube):
    api.answers[("GET", "/api/v1/namespaces/ml/pods")] = (200, {"items": [{"a": 1}, {"b": 2}]})
    assert len(kube.list("v1", "Pod", "ml", "kvstrata.io/cache=demo")) == 2
    assert parse_qs(api.requests[0]["query"]) == {"labelSelector": ["kvstrata.io/cache=demo"]}
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/w"
    api.answers[("PATCH", path)] = (200, {"ok": True})
    kube.patch("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", "", "w", {"x": 1})
    assert api.requests[1]["path"] == path
    assert api.requests[1]["content_type"] == "application/merge-patch+json"


def test_has_kind_reads_the_group_version_resource_list(api, kube):
    assert kube.has_kind("monitoring.coreos.com/v1", "ServiceMonitor") is False
    api.answers[("GET", "/apis/monitoring.coreos.com/v1")] = (
        200,
        {"resources": [{"name": "servicemonitors", "kind": "ServiceMonitor"}]},
    )
    assert kube.has_kind("monitoring.coreos.com/v1", "ServiceMonitor") is True


def test_a_refused_write_raises_with_the_status_and_path(api, kube):
    api.answers[("PATCH", "/api/v1/namespaces/ml/configmaps/c")] = (409, {"reason": "Conflict"})
    with pytest.raises(ApiException) as refused:
        kube.apply(CM)
    assert refused.value.status == 409
    assert "/api/v1/namespaces/ml/configmaps/c" in str(refused.value)
