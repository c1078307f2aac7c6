"""Paged KV-cache bookkeeping: which physical blocks hold which tokens."""
