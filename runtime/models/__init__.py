"""Model definitions (our own forward passes) and weight loading."""
