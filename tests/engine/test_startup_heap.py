"""``freeze_startup_heap``: what start-up left alive is out of the collector's reach; garbage made later is still
collected (a full pass no longer walks the modules and the model, which stopped the CUDA engine for 200-300 ms)."""

from __future__ import annotations

import gc
import weakref

from pdpool.engine.llm_engine import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_later_cycles_are_still_collected_and_startup_objects_are_frozen():
    before = gc.get_freeze_count()
    try:
        kept = _Node()
        freeze_startup_heap()
        assert gc.get_freeze_count() > before
        assert not any(o is kept for o in gc.get_objects())  # frozen objects are not tracked by any generation
        later = _Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
