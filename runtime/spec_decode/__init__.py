"""Speculative decoding: a drafter proposes tokens, one step of the model verifies them all."""
