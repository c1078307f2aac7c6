"""Route: the body's model names the InferenceService that serves it."""

from __future__ import annotations

from dataclasses import dataclass

from ladle.gateway.cluster import Cluster
from ladle.gateway.context import ClientRequest, Outcome, Send
from ladle.gateway.errors import GatewayError


@dataclass
class Route:
    cluster: Cluster

    async def on_request(self, req: ClientRequest, send: Send, out: Outcome) -> bool:
        model = req.inbound.model
        req.route = self.cluster.table.by_model.get(model)
        if req.route is None:
            self.cluster.metrics.rejected.labels("", "", "unknown_model").inc()
            raise GatewayError(
                404,
                f"the model {model!r} does not exist; GET /v1/models lists the models this "
                "gateway routes",
                "model_not_found",
                param="model",
            )
        return False

    def on_response(self, req: ClientRequest, out: Outcome, ok: bool) -> None:
        """Nothing to do on the way back."""
