"""Priority: the request's band and its tenant, which the flow queue orders by.

The band comes from ``x-ladle-priority``, else the API key's ``priority``, else the gateway's
default; a key's band is also the highest its requests may ask for. The tenant, whose fair
share of its band the queue keeps, is the API key's name; without keys, the Gateway API
Inference Extension's ``x-gateway-inference-fairness-id``. A key holder cannot split itself
into many tenants by inventing ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from ladle.gateway.context import ClientRequest, Outcome, Send
from ladle.gateway.errors import GatewayError

PRIORITY_HEADER = b"x-ladle-priority"
FAIRNESS_HEADER = b"x-gateway-inference-fairness-id"
_MAX_TENANT = 128


@dataclass
class Priority:
    bands: tuple[str, ...]
    default: str

    async def on_request(self, req: ClientRequest, send: Send, out: Outcome) -> bool:
        key = req.key
        floor = key.spec.priority if key is not None else None
        asked = req.header(PRIORITY_HEADER)
        if asked is None:
            req.band = self.bands.index(floor or self.default)
        else:
            name = asked.decode("latin-1").strip().lower()
            if name not in self.bands:
                raise GatewayError(
                    400,
                    f"x-ladle-priority names no band: {name!r}; the bands are "
                    f"{', '.join(self.bands)} (highest first)",
                    "invalid_priority",
                )
            req.band = self.bands.index(name)
            if floor is not None and req.band < self.bands.index(floor):
                assert key is not None
                raise GatewayError(
                    403,
                    f"the key {key.name!r} may ask for {floor!r} or a lower band, not {name!r}",
                    "priority_not_allowed",
                )
        if key is not None:
            req.tenant = key.name
        else:
            fairness = req.header(FAIRNESS_HEADER)
            req.tenant = "" if fairness is None else fairness.decode("latin-1")[:_MAX_TENANT]
        return False

    def on_response(self, req: ClientRequest, out: Outcome, ok: bool) -> None:
        """Nothing to do on the way back."""
