"""Who is calling: API keys (stored hashed) and client certificates map callers to tenants.

The keys file is JSON, reloaded when it changes (and on SIGHUP):

    {"tenants": {"acme": {"keys": ["sha256:<hex of sha256(key)>"],
                          "weight": 2.0, "max_concurrent": 64, "max_queued_tokens": 200000}}}

`tokenline keys new --tenant acme` prints a fresh key and its entry. Without a
keys file and without client certificates, every caller is the default tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pathlib
import secrets
import time
from dataclasses import dataclass

from tokenline.engine.scheduler.config import TenantConfig
from tokenline.server.errors import Unauthenticated

log = logging.getLogger("tokenline.auth")

DEFAULT_TENANT = "default"


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "tl-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Tenant:
    name: str
    key_hashes: frozenset[str]
    quota: TenantConfig


def load_tenants(path: pathlib.Path) -> dict[str, Tenant]:
    """Parse the keys file; raises ValueError with the problem and where it is."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read keys file {path}: {err}") from err
    tenants = {}
    for name, entry in (doc.get("tenants") or {}).items():
        keys = entry.get("keys") or []
        bad = [k for k in keys if not (isinstance(k, str) and k.startswith("sha256:") and len(k) == 71)]
        if bad:
            raise ValueError(f"keys file {path}: tenant {name!r} has keys not of the form 'sha256:<64 hex>' (store hashes, never keys)")
        quota = TenantConfig(weight=float(entry.get("weight", 1.0)),
                             max_concurrent=int(entry.get("max_concurrent", 1_000_000)),
                             max_queued_tokens=int(entry.get("max_queued_tokens", 1_000_000_000)))
        tenants[name] = Tenant(name, frozenset(keys), quota)
    return tenants


class Authenticator:
    """Maps a call's metadata (or client certificate) to a tenant name."""

    def __init__(self, keys_file: str | None = None, *, client_certs: bool = False):
        self.keys_file = pathlib.Path(keys_file) if keys_file else None
        self.client_certs = client_certs
        self.tenants: dict[str, Tenant] = {}
        self._by_hash: dict[str, str] = {}
        self._mtime = 0.0
        self._checked = 0.0
        if self.keys_file:
            self.reload()

    @property
    def enabled(self) -> bool:
        return self.keys_file is not None or self.client_certs

    def reload(self) -> None:
        assert self.keys_file is not None
        tenants = load_tenants(self.keys_file)
        self.tenants = tenants
        self._by_hash = {h: t.name for t in tenants.values() for h in t.key_hashes}
        self._mtime = os.stat(self.keys_file).st_mtime
        log.info("loaded %d tenants from %s", len(tenants), self.keys_file)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.keys_file is None or now - self._checked < 1.0:
            return
        self._checked = now
        try:
            if os.stat(self.keys_file).st_mtime != self._mtime:
                self.reload()
        except (OSError, ValueError) as err:
            log.error("keys file not reloaded, keeping the previous one: %s", err)

    def tenant(self, metadata: tuple, peer_common_name: str | None = None) -> str:
        """The caller's tenant, or Unauthenticated."""
        if not self.enabled:
            return DEFAULT_TENANT
        self._maybe_reload()
        bearer = next((v for k, v in metadata if k == "authorization"), None)
        if bearer is not None and self.keys_file is not None:
            scheme, _, key = bearer.partition(" ")
            if scheme.lower() != "bearer" or not key:
                raise Unauthenticated("the authorization metadata must be 'Bearer <api key>'")
            digest = hash_key(key.strip())
            for h, name in self._by_hash.items():
                if hmac.compare_digest(h, digest):
                    return name
            raise Unauthenticated("the API key is not valid")
        if self.client_certs and peer_common_name:
            return peer_common_name
        raise Unauthenticated("credentials are required: send 'authorization: Bearer <api key>' metadata")

    def quotas(self) -> dict[str, TenantConfig]:
        return {name: t.quota for name, t in self.tenants.items()}
