"""Hypothesis profiles for the test suite (docs/testing.md).

- ``dev`` (default): random examples, failures saved in ``.hypothesis/`` and replayed first on the next run.
- ``ci`` (chosen when ``CI`` is set): derandomized, so a commit tests the same examples on every run; a failure
  prints its ``@reproduce_failure`` blob.
- ``explore`` (``HYPOTHESIS_PROFILE=explore``): random and ``EXPLORE_FACTOR`` times the examples, for a long
  search before a change lands.

``HYPOTHESIS_PROFILE`` names a profile explicitly and wins over ``CI``. No profile has a deadline: these
tests share small machines, and a slow example is not a bug.

A test that sets its own ``max_examples`` (sized to its cost) would keep that count under every profile;
``scaled(n)`` keeps it in ``dev`` and ``ci`` and multiplies it in ``explore``.
"""

from __future__ import annotations

import os

from hypothesis import settings

EXPLORE_FACTOR = 10

_DEFAULT = settings.get_profile("default")
settings.register_profile("dev", _DEFAULT, deadline=None, print_blob=True)
settings.register_profile("ci", settings.get_profile("ci"), derandomize=True, database=None, deadline=None,
                          print_blob=True, max_examples=100)
settings.register_profile("explore", _DEFAULT, deadline=None, print_blob=True, derandomize=False,
                          max_examples=100 * EXPLORE_FACTOR)


def profile_name() -> str:
    return os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")


def load() -> str:
    """Load the profile the environment asks for; returns its name."""
    name = profile_name()
    settings.load_profile(name)
    return name


def scaled(max_examples: int) -> int:
    """A test's own example count, multiplied by ``EXPLORE_FACTOR`` under the explore profile."""
    return max_examples * EXPLORE_FACTOR if settings.get_current_profile_name() == "explore" else max_examples
