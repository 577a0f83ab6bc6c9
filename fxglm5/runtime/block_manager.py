"""Block allocation for the paged cache: per-request block lists, growth, release and prefix reuse.

Prefix reuse: every full block a request has written gets a key, the hash of all token ids up to the end
of that block (chained block by block, so equal keys mean equal prefixes). A later request whose prompt
starts with the same tokens takes those blocks instead of recomputing them (reference-counted; nobody
writes into a shared block, because only full blocks are shared and writes go past a request's prefix).
A block nobody uses any more keeps its contents and key until its memory is needed (least recently freed
goes first), so reuse also works after the first request finished.

A request that does not fit raises :class:`CacheFullError` and changes nothing: other requests go on.
"""

from __future__ import annotations

import collections
import hashlib

from fxglm5.errors import CacheFullError, InputError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2 or block_size < 1:
            raise InputError(f"num_blocks/block_size: need >= 2 blocks (block 0 is reserved) and a positive size, "
                             f"got {num_blocks} / {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = collections.deque(range(1, num_blocks))
        self._ref = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # ref 0, keyed
        self.tables: dict[object, list[int]] = {}
        self._committed: dict[object, tuple[int, bytes]] = {}  # per request: full blocks keyed, the last key

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def fits_unevicted(self, growth) -> bool:
        """Whether growing each ``(request, num_tokens)`` of ``growth`` takes only blocks that hold no cached prefix:
        then ``extend`` neither fails nor evicts, so the overlapped decode loop may grow a request before it knows
        whether the request stopped at the step in flight (the wasted room goes back through ``truncate``)."""
        need = sum(max(-(-n // self.block_size) - len(self.tables[seq_id]), 0) for seq_id, n in growth)
        return need <= len(self._free)

    def _keys(self, tokens, n_blocks: int, first: int = 0, digest: bytes = b"") -> list[bytes]:
        """Keys of blocks ``first`` .. ``n_blocks - 1``; ``digest`` is block ``first - 1``'s key (chained)."""
        keys, bs = [], self.block_size
        for i in range(first, n_blocks):
            chunk = ",".join(map(str, tokens[i * bs:(i + 1) * bs])).encode()
            digest = hashlib.sha256(digest + b"|" + chunk).digest()
            keys.append(digest)
        return keys

    def _cached_prefix(self, tokens) -> list[int]:
        """Blocks holding the longest cached prefix; at least one token is left to compute (its logits)."""
        blocks = []
        for key in self._keys(tokens, (len(tokens) - 1) // self.block_size):
            if key not in self._block_of:
                break
            blocks.append(self._block_of[key])
        return blocks

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block

    def allocate(self, seq_id, tokens) -> int:
        """Blocks for a new request's prompt; returns how many leading tokens are already cached."""
        if seq_id in self.tables:
            raise InputError(f"request {seq_id!r}: already has blocks")
        reused = self._cached_prefix(tokens)
        need = -(-len(tokens) // self.block_size) - len(reused)
        available = len(self._free) + sum(1 for b in self._evictable if b not in reused)
        if need > available:
            raise CacheFullError(f"request {seq_id!r}: the KV cache is full: {len(tokens)} prompt tokens need "
                                 f"{need} more blocks of {self.block_size}, {available} free of {self.num_blocks - 1}")
        for block in reused:
            self._ref[block] += 1
            self._evictable.pop(block, None)
        new = [self._take() for _ in range(need)]
        for block in new:
            self._ref[block] = 1
        self.tables[seq_id] = reused + new
        return len(reused) * self.block_size

    def extend(self, seq_id, num_tokens: int) -> None:
        """Grow a request's blocks to hold ``num_tokens`` tokens (CacheFullError, unchanged, if no room)."""
        table = self.tables[seq_id]
        need = -(-num_tokens // self.block_size) - len(table)
        if need > self.num_free:
            raise CacheFullError(f"request {seq_id!r}: the KV cache is full: {num_tokens} tokens need {need} more "
                                 f"blocks of {self.block_size}, {self.num_free} free")
        for _ in range(max(need, 0)):
            block = self._take()
            self._ref[block] = 1
            table.append(block)

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Shrink a request's blocks to those holding its first ``num_tokens`` tokens: the rollback of rejected
        draft tokens (fxglm5.runtime.speculative). The released blocks were taken by ``extend`` (never shared,
        never committed) and go back to the FRONT of the free list in their order, so the next ``extend`` takes
        them again as plain decoding would have. A committed block cannot be released (InputError)."""
        table = self.tables[seq_id]
        keep = -(-num_tokens // self.block_size)
        if keep < self._committed.get(seq_id, (0, b""))[0]:
            raise InputError(f"request {seq_id!r}: truncate to {num_tokens} tokens would drop a committed block")
        for block in reversed(table[keep:]):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free.appendleft(block)
        del table[keep:]

    def commit(self, seq_id, tokens) -> None:
        """Make the full blocks of ``tokens`` (all of them already in the cache) reusable as a prefix.

        Incremental: a request's tokens only grow, so only the blocks filled since its last commit are hashed,
        chained from the last key (re-hashing the whole sequence every decode step cost O(context) host time
        per request per step)."""
        table = self.tables[seq_id]
        done, digest = self._committed.get(seq_id, (0, b""))
        n_full = len(tokens) // self.block_size
        keys = self._keys(tokens, n_full, done, digest)
        for block, key in zip(table[done:n_full], keys):
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block], self._block_of[key] = key, block
        if keys:
            self._committed[seq_id] = (n_full, keys[-1])

    def free(self, seq_id) -> None:
        """Release a request's blocks; tail first, so eviction takes a prefix's last blocks before its head."""
        self._committed.pop(seq_id, None)
        for block in reversed(self.tables.pop(seq_id, [])):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
