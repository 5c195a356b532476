"""API keys at the edge: who may call the gateway, how often, and at what priority at most.

Keys come from a file (`api_key_file`) and/or the environment (`MOE_GATEWAY_API_KEY`, several
separated by commas), never from a flag: a command line is visible to every user of the host.
The file holds one key per line, optionally with `name=` (what logs and metrics show instead of
the key), `rpm=` (requests per minute, a token bucket as large as one minute's share) and
`max_priority=` (the highest `priority` the key may ask for, and what a request that asks for none
runs at when it is below 0):

    # moe-mesh API keys
    sk-team-a-1f0c...  name=team-a rpm=600
    sk-batch-77aa...   name=batch  max_priority=-10

The file is re-read when it changes (checked on each request: one stat), so keys are added and
revoked without a restart; a file that cannot be read or parsed leaves the keys in force and logs
why. Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every key, so the
time taken says nothing about how much of a key matched or which one did.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    UnauthenticatedError,
)

log = logging.getLogger(__name__)
ENV_KEYS = "MOE_GATEWAY_API_KEY"
MIN_KEY_CHARS = 8


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes
    rpm: float | None = None
    max_priority: int | None = None


@dataclass
class _Bucket:
    tokens: float
    at: float


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, source: str) -> list[ApiKey]:
    """The keys of a key file; ValueError naming the line (never the key) for a bad one."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        secret, options = words[0], {}
        for word in words[1:]:
            name, sep, value = word.partition("=")
            if not sep or name not in ("name", "rpm", "max_priority") or not value:
                raise ValueError(f"{source} line {number}: unknown option {name!r}")
            options[name] = value
        if len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"{source} line {number}: a key needs {MIN_KEY_CHARS}+ characters")
        try:
            rpm = float(options["rpm"]) if "rpm" in options else None
            cap = int(options["max_priority"]) if "max_priority" in options else None
        except ValueError:
            raise ValueError(f"{source} line {number}: rpm and max_priority are numbers") from None
        if rpm is not None and not rpm > 0:
            raise ValueError(f"{source} line {number}: rpm must be above 0")
        keys.append(ApiKey(options.get("name", f"key{len(keys) + 1}"), _digest(secret), rpm, cap))
    return keys


@dataclass
class Caller:
    """An authenticated caller; `admit` applies its key's limits to one request."""

    key: ApiKey | None  # None: keys are off
    keys: ApiKeys | None = None

    @property
    def name(self) -> str:
        return self.key.name if self.key else ""

    def admit(self, priority: int | None, requests: int = 1) -> int:
        """The priority a request runs at: what it asks for, at most its key's cap (above it is
        refused), or when it asks for none 0 or the cap if that is lower; takes `requests` (one
        per prompt of a list) from the key's rate (ResourceExhaustedError when it is spent)."""
        cap = self.key.max_priority if self.key is not None else None
        if priority is None:
            priority = 0 if cap is None else min(0, cap)
        elif cap is not None and priority > cap:
            raise InvalidArgumentError(
                "priority", f"at most {cap} for this API key, got {priority}"
            )
        if self.key is not None and self.keys is not None:
            self.keys.take(self.key, requests)
        return priority


@dataclass
class ApiKeys:
    file: Path | None = None
    env_keys: str = ""
    clock: Callable[[], float] = time.monotonic
    _keys: list[ApiKey] = field(default_factory=list)
    _stamp: tuple[int, int, int] | None = None
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            self._env = parse_keys(self.env_keys.replace(",", "\n"), ENV_KEYS)
        except ValueError as e:
            # its keys are separated by commas, not lines
            raise InvalidArgumentError(
                ENV_KEYS, str(e).replace(f"{ENV_KEYS} line", "key")
            ) from None
        self._keys = self._env
        if self.file is not None:  # at start-up a bad file is an error, not a log line
            try:
                self._load(os.stat(self.file))
            except (OSError, ValueError) as e:
                raise InvalidArgumentError("api_key_file", str(e)) from None

    @classmethod
    def from_environment(cls, file: Path | None) -> ApiKeys:
        return cls(file, os.environ.get(ENV_KEYS, ""))

    @property
    def enabled(self) -> bool:
        return self.file is not None or bool(self._env)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller of an `Authorization` value ("Bearer <key>"); UnauthenticatedError if none
        or not a key. Without keys configured everyone is a caller."""
        if not self.enabled:
            return Caller(None)
        self._reload()
        scheme, _, secret = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise UnauthenticatedError("missing API key: send it as 'Authorization: Bearer <key>'")
        digest = _digest(secret.strip())
        found = None
        for key in self._keys:  # every key, so the time does not depend on which one matched
            if hmac.compare_digest(key.digest, digest):
                found = key
        if found is None:
            raise UnauthenticatedError("incorrect API key")
        return Caller(found, self)

    def take(self, key: ApiKey, requests: int = 1) -> None:
        """`requests` of `key`'s rate, all or none; ResourceExhaustedError with a retry hint when
        over, InvalidArgumentError (naming `prompt`, the only way to ask for several) when more
        than a minute's worth, which no wait would grant."""
        if key.rpm is None:
            return
        if requests > key.rpm:
            raise InvalidArgumentError(
                "prompt",
                f"{requests} prompts exceed the rate of API key {key.name!r} "
                f"({key.rpm:g} requests per minute); send fewer at once",
            )
        now, per_s = self.clock(), key.rpm / 60
        bucket = self._buckets.setdefault(key.name, _Bucket(key.rpm, now))
        bucket.tokens = min(key.rpm, bucket.tokens + (now - bucket.at) * per_s)
        bucket.at = now
        if bucket.tokens < requests:
            raise ResourceExhaustedError(
                f"rate limit of API key {key.name!r} ({key.rpm:g} requests per minute) reached",
                (requests - bucket.tokens) / per_s,
            )
        bucket.tokens -= requests

    def _reload(self) -> None:
        if self.file is None:
            return
        try:
            st = os.stat(self.file)
        except OSError as e:
            if self._stamp is not None:
                log.error("API key file %s: %s; keeping the keys in force", self.file, e.strerror)
                self._stamp = None
            return
        if (st.st_mtime_ns, st.st_size, st.st_ino) != self._stamp:
            try:
                self._load(st)
            except (OSError, ValueError) as e:
                log.error("API key file not reloaded, keeping the keys in force: %s", e)
                self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self, st: os.stat_result) -> None:
        assert self.file is not None
        keys = parse_keys(self.file.read_text(), str(self.file))
        self._keys = [*self._env, *keys]
        self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        names = ", ".join(k.name for k in keys) or "none"
        log.info("API keys from %s: %s", self.file, names)
