"""Who the caller is at the HTTP front door: tenants by API key (I7: the tenant comes from the authenticated key,
never from a request field), and operators by the admin and scrape keys (`Operators`, docs/security.md).

Keys file: TOML or JSON, a flat mapping `"key" = "tenant"` or `[tenants.NAME]` tables with limits
(kvfence/server/tenants.py). Without a keys file the server has one tenant,
`anonymous`, and accepts any or no Authorization header (it binds to loopback unless told otherwise). Every
comparison of a given key runs in constant time against every configured key (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path

from kvfence.server.errors import OpenAIError
from kvfence.server.tenants import load_keys_file

ANONYMOUS = "anonymous"


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read a keys file (either form, kvfence/server/tenants.py): API key -> tenant; raises ValueError naming the
    file and the problem."""
    return load_keys_file(path).keys


class Authenticator:
    def __init__(self, keys: Mapping[str, str] | None) -> None:
        self._keys = [(k.encode(), t) for k, t in (keys or {}).items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of the bearer token in `authorization`; raises a 401 `OpenAIError` when keys are
        configured and the token is missing or unknown."""
        if not self._keys:
            return ANONYMOUS
        token = bearer_token(authorization)
        if token is None:
            raise _unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
        found = self.lookup(token)
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        return found

    def lookup(self, token: bytes) -> str | None:
        """The tenant whose key `token` is, or None (also when no keys are configured)."""
        found = None
        for key, tenant in self._keys:  # compare against every key, in constant time, whatever matches
            if hmac.compare_digest(key, token):
                found = tenant
        return found


class Operators:
    """The operator routes' gate (docs/security.md). The admin key opens `/metrics` and `/debug/*`; the scrape key
    (`--metrics-key`) opens `/metrics` only. A tenant's API key opens neither: `/metrics` labels its series by
    tenant and `/debug/kv` shows prompts. A credential this server knows that does not open the route gets 403
    `permission_denied`; none, or one it does not know, 401.

    Without an operator key: a single-user server (no --api-keys; loopback unless told otherwise) serves
    `/metrics` to anyone, as it serves everything else; a server with tenants serves it to nobody. `/debug/*`
    always needs the admin key: it shows prompts, and a server without one serves it to nobody."""

    def __init__(self, admin_key: str | None, metrics_key: str | None, tenants: Authenticator) -> None:
        self._admin = admin_key.encode() if admin_key else None
        self._scrape = metrics_key.encode() if metrics_key else None
        self._tenants = tenants

    def check_metrics(self, authorization: str | None) -> None:
        """GET /metrics: return if `authorization` opens it, else raise a 401 or 403 `OpenAIError`."""
        accepted = [k for k in (self._admin, self._scrape) if k]
        if not accepted and not self._tenants.enabled:
            return
        needs = "an operator key (--metrics-key or --admin-key)" + ("" if accepted else ", and none is set")
        message = "Missing or incorrect operator key (the admin key or the metrics key)."
        self._check(
            authorization, accepted, "/metrics", needs, _unauthorized(message, realm="kvfence-operator")
        )

    def check_admin(self, authorization: str | None, route: str) -> None:
        """GET /debug/*: return if `authorization` is the admin key, else raise a 401 or 403 `OpenAIError`."""
        accepted = [self._admin] if self._admin else []
        needs = "the admin key (--admin-key)" + ("" if accepted else ", and none is set")
        message = (
            "Missing or incorrect admin key."
            if accepted
            else f"{route} is disabled: start kvfence with --admin-key (or KVFENCE_ADMIN_KEY)."
        )
        unauthorized = _unauthorized(message, code="invalid_admin_key", realm="kvfence-admin")
        self._check(authorization, accepted, route, needs, unauthorized)

    def check_cluster(self, authorization: str | None, route: str) -> None:
        """/cluster/*: the admin key. A single-user server (no --api-keys) without one opens them to its user,
        as it opens /metrics: whoever reaches it is the operator."""
        if not self._admin and not self._tenants.enabled:
            return
        self.check_admin(authorization, route)

    def _check(
        self,
        authorization: str | None,
        accepted: list[bytes],
        route: str,
        needs: str,
        unauthorized: OpenAIError,
    ) -> None:
        token = bearer_token(authorization)
        if token is not None and _matches(accepted, token):
            return
        if token is not None and self._knows(token):
            message = f"This credential does not open {route}: it needs {needs}."
            raise OpenAIError(403, message, code="permission_denied")
        raise unauthorized

    def _knows(self, token: bytes) -> bool:
        """Whether `token` is a credential of this server (a tenant's API key or an operator key)."""
        operators = [k for k in (self._admin, self._scrape) if k]
        return (self._tenants.lookup(token) is not None) | _matches(operators, token)  # both compared


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, or None when there is none."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


def _matches(keys: list[bytes], token: bytes) -> bool:
    """Whether `token` is one of `keys`, comparing against every key in constant time, whatever matches."""
    return any([hmac.compare_digest(k, token) for k in keys])  # a list, not a generator: no early exit


def check_distinct(keys: Mapping[str, str] | None, admin_key: str | None, metrics_key: str | None) -> None:
    """An operator key must not also be a tenant's API key (that tenant would read every tenant's series, or the
    prompts): raises ValueError naming the flag and the tenant (exit 2 at startup)."""
    for flag, key in (("--admin-key", admin_key), ("--metrics-key", metrics_key)):
        if key and keys and key in keys:
            raise ValueError(
                f"{flag} is also the API key of tenant {keys[key]!r} (--api-keys): an operator key must be "
                "a key of its own"
            )


def _unauthorized(message: str, code: str = "invalid_api_key", realm: str = "kvfence") -> OpenAIError:
    return OpenAIError(401, message, code=code, headers={"WWW-Authenticate": f'Bearer realm="{realm}"'})
