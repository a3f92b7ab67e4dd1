"""Small helpers shared across the package (no third-party imports)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of ``b``-sized blocks that hold ``a`` items."""
    return -(-a // b)
