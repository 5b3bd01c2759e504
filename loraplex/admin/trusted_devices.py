"""The trusted-device cookie: a browser that logged in to an account gets a signed cookie naming that account (and its
session version, so `loraplex admin passwd` withdraws it). Carrying it exempts the browser from the account-wide
limits (the lockout and the per-account rate): someone guessing at a username can lock it against every other
client, never against the browsers its admin already uses. Each browser still has its per-client limit."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from starlette.requests import Request
from starlette.responses import Response

COOKIE = "loraplex_admin_device"


class TrustedDevices:
    def __init__(self, secret: str, days: int) -> None:
        self._key = hashlib.sha256(b"loraplex admin trusted device\0" + secret.encode()).digest()
        self.max_age_s = days * 86400

    def _sign(self, body: str) -> str:
        mac = hmac.new(self._key, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def issue(self, response: Response, account_id: str, session_version: int, *, secure: bool) -> None:
        body = f"{account_id}.{session_version}.{int(time.time()) + self.max_age_s}"
        response.set_cookie(COOKIE, f"{body}.{self._sign(body)}", max_age=self.max_age_s, path="/admin",
                            httponly=True, samesite="strict", secure=secure)  # fmt: skip

    def vouches(self, request: Request, account_id: str, session_version: int) -> bool:
        """Whether the request carries a valid, unexpired cookie issued for this account at this session version."""
        value = request.cookies.get(COOKIE, "")
        body, _, mac = value.rpartition(".")
        if not body or not hmac.compare_digest(mac, self._sign(body)):
            return False
        held_id, _, rest = body.partition(".")
        version, _, expires = rest.partition(".")
        try:
            return held_id == account_id and int(version) == session_version and int(expires) > time.time()
        except ValueError:
            return False
