"""Prefix caching: requests whose prompts share a prefix of whole cache blocks reuse its
cache instead of prefilling it again.

What a request's cache holds after P = 128 k tokens (a block boundary: every compression
ratio divides 128, so no compressor block is half full):
- the compressed KV entries and indexer keys of tokens < P, in its first k pool blocks.
  They are complete and never written again, so later requests can read the same blocks
  (shared through the block table, counted by `ref`);
- its slot's own state: the window ring (the last 128 tokens' KV rows and positions) and
  the compressor state (`cst`: CSA keeps the previous block's half for pooling). These
  are copied into a snapshot (a pytree like the cache's slot rows, `entries` deep), and
  copied back into the slot of a request that reuses the prefix.

An entry is keyed by the hash chain of its k blocks' tokens. A request looks up the
longest entry that leaves at least one prompt token to prefill (the last chunk's logits
give the first token), and adds an entry at every block boundary its own prefill reaches.
Entries are evicted least recently used, when a snapshot is needed or when admission
needs their blocks; a block returns to the pool when no entry and no running request
holds it. Single-device engines only (the copies index the unsharded cache).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import BLOCK_TOKENS, slot_state, with_slot_state


@functools.partial(jax.jit, donate_argnums=(0,))
def save_snapshot(snaps, cache, slot, idx):
    """snaps[idx] = the slot's rows of the cache (snaps donated)."""
    return jax.tree.map(lambda s, c: s.at[idx].set(c[slot]), snaps, slot_state(cache))


@functools.partial(jax.jit, donate_argnums=(0,))
def load_snapshot(cache, snaps, slot, idx):
    """The cache with the slot's rows set from snaps[idx] (cache donated)."""
    new = jax.tree.map(lambda c, s: c.at[slot].set(s[idx]), slot_state(cache), snaps)
    return with_slot_state(cache, new)


def block_keys(prompt, n_blocks: int) -> list[bytes]:
    """Keys of the prompt's first 1..n_blocks whole blocks (a hash chain over their tokens)."""
    keys, h = [], b""
    for k in range(n_blocks):
        blk = np.asarray(prompt[k * BLOCK_TOKENS:(k + 1) * BLOCK_TOKENS], np.int64)
        h = hashlib.sha256(h + blk.tobytes()).digest()
        keys.append(h)
    return keys


@dataclasses.dataclass
class Entry:
    blocks: tuple[int, ...]   # the prefix's pool blocks, in table order
    snap: int                 # its snapshot's index


class PrefixCache:
    """Host bookkeeping of the entries and of the pool blocks they share, plus the device
    snapshots. bm: the engine's BlockManager (blocks return to bm.free)."""

    def __init__(self, engine, entries: int):
        if engine.mesh is not None or engine.pipeline is not None:
            raise ValueError("prefix caching runs on a single-device engine (no --devices)")
        if entries < 1:
            raise ValueError(f"prefix cache entries must be >= 1, got {entries}")
        self.eng, self.bm = engine, engine.bm
        self.snaps = jax.tree.map(lambda a: jnp.zeros((entries, *a.shape[1:]), a.dtype),
                                  slot_state(engine.cache))
        self.snaps = jax.device_put(self.snaps, jax.devices()[0])
        self.free_snaps = list(range(entries))[::-1]
        self.entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self.ref: dict[int, int] = {}   # shared block -> entries + requests holding it
        self.queried_tokens = self.hit_tokens = 0

    @property
    def blocks_held(self) -> int:
        return len(self.ref)

    # ---- requests ------------------------------------------------------------------------
    def lookup(self, prompt) -> tuple[int, Entry | None]:
        """-> (k, entry): the longest cached prefix of k whole blocks that leaves a prompt
        token to prefill (k = 0, None: none)."""
        n = (len(prompt) - 1) // BLOCK_TOKENS
        keys = block_keys(prompt, n)
        for k in range(n, 0, -1):
            e = self.entries.get(keys[k - 1])
            if e is not None:
                self.entries.move_to_end(keys[k - 1])
                return k, e
        return 0, None

    def attach(self, slot: int, e: Entry) -> None:
        """Put the entry's blocks at the head of the (just admitted) slot's table, its
        length after them (detach undoes it)."""
        k = len(e.blocks)
        self.bm.table[slot, :k] = e.blocks
        for b in e.blocks:
            self.ref[b] += 1
        self.bm.length[slot] = k * BLOCK_TOKENS

    def load(self, slot: int, e: Entry) -> None:
        """Copy the entry's snapshot into the slot's rows (window ring, compressor state)."""
        self.eng.cache = load_snapshot(self.eng.cache, self.snaps, np.int32(slot),
                                       np.int32(e.snap))

    def detach(self, slot: int) -> None:
        """Before the block manager releases the slot: give back its shared blocks (the
        pool gets those no one holds any more) and leave it only its own."""
        for j, b in enumerate(self.bm.table[slot]):
            b = int(b)
            if b in self.ref:
                self.bm.table[slot, j] = -1
                self._unref(b)

    def insert(self, prompt, slot: int, k: int) -> None:
        """The slot has just prefilled exactly k whole blocks of `prompt`: keep them as an
        entry (its blocks become shared; the slot's rows go to a snapshot)."""
        key = block_keys(prompt, k)[-1]
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if not self.free_snaps and not self.evict():
            return
        blocks = tuple(int(b) for b in self.bm.table[slot, :k])
        for b in blocks:
            # a block the request allocated itself is now shared: the request holds it too
            self.ref[b] = self.ref.get(b, 1) + 1
        e = Entry(blocks, self.free_snaps.pop())
        self.snaps = save_snapshot(self.snaps, self.eng.cache, np.int32(slot), np.int32(e.snap))
        self.entries[key] = e

    def evict(self) -> bool:
        """Drop the least recently used entry (False: there is none)."""
        if not self.entries:
            return False
        _, e = self.entries.popitem(last=False)
        self.free_snaps.append(e.snap)
        for b in e.blocks:
            self._unref(b)
        return True

    def _unref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            del self.ref[b]
            self.bm.free.append(b)

    def warm_up(self, slot: int = 0) -> None:
        """Compile the two copies (on an idle slot: its rows are garbage until a request
        is admitted there, which a fresh prefill ignores)."""
        self.snaps = save_snapshot(self.snaps, self.eng.cache, np.int32(slot), np.int32(0))
        self.eng.cache = load_snapshot(self.eng.cache, self.snaps, np.int32(slot),
                                       np.int32(0))
