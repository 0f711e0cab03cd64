"""KV-cache block manager: reference-counted blocks, prefix caching by token-block hashes, copy-on-write,
and a host block pool that preempted sequences swap out to."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class NoFreeBlocks(Exception):
    """Raised when an allocation cannot be satisfied right now."""


@dataclass
class BlockTable:
    """The blocks of one sequence, in order, and how many of its tokens are in the cache."""

    blocks: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose K/V are written
    hashes: list[int | None] = field(default_factory=list)  # per full block, for prefix caching
    on_host: bool = False  # swapped out: ``blocks`` are host block ids
    # the first block's hash parent: an encoder-decoder's decoder blocks depend on the encoder's input too,
    # so their prefix-caching hashes chain from a hash of it (None for decoder-only models)
    salt: int | None = None


class BlockManager:
    """Hands out cache blocks.

    Full blocks of prompt tokens are registered under a hash of (previous block's hash, tokens),
    so a later request with the same prefix reuses them. Blocks nobody references but that hold
    a cached prefix stay findable until their space is needed (least recently freed first).

    ``num_host_blocks`` host blocks hold swapped-out sequences: ``swap_out`` moves a table's blocks
    there and ``swap_in`` back. Like block copies, the data moves are queued for the engine
    (``take_swaps``); the manager only does the bookkeeping.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._cached: dict[int, int] = {}  # hash -> block
        self._block_hash: dict[int, int] = {}  # block -> hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but holding a cached prefix
        self.prefix_hits = 0  # blocks reused through prefix caching
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), for the engine
        self.num_host_blocks = num_host_blocks
        # host blocks need no reference counts: each belongs to exactly one swapped-out table
        self._host_free = list(range(num_host_blocks - 1, -1, -1))
        # host blocks swapped in since the last take_swaps: their data is read only when the engine
        # runs the queued swaps, so they must not receive a queued swap-out before then
        self._host_releasing: list[int] = []
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, host block), for the engine
        self.pending_swap_in: list[tuple[int, int]] = []  # (host block, device block), for the engine

    # --- accounting

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_free_host(self) -> int:
        return len(self._host_free)

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        total = table.num_cached_tokens + num_tokens
        return max(0, -(-total // self.block_size) - len(table.blocks))

    # --- allocation

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self._block_hash.pop(b)
            self._cached.pop(h, None)
        else:
            raise NoFreeBlocks
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self._block_hash:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def allocate_prompt(self, table: BlockTable, prompt: Sequence[int]) -> int:
        """Reuse cached full blocks of ``prompt``'s prefix; returns how many tokens are already cached.

        At least the last prompt token is always left to compute (its logits are needed).
        """
        if not self.enable_prefix_caching or table.blocks:
            return 0
        bs = self.block_size
        parent = table.salt
        for i in range((len(prompt) - 1) // bs):
            h = hash((parent, tuple(prompt[i * bs:(i + 1) * bs])))
            b = self._cached.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                self._evictable.pop(b, None)
            self.ref[b] += 1
            table.blocks.append(b)
            table.hashes.append(h)
            parent = h
            self.prefix_hits += 1
        table.num_cached_tokens = len(table.blocks) * bs
        return table.num_cached_tokens

    def _writes_shared(self, table: BlockTable) -> bool:
        """Whether the next token's block is shared (a write copies it first)."""
        last = table.num_cached_tokens // self.block_size
        return last < len(table.blocks) and self.ref[table.blocks[last]] > 1

    def room_for(self, table: BlockTable, num_tokens: int) -> int:
        """Free blocks ``reserve(table, num_tokens)`` takes: new blocks, and a copy of a shared last block."""
        return self.blocks_needed(table, num_tokens) + int(self._writes_shared(table))

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make room for ``num_tokens`` more tokens (all or nothing), copying shared blocks before a write."""
        need = self.blocks_needed(table, num_tokens)
        cow = self._writes_shared(table)
        if not need and not cow:  # most of a decode step's requests: room in their last block
            return
        last = table.num_cached_tokens // self.block_size
        if need + int(cow) > self.num_free:
            raise NoFreeBlocks
        if cow:
            src = table.blocks[last]
            dst = self._take()
            self.pending_copies.append((src, dst))
            self.ref[src] -= 1
            table.blocks[last] = dst
            if last < len(table.hashes):
                table.hashes[last] = None
        for _ in range(need):
            table.blocks.append(self._take())

    def commit(self, table: BlockTable, tokens: Sequence[int] | Callable[[], Sequence[int]], num_new: int) -> None:
        """Record that ``num_new`` more tokens were written; register newly full blocks for reuse.

        ``tokens`` is the sequence's whole token list so far (prompt and generated), or a function giving it:
        called only when a block fills (a decode step's commits seldom need the list).
        """
        before = table.num_cached_tokens
        self.count(table, num_new)
        self.register(table, tokens, before, table.num_cached_tokens)

    def count(self, table: BlockTable, num_new: int) -> None:
        """Record that ``num_new`` more tokens are being written whose ids are not known on the host yet (an
        asynchronous decode step's input, read on the device); ``register`` their blocks once they are."""
        table.num_cached_tokens += num_new

    def register(self, table: BlockTable, tokens: Sequence[int] | Callable[[], Sequence[int]], start: int,
                 end: int) -> None:
        """Register for reuse the blocks that positions ``[start, end)`` fill, their tokens now known: ``commit``
        does it as it counts them; an asynchronous decode step counts its token as it starts (the next step
        reserves past it) and registers it once its input token is read back (it came from the device)."""
        bs = self.block_size
        if not self.enable_prefix_caching or start // bs == end // bs:
            return
        if callable(tokens):
            tokens = tokens()
        for i in range(start // bs, end // bs):
            if i == 0:
                parent = table.salt
            else:
                parent = table.hashes[i - 1] if i - 1 < len(table.hashes) else None
                if parent is None:
                    break  # an unhashed block breaks the chain
            h = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            while len(table.hashes) <= i:
                table.hashes.append(None)
            table.hashes[i] = h
            b = table.blocks[i]
            if h not in self._cached and b not in self._block_hash:
                self._cached[h] = b
                self._block_hash[b] = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (as vLLM's ``reset_prefix_cache``): no later prompt reuses a block filled so
        far. Blocks no table holds are free again; where no table holds any, they are handed out in their first
        order again, as by a new manager. Blocks in use stay with their tables, no longer findable."""
        if any(self.ref):
            self._free.extend(self._evictable)
        else:
            self._free = list(range(self.num_blocks - 1, -1, -1))
        self._evictable.clear()
        self._cached.clear()
        self._block_hash.clear()

    def allocate(self, table: BlockTable, num_blocks: int) -> None:
        """Give an empty table ``num_blocks`` private blocks at once (all or nothing; never prefix-cached):
        an encoder-decoder request's cross-attention blocks, filled once by its encoder."""
        if table.blocks:
            raise ValueError("allocate: the table already holds blocks")
        if num_blocks > self.num_free:
            raise NoFreeBlocks
        table.blocks.extend(self._take() for _ in range(num_blocks))

    def fork(self, table: BlockTable) -> BlockTable:
        """A second sequence sharing every block of ``table`` (copy-on-write on its next write)."""
        for b in table.blocks:
            self.ref[b] += 1
        return BlockTable(list(table.blocks), table.num_cached_tokens, list(table.hashes), salt=table.salt)

    def free(self, table: BlockTable) -> None:
        if table.on_host:
            self._host_free.extend(reversed(table.blocks))
            table.on_host = False
        else:
            for b in reversed(table.blocks):
                self._release(b)
        table.blocks.clear()
        table.hashes.clear()
        table.num_cached_tokens = 0

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    # --- swapping

    def can_swap_out(self, table: BlockTable) -> bool:
        return not table.on_host and len(table.blocks) <= len(self._host_free)

    def swap_out(self, table: BlockTable) -> list[tuple[int, int]]:
        """Move every block of ``table`` to a host block; returns the (device, host) pairs queued.

        Shared blocks are copied too: the table drops its reference (the other holders keep
        theirs) and owns a private host copy, so nothing on the host is shared.
        """
        if not self.can_swap_out(table):
            raise NoFreeBlocks
        pairs = [(b, self._host_free.pop()) for b in table.blocks]
        for b in reversed(table.blocks):
            self._release(b)  # a prefix-cached block stays findable on the device until evicted
        table.blocks = [h for _, h in pairs]
        table.on_host = True
        self.pending_swap_out.extend(pairs)
        return pairs

    def swap_in_blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Device blocks a swapped-out ``table`` needs to come back and take ``num_tokens`` more."""
        return len(table.blocks) + self.blocks_needed(table, num_tokens)

    def can_swap_in(self, table: BlockTable, num_tokens: int) -> bool:
        return table.on_host and self.swap_in_blocks_needed(table, num_tokens) <= self.num_free

    def swap_in(self, table: BlockTable) -> list[tuple[int, int]]:
        """Move ``table``'s host blocks back to device blocks; returns the (host, device) pairs queued.

        A full block whose prefix is still cached on the device is shared instead of copied.
        """
        if not table.on_host:
            raise ValueError("swap_in: the table is not swapped out")
        if len(table.blocks) > self.num_free:
            raise NoFreeBlocks
        pairs, device = [], []
        for i, h in enumerate(table.blocks):
            key = table.hashes[i] if i < len(table.hashes) else None
            b = self._share_cached(key)
            if b is None:
                b = self._take()
                pairs.append((h, b))
                self._register(key, b)
            device.append(b)
            self._host_releasing.append(h)
        table.blocks = device
        table.on_host = False
        self.pending_swap_in.extend(pairs)
        return pairs

    def _share_cached(self, key: int | None) -> int | None:
        """The cached device block holding the full block hashed ``key``, with one more reference."""
        b = self._cached.get(key) if self.enable_prefix_caching and key is not None else None
        if b is not None:
            if self.ref[b] == 0:
                self._evictable.pop(b, None)
            self.ref[b] += 1
            self.prefix_hits += 1
        return b

    def _register(self, key: int | None, b: int) -> None:
        """Make a swapped-in full block findable by its prefix hash (when no other block is)."""
        if self.enable_prefix_caching and key is not None and key not in self._cached:
            self._cached[key] = b
            self._block_hash[b] = key

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Queued (device, host) swap-outs and (host, device) swap-ins; swap-outs run first."""
        out, self.pending_swap_out = self.pending_swap_out, []
        into, self.pending_swap_in = self.pending_swap_in, []
        self._host_free.extend(reversed(self._host_releasing))
        self._host_releasing.clear()
        return out, into
