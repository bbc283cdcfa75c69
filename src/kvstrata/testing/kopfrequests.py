"""The API requests kopf's peering makes, recorded as RBAC verbs.

Why this module exists: the chart grants the operator what kopf's peering
needs on its peering kind. A list of verbs written beside the chart would only
restate the chart; here kopf's own peering code (the keep-alive with its
farewell, the clean-up of a dead peer, the watcher of the peering objects)
runs against a stand-in API server on loopback that answers for one peering
object and records every request. Each request becomes what the API server's
RBAC authorizer would check: ``(group, resource, verb, name)``, with the verb
derived from the HTTP method and ``?watch`` as the authorizer does
(``get``/``list``/``watch`` for GET, ``patch``, ``create``, ``update``,
``delete``), the subresource folded into the resource (``kind/status``), and
the name ``None`` for a request on the collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Request:
    """One request as the RBAC authorizer sees it."""

    group: str
    resource: str
    verb: str
    name: str | None
    namespace: str | None


def as_request(method: str, path: str, query: dict[str, str]) -> Request:
    """An ``/apis/GROUP/VERSION[/namespaces/NS]/PLURAL[/NAME[/SUB]]`` request as RBAC names it."""
    parts = path.strip("/").split("/")
    if parts[0] != "apis" or len(parts) < 4:
        raise ValueError(f"not a request on a resource of an API group: {method} {path}")
    group, rest = parts[1], parts[3:]
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], (rest[1] if len(rest) > 1 else None)
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else "get" if name else "list"
    else:
        verb = {"PATCH": "patch", "POST": "create", "PUT": "update"}.get(method)
        if method == "DELETE":
            verb = "delete" if name else "deletecollection"
        if verb is None:
            raise ValueError(f"an HTTP method RBAC does not name: {method} {path}")
    return Request(group, resource, verb, name, namespace)


class PeeringStandIn:
    """A loopback HTTP server holding one peering object; it records every request."""

    def __init__(self, plural: str, kind: str, name: str, namespace: str | None) -> None:
        self.plural, self.kind, self.name, self.namespace = plural, kind, name, namespace
        self.requests: list[Request] = []
        self.watched = asyncio.Event()  # set once a watch request came
        self.body: dict[str, Any] = {
            "apiVersion": "kopf.dev/v1",
            "kind": kind,
            "metadata": {"name": name, "resourceVersion": "1"}
            | ({"namespace": namespace} if namespace else {}),
            "status": {},
        }
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        recorded = as_request(request.method, request.path, query)
        self.requests.append(recorded)
        if recorded.verb == "watch":
            self.watched.set()
            response = web.StreamResponse()
            await response.prepare(request)
            event = {"type": "MODIFIED", "object": self.body}
            await response.write(json.dumps(event).encode() + b"\n")
            return response  # the stream ends: kopf reconnects, which is fine here
        if recorded.verb == "list":
            return web.json_response(
                {
                    "apiVersion": "kopf.dev/v1",
                    "kind": f"{self.kind}List",
                    "metadata": {"resourceVersion": self.body["metadata"]["resourceVersion"]},
                    "items": [self.body],
                }
            )
        if recorded.verb == "patch":
            patch = await request.json()
            status = self.body.setdefault("status", {})
            for identity, entry in (patch.get("status") or {}).items():
                if entry is None:
                    status.pop(identity, None)
                else:
                    status[identity] = entry
            return web.json_response(self.body)
        return web.json_response(self.body)


async def peering_requests(
    clusterwide: bool, name: str = "kvstrata", namespace: str = "ml"
) -> list[Request]:
    """Run kopf's peering against a stand-in and return the requests it made.

    What runs is what ``kopf.run(peering_name=..., priority=...)`` starts for one
    peering: the keep-alive (a touch, then the farewell when cancelled), the
    watcher of the peering objects (a list, then a watch), and the clean-up a
    replica does when it sees a dead peer. ``namespace`` is where the KopfPeering
    is (unused cluster-wide: a ClusterKopfPeering has none).
    """
    from kopf._cogs.clients import auth
    from kopf._cogs.configs import configuration
    from kopf._cogs.structs import credentials, references
    from kopf._core.engines import peering
    from kopf._core.reactor import queueing

    plural, kind = (
        ("clusterkopfpeerings", "ClusterKopfPeering")
        if clusterwide
        else ("kopfpeerings", "KopfPeering")
    )
    where = None if clusterwide else namespace
    stand_in = PeeringStandIn(plural, kind, name, where)
    await stand_in.start()
    try:
        vault = credentials.Vault()
        await vault.populate({"stand-in": credentials.ConnectionInfo(server=stand_in.url)})
        auth.vault_var.set(vault)
        settings = configuration.OperatorSettings()
        settings.peering.name = name
        settings.peering.priority = 7
        settings.peering.clusterwide = clusterwide
        settings.watching.reconnect_backoff = 0.1
        resource = references.Resource(
            group="kopf.dev",
            version="v1",
            plural=plural,
            kind=kind,
            namespaced=not clusterwide,
            verbs=["list", "watch", "patch", "get"],
        )
        identity = peering.Identity("replica-a")
        keepalive = asyncio.create_task(
            peering.keepalive(
                namespace=where, resource=resource, identity=identity, settings=settings
            )
        )
        watcher = asyncio.create_task(
            queueing.watcher(
                settings=settings,
                resource=resource,
                namespace=where,
                processor=_ignore,
            )
        )
        await asyncio.wait_for(stand_in.watched.wait(), 30)
        # A peer gone silent for longer than its lifetime: the replica cleans it out.
        dead = {"priority": 1, "lifetime": 1, "lastseen": "2000-01-01T00:00:00+00:00"}
        event = {"type": "MODIFIED", "object": {**stand_in.body, "status": {"gone": dead}}}
        await peering.process_peering_event(
            raw_event=event,  # type: ignore[arg-type]
            namespace=where,
            resource=resource,
            identity=identity,
            settings=settings,
        )
        for task in (watcher, keepalive):  # the keep-alive says farewell when cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async for _key, _info, context in vault.extended(auth.APIContext, "contexts"):
            await context.close()  # kopf's HTTP session, which kopf.run would close
    finally:
        await stand_in.stop()
    return stand_in.requests


async def _ignore(**_: Any) -> None:
    """The watcher's processor: what the events mean is not the question here."""
