"""Triton kernels for the CUDA path, each with a plain-torch reference beside it.

Importing this package does not import Triton; the kernel modules do. Under
``TRITON_INTERPRET=1`` (set before importing them) the same kernels run on CPU tensors, which
is how they are tested on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (read when kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """Triton is importable; the kernels can run on CUDA, or on CPU when interpreting."""
    return importlib.util.find_spec("triton") is not None
