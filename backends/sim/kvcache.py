"""Paged KV cache with block reuse and LRU leaf eviction, after TensorRT-LLM.

Full blocks of `tokens_per_block` tokens are keyed by a hash chain, key(i) = H(key(i-1),
tokens of block i), so a key names a whole prefix. A request reuses the longest chain of
cached blocks matching its prompt, but always recomputes at least the last prompt token.
When it ends, the full blocks it computed (prompt and generated tokens alike) are
registered and become evictable; the partial last block is freed. A block whose key is
already cached is dropped in favour of the cached one, which keeps the older contents.

When a block is needed and the pool is full, the least recently used *leaf* (a cached block
with no cached children) that the running request does not use is evicted; eviction only
ever shortens a chain from its end, so every cached key stays reachable from the root.

The engine runs one request at a time, so there is at most one `Session`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from backends.sim.numerics import F32, F64


class CapacityError(Exception):
    """No block could be allocated: the pool is full of blocks the request is using."""


@dataclass
class _Block:
    parent: bytes | None
    kv: F32  # [layers, 2, tokens_per_block, heads, head_dim], values exact in float32
    last_used: int
    children: int = 0


def chain_keys(tokens: list[int], n_blocks: int, tpb: int) -> list[bytes]:
    """Hash-chain keys of the first `n_blocks` full blocks of `tokens`."""
    keys: list[bytes] = []
    prev = b""
    for i in range(n_blocks):
        block = np.asarray(tokens[i * tpb : (i + 1) * tpb], dtype=np.uint16).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        keys.append(prev)
    return keys


class Session:
    """One running request: its contiguous working K/V and the blocks it holds.

    The working K/V use the transformer's layout: `kt` [layers, heads, tpb, head_dim,
    pages] and `v` [layers, heads, pages * tpb, head_dim], float64 holding rounded values.
    """

    def __init__(
        self, cache: PagedKVCache, tokens: list[int], reused: list[bytes], expected: int
    ) -> None:
        self.cache = cache
        self.tokens = list(tokens)  # prompt, then every generated token fed back
        self.reused = reused
        self.new_blocks = 0
        self.computed = 0  # tokens whose K/V are in the working buffers
        c = cache
        self.kt: F64 = np.zeros((c.layers, c.heads, c.tpb, c.head_dim, 0))
        self.v: F64 = np.zeros((c.layers, c.heads, 0, c.head_dim))
        # Sized for the whole request up front: regrowing mid-request copies the buffers.
        self._grow(-(-max(len(tokens), expected, 1) // c.tpb))

    @property
    def reused_tokens(self) -> int:
        return len(self.reused) * self.cache.tpb

    @property
    def pages(self) -> int:
        return self.kt.shape[-1]

    def reserve(self, n_tokens: int) -> None:
        """Hold enough blocks (and buffer) for the first `n_tokens` tokens' K/V."""
        pages = -(-n_tokens // self.cache.tpb)
        while self.new_blocks < pages - len(self.reused):
            self.cache.allocate()
            self.new_blocks += 1
        if pages > self.pages:
            # Doubling keeps the decode loop's copying O(1) amortized.
            self._grow(max(pages, 2 * self.pages))

    def _grow(self, pages: int) -> None:
        c, old = self.cache, self.pages
        kt = np.zeros((c.layers, c.heads, c.tpb, c.head_dim, pages))
        v = np.zeros((c.layers, c.heads, pages * c.tpb, c.head_dim))
        kt[..., :old] = self.kt
        v[:, :, : old * c.tpb] = self.v
        self.kt, self.v = kt, v

    def load(self, blocks: F32) -> None:
        """Copy cached blocks [b, layers, 2, tpb, heads, hd] into pages 0..b."""
        n = len(blocks)
        self.kt[..., :n] = blocks[:, :, 0].transpose(1, 3, 2, 4, 0)
        v = blocks[:, :, 1].transpose(1, 3, 0, 2, 4)
        self.v[:, :, : n * self.cache.tpb] = v.reshape(*v.shape[:2], -1, v.shape[-1])
        self.computed = n * self.cache.tpb

    def blocks(self, first: int, end: int) -> F32:
        """Pages first..end as float32 blocks [b, layers, 2, tpb, heads, hd]."""
        c = self.cache
        k = self.kt[..., first:end].transpose(4, 0, 2, 1, 3)
        v = self.v[:, :, first * c.tpb : end * c.tpb]
        v = v.reshape(c.layers, c.heads, end - first, c.tpb, c.head_dim).transpose(2, 0, 3, 1, 4)
        blocks: F32 = np.stack([k, v], axis=2).astype(np.float32)
        return blocks


class PagedKVCache:
    """The block pool: cached chains, LRU leaves and the running request's blocks."""

    def __init__(
        self,
        *,
        capacity_blocks: int,
        tokens_per_block: int,
        reuse: bool,
        layers: int,
        heads: int,
        head_dim: int,
    ) -> None:
        self.capacity = capacity_blocks
        self.tpb = tokens_per_block
        self.reuse = reuse
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self._blocks: dict[bytes, _Block] = {}
        self._leaves: dict[bytes, None] = {}
        self._pinned: set[bytes] = set()
        self._inflight = 0
        self._clock = 0
        self.reused_blocks_total = 0

    @property
    def used_blocks(self) -> int:
        return len(self._blocks) + self._inflight

    def clear(self) -> None:
        """Drop every cached block (a reset); cumulative counters are kept."""
        self._blocks.clear()
        self._leaves.clear()
        self._pinned.clear()
        self._inflight = 0

    def begin(self, prompt: list[int], expected_tokens: int) -> Session:
        """Start a request: pin the longest cached chain matching the prompt.

        `expected_tokens` (prompt plus most tokens it may generate) sizes the working K/V.
        """
        reused: list[bytes] = []
        if self.reuse:
            max_reuse = (len(prompt) - 1) // self.tpb
            for key in chain_keys(prompt, max_reuse, self.tpb):
                if key not in self._blocks:
                    break
                reused.append(key)
                self._touch(key)
        self._pinned = set(reused)
        self.reused_blocks_total += len(reused)
        session = Session(self, prompt, reused, expected_tokens)
        if reused:
            session.load(np.stack([self._blocks[key].kv for key in reused]))
        return session

    def allocate(self) -> None:
        """Account one more block for the running request, evicting if the pool is full."""
        if self.used_blocks >= self.capacity:
            self._evict_one()
        self._inflight += 1

    def finish(self, session: Session, register: bool) -> None:
        """End the running request; with `register` (and reuse on) cache its full blocks."""
        self._inflight -= session.new_blocks
        self._pinned = set()
        if not (register and self.reuse):
            return
        full = session.computed // self.tpb
        keys = chain_keys(session.tokens, full, self.tpb)
        first_new = len(session.reused)
        kv = session.blocks(first_new, full)
        for i, key in enumerate(keys):
            if key not in self._blocks:
                self._register(key, keys[i - 1] if i else None, kv[i - first_new])
            self._touch(key)

    def _register(self, key: bytes, parent: bytes | None, kv: F32) -> None:
        self._blocks[key] = _Block(parent=parent, kv=np.ascontiguousarray(kv), last_used=0)
        self._leaves[key] = None
        if parent is not None:
            self._blocks[parent].children += 1
            self._leaves.pop(parent, None)

    def _touch(self, key: bytes) -> None:
        self._clock += 1
        self._blocks[key].last_used = self._clock

    def _evict_one(self) -> None:
        candidates = [key for key in self._leaves if key not in self._pinned]
        if not candidates:
            raise CapacityError("KV cache capacity exceeded")
        victim = min(candidates, key=lambda key: self._blocks[key].last_used)
        parent = self._blocks.pop(victim).parent
        del self._leaves[victim]
        if parent is not None:
            block = self._blocks[parent]
            block.children -= 1
            if block.children == 0:
                self._leaves[parent] = None
