"""Who is calling: API keys (stored hashed) and client certificates map callers to tenants.

The keys file is JSON, reloaded when it changes (and on SIGHUP), quotas included; a file
that does not parse or has a wrong type is reported and the previous one kept:

    {"tenants": {"acme": {"keys": ["sha256:<hex of sha256(key)>"],
                          "weight": 2.0, "max_concurrent": 64, "max_queued_tokens": 200000,
                          "models": {"chat": {"max_concurrent": 16}}}}}

"max_concurrent" bounds the tenant's queued and running requests on all models together; "models" bounds them on
one model (every version and LoRA adapter of it), so a tenant can be held to a share of one model's workers.

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
    admin: bool = False  # may call the admin RPCs (server/admin.py): "admin": true in the keys file


_QUOTA_FIELDS = {"weight": (float, 1.0), "max_concurrent": (int, 1_000_000), "max_queued_tokens": (int, 1_000_000_000)}


def load_tenants(path: pathlib.Path) -> dict[str, Tenant]:
    """Parse the keys file; raises ValueError with the problem and where it is."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read keys file {path}: {err}") from err
    where = f"keys file {path}"
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants", {}), dict):
        raise ValueError(f'{where}: expected an object {{"tenants": {{"<name>": {{"keys": [...]}}}}}}')
    tenants = {}
    for name, entry in (doc.get("tenants") or {}).items():
        if not name or not isinstance(entry, dict):
            raise ValueError(f"{where}: tenant {name!r} must be a non-empty name with an object of keys and quotas")
        keys = entry.get("keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) and k.startswith("sha256:") and len(k) == 71 for k in keys):
            raise ValueError(f"{where}: tenant {name!r} has keys not of the form 'sha256:<64 hex>' (store hashes, never keys)")
        quota = {}
        for field_name, (kind, default) in _QUOTA_FIELDS.items():
            value = entry.get(field_name, default)
            # bool is an int to Python, never a quota.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise ValueError(f"{where}: tenant {name!r}: {field_name} must be a {'whole ' if kind is int else ''}number, got {value!r}")
            quota[field_name] = kind(value)
        models = entry.get("models", {})
        if not isinstance(models, dict) or not all(isinstance(v, dict) and set(v) <= {"max_concurrent"}
                                                   for v in models.values()):
            raise ValueError(f'{where}: tenant {name!r}: models must be an object of {{"<model>": {{"max_concurrent": N}}}}')
        per_model = []
        for model, limits in models.items():
            value = limits.get("max_concurrent")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}: tenant {name!r}: models.{model}.max_concurrent must be a whole number, "
                                 f"got {value!r}")
            per_model.append((model, value))
        quota["model_concurrent"] = tuple(per_model)
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: tenant {name!r}: admin must be true or false, got {admin!r}")
        try:
            tenants[name] = Tenant(name, frozenset(keys), TenantConfig(**quota), admin)
        except ValueError as err:
            raise ValueError(f"{where}: tenant {name!r}: {err}") from err
    return tenants


class Authenticator:
    """Maps a call's metadata (or client certificate) to a tenant name."""

    def __init__(self, keys_file: str | None = None, *, client_certs: bool = False):
        self.keys_file = pathlib.Path(keys_file) if keys_file else None
        self.client_certs = client_certs
        self.tenants: dict[str, Tenant] = {}
        self._by_hash: dict[str, str] = {}
        self._mtime = 0.0
        self._bad_mtime: float | None = 0.0  # the last change that failed to load (logged once)
        if self.keys_file:
            self.reload()

    @property
    def enabled(self) -> bool:
        return self.keys_file is not None or self.client_certs

    def reload(self) -> None:
        """Read the keys file again; raises ValueError (and keeps the current tenants) if it is bad.

        Blocking (a file read): the server calls it off the event loop."""
        if self.keys_file is None:
            raise ValueError("no keys file to reload")
        try:
            mtime = os.stat(self.keys_file).st_mtime
        except OSError as err:
            raise ValueError(f"cannot read keys file {self.keys_file}: {err}") from err
        tenants = load_tenants(self.keys_file)
        # Swapped whole, so a call on the loop sees the old set or the new one, never half of each.
        self.tenants, self._by_hash = tenants, {h: t.name for t in tenants.values() for h in t.key_hashes}
        self._mtime = mtime
        log.info("loaded %d tenants from %s", len(tenants), self.keys_file)

    def reload_if_changed(self) -> bool:
        """Reload when the file's modification time moved; True when new tenants were loaded.

        A bad file is logged once per change and the previous tenants are kept."""
        if self.keys_file is None:
            return False
        try:
            mtime = os.stat(self.keys_file).st_mtime
        except OSError as err:
            mtime = None
            problem = str(err)
        else:
            if mtime == self._mtime:
                return False
            try:
                self.reload()
                return True
            except ValueError as err:
                problem = str(err)
        if mtime != self._bad_mtime:
            log.error("keys file not reloaded, keeping the previous one: %s", problem)
        self._bad_mtime = mtime
        return False

    def tenant(self, metadata: tuple, peer_common_name: str | None = None) -> str:
        """The caller's tenant, or Unauthenticated."""
        if not self.enabled:
            return DEFAULT_TENANT
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

    def is_admin(self, tenant: str) -> bool:
        """May `tenant` operate the server (server/admin.py)? A keys-file tenant with "admin": true."""
        found = self.tenants.get(tenant) if self.keys_file is not None else None
        return found is not None and found.admin

    def revoked(self, tenant: str) -> bool:
        """The keys file no longer gives `tenant` any key (its work stops: queued and running jobs, open
        watches). Tenants named by client certificates are revoked by their CA, not here."""
        if self.keys_file is None or self.client_certs:
            return False
        found = self.tenants.get(tenant)
        return found is None or not found.key_hashes

    def quotas(self) -> dict[str, TenantConfig]:
        return {name: t.quota for name, t in self.tenants.items()}
