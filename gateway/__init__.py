"""The Ladle gateway: one OpenAI-compatible front door for every InferenceService.

Data flows one way: request → key and limits → route (model → service) → breaker → variant →
pod → upstream, and the answer streams back. The decisions (``routes``, ``split``, ``picker``,
``outlier``, ``breaker``, ``ratelimit``) are pure and take the time as an argument; ``proxy``,
``upstream``, ``watch`` and ``app`` are the I/O around them.
"""
