"""API keys: which callers the gateway serves (HTTP `Authorization` header, gRPC metadata).

`ApiKeys(keys)` holds the configured keys; `check(authorization)` raises a 401 `APIError` unless
the value is `Bearer <key>` for one of them (the scheme in any case, as RFC 9110 says), and
returns that key's cache salt (a hash of the key: never the key itself). Every key is compared,
in constant time, whatever matches first: how long a check takes tells nothing of the keys. No
keys configured: every caller is served (salt None).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

from pdserve.gateway.errors import APIError


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode() for k in keys]
        # Per key, the salt its requests' prefix-cache blocks carry under cache_isolation per_key.
        self._salts = ["key:" + hashlib.sha256(b"pdserve-cache-salt:" + k).hexdigest()[:32] for k in self._keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str) -> str | None:
        """The matching key's cache salt; a 401 without one (None: no keys configured)."""
        if not self._keys:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        given = token.strip().encode(errors="replace")
        matched = None
        for i, key in enumerate(self._keys):  # no early exit: the time taken is the same for every key
            if hmac.compare_digest(given, key):
                matched = i
        if matched is None or scheme.lower() != "bearer":
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", "invalid_api_key")
        return self._salts[matched]
