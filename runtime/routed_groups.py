"""Block operations on a routed group (one routed layer's BlockManager in a RoutedBlockManager) without the group's
per-call bookkeeping: a routed reservation (_take) and its give-back (_give_back), the hot path of a routed step."""

from __future__ import annotations

from kiln.runtime.block_manager import BlockManager


def _take(g: BlockManager, table: list[int], k: int) -> None:
    """g.append_slots growing a routed table by k blocks, room checked: a routed group never hashes a block (its
    prefix caching is off; RoutedBlockManager keeps entries itself), so there is nothing to evict, and the
    per-call bookkeeping is done (reserved every step where a routed table is full, this is the hot path)."""
    fq, refs = g.free_queue, g.ref_counts
    for _ in range(k):
        block = fq.popitem(last=False)[0]
        refs[block] = 1
        table.append(block)


def _give_back(g: BlockManager, request_id: str, keep: int) -> None:
    """g.truncate(request_id, tokens of `keep` blocks) for a routed table's reserved, private tail blocks."""
    table = g.tables[request_id]
    dropped = table[keep:]
    del table[keep:]
    for listener in g.on_truncate:
        listener(request_id, keep)
    fq, refs = g.free_queue, g.ref_counts
    for block in reversed(dropped):
        assert refs[block] == 1, f"routed block {block} is shared"
        refs[block] = 0
        fq[block] = None
        fq.move_to_end(block, last=False)
