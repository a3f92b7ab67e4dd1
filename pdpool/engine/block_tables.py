"""The block tables of the scheduled requests, kept by row from step to step (a persistent batch's tables).

A running request keeps its row while it is scheduled in consecutive steps; a step writes only what changed in a
row (the ids of a block it grew, or the whole row for a request that joined or whose table was replaced), so a
decode step, which grows a table once in ``block_size`` steps, copies almost nothing per request. A request that
is not scheduled in a step gives its row back, zeroed, for the next one that joins::

    table: [rows, width] int64, 0 past each row's ids
    row r: | id id id ... id (len(block_ids)) | 0 0 ... 0 |

``rows_for(scheduled)`` returns each scheduled request's row, in scheduled order; ``table[rows, :width]`` is then
the step's padded table, the same as one built from the ids of every request.
"""

from __future__ import annotations

import numpy as np


class BlockTableRows:
    def __init__(self, rows: int = 256, width: int = 64) -> None:
        self.table = np.zeros((max(1, rows), max(1, width)), dtype=np.int64)
        self._kept: dict[str, tuple[int, list[int]]] = {}  # request id -> (row, its ids as written there)
        self._free = list(range(self.table.shape[0] - 1, -1, -1))  # popped from the end: row 0 first

    def rows_for(self, scheduled) -> list[int]:
        """Each ``ScheduledRequest``'s row, its ids written where they differ from the row's; the rows of requests
        kept before and not scheduled now are zeroed and freed."""
        kept, self._kept = self._kept, {}
        rows = []
        for sr in scheduled:
            rid, ids = sr.request.request_id, sr.block_ids
            entry = kept.pop(rid, None)
            if entry is None:
                row, old = self._take_row(), []
            else:
                row, old = entry
            if ids != old:  # a C-level list compare: equal for a decode step that did not grow the table
                self._write(row, old, ids)
                old = list(ids)  # our own copy: a caller may grow its list in place
            self._kept[rid] = (row, old)
            rows.append(row)
        for row, old in kept.values():
            self.table[row, :len(old)] = 0
            self._free.append(row)
        return rows

    def _write(self, row: int, old: list[int], ids: list[int]) -> None:
        n, k = len(ids), len(old)
        if n > self.table.shape[1]:
            grown = np.zeros((self.table.shape[0], max(n, 2 * self.table.shape[1])), dtype=np.int64)
            grown[:, :self.table.shape[1]] = self.table
            self.table = grown
        if k <= n and ids[:k] == old:  # the table grew: only the new ids
            self.table[row, k:n] = ids[k:]
        else:  # replaced (e.g. freed and allocated again under the same id)
            self.table[row, :n] = ids
            if k > n:
                self.table[row, n:k] = 0

    def _take_row(self) -> int:
        if not self._free:
            rows = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()
