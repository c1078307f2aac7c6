"""Ladle: Kubernetes-native LLM serving.

The runtime engine lives in :mod:`ladle.runtime`, the kopf operator in :mod:`ladle.operator`.
"""

__version__ = "0.1.0"
