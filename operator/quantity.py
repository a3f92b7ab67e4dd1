"""Kubernetes resource quantities (``500m``, ``1Gi``, ``1e3``) as exact values: what the API server compares."""

from __future__ import annotations

import re
from fractions import Fraction

_SCALE = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60,
          "n": Fraction(1, 10 ** 9), "u": Fraction(1, 10 ** 6), "m": Fraction(1, 1000), "": 1, "k": 10 ** 3,
          "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18}
_AMOUNT = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|([KMGTPE]i|[numkMGTPE]))?")


def quantity(value) -> Fraction | None:
    """A resource quantity's value (``1000m`` and ``1`` are one CPU); None for anything else."""
    found = None if isinstance(value, bool) else _AMOUNT.fullmatch(str(value).strip())
    if found is None:
        return None
    base, power, unit = found.groups()
    return Fraction(base) * (Fraction(10) ** int(power) if power else _SCALE[unit or ""])
