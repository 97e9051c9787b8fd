"""API keys and tenants (I7: the tenant comes from the authenticated key, never from a request field).

Keys file: TOML or JSON, a flat mapping `"key" = "tenant"`. Without a keys file the server has one tenant,
`anonymous`, and accepts any or no Authorization header (it binds to loopback unless told otherwise).
"""

from __future__ import annotations

import hmac
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path

from kvfence.server.errors import OpenAIError

ANONYMOUS = "anonymous"


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read a keys file; raises ValueError naming the file and the problem."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{p}: cannot parse API keys file: {e}") from e
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{p}: expected a non-empty mapping of API key -> tenant name")
    for key, tenant in data.items():
        if not isinstance(tenant, str) or not tenant or not key:
            raise ValueError(f"{p}: every entry must map a non-empty key to a non-empty tenant name")
    return dict(data)


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
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'.")
        given = token.strip().encode()
        found = None
        for key, tenant in self._keys:  # compare against every key, in constant time, whatever matches
            if hmac.compare_digest(key, given):
                found = tenant
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        return found


def check_operator(
    authorization: str | None, admin_key: str | None, metrics_key: str | None, tenants: Authenticator
) -> None:
    """GET /metrics: the admin key or the scrape key, never a tenant's (its series name every tenant). Without
    either key configured, a server with tenants serves /metrics to nobody; a single-user server (no
    --api-keys) serves it to anyone, as it serves everything else."""
    operators = [k.encode() for k in (admin_key, metrics_key) if k]
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not operators and not tenants.enabled:
        return
    if given and any(
        [hmac.compare_digest(k, given) for k in operators]
    ):  # every key compared, matched or not
        return
    try:
        tenant = tenants.tenant(authorization) if given else None
    except OpenAIError:
        tenant = None
    if tenant is not None:
        hint = "" if operators else " (none is configured: start kvfence with --metrics-key or --admin-key)"
        raise OpenAIError(403, f"/metrics needs an operator credential, not a tenant's API key{hint}.",
                          code="permission_denied")  # fmt: skip
    realm = {"WWW-Authenticate": 'Bearer realm="kvfence-operator"'}
    raise OpenAIError(401, "Missing or incorrect operator key (the admin key or the metrics key).",
                      code="invalid_api_key", headers=realm)  # fmt: skip


def check_distinct(keys: Mapping[str, str] | None, *operator_keys: str | None) -> None:
    """An operator key must not also be a tenant's API key (it would open /metrics to that tenant)."""
    for key in operator_keys:
        if key and keys and key in keys:
            raise ValueError("an operator key (--admin-key / --metrics-key) is also a tenant's API key")


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="kvfence"'}
    )
