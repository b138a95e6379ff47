"""The LRU free queue: an intrusive doubly linked list of unreferenced blocks, O(1) everywhere."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prefill_node.core.block import KVBlock
from prefill_node.errors import InvariantError


class FreeBlockQueue:
    """Unreferenced blocks in eviction order: the head is evicted (handed out) first.

    Links live in the blocks themselves (``prev_free`` / ``next_free``) so that a cache hit
    can take a block out of the middle in O(1). Sentinel head and tail nodes remove every
    edge case. A block is in the queue iff ``block.prev_free is not None``.

    Order contract (kept by ``BlockPool``): blocks freed by a request go to the TAIL, a
    chain's last block first, so the least recently used prefix tail is evicted before
    its head; blocks returned unused by an escrow go back to the HEAD, where they were.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVBlock:
        """Remove and return the head (least recently used). Raises InvariantError if empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise InvariantError("popleft on an empty free queue")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise InvariantError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        """Insert at the tail (most recently used, evicted last)."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Insert at the head (evicted first)."""
        self._link(block, self._head, self._head.next_free)

    def _link(self, block: KVBlock, prev: KVBlock | None, nxt: KVBlock | None) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise InvariantError(f"block {block.block_id} is already in the free queue")
        if prev is None or nxt is None:
            raise InvariantError("free queue sentinels are broken")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail. Do not mutate the queue while iterating."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        """Block ids head (next evicted) to tail; for tests and debugging."""
        return [b.block_id for b in self]

    def check_integrity(self) -> None:
        """Raise InvariantError unless the links form one consistent list of ``len`` blocks."""
        count, prev, node = 0, self._head, self._head.next_free
        while node is not self._tail:
            if node is None or node.prev_free is not prev:
                raise InvariantError("free queue links are inconsistent")
            count += 1
            if count > self._len:
                raise InvariantError(f"free queue holds more than its length {self._len}")
            prev, node = node, node.next_free
        if self._tail.prev_free is not prev or count != self._len:
            raise InvariantError(f"free queue length {self._len} but {count} linked blocks")
