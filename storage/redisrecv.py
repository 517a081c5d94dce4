"""Receiving Redis replies straight into the caller's buffers, verified as they arrive.

The raw side of :class:`~kvtrio.storage.redisstore.RedisBlockStore`'s reads: pipelined
``GET`` commands are written by hand (:func:`pack_gets`), and each reply's bulk string is
received with ``recvmsg_into`` into the destination buffers (:func:`receive_expected`),
no intermediate copy; blocks are re-hashed against their names while they arrive
(:class:`Verifier`) or on helper threads (:class:`PooledVerifier`, the shared
:mod:`kvtrio.storage.hashpool`), and a read never returns while a helper still reads the
caller's buffers.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from kvtrio.storage.blockstore import (
    CorruptBlockError,
)
from kvtrio.storage.hashpool import HashBatch

__all__ = [
    "PooledVerifier",
    "Verifier",
    "get_raw",
    "ignore_progress",
    "pack_gets",
    "receive_expected",
]

_READ_AHEAD = 64 * 1024  # bytes read at once outside reply headers (a reply's CRLF)
_HEADER_READ = 32  # bytes read at once for a reply header such as "$65536\r\n"
_IOV_WINDOW = 256  # buffers handed to one recvmsg_into (Linux's IOV_MAX is 1024)
_HASH_PIECE = 64 * 1024  # a verified read hashes a block's arrived bytes in such pieces
_HASH_GROUP = 512 * 1024  # with hash threads: complete blocks handed over in such groups


class _ReplyReader:
    """RESP replies read from a socket; bulk strings land in the caller's buffers.

    Small reads (reply headers) go through a little read-ahead buffer; a block's bytes
    beyond what was read ahead are received with ``recv_into`` straight into its buffer.
    """

    __slots__ = ("_buf", "_pos", "_sock")

    def __init__(self, sock: Any, ahead: bytes = b"") -> None:
        self._sock = sock
        self._buf = bytearray(ahead)  # bytes already received from the socket, unparsed
        self._pos = 0

    def drained(self) -> bool:
        """Whether nothing was read past the last reply (the connection is reusable)."""
        return self._pos == len(self._buf)

    def _more(self, small: bool = False) -> None:
        chunk = self._sock.recv(_HEADER_READ if small else _READ_AHEAD)
        if not chunk:
            raise ConnectionError("connection closed by the server mid-reply")
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                return line
            if len(self._buf) - self._pos > 64 * 1024:
                raise ConnectionError("redis reply header too long")
            # A header is read in small pieces, so the block after it is not read ahead
            # (and copied) but received into its buffer.
            self._more(small=True)

    def _skip(self, count: int) -> bytes:
        while len(self._buf) - self._pos < count:
            self._more()
        tail = bytes(self._buf[self._pos : self._pos + min(count, 2)])
        self._pos += count
        return tail

    def bulk_into(self, name: str, view: memoryview) -> bool:
        """Read one GET reply into ``view``; False for a missing key."""
        from redis.exceptions import InvalidResponse, ResponseError

        line = self._line()
        if line in (b"$-1", b"_"):
            return False
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"$" or not line[1:].isdigit():
            raise InvalidResponse(f"unexpected reply to GET: {line[:40]!r}")
        size = int(line[1:])
        if size != len(view):
            raise CorruptBlockError(name, "bytes", f"stored size {size} != expected {len(view)}")
        have = min(len(self._buf) - self._pos, size)
        if have:
            with memoryview(self._buf) as ahead:
                view[:have] = ahead[self._pos : self._pos + have]
            self._pos += have
        while have < size:
            got = self._sock.recv_into(view[have:])
            if got == 0:
                raise ConnectionError("connection closed by the server mid-reply")
            have += got
        self.end_bulk()
        return True

    def end_bulk(self) -> None:
        """Consume the CRLF that ends a bulk reply."""
        from redis.exceptions import InvalidResponse

        if self._skip(2) != b"\r\n":
            raise InvalidResponse("bulk reply not terminated by CRLF")


class _Misaligned(Exception):
    """The replies differ from the expected ``$<size>`` CRLF headers (a miss, a resized
    block, an error reply): the bytes received from ``piece`` on are in ``ahead``."""

    def __init__(self, piece: int, ahead: bytes) -> None:
        super().__init__(piece)
        self.piece = piece
        self.ahead = ahead


def receive_expected(
    sock: socket.socket,
    views: Sequence[memoryview],
    done: Callable[[int], None],
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Receive the replies to pipelined GETs of blocks of ``len(views[i])`` bytes, assuming
    each is present at that size: one ``recvmsg_into`` scatters the stream over the
    expected framing (a small buffer for each CRLF + ``$<size>`` CRLF) and the blocks'
    own buffers, so a block's bytes are copied once, by the kernel, with no Python work
    per byte and a few system calls per megabyte. ``done(i)`` is called as block ``i``
    completes, and ``progress(i, n)`` when its first ``n`` bytes have arrived.

    Raises :class:`_Misaligned` at the first framing byte that differs from the
    expectation; the stream then matched the expectation up to that piece (blocks before
    it are complete), and the caller parses the rest from the bytes handed back. Never
    reads past the expected replies: the buffers hold exactly that many bytes.
    """
    expected, smalls, bufs = _expected_framing(views)
    total = len(bufs)
    k = 0  # the buffer being filled
    off = 0  # bytes of it filled
    while True:
        while k < total and off == len(bufs[k]):  # complete buffers (or empty blocks)
            if k % 2:
                done(k // 2)
            k += 1
            off = 0
        if k == total:
            return
        got = sock.recvmsg_into([bufs[k][off:], *bufs[k + 1 : k + _IOV_WINDOW]])[0]
        if got == 0:
            raise ConnectionError("connection closed by the server mid-reply")
        while got:
            step = min(len(bufs[k]) - off, got)
            piece = k // 2
            if k % 2 == 0 and smalls[piece][off : off + step] != expected[piece][off : off + step]:
                # Hand back every byte received from the start of this piece on.
                head = bytes(smalls[piece][: off + step])
                raise _Misaligned(piece, _received_from(head, bufs, k + 1, got - step))
            off += step
            got -= step
            if k % 2 and progress is not None and off < len(bufs[k]):
                progress(k // 2, off)
            if off == len(bufs[k]) and got:
                if k % 2:
                    done(k // 2)
                k += 1
                off = 0


def _expected_framing(
    views: Sequence[memoryview],
) -> tuple[list[bytes], list[bytearray], list[memoryview]]:
    """The framing expected around blocks of ``len(views[i])`` bytes (piece ``i``: the
    CRLF ending the previous reply and ``$<size>`` CRLF; then a last CRLF), a buffer to
    receive each piece, and the scatter list: ``bufs[2i]`` the framing before block
    ``i``, ``bufs[2i + 1]`` block ``i``, then the last CRLF."""
    count = len(views)
    heads = [b"$%d\r\n" % len(view) for view in views]
    expected = [heads[0], *(b"\r\n" + head for head in heads[1:]), b"\r\n"]
    smalls = [bytearray(len(e)) for e in expected]
    bufs: list[memoryview] = []
    for i in range(count):
        bufs.append(memoryview(smalls[i]))
        bufs.append(views[i])
    bufs.append(memoryview(smalls[count]))
    return expected, smalls, bufs


def _received_from(head: bytes, bufs: Sequence[memoryview], j: int, got: int) -> bytes:
    """``head`` and the ``got`` bytes one receive scattered from ``bufs[j]`` on."""
    rest = [head]
    while got:
        take = min(len(bufs[j]), got)
        rest.append(bytes(bufs[j][:take]))
        got -= take
        j += 1
    return b"".join(rest)


class Verifier:
    """Re-hash each block as it is received, on the receiving thread: the bytes that have
    arrived are hashed in pieces of at least :data:`_HASH_PIECE` (``progress``), the rest
    when the block is complete (``done(i)``), so every byte is hashed while it is still in
    the CPU cache.

    Measured on the 2-core development VM (64 KiB blocks): hashing a block just received
    runs at about 1.5 GB/s (its bytes are still in the CPU cache) against 0.75 GB/s for
    blocks hashed after a whole batch has arrived, and handing blocks to helper threads
    cost 30-60 % more CPU per byte than this, for no gain in throughput on a machine whose
    cores are all busy (Redis, the receiver, the hashing). The overlap comes from the
    kernel: while a block is hashed, Redis goes on sending the next ones into the socket's
    receive buffer (autotuned to megabytes), which the next ``recvmsg_into`` drains.
    """

    __slots__ = ("_items", "_running", "checked")

    def __init__(self, items: Sequence[tuple[str, memoryview]]) -> None:
        self._items = items
        self._running: dict[int, tuple[Any, int]] = {}  # block -> (sha256 so far, bytes)
        self.checked = 0

    def progress(self, index: int, filled: int) -> None:
        hasher, hashed = self._running.get(index) or (hashlib.sha256(), 0)
        if filled - hashed >= _HASH_PIECE:
            hasher.update(self._items[index][1][hashed:filled])
            self._running[index] = (hasher, filled)

    def __call__(self, index: int) -> None:
        name, view = self._items[index]
        hasher, hashed = self._running.pop(index, None) or (hashlib.sha256(), 0)
        hasher.update(view[hashed:])
        if hasher.hexdigest() != name:
            raise CorruptBlockError(name, "sha256", "block content does not hash to its name")
        self.checked += 1


def _check_blocks(items: Sequence[tuple[str, memoryview]], indices: Sequence[int]) -> None:
    for index in indices:
        name, view = items[index]
        if hashlib.sha256(view).hexdigest() != name:
            raise CorruptBlockError(name, "sha256", "block content does not hash to its name")


class PooledVerifier:
    """Re-hash complete blocks on the store's helper threads
    (``IoOptions.redis_hash_threads``), in groups of at least :data:`_HASH_GROUP` bytes,
    while the receiving thread goes on receiving: for machines with cores to spare, where
    one thread's sha256 (about 0.7 to 1.5 GB/s) is slower than the network. The groups
    are one :class:`~kvtrio.storage.hashpool.HashBatch`: :meth:`finish` waits for every
    group and raises the first mismatch in block order; leaving the batch's ``with`` block
    on an error waits for every helper, so none still reads the caller's buffers when the
    read returns or raises.
    """

    __slots__ = ("_batch", "_group", "_group_bytes", "_items")

    def __init__(self, items: Sequence[tuple[str, memoryview]], batch: HashBatch) -> None:
        self._items = items
        self._batch = batch
        self._group: list[int] = []
        self._group_bytes = 0

    def __call__(self, index: int) -> None:
        self._group.append(index)
        self._group_bytes += len(self._items[index][1])
        if self._group_bytes >= _HASH_GROUP:
            self._flush()

    def _flush(self) -> None:
        if self._group:
            self._batch.submit(_check_blocks, self._items, self._group)
            self._group = []
            self._group_bytes = 0

    def finish(self) -> None:
        """Hash the last group; wait for every group, raising the first mismatch."""
        self._flush()
        self._batch.wait()


def ignore_progress(index: int) -> None:
    return None


def pack_gets(keys: Sequence[str]) -> list[bytes]:
    """Pipelined GET commands in RESP (what redis-py's ``pack_commands`` builds, for less)."""
    out = []
    for key in keys:
        raw = key.encode()
        out.append(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(raw), raw))
    return [b"".join(out)]


def get_raw(
    sock: socket.socket, chunk: Sequence[tuple[str, memoryview]], done: Callable[[int], None]
) -> tuple[list[bool], bool]:
    """The GET replies of ``chunk`` received from ``sock`` into the buffers; also whether
    the connection is clean afterwards (nothing read past the last reply)."""
    views = [view for _, view in chunk]
    start = 0
    ahead = b""
    if not isinstance(sock, ssl.SSLSocket):  # TLS sockets have no recvmsg_into
        try:
            progress = done.progress if isinstance(done, Verifier) else None
            receive_expected(sock, views, done, progress)
            return [True] * len(chunk), True
        except _Misaligned as exc:
            start, ahead = exc.piece, exc.ahead
    # Reply by reply from ``start`` on; a piece after the first begins with the CRLF that
    # ends the previous (complete) block's reply.
    replies = _ReplyReader(sock, ahead)
    if start:
        replies.end_bulk()
    found = [True] * start
    for i in range(start, len(chunk)):
        name, view = chunk[i]
        ok = replies.bulk_into(name, view)
        found.append(ok)
        if ok:
            done(i)
    return found, replies.drained()
