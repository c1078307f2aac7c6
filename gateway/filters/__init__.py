"""The gateway's filters, one module each, in the order ``ladle.gateway.chain`` runs them."""
