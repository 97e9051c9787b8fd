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


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="kvfence"'}
    )
