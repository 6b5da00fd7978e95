"""API keys: which callers the gateway serves (HTTP `Authorization` header, gRPC metadata).

`ApiKeys(keys)` holds the configured keys; `check(authorization)` raises a 401 `APIError` unless
the value is `Bearer <key>` for one of them (the scheme in any case, as RFC 9110 says). Every key
is compared, in constant time, whatever matches first: how long a check takes tells nothing of
the keys. No keys configured: every caller is served.
"""

from __future__ import annotations

import hmac
from typing import Iterable

from pdserve.gateway.errors import APIError


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str) -> None:
        if not self._keys:
            return
        scheme, _, token = authorization.strip().partition(" ")
        given = token.strip().encode(errors="replace")
        matched = False
        for key in self._keys:  # no early exit: the time taken is the same for every key
            matched |= hmac.compare_digest(given, key)
        if not matched or scheme.lower() != "bearer":
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", "invalid_api_key")
