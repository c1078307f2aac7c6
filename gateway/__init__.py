"""The Ladle gateway: one OpenAI-compatible front door for every InferenceService.

Data flows one way, down a filter chain in Envoy's order (``chain``, ``filters/``):
authentication → rate limit → body → route (model → service) → response cache → router, which
asks the cluster (breaker and fallback, variant, pod, hold) where to go → upstream, and the
answer streams back. The decisions (``routes``, ``split``, ``picker``, ``outlier``, ``breaker``,
``ratelimit``) are pure and take the time as an argument; ``cluster`` keeps their state, and
``upstream``, ``watch`` and ``app`` are the I/O around them.
"""
