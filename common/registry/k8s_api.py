"""The slice of the Kubernetes API that discovery reads: list and watch EndpointSlices by label.

Where and how to reach the API server follows in-cluster conventions: the base URL defaults to
`https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`; the bearer token, the CA and the
namespace come from the service account directory (/var/run/secrets/kubernetes.io/serviceaccount,
or MOE_MESH_K8S_SERVICE_ACCOUNT_DIR); MOE_MESH_K8S_NAMESPACE overrides the namespace (the rendered
manifests set it through the downward API). An explicit address such as `kubectl proxy`'s
http://127.0.0.1:8001 works too: without a token file no Authorization header is sent.

Failures are our exception tree with the cause in words: an unreachable server is
UnavailableError, a refused token or a missing RBAC permission PreconditionError naming the verb
and resource, an expired resourceVersion `Gone` (the caller lists again).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from common.errors import PreconditionError, UnavailableError

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
GROUP, RESOURCE = "discovery.k8s.io", "endpointslices"
LIST_PAGE = 500  # items per list call; `continue` fetches the rest


class Gone(UnavailableError):
    """410: the resourceVersion a watch resumed from is older than the server keeps; list again."""


@dataclass(frozen=True)
class KubeConfig:
    """Base URL, namespace and the files of the service account (read on every request: kubelet
    rotates projected tokens)."""

    base_url: str
    namespace: str
    token_file: Path | None
    ca_file: Path | None

    @classmethod
    def from_env(
        cls, address: str | None = None, env: Mapping[str, str] | None = None
    ) -> KubeConfig:
        env = os.environ if env is None else env
        account = Path(env.get("MOE_MESH_K8S_SERVICE_ACCOUNT_DIR") or SERVICE_ACCOUNT_DIR)
        if address is None:
            host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
            if not host:
                raise ValueError(
                    "no Kubernetes API server: outside a cluster give --registry-address "
                    "(e.g. http://127.0.0.1:8001 of `kubectl proxy`); in one, "
                    "KUBERNETES_SERVICE_HOST is set by Kubernetes"
                )
            host = f"[{host}]" if ":" in host else host
            address = f"https://{host}:{port or 443}"
        parsed = urllib.parse.urlsplit(address)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(
                f"Kubernetes API address {address!r} is not http(s)://host[:port] "
                "(e.g. https://10.0.0.1:443)"
            )
        namespace = env.get("MOE_MESH_K8S_NAMESPACE") or _read_text(account / "namespace")
        token, ca = account / "token", account / "ca.crt"
        return cls(
            address.rstrip("/"),
            namespace or "default",
            token if token.is_file() else None,
            ca if ca.is_file() and parsed.scheme == "https" else None,
        )

    def headers(self) -> dict[str, str]:
        token = _read_text(self.token_file) if self.token_file else None
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ssl_context(self) -> ssl.SSLContext | bool:
        """The cluster CA when there is one; the system's otherwise (unused for http)."""
        if self.ca_file is None:
            return True
        return ssl.create_default_context(cafile=str(self.ca_file))

    def url(self) -> str:
        return f"{self.base_url}/apis/{GROUP}/v1/namespaces/{self.namespace}/{RESOURCE}"


def _read_text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _why(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class KubeApi:
    """List and watch EndpointSlices of one namespace. The session is opened on first use, in the
    running loop; `close` ends it (a later call opens another)."""

    def __init__(self, config: KubeConfig, request_timeout_s: float = 10.0) -> None:
        self.config, self.request_timeout_s = config, request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.config.ssl_context()),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.request_timeout_s),
            )
        return self._session

    async def list(self, selector: str) -> tuple[str, list[dict[str, Any]]]:
        """(the list's resourceVersion, every slice matching `selector`), page by page."""
        items: list[dict[str, Any]] = []
        params = {"labelSelector": selector, "limit": str(LIST_PAGE)}
        while True:
            body = await self._get(params, "list", self.request_timeout_s)
            items += body.get("items") or []
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                return str(meta.get("resourceVersion", "")), items
            params["continue"] = meta["continue"]

    async def _get(self, params: dict[str, str], verb: str, timeout_s: float) -> dict[str, Any]:
        try:
            async with (
                asyncio.timeout(timeout_s),
                self._http().get(
                    self.config.url(), params=params, headers=self.config.headers()
                ) as resp,
            ):
                if resp.status != 200:
                    raise self._refused(verb, resp.status, await resp.text())
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise self._unreachable(verb, e) from e

    async def watch(
        self, selector: str, resource_version: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The watch events after `resource_version` ({"type", "object"}), until the server ends
        the stream (it does after `timeout_s`; a silent one is cut `request_timeout_s` later)."""
        params = {
            "labelSelector": selector,
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, round(timeout_s))),
        }
        try:
            async with (
                asyncio.timeout(timeout_s + self.request_timeout_s),
                self._http().get(
                    self.config.url(), params=params, headers=self.config.headers()
                ) as resp,
            ):
                if resp.status != 200:
                    raise self._refused("watch", resp.status, await resp.text())
                buffer = b""
                # By hand, not readline(): one event is a whole object, beyond aiohttp's line limit.
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield _event(line, self.config.base_url)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise self._unreachable("watch", e) from e

    def _refused(self, verb: str, status: int, text: str) -> UnavailableError | PreconditionError:
        where, ns = self.config.base_url, self.config.namespace
        said = _status_message(text)
        if status == 410:
            return Gone(f"{where}: resourceVersion expired ({said})")
        if status == 401:
            token = self.config.token_file or "none (no service account token file)"
            return PreconditionError(
                f"the Kubernetes API server at {where} refused the credentials (401 "
                f"Unauthorized): token {token}; {said}"
            )
        if status == 403:
            return PreconditionError(
                f"the Kubernetes API server at {where} forbids verb {verb!r} on resource "
                f"{RESOURCE!r} (API group {GROUP}) in namespace {ns!r} (403 Forbidden): "
                f"the service account needs a Role with get, list and watch on {RESOURCE}. "
                f"{said}"
            )
        if status == 404:
            return PreconditionError(
                f"{where} has no {RESOURCE}.{GROUP}/v1 in namespace {ns!r} (404): is it a "
                f"Kubernetes API server (>= 1.21) and the namespace right (MOE_MESH_K8S_NAMESPACE)?"
            )
        return UnavailableError(f"the Kubernetes API server at {where} answered {status}: {said}")

    def _unreachable(self, verb: str, e: BaseException) -> UnavailableError:
        return UnavailableError(
            f"cannot {verb} {RESOURCE} at the Kubernetes API server {self.config.base_url} "
            f"({_why(e)}): is --registry-address right?"
        )

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def _status_message(text: str) -> str:
    """The `message` of a Kubernetes Status body, or the body's start."""
    try:
        return str(json.loads(text).get("message") or text[:200])
    except (ValueError, AttributeError):
        return text[:200].strip() or "no message"


def _event(line: bytes, where: str) -> dict[str, Any]:
    event = json.loads(line)
    if event.get("type") == "ERROR":  # in-stream failure: a Status object, 410 when expired
        status = event.get("object") or {}
        message = status.get("message", "watch error")
        if status.get("code") == 410:
            raise Gone(f"{where}: {message}")
        raise UnavailableError(f"the Kubernetes API server at {where} ended the watch: {message}")
    return event
