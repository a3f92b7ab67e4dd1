"""Interpreter mode for the whole folder, before any test module imports a Triton kernel.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated, so a module that imports ``pdpool.kernels``
before ``kernel_builders`` (the CPU-extension tests do) would otherwise fix those kernels in compiled mode for the
rest of the session, and a later interpreted test fails with "Cannot call @triton.jit'd outside of the scope of a
kernel". ``kernel_builders`` makes the same choice; this only makes it first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
