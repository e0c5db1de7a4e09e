"""The node's protocol server: one asyncio task per connection, on a Unix socket and TCP.

Each connection is a :class:`Session`: the handshake, then requests served in order.
- PUT payloads are received straight into reserved arena slots and verified against their
  checksums piece by piece as they arrive; a mismatch is never committed.
- GET payloads are sent from the arena with scatter-gather ``sendmsg`` while the blocks
  are pinned.
- Bad input gets an error reply: a bad message body (framing intact) keeps the connection;
  a bad frame header closes it.  Either way the daemon keeps serving everyone else.
- When a connection ends, its reservations are aborted and its pins dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool import checksum as ck
from kvpool.config import NodeConfig
from kvpool.errors import (
    AuthenticationError,
    BadRequest,
    KVPoolError,
    NodeUnavailable,
    ProtocolError,
    Status,
    UnsupportedVersion,
    status_for_error,
)
from kvpool.node.metrics import NodeMetrics
from kvpool.protocol import auth
from kvpool.protocol.channel import AsyncChannel
from kvpool.protocol.frames import (
    FLAG_RESPONSE,
    FrameHeader,
    decode_request,
    encode_frame,
)
from kvpool.protocol.messages import (
    CHECKSUM_BYTES,
    SUPPORTED_VERSIONS,
    AbortRequest,
    Challenge,
    CommitRequest,
    DescribeRequest,
    Empty,
    ErrorResponse,
    GetRequest,
    GetResponse,
    Health,
    Hello,
    KeysRequest,
    LookupRequest,
    LookupResponse,
    Message,
    NamespaceStats,
    NodeStats,
    Op,
    PinRequest,
    PinResponse,
    PutRequest,
    ReserveRequest,
    ReserveResponse,
    StatusResponse,
    UnpinRequest,
    Welcome,
)
from kvpool.store.arena import Arena
from kvpool.store.pool import BlockStore

log = logging.getLogger("kvpool.node")

HANDSHAKE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 4096
EXPIRE_INTERVAL_S = 0.25
SOCKET_BUFFER_BYTES = 4 << 20

# Replicator hook: called with the keys a client committed and asked to write through.
ReplicateHook = Callable[[Sequence[bytes]], None]


class NodeServer:
    def __init__(self, config: NodeConfig, store: BlockStore, arena: Arena):
        self.config = config
        self.store = store
        self.arena = arena
        self.node_id = config.name
        self.started_at = time.monotonic()
        self.bytes_in = 0
        self.bytes_out = 0
        self.sessions: set[Session] = set()
        self.replicate: ReplicateHook | None = None
        self.peers: Callable[[], list[str]] = list
        self._owner_ids = itertools.count(1)
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed: asyncio.Future[None] | None = None
        self.store.on_change = self._on_store_change
        self.tcp_port = config.port
        self.metrics = NodeMetrics(self.stats)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = self.config.socket_path
        path.unlink(missing_ok=True)
        old_umask = os.umask(0o117)
        try:
            unix.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o660)
        unix.listen(512)
        unix.setblocking(False)
        tcp = socket.create_server(
            (self.config.host, self.config.port), family=_family(self.config.host), backlog=512
        )
        tcp.setblocking(False)
        self.tcp_port = tcp.getsockname()[1]
        self._listeners = [unix, tcp]
        for listener in self._listeners:
            self._spawn(self._accept_loop(loop, listener))
        self._spawn(self._expire_loop())

    async def stop(self) -> None:
        for listener in self._listeners:
            listener.close()
        for task in list(self._tasks):
            task.cancel()
        for session in list(self.sessions):
            session.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            Path(self.config.socket_path).unlink()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept_loop(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if listener.fileno() < 0:
                    return
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if len(self.sessions) >= MAX_CONNECTIONS:
                sock.close()
                continue
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            session = Session(self, sock, next(self._owner_ids))
            self._spawn(session.run())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            if self.store.expire():
                self._on_store_change()

    # -- store change notification (for lookups that wait) --------------------------------

    def _on_store_change(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def wait_for_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> NodeStats:
        store = self.store
        counters = store.counters
        namespaces = [
            NamespaceStats(
                namespace_id=ns.hex(),
                label=usage.label,
                num_blocks=usage.num_blocks,
                used_bytes=usage.used_bytes,
                hits=usage.hits,
                misses=usage.misses,
                puts=usage.puts,
            )
            for ns, usage in store.namespaces.items()
        ]
        return NodeStats(
            node_id=self.node_id,
            host_id=self.config.host_id,
            tcp_address=self.tcp_address,
            capacity_bytes=store.capacity,
            used_bytes=store.used_bytes,
            reserved_bytes=store.reserved_bytes,
            num_blocks=len(store),
            num_pinned=store.num_pinned,
            hits=counters.lookup_hits,
            misses=counters.lookup_misses,
            puts=counters.puts,
            evictions=counters.evictions,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            num_connections=len(self.sessions),
            uptime_s=time.monotonic() - self.started_at,
            namespaces=namespaces,
            peers=self.peers(),
            corrupt_reports=counters.corrupt_reports,
        )

    @property
    def tcp_address(self) -> str:
        host = self.config.advertise_host or self.config.host
        return f"{host}:{self.tcp_port}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Session:
    """One client connection."""

    def __init__(self, server: NodeServer, sock: socket.socket, owner: int):
        self.server = server
        self.store = server.store
        self.arena = server.arena
        self.owner = owner
        self.channel = AsyncChannel(sock)
        self.peer = "unix" if sock.family == socket.AF_UNIX else str(sock.getpeername()[0])

    def close(self) -> None:
        self.channel.close()

    async def run(self) -> None:
        self.server.sessions.add(self)
        try:
            await asyncio.wait_for(self._handshake(), HANDSHAKE_TIMEOUT_S)
            while True:
                header = await self.channel.recv_header()
                await self._serve(header)
        except (NodeUnavailable, ConnectionError, asyncio.CancelledError):
            pass
        except TimeoutError:
            log.info("handshake timed out (%s)", self.peer)
        except ProtocolError as exc:
            # The frame header itself was bad: we cannot find the next frame.  Say why, close.
            log.info("closing connection from %s: %s", self.peer, exc)
            with contextlib.suppress(OSError, KVPoolError):
                await self._reply_error(0, 0, exc)
        except OSError as exc:
            log.debug("connection from %s failed: %s", self.peer, exc)
        finally:
            self.server.sessions.discard(self)
            self.store.release_owner(self.owner)
            self.channel.close()

    async def _handshake(self) -> None:
        config = self.server.config
        server_nonce = auth.new_nonce()
        challenge = Challenge(
            versions=list(SUPPORTED_VERSIONS),
            nonce=server_nonce,
            node_id=self.server.node_id,
            auth_required=bool(config.access_key),
        )
        await self.channel.send([encode_frame(Op.CHALLENGE, challenge, flags=FLAG_RESPONSE)])
        header = await self.channel.recv_header()
        if header.op != Op.HELLO or header.payload_len:
            raise BadRequest("expected HELLO")
        hello = decode_request(Op.HELLO, await self.channel.recv_meta(header.meta_len))
        assert isinstance(hello, Hello)
        if hello.version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(f"client speaks version {hello.version}")
        proof = b""
        if config.access_key:
            ok = hello.access_id == config.access_id and auth.verify(
                config.access_key, "client", hello.access_id, server_nonce, hello.nonce, hello.proof
            )
            if not ok:
                log.warning(
                    "authentication failed for access id %r (%s)", hello.access_id, self.peer
                )
                raise AuthenticationError("access id or key refused")
            proof = auth.proof(
                config.access_key, "node", hello.access_id, server_nonce, hello.nonce
            )
        arena = self.arena
        welcome = Welcome(
            node_id=self.server.node_id,
            proof=proof,
            host_id=config.host_id,
            tcp_address=self.server.tcp_address,
            arena_path=str(arena.path),
            arena_bytes=arena.num_bytes,
            arena_dev=arena.dev,
            arena_ino=arena.ino,
            arena_id=arena.arena_id,
        )
        await self._reply(header, Op.HELLO, welcome)

    # -- dispatch -------------------------------------------------------------------------

    async def _serve(self, header: FrameHeader) -> None:
        started = time.perf_counter()
        op_name = Op(header.op).name if header.op in Op._value2member_map_ else "UNKNOWN"
        meta = await self.channel.recv_meta(header.meta_len)
        payload_left = header.payload_len
        try:
            handler = _HANDLERS.get(header.op)
            if handler is None:
                raise BadRequest(f"unexpected op {op_name}")
            request = decode_request(header.op, meta)
            if header.op != Op.PUT and header.payload_len:
                raise BadRequest(f"{op_name} carries no payload")
            if header.op == Op.PUT:
                payload_left = 0  # from here on the PUT handler consumes the payload itself
            await handler(self, header, request)
        except (NodeUnavailable, ConnectionError, asyncio.CancelledError):
            raise  # the connection is lost, or its framing is: close it
        except (ProtocolError, KVPoolError) as exc:
            if payload_left:
                await self.channel.skip(payload_left)
            if header.wants_reply:
                await self._reply_error(header.op, header.request_id, exc)
        except Exception as exc:  # a bug: report it, keep the connection if framing is intact
            log.exception("internal error serving %s", op_name)
            if header.op == Op.PUT:
                raise NodeUnavailable("internal error mid-payload") from exc
            if header.wants_reply:
                await self._reply_error(header.op, header.request_id, exc)
        finally:
            self.server.metrics.op_latency.labels(op_name.lower()).observe(
                time.perf_counter() - started
            )

    async def _reply(
        self,
        header: FrameHeader,
        op: int,
        message: Message,
        payload: Sequence[memoryview] = (),
        payload_len: int = 0,
    ) -> None:
        if not header.wants_reply:
            return
        frame = encode_frame(
            op, message, payload_len=payload_len, request_id=header.request_id, flags=FLAG_RESPONSE
        )
        await self.channel.send([frame, *payload])

    async def _reply_error(self, op: int, request_id: int, exc: BaseException) -> None:
        status = status_for_error(exc)
        message = ErrorResponse(message=str(exc)[:1000])
        frame = encode_frame(op, message, request_id=request_id, flags=FLAG_RESPONSE, status=status)
        await self.channel.send([frame])

    # -- handlers -------------------------------------------------------------------------

    async def _lookup(self, header: FrameHeader, req: LookupRequest) -> None:
        keys = req.keys
        if req.mask:
            present = self.store.lookup_mask(keys)
            writing = self.store.pending_mask(keys)
            response = LookupResponse(num_prefix=0, present=present, pending=writing)
            await self._reply(header, Op.LOOKUP, response)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.wait_ms / 1000
        while True:
            num_prefix, pending = self.store.lookup(keys, count=False)
            remaining = deadline - loop.time()
            if num_prefix == len(keys) or remaining <= 0 or not (pending or req.wait_absent):
                break
            await self.server.wait_for_change(remaining)
        self.store._count_lookup(keys, num_prefix)
        response = LookupResponse(num_prefix=num_prefix, num_pending=int(pending))
        await self._reply(header, Op.LOOKUP, response)

    async def _put(self, header: FrameHeader, req: PutRequest) -> None:
        keys, sizes = req.keys, req.sizes
        problem = ""
        expected = sum(sizes) + CHECKSUM_BYTES * len(sizes)
        if len(keys) != len(sizes):
            problem = "keys and sizes differ in length"
        elif expected != header.payload_len:
            problem = f"payload of {header.payload_len} bytes, sizes need {expected}"
        if problem:
            await self.channel.skip(header.payload_len)
            raise BadRequest(problem)
        # The reservation does not expire while this session fills it (another key could be
        # given the memory mid-receive); the receive itself is bounded instead, and a session
        # that fails or times out closes, which returns the memory.
        result = self.store.reserve(keys, sizes, self.owner, math.inf)
        statuses = list(result.statuses)
        checksums: list[int | None] = []
        try:
            async with asyncio.timeout(self.server.config.reserve_lease_s):
                for i, block in enumerate(result.blocks):
                    meta = await self.channel.recv_meta(CHECKSUM_BYTES)
                    expected = int.from_bytes(meta, "little")
                    if block is None:
                        await self.channel.skip(sizes[i])
                        checksums.append(None)
                        continue
                    hasher = ck.new_hasher()
                    await self.channel.recv_into(self.arena.slice(block.offset, block.size), hasher)
                    if hasher.intdigest() == expected:
                        checksums.append(expected)
                    else:
                        statuses[i] = Status.CHECKSUM_MISMATCH
                        checksums.append(None)
        except TimeoutError:
            raise NodeUnavailable("timed out receiving a PUT payload") from None
        self.server.bytes_in += header.payload_len
        if result.reservation_id:
            committed = self.store.commit(result.reservation_id, checksums, self.owner)
            self._replicate(req.replicate, result.blocks, committed)
        await self._reply(header, Op.PUT, StatusResponse(statuses=[int(s) for s in statuses]))

    async def _get(self, header: FrameHeader, req: GetRequest) -> None:
        # As for PUT: the pin lasts as long as the send, and the send is bounded.
        pin_id, blocks = self.store.pin(req.keys, self.owner, math.inf, prefix=req.prefix)
        try:
            statuses: list[int] = []
            sizes: list[int] = []
            checksums: list[int] = []
            views: list[memoryview] = []
            for block in blocks:
                if block is None:
                    statuses.append(Status.NOT_FOUND)
                    sizes.append(0)
                    checksums.append(0)
                else:
                    statuses.append(Status.OK)
                    sizes.append(block.size)
                    checksums.append(block.checksum)
                    views.append(self.arena.slice(block.offset, block.size))
            total = sum(sizes)
            response = GetResponse(statuses=statuses, sizes=sizes, checksums=checksums)
            try:
                async with asyncio.timeout(self.server.config.pin_lease_s):
                    await self._reply(header, Op.GET, response, views, total)
            except TimeoutError:
                raise NodeUnavailable("timed out sending a GET payload") from None
            self.server.bytes_out += total
        finally:
            if pin_id:
                self.store.unpin(pin_id)

    async def _reserve(self, header: FrameHeader, req: ReserveRequest) -> None:
        if len(req.keys) != len(req.sizes):
            raise BadRequest("keys and sizes differ in length")
        result = self.store.reserve(req.keys, req.sizes, self.owner, req.lease_ms / 1000)
        offsets = [b.offset if b is not None else -1 for b in result.blocks]
        response = ReserveResponse(
            reservation_id=result.reservation_id,
            statuses=[int(s) for s in result.statuses],
            offsets=offsets,
        )
        await self._reply(header, Op.RESERVE, response)

    async def _commit(self, header: FrameHeader, req: CommitRequest) -> None:
        reservation = self.store._reservations.get(req.reservation_id)
        blocks = list(reservation.blocks) if reservation is not None else []
        statuses = self.store.commit(req.reservation_id, req.checksums, self.owner)
        self.server.bytes_in += sum(
            b.size for b, s in zip(blocks, statuses, strict=True) if b is not None and s == 0
        )
        self._replicate(req.replicate, blocks, statuses)
        await self._reply(header, Op.COMMIT, StatusResponse(statuses=[int(s) for s in statuses]))

    async def _abort(self, header: FrameHeader, req: AbortRequest) -> None:
        self.store.abort(req.reservation_id, self.owner)
        await self._reply(header, Op.ABORT, Empty())

    async def _pin(self, header: FrameHeader, req: PinRequest) -> None:
        pin_id, blocks = self.store.pin(
            req.keys, self.owner, req.lease_ms / 1000, prefix=req.prefix
        )
        response = PinResponse(
            pin_id=pin_id,
            statuses=[Status.OK if b is not None else Status.NOT_FOUND for b in blocks],
            offsets=[b.offset if b is not None else -1 for b in blocks],
            sizes=[b.size if b is not None else 0 for b in blocks],
            checksums=[b.checksum if b is not None else 0 for b in blocks],
        )
        self.server.bytes_out += sum(response.sizes)
        await self._reply(header, Op.PIN, response)

    async def _unpin(self, header: FrameHeader, req: UnpinRequest) -> None:
        self.store.unpin(req.pin_id, self.owner)
        await self._reply(header, Op.UNPIN, Empty())

    async def _delete(self, header: FrameHeader, req: KeysRequest) -> None:
        statuses = self.store.delete(req.keys)
        await self._reply(header, Op.DELETE, StatusResponse(statuses=[int(s) for s in statuses]))

    async def _report_corrupt(self, header: FrameHeader, req: KeysRequest) -> None:
        log.warning("a reader reported %d corrupt block(s); dropping them", len(req.keys))
        statuses = self.store.report_corrupt(req.keys)
        response = StatusResponse(statuses=[int(s) for s in statuses])
        await self._reply(header, Op.REPORT_CORRUPT, response)

    async def _describe(self, header: FrameHeader, req: DescribeRequest) -> None:
        self.store.describe(req.namespace_id, req.label)
        await self._reply(header, Op.DESCRIBE, Empty())

    async def _stats(self, header: FrameHeader, req: Empty) -> None:
        await self._reply(header, Op.STATS, self.server.stats())

    async def _health(self, header: FrameHeader, req: Empty) -> None:
        uptime = time.monotonic() - self.server.started_at
        await self._reply(
            header, Op.HEALTH, Health(ok=True, node_id=self.server.node_id, uptime_s=uptime)
        )

    def _replicate(self, wanted: bool, blocks: Sequence[Any], statuses: Sequence[int]) -> None:
        if not wanted or self.server.replicate is None:
            return
        keys = [b.key for b, s in zip(blocks, statuses, strict=True) if b is not None and s == 0]
        if keys:
            self.server.replicate(keys)


_HANDLERS: dict[int, Callable[[Session, FrameHeader, Any], Any]] = {
    Op.LOOKUP: Session._lookup,
    Op.PUT: Session._put,
    Op.GET: Session._get,
    Op.RESERVE: Session._reserve,
    Op.COMMIT: Session._commit,
    Op.ABORT: Session._abort,
    Op.PIN: Session._pin,
    Op.UNPIN: Session._unpin,
    Op.DELETE: Session._delete,
    Op.REPORT_CORRUPT: Session._report_corrupt,
    Op.DESCRIBE: Session._describe,
    Op.STATS: Session._stats,
    Op.HEALTH: Session._health,
}
