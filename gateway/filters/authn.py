"""Authentication: ``Authorization: Bearer <key>`` must name one of the keys file's keys."""

from __future__ import annotations

from dataclasses import dataclass

from ladle.gateway.apikeys import ApiKey, KeyStore
from ladle.gateway.context import ClientRequest, Outcome, Send
from ladle.gateway.errors import GatewayError


def unauthenticated() -> GatewayError:
    return GatewayError(
        401,
        "a valid API key is required (Authorization: Bearer <key>)",
        "invalid_api_key",
        headers=[(b"www-authenticate", b"Bearer")],
    )


@dataclass
class Authentication:
    keys: KeyStore

    def key(self, authorization: bytes | None, now: float) -> ApiKey | None:
        """The key presented, if it is one of ours."""
        scheme, _, presented = (authorization or b"").decode("latin-1").partition(" ")
        return self.keys.lookup(presented.strip(), now) if scheme.lower() == "bearer" else None

    async def on_request(self, req: ClientRequest, send: Send, out: Outcome) -> bool:
        req.key = self.key(req.header(b"authorization"), req.arrival)
        if req.key is None:
            raise unauthenticated()
        return False

    def on_response(self, req: ClientRequest, out: Outcome, ok: bool) -> None:
        """Nothing to do on the way back."""
