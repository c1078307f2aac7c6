"""Benchmarks behind ``ladle bench``."""
