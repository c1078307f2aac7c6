"""Tensor parallelism: one model split across ranks (Megatron's layout), one scheduler.

Rank 0 is the engine: it schedules, sends each step's plan to the other ranks, and samples.
Every rank holds a slice of every layer and the KV heads its attention heads read, and runs
the forward pass on its slice; the ranks meet in an all-reduce after each row-parallel
projection and an all-gather of the vocabulary-parallel logits (``torch.distributed``: NCCL on
GPUs, gloo on CPUs).
"""
