"""The admin's cookies get the Secure flag when the request came over HTTPS: the ASGI scope's scheme, which uvicorn
sets from a trusted proxy's X-Forwarded-Proto (its --forwarded-allow-ips, 127.0.0.1 by default), so a TLS-terminating
proxy in front needs no setting. `admin_cookie_secure` True forces the flag, False leaves it off."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.settings import Settings


def cookie_secure(settings: Settings, scheme: str) -> bool:
    if settings.admin_cookie_secure is not None:
        return settings.admin_cookie_secure
    return scheme in ("https", "wss")


class SecureCookiesOverHttps:
    """Adds `; Secure` to every Set-Cookie of a response to a request that `cookie_secure` says is over HTTPS (the
    session cookie is set by Starlette's SessionMiddleware, whose flag is fixed when it is built)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not cookie_secure(self.settings, scope.get("scheme", "http")):
            await self.app(scope, receive, send)
            return

        async def send_secure(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    (k, v + b"; Secure" if k.lower() == b"set-cookie" and not _has_secure(v) else v)
                    for k, v in message.get("headers", [])
                ]
            await send(message)

        await self.app(scope, receive, send_secure)


def _has_secure(cookie: bytes) -> bool:
    return any(attribute.strip().lower() == b"secure" for attribute in cookie.split(b";")[1:])
