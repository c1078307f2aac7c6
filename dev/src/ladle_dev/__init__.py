"""Ladle's development tooling, kept out of the product package that the images install."""
