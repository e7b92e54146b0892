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

Partial reuse (``KvCacheConfig::enablePartialReuse``, on by default, as in TensorRT-LLM's
``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``, ``loadOrAllocateBlocks``): after the
longest chain of full matches, the cached child block sharing the longest prefix with the prompt's
next tokens is reused for those tokens: claimed when it is a leaf nobody uses (it leaves the tree
and becomes the request's own block), copied into a new block otherwise. Either way it counts as
a reused block (``++mReusedBlocks``) and the request computes from the first unmatched token.

Occupancy as the real pool reports it (``kvCacheManager.h``, ``getNumAllocatedBlocks``): a
cached block nobody uses sits in the eviction policy's free queue, so it counts as free; only the
running request's blocks (reused or new) are allocated. A warm idle cache reads ``used = 0``.

The engine runs one request at a time, so there is at most one `Session`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from backends.sim.numerics import F32, F64


class CapacityError(Exception):
    """No block could be allocated: the pool is full of blocks the request is using."""


@dataclass
class _Block:
    parent: bytes | None
    kv: F32  # [layers, 2, tokens_per_block, heads, head_dim], values exact in float32
    last_used: int
    tokens: tuple[int, ...] = ()
    children: set[bytes] = field(default_factory=set)


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
        self.reused = reused  # fully matched cached blocks, pinned while the request runs
        self.partial_tokens = 0  # tokens of a partially matched block (claimed or copied)
        self.new_blocks = 0
        self.computed = 0  # tokens whose K/V are in the working buffers
        c = cache
        self.kt: F64 = np.zeros((c.layers, c.heads, c.tpb, c.head_dim, 0))
        self.v: F64 = np.zeros((c.layers, c.heads, 0, c.head_dim))
        # Sized for the whole request up front: regrowing mid-request copies the buffers.
        self._grow(-(-max(len(tokens), expected, 1) // c.tpb))

    @property
    def reused_tokens(self) -> int:
        return len(self.reused) * self.cache.tpb + self.partial_tokens

    @property
    def partial_blocks(self) -> int:
        return 1 if self.partial_tokens else 0

    @property
    def reused_blocks(self) -> int:
        """Blocks counted as reused, as ``kv_cache_reused_blocks``: full and partial matches."""
        return len(self.reused) + self.partial_blocks

    @property
    def pages(self) -> int:
        return self.kt.shape[-1]

    def reserve(self, n_tokens: int) -> None:
        """Hold enough blocks (and buffer) for the first `n_tokens` tokens' K/V."""
        pages = -(-n_tokens // self.cache.tpb)
        while self.new_blocks < pages - len(self.reused) - self.partial_blocks:
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

    def load(self, blocks: F32, tokens: int) -> None:
        """Copy cached blocks [b, layers, 2, tpb, heads, hd] into pages 0..b; the first
        ``tokens`` positions are then computed (a partial last block's later positions are
        overwritten by the prefill)."""
        n = len(blocks)
        self.kt[..., :n] = blocks[:, :, 0].transpose(1, 3, 2, 4, 0)
        v = blocks[:, :, 1].transpose(1, 3, 0, 2, 4)
        self.v[:, :, : n * self.cache.tpb] = v.reshape(*v.shape[:2], -1, v.shape[-1])
        self.computed = tokens

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
        partial_reuse: bool = True,
    ) -> None:
        self.capacity = capacity_blocks
        self.tpb = tokens_per_block
        self.reuse = reuse
        self.partial_reuse = partial_reuse
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self._blocks: dict[bytes, _Block] = {}
        self._roots: set[bytes] = set()  # cached first blocks (no parent)
        self._leaves: dict[bytes, None] = {}
        self._pinned: set[bytes] = set()
        self._inflight = 0
        self._clock = 0
        self.reused_blocks_total = 0

    @property
    def used_blocks(self) -> int:
        """Allocated blocks: the running request's (reused or new); cached blocks nobody uses
        are free (TensorRT-LLM's free queue holds them until they are evicted or reused)."""
        return len(self._pinned) + self._inflight

    @property
    def cached_blocks(self) -> int:
        """Blocks whose contents are kept for reuse, in use or not."""
        return len(self._blocks)

    def _occupied(self) -> int:
        # Blocks that hold something: cached ones (in use or free-but-reusable) and new ones.
        return len(self._blocks) + self._inflight

    def clear(self) -> None:
        """Drop every cached block (a reset); cumulative counters are kept."""
        self._blocks.clear()
        self._roots.clear()
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
        session = Session(self, prompt, reused, expected_tokens)
        kv = [self._blocks[key].kv for key in reused]
        partial = self._partial_match(prompt, reused) if self.reuse and self.partial_reuse else None
        if partial is not None:
            key, matched = partial
            kv.append(self._blocks[key].kv)
            self._take_partial(key)
            session.partial_tokens = matched
        self.reused_blocks_total += session.reused_blocks
        if kv:
            session.load(np.stack(kv), session.reused_tokens)
        return session

    def _partial_match(self, prompt: list[int], reused: list[bytes]) -> tuple[bytes, int] | None:
        """The cached block after the matched chain sharing the longest prefix (at least one
        token) with the prompt's next tokens, keeping the last prompt token to compute."""
        start = len(reused) * self.tpb
        wanted = prompt[start : min(start + self.tpb, len(prompt) - 1)]
        if not wanted:
            return None
        children = self._blocks[reused[-1]].children if reused else self._roots
        best: tuple[bytes, int] | None = None
        for key in children:
            tokens = self._blocks[key].tokens
            n = 0
            while n < len(wanted) and tokens[n] == wanted[n]:
                n += 1
            if n and (best is None or n > best[1]):
                best = (key, n)
        return best

    def _take_partial(self, key: bytes) -> None:
        """The request takes a partially matched block: a leaf nobody uses leaves the tree
        and becomes its own (claimed); any other block is copied into a new one."""
        if key in self._leaves and key not in self._pinned:
            self._drop(key)
        elif self._occupied() >= self.capacity:
            self._evict_one()
        self._inflight += 1

    def allocate(self) -> None:
        """Account one more block for the running request, evicting if the pool is full."""
        if self._occupied() >= self.capacity:
            self._evict_one()
        self._inflight += 1

    def finish(self, session: Session, register: bool) -> None:
        """End the running request; with `register` (and reuse on) cache its full blocks."""
        self._inflight -= session.new_blocks + session.partial_blocks
        self._pinned = set()
        if not (register and self.reuse):
            return
        full = session.computed // self.tpb
        keys = chain_keys(session.tokens, full, self.tpb)
        first_new = len(session.reused)
        kv = session.blocks(first_new, full)
        tpb = self.tpb
        for i, key in enumerate(keys):
            if key not in self._blocks:
                tokens = tuple(session.tokens[i * tpb : (i + 1) * tpb])
                self._register(key, keys[i - 1] if i else None, kv[i - first_new], tokens)
            self._touch(key)

    def _register(self, key: bytes, parent: bytes | None, kv: F32, tokens: tuple[int, ...]) -> None:
        block = _Block(parent=parent, kv=np.ascontiguousarray(kv), last_used=0, tokens=tokens)
        self._blocks[key] = block
        self._leaves[key] = None
        if parent is None:
            self._roots.add(key)
        else:
            self._blocks[parent].children.add(key)
            self._leaves.pop(parent, None)

    def _touch(self, key: bytes) -> None:
        self._clock += 1
        self._blocks[key].last_used = self._clock

    def _evict_one(self) -> None:
        candidates = [key for key in self._leaves if key not in self._pinned]
        if not candidates:
            raise CapacityError("KV cache capacity exceeded")
        self._drop(min(candidates, key=lambda key: self._blocks[key].last_used))

    def _drop(self, leaf: bytes) -> None:
        """Take a leaf out of the tree (evicted, or claimed by a partial match)."""
        parent = self._blocks.pop(leaf).parent
        del self._leaves[leaf]
        if parent is None:
            self._roots.discard(leaf)
            return
        block = self._blocks[parent]
        block.children.discard(leaf)
        if not block.children:
            self._leaves[parent] = None
