"""A fake Kubernetes API server of EndpointSlices (aiohttp on loopback), for discovery tests.

It honours the API's shape where discovery reads it: GET
/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices with an equality labelSelector answers an
EndpointSliceList carrying metadata.resourceVersion; with watch=true it streams JSON lines
{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...} after the given resourceVersion and
ends the stream after timeoutSeconds; a resourceVersion older than its (compactable) history gets
an ERROR event with a 410 Status, as the real server answers; no or a wrong bearer token is 401,
a verb in `forbidden` 403, with Status bodies worded like the real ones.

The test plays the EndpointSlice controller: `set_endpoint` puts a Pod's address into the slice of
its Service and port (one slice per port, as the controller groups them), `remove_endpoint` takes
it out.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from typing import Any

from aiohttp import web

TOKEN = "fake-service-account-token"
GROUP_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKubernetes:
    """EndpointSlices of one cluster; `base_url` once started. `http_gone` makes a watch from an
    expired version a plain HTTP 410 instead of the in-stream ERROR event."""

    def __init__(self, token: str | None = TOKEN) -> None:
        self.token = token
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> object
        self.version = 100
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, object)
        self.oldest = 0  # versions below this are compacted away: 410 Gone
        self.forbidden: set[str] = set()  # verbs answered 403
        self.http_gone = False
        self.lists = self.watches = 0
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(GROUP_PATH, self._endpointslices)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- the controller's side ------------------------------------------------------------------

    async def set_endpoint(
        self,
        namespace: str,
        service: str,
        labels: dict[str, str],
        pod: str,
        address: str,
        port: int,
        ready: bool = True,
        terminating: bool = False,
    ) -> dict[str, Any]:
        """Put `pod` at `address` into the slice of Kubernetes Service `service` for `port`."""
        name = f"{service}-{port}"
        old = self.slices.get((namespace, name))
        obj = copy.deepcopy(old) if old else self._new_slice(namespace, service, name, labels, port)
        endpoints = [e for e in obj["endpoints"] if e["targetRef"]["name"] != pod]
        conditions = {"ready": ready, "serving": ready or terminating, "terminating": terminating}
        endpoints.append(
            {
                "addresses": [address],
                "conditions": conditions,
                "targetRef": {"kind": "Pod", "namespace": namespace, "name": pod, "uid": _uid()},
                "nodeName": "node-1",
            }
        )
        obj["endpoints"] = sorted(endpoints, key=lambda e: e["targetRef"]["name"])
        await self._put(namespace, name, obj, "MODIFIED" if old else "ADDED")
        return obj

    async def remove_endpoint(self, namespace: str, service: str, pod: str) -> None:
        for (ns, name), obj in list(self.slices.items()):
            if (
                ns != namespace
                or obj["metadata"]["labels"]["kubernetes.io/service-name"] != service
            ):
                continue
            kept = [e for e in obj["endpoints"] if e["targetRef"]["name"] != pod]
            if len(kept) != len(obj["endpoints"]):
                obj = copy.deepcopy(obj)
                obj["endpoints"] = kept
                await self._put(ns, name, obj, "MODIFIED")

    async def put_raw(self, namespace: str, obj: dict[str, Any]) -> None:
        """Store `obj` as it is, valid or not (a test of what a client does with a broken one)."""
        await self._put(namespace, obj["metadata"]["name"], obj, "ADDED")

    async def delete_slice(self, namespace: str, name: str) -> None:
        obj = self.slices.pop((namespace, name))
        await self._record("DELETED", obj)

    async def bookmark(self) -> None:
        self.version += 1
        await self._record(
            "BOOKMARK", {"kind": "EndpointSlice", "apiVersion": _API, "metadata": {}}
        )

    async def compact(self, before: int | None = None) -> None:
        """Forget the versions below `before` (default: every one so far): watches resuming from
        one get 410, open ones still at one an ERROR event."""
        self.oldest = self.version + 1 if before is None else before
        async with self._changed:
            self._changed.notify_all()

    def _new_slice(
        self, namespace: str, service: str, name: str, labels: dict[str, str], port: int
    ) -> dict[str, Any]:
        return {
            "apiVersion": _API,
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "generateName": f"{service}-",
                "uid": _uid(),
                "labels": {
                    **labels,
                    "kubernetes.io/service-name": service,
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                },
            },
            "addressType": "IPv4",
            "endpoints": [],
            "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
        }

    async def _put(self, namespace: str, name: str, obj: dict[str, Any], kind: str) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.slices[namespace, name] = obj
        await self._record(kind, obj)

    async def _record(self, kind: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, kind, obj))
        async with self._changed:
            self._changed.notify_all()

    # -- the API server's side ------------------------------------------------------------------

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        namespace = request.match_info["namespace"]
        watch = request.query.get("watch") in ("true", "1")
        verb = "watch" if watch else "list"
        if verb in self.forbidden:
            message = (
                f'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:'
                f'{namespace}:moe-mesh" cannot {verb} resource "endpointslices" in API group '
                f'"discovery.k8s.io" in the namespace "{namespace}"'
            )
            return web.json_response(status(403, "Forbidden", message), status=403)
        wanted = _selector(request.query.get("labelSelector", ""))
        if not watch:
            self.lists += 1
            items = [
                {k: v for k, v in copy.deepcopy(o).items() if k not in ("kind", "apiVersion")}
                for (ns, _), o in sorted(self.slices.items())
                if ns == namespace and _matches(o, wanted)
            ]
            body = {
                "kind": "EndpointSliceList",
                "apiVersion": _API,
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
            return web.json_response(body)
        return await self._watch(request, namespace, wanted)

    async def _watch(
        self, request: web.Request, namespace: str, wanted: dict[str, str]
    ) -> web.StreamResponse:
        self.watches += 1
        since = int(request.query.get("resourceVersion") or self.version)
        gone = status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
        if since < self.oldest and self.http_gone:
            return web.json_response(gone, status=410)
        timeout_s = float(request.query.get("timeoutSeconds", "1800"))
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            await self._stream(resp, namespace, wanted, since, timeout_s, bookmarks)
            await resp.write_eof()
        except ConnectionResetError:  # the client went away (a closed watch): nothing to do
            pass
        return resp

    async def _stream(
        self,
        resp: web.StreamResponse,
        namespace: str,
        wanted: dict[str, str],
        since: int,
        timeout_s: float,
        bookmarks: bool,
    ) -> None:
        gone = status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if since < self.oldest:
                await _send(resp, "ERROR", gone)
                break
            for version, kind, obj in self.history:
                if version <= since:
                    continue
                since = version
                if kind == "BOOKMARK":
                    if bookmarks:
                        await _send(resp, kind, obj)
                elif obj["metadata"]["namespace"] == namespace and _matches(obj, wanted):
                    await _send(resp, kind, obj)
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    pass


_API = "discovery.k8s.io/v1"


def _uid() -> str:
    return str(uuid.uuid4())


def _selector(text: str) -> dict[str, str]:
    """Equality selectors only ("a=b,c=d"), what discovery sends."""
    return dict(part.split("=", 1) for part in text.split(",") if part)


def _matches(obj: dict[str, Any], wanted: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


async def _send(resp: web.StreamResponse, kind: str, obj: dict[str, Any]) -> None:
    await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
