"""BlockTableRows: after any sequence of steps (requests join, grow, stay, leave, get a new table under the same
id), the kept rows gathered for a step equal the padded table built from every request's ids."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings, strategies as st

from pdpool.engine.block_tables import BlockTableRows


def scheduled(tables: dict[str, list[int]]) -> list:
    return [SimpleNamespace(request=SimpleNamespace(request_id=rid), block_ids=list(ids))
            for rid, ids in tables.items()]


def padded(tables: dict[str, list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), dtype=np.int64)
    for r, ids in enumerate(tables.values()):
        out[r, :len(ids)] = ids
    return out


def check_step(kept: BlockTableRows, tables: dict[str, list[int]]) -> list[int]:
    rows = kept.rows_for(scheduled(tables))
    width = max(1, max((len(ids) for ids in tables.values()), default=1))
    np.testing.assert_array_equal(kept.table[rows, :width], padded(tables, width))
    assert len(set(rows)) == len(rows)
    return rows


def test_a_decode_step_keeps_rows_and_writes_only_growth():
    kept = BlockTableRows(rows=2, width=2)
    rows = check_step(kept, {"a": [5, 6], "b": [7]})
    before = kept.table.copy()
    assert check_step(kept, {"a": [5, 6], "b": [7]}) == rows
    np.testing.assert_array_equal(kept.table, before)
    check_step(kept, {"a": [5, 6, 9], "b": [7]})  # past the width: the table widens
    check_step(kept, {"b": [7], "c": [1, 2, 3, 4]})  # a left, c joins: a's row is zeroed and reused
    check_step(kept, {"b": [7], "c": [1, 2, 3, 4], "d": [8], "e": [3]})  # more rows than the table had


def test_a_list_grown_in_place_is_seen():
    kept = BlockTableRows(rows=2, width=2)
    ids = [3, 4]
    sr = [SimpleNamespace(request=SimpleNamespace(request_id="a"), block_ids=ids)]
    kept.rows_for(sr)
    ids.append(5)
    rows = kept.rows_for(sr)
    np.testing.assert_array_equal(kept.table[rows, :3], [[3, 4, 5]])


def test_a_replaced_table_under_the_same_id_is_rewritten():
    kept = BlockTableRows(rows=4, width=4)
    check_step(kept, {"a": [1, 2, 3]})
    check_step(kept, {"a": [4]})  # shorter and different: the tail is zeroed
    check_step(kept, {"a": [4, 6, 7]})
    check_step(kept, {"a": [9, 6, 7]})  # same length, different ids


tables_st = st.dictionaries(st.sampled_from("abcdefgh"), st.lists(st.integers(0, 50), max_size=12), max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(tables_st, st.booleans()), min_size=1, max_size=12))
def test_kept_rows_equal_the_rebuilt_table(steps):
    kept = BlockTableRows(rows=2, width=3)
    current: dict[str, list[int]] = {}
    for fresh, grow in steps:
        # either a new set of tables, or every kept request grows (the common decode step)
        current = {rid: ids + [len(ids)] for rid, ids in current.items()} if grow and current else fresh
        check_step(kept, current)
