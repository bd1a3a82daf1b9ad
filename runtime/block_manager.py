"""The paged KV pool: fixed-size blocks, reference counts, and a prefix cache over full blocks.

Block 0 is the null block: never handed out, it is what padding in block tables points at and where padded
rows of a CUDA-graph batch write. A request's block table covers its cached tokens; only full blocks whose
K/V has been written are hashed (the hash chains the previous block's hash and the block's token ids), so a
later request whose prompt starts with the same tokens takes references on those blocks instead of
recomputing them. Only full blocks are shared and a request only ever writes past its shared prefix, so no
copy-on-write is needed.

Free blocks sit in one ordered queue, evicted from the front: blocks without a hash go to the front, freed
cached blocks to the back (least recently used first). A cached block in the queue can be revived by a
prefix hit until it is handed out for other tokens, which drops its hash.
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.errors import KilnError

NULL_BLOCK = 0


@dataclass
class BlockStats:
    prefix_queries: int = 0  # full prompt blocks looked up in the prefix cache
    prefix_hits: int = 0  # of those, found (their K/V was reused)
    evictions: int = 0  # cached blocks handed out for other tokens


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    # Whether append_slots reserves something for every new token even when the table has room (the scheduler's
    # decode fast path then cannot skip it); a routed model's manager does.
    reserves_every_token = False

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise KilnError(f"need num_blocks >= 2 (block 0 is reserved) and block_size >= 1, "
                             f"got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block holding those tokens (in use or in the free queue)
        self.tables: dict[str, list[int]] = {}
        self._chain: dict[str, list[bytes]] = {}  # hashes of each request's leading full, written blocks
        self.stats = BlockStats()
        # Called with a request id whenever its table is dropped (the model runner's persistent rows follow it).
        self.on_free: list[Callable[[str], None]] = []
        # Called with (request id, blocks kept) when truncate() shortens a table.
        self.on_truncate: list[Callable[[str, int], None]] = []

    def ahead(self) -> contextlib.AbstractContextManager[None]:
        """Scheduling the step after one in flight (async scheduling, Scheduler.schedule_ahead): nothing changes
        here; RoutedBlockManager's append_slots then reserves without recording that step's routing."""
        return contextlib.nullcontext()

    # ---- queries ------------------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included)."""
        return len(self.free_queue)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_shared_blocks(self) -> int:
        return sum(1 for r in self.ref_counts if r > 1)

    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_slots(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ())) * self.block_size

    # ---- allocation ---------------------------------------------------------------------------------------

    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """For a request without blocks: take references on the cached blocks its tokens start with.

        Returns the number of tokens now in the cache. At least the last token is left to compute, since the
        model must run on it to give logits.
        """
        assert request_id not in self.tables, f"{request_id} already has blocks"
        self.tables[request_id] = []
        self._chain[request_id] = []
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hashes = self._chain[request_id]
        parent = b""
        for i in range((len(token_ids) - 1) // bs):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            self.stats.prefix_queries += 1
            block = self.cached.get(h)
            if block is None or not self._shareable(h):
                break
            self.stats.prefix_hits += 1
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
            self.tables[request_id].append(block)
            hashes.append(h)
            parent = h
        return len(hashes) * bs

    def _shareable(self, block_hash: bytes) -> bool:
        """Whether a cached block may be shared now (a subclass can keep state that must come with it)."""
        return True

    def append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold num_tokens tokens; False (and no change) when blocks run out."""
        table = self.tables.setdefault(request_id, [])
        self._chain.setdefault(request_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self.free_queue):
            return False
        for _ in range(need):
            block, _ = self.free_queue.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict: the block's tokens are no longer cached
                del self.cached[old]
                self.block_hash[block] = None
                self.stats.evictions += 1
            self.ref_counts[block] = 1
            table.append(block)
        return True

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's full blocks whose K/V is now written (the first num_computed tokens)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table, hashes = self.tables[request_id], self._chain[request_id]
        parent = hashes[-1] if hashes else b""
        for i in range(len(hashes), num_computed // bs):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            parent = h
            block = table[i]
            # The same tokens may already be cached in another block (two requests computed them at once);
            # then this copy stays private and unhashed.
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h

    def free(self, request_id: str) -> None:
        """Drop the request's references; unreferenced blocks join the free queue (tail blocks evicted first)."""
        table = self.tables.pop(request_id, [])
        self._chain.pop(request_id, None)
        for listener in self.on_free:
            listener(request_id)
        for block in reversed(table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Free the request's blocks past those holding num_tokens tokens (speculative slots it did not use);
        returns how many were freed. Only private, unhashed tail blocks can be past what a request computed."""
        table = self.tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        if table is None or len(table) <= keep:
            return 0
        assert keep >= len(self._chain[request_id]), f"{request_id}: truncating into its hashed blocks"
        dropped = table[keep:]
        del table[keep:]
        for listener in self.on_truncate:
            listener(request_id, keep)
        for block in reversed(dropped):
            assert self.ref_counts[block] == 1 and self.block_hash[block] is None, f"block {block} is shared"
            self.ref_counts[block] = 0
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)
        return len(dropped)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their tokens, they just stop being shareable)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks

    # ---- invariants (tests) -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                refs[b] += 1
        assert refs == self.ref_counts, "reference counts disagree with the block tables"
        assert refs[NULL_BLOCK] == 0 and NULL_BLOCK not in self.free_queue, "the null block was handed out"
        free = {b for b in range(1, self.num_blocks) if refs[b] == 0}
        assert free == set(self.free_queue), "the free queue is not exactly the unreferenced blocks"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache entry for block {b} disagrees with its hash"
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
