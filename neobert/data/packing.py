"""Sequence packing: tokenized documents laid end to end into rows of at most `max_length` tokens.

A packed batch carries `cu_seqlens`, so no document attends to another, and holds no [PAD] token at all (the
official NeoBERT code put [PAD] inside packed batches, its issue #7), except under data.static_shapes: there every
batch is [micro-batch, max_length] for a compiled model, [PAD] after each row as a document of its own that nothing
real attends to, labelled -100 (`neobert.data.masking.StaticShapes`). Two ways to fill the rows:

* `GreedyPacker`: documents in arrival order, every row filled exactly; a document that does not fit the rest of
  a row is cut there and continues in the next one. No capacity is lost, but most documents are cut in two.
* `BestFitPacker`: documents are never cut unless longer than a row. Each goes into the open row with the least
  room that still holds it; a row that becomes full is closed, and when more than `open_rows` rows are open the
  fullest is closed. Rows end short (the packing efficiency, real tokens / capacity, says by how much).

Both are deterministic and exactly resumable: `state()` holds the waiting and open rows as plain lists.
"""

from __future__ import annotations

Row = list[list[int]]  # a row: the document segments it holds, in order


class ClosedRows:
    """What both packers share: the queue of closed rows, taken from the front in closing order."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.closed: list[Row] = []

    def ready(self, rows: int) -> bool:
        return len(self.closed) >= rows

    def take(self, rows: int) -> list[Row]:
        taken, self.closed = self.closed[:rows], self.closed[rows:]
        return taken

    def pending_rows(self) -> int:
        return len(self.closed)


class GreedyPacker(ClosedRows):
    def __init__(self, max_length: int):
        super().__init__(max_length)
        self.open: Row = []  # the row being filled
        self.open_tokens = 0

    def add(self, ids: list[int]) -> None:
        # An offset rather than re-slicing the rest: packed documents are not truncated, and re-slicing would copy
        # a book-length one once per row (quadratic; seconds for a million tokens).
        start = 0
        while start < len(ids):
            segment = ids[start : start + self.max_length - self.open_tokens]
            self.open.append(segment)
            self.open_tokens += len(segment)
            start += len(segment)
            if self.open_tokens == self.max_length:
                self.closed.append(self.open)
                self.open, self.open_tokens = [], 0

    def flush(self) -> None:
        if self.open:
            self.closed.append(self.open)
            self.open, self.open_tokens = [], 0

    def state(self) -> dict:
        return {"closed": [[list(s) for s in row] for row in self.closed], "open": [list(s) for s in self.open]}

    def load(self, state: dict) -> None:
        self.closed = [[list(s) for s in row] for row in state["closed"]]
        self.open = [list(s) for s in state["open"]]
        self.open_tokens = sum(len(s) for s in self.open)


class BestFitPacker(ClosedRows):
    def __init__(self, max_length: int, open_rows: int):
        if open_rows < 1:
            raise ValueError(f"best-fit packing needs at least one open row, got {open_rows}")
        super().__init__(max_length)
        self.open_rows = open_rows
        self.open: list[Row] = []  # oldest first
        self.used: list[int] = []  # tokens in each open row

    def add(self, ids: list[int]) -> None:
        # A document longer than a row: full rows of its first pieces, then the rest like any document (offsets, as
        # in GreedyPacker.add).
        start = 0
        while len(ids) - start > self.max_length:
            self.closed.append([ids[start : start + self.max_length]])
            start += self.max_length
        if start < len(ids):
            self._place(ids[start:])  # a copy: the open rows never hold the caller's list

    def _place(self, ids: list[int]) -> None:
        fits = [i for i, used in enumerate(self.used) if used + len(ids) <= self.max_length]
        if fits:  # the least room left that still holds it; the oldest such row on a tie (min keeps the first)
            row = min(fits, key=lambda i: self.max_length - self.used[i])
        else:
            self.open.append([])
            self.used.append(0)
            row = len(self.open) - 1
        self.open[row].append(ids)
        self.used[row] += len(ids)
        if self.used[row] == self.max_length:
            self._close(row)
        elif len(self.open) > self.open_rows:  # too many open: close the fullest (the oldest on a tie)
            self._close(max(range(len(self.open)), key=lambda i: self.used[i]))

    def _close(self, row: int) -> None:
        self.closed.append(self.open.pop(row))
        self.used.pop(row)

    def flush(self) -> None:
        self.closed.extend(self.open)
        self.open, self.used = [], []

    def state(self) -> dict:
        return {"closed": [[list(s) for s in row] for row in self.closed],
                "open": [[list(s) for s in row] for row in self.open]}

    def load(self, state: dict) -> None:
        self.closed = [[list(s) for s in row] for row in state["closed"]]
        self.open = [[list(s) for s in row] for row in state["open"]]
        self.used = [sum(len(s) for s in row) for row in self.open]


def make_packer(mode: str, max_length: int, open_rows: int = 64) -> GreedyPacker | BestFitPacker:
    if mode == "greedy":
        return GreedyPacker(max_length)
    if mode == "best_fit":
        return BestFitPacker(max_length, open_rows)
    raise ValueError(f"packing must be 'greedy' or 'best_fit', got {mode!r}")


def packing_efficiency(rows: list[Row], max_length: int) -> float:
    """Real tokens / (rows x max_length): the share of the rows' capacity that holds text."""
    return sum(len(s) for row in rows for s in row) / (len(rows) * max_length) if rows else 0.0
