"""One client connection of the node: the handshake, then requests served in order.

- Writes have one path: pending blocks, then a commit.  A same-host client copies the
  blocks itself, into slots a RESERVE handed it or, with no round trip first, at the front
  of its write area (AREA: see :mod:`kvpool.store.areas`), then sends COMMIT.  A PUT
  carries the blocks, which are received straight into reserved slots, verified against
  their checksums piece by piece as they arrive, and committed the same way.  A mismatch
  is never committed.  Each PUT's or COMMIT's reply says how many blocks the connection's
  writes evicted that no lower tier took (:meth:`Session._evicting`).
- Reads have one path: the store's pin → unpin.  A PIN hands the offsets to a same-host
  client, which verifies and copies, then sends UNPIN; a GET sends the pinned blocks with
  scatter-gather ``sendmsg`` and unpins.
- Leases are the store's ledger's: a client's requested lease is clamped to the node's
  :class:`~kvpool.limits.LeaseLimits` (announced in the Welcome), and a transfer the
  session streams itself ends before its lease.
- The session uses the node through one narrow object, :class:`SessionServices`
  (:mod:`kvpool.node.services`), and serves each op with the method :data:`HANDLERS` names.
- Bad input gets an error reply: a bad message body (framing intact) keeps the connection;
  a bad frame header closes it.  Either way the daemon keeps serving everyone else.
- A client that hangs up (:class:`~kvpool.protocol.channel.PeerClosed`) just ends its
  session; its reservations are aborted and its pins dropped.
- Tenants take turns: a request that was already there when the session asked for it
  (pipelined, or queued while the event loop served others) waits for its tenant's turn
  (:class:`~kvpool.node.services.Turns`, round robin by account), so that neither a
  connection's stream of requests nor a tenant's many connections hold the loop from the
  others.
- What a connection costs is charged to its tenant's account
  (:mod:`kvpool.store.accounts`) through the registry
  (:mod:`kvpool.node.connections`): its slot and read-ahead once it authenticates, a
  frame's own metadata buffer while that request is served, the keys of a lookup while it
  waits.  A waiting lookup is parked on the one key it waits for, and woken when that key
  changes (:class:`~kvpool.node.services.StoreChanges`): what it costs is what it finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, cast

import msgspec

from kvpool import checksum as ck
from kvpool.config import page_bytes
from kvpool.errors import (
    AuthenticationError,
    BadRequest,
    Forbidden,
    KVPoolError,
    NodeUnavailable,
    ProtocolError,
    QuotaExceeded,
    Status,
    TooLarge,
    UnsupportedVersion,
    status_for_error,
)
from kvpool.keys import BlockOrigin
from kvpool.limits import LeaseLimits
from kvpool.node.connections import READ_AHEAD_BYTES
from kvpool.node.services import SessionServices
from kvpool.protocol import auth
from kvpool.protocol import messages as msg
from kvpool.protocol.channel import AsyncChannel, PeerClosed
from kvpool.protocol.frames import (
    FLAG_RESPONSE,
    FrameHeader,
    decode_request,
    encode_frame,
)
from kvpool.protocol.messages import CHECKSUM_BYTES, SUPPORTED_VERSIONS, Op
from kvpool.stats import TIER_DRAM
from kvpool.store.accounts import NODE, Resource
from kvpool.store.block import Area, Block
from kvpool.tenants import Credential, Tenant
from kvpool.tiers.reads import Part
from kvpool.tiers.writeback import MAX_BACKPRESSURE_S

log = logging.getLogger("kvpool.node")

# A HELLO is a version, an access id, a host id and a client name (256 characters each at
# most), a nonce and a proof: 4 KiB holds any valid one.
MAX_HELLO_BYTES = 4 << 10
PRE_AUTH_BUFFER_BYTES = 4 << 10
FRAME_TIMEOUT_S = 10.0  # a frame's metadata, once its header arrived (slow writers)
# A transfer with no lease to bound it (a reply, a refused PUT's payload being skipped)
# gets FRAME_TIMEOUT_S plus its size at this rate: a peer that stops reading or trickles
# bytes cannot hold its session, and what it has buffered, for ever.
MIN_TRANSFER_BYTES_S = 16 << 20

# What a tenant's connection may do: no arena offsets (RESERVE/PIN are the shared-memory
# path, which tenants do not get) and no shutdown.
TENANT_OPS = frozenset(
    {
        Op.LOOKUP,
        Op.PUT,
        Op.GET,
        Op.DELETE,
        Op.RETAIN,
        Op.REPORT_CORRUPT,
        Op.DESCRIBE,
        Op.STATS,
        Op.HEALTH,
        Op.PREFETCH,
    }
)


# A tenant's block keeps an origin of at most one token id per this many bytes of arena
# memory it takes (a 4 KiB page: 16 token ids; a 2 MiB block: all 4,096 a block may have).
ORIGIN_BYTES_PER_TOKEN = 256

# What only the node's operators may do: a keyless node's TCP listener does not offer it
# (the Unix socket does, in the node's directory that only the daemon's user and group may
# enter), so that any local user who reaches the loopback port cannot stop or drain it.
ADMIN_OPS = frozenset({Op.SHUTDOWN, Op.HANDOFF})


# What need not wait for the seals in flight (every other request sees them done).
_BEFORE_SEALS = frozenset(
    {Op.AREA, Op.RESERVE, Op.COMMIT, Op.ABORT, Op.PUT, Op.UNPIN, Op.TOUCH, Op.HEALTH}
)


class TransferTimeout(Exception):
    """A transfer the session streams ran out of its lease: the connection is closed."""


class Session:
    """One client connection.

    Why so many methods (46): a session is the wire protocol's server side, and the protocol
    has 21 operations (:class:`~kvpool.protocol.messages.Op`), two of them the handshake's.
    Each of the others has one handler here
    (``_reserve`` ... ``_handoff``), which decodes, calls the store, the tiers or a service
    that does the work, and replies; the rest is what every handler shares: the handshake
    (challenge, authentication, welcome), framing (receive, decode, permission, reply,
    errors) and the lease bound on a reply.  None holds logic of its own to move out.
    """

    def __init__(self, services: SessionServices, sock: socket.socket, owner: int):
        """``owner``: the connection's number (>= 1), which owns its leases in the ledger."""
        self.services = services
        self.store = services.store
        self.arena = services.arena
        self.tiers = services.tiers
        self.limits = services.limits
        self.owner = owner
        # Small until a peer has authenticated: nothing sizeable before that.  Then the usual
        # read-ahead, which never grows: a larger frame's metadata gets a buffer of its own,
        # charged to the tenant while the request is served.
        self.channel = AsyncChannel(sock, buffer_bytes=PRE_AUTH_BUFFER_BYTES, grows=False)
        self.is_local = sock.family == socket.AF_UNIX
        self.peer = "unix" if self.is_local else str(sock.getpeername()[0])
        self.account = NODE  # whose account it is charged to, once it authenticates
        self._received_at = time.monotonic()  # when it last received a request
        self._is_serving = False
        # What the handshake's proofs cover of this connection (see kvpool.protocol.auth).
        self.binding = services.identity.unix_binding if self.is_local else auth.TCP_BINDING
        self.credential: Credential | None = None  # who authenticated (None: no keys)
        self.tenant: Tenant | None = None  # whose keys this connection names
        self.task: asyncio.Task[None] | None = None
        self.is_welcomed = False  # the handshake is done
        # Blocks this connection's writes evicted that no lower tier took, not yet told
        # (see _evicting).
        self._num_not_kept = 0

    @property
    def buffer_bytes(self) -> int:
        return self.channel.rbuf.capacity

    @property
    def is_idle_since(self) -> float | None:
        """When it last received a request, if none is in service now (None: busy)."""
        return None if self._is_serving else self._received_at

    def close(self) -> None:
        """End the session (from outside it: a revoked key, the node stopping)."""
        if self.task is not None:
            self.task.cancel()
        else:
            self.channel.close()

    async def run(self) -> None:
        registry = self.services.registry
        registry.opened(self)
        try:
            async with asyncio.timeout(registry.budgets.handshake_s):
                await self.channel.handshake()  # TLS, on a TCP listener that has it
                await self._handshake()
            channel = self.channel
            while True:
                waits = channel.num_read_waits
                header = await channel.recv_header()
                if channel.num_read_waits == waits:
                    # The request was there already (pipelined, or queued while the loop
                    # served others): it waits for its tenant's turn, so that neither one
                    # connection's stream of requests nor one tenant's many connections
                    # hold the event loop from the others.
                    await self.services.turns.take(self.account)
                self._received_at = time.monotonic()
                self._is_serving = True
                try:
                    await self._serve(header)
                finally:
                    self._is_serving = False
        except NodeUnavailable as exc:  # e.g. the tenant has all its connections open
            log.info("refusing a connection from %s: %s", self.peer, exc)
            with contextlib.suppress(OSError, KVPoolError, TransferTimeout):
                await self._reply_error(Op.HELLO, 0, exc)
        except (PeerClosed, asyncio.CancelledError):
            pass  # the client hung up, or the node stops
        except TimeoutError:
            self._log_closing("the handshake timed out")
        except TransferTimeout as exc:
            self._log_closing(str(exc))
        except ProtocolError as exc:
            # The frame header itself was bad: we cannot find the next frame.  Say why, close.
            if not isinstance(exc, AuthenticationError):  # (counted where it was refused)
                self._log_closing(str(exc))
            with contextlib.suppress(OSError, KVPoolError, TransferTimeout):
                await self._reply_error(0, 0, exc)
        except ssl.SSLError as exc:
            self._log_closing(f"TLS failed: {exc.reason or exc}")
        except OSError as exc:
            log.debug("connection from %s failed: %s", self.peer, exc)
        finally:
            self.services.registry.closed(self)
            self.store.release_owner(self.owner)
            self.channel.close()

    def _log_closing(self, reason: str) -> None:
        """Say why the connection closes: in the log once the peer has authenticated;
        before, counted and logged at a bounded rate (anyone who reaches a listener could
        otherwise fill the log, a line a connection)."""
        if self.is_welcomed:
            log.info("closing connection from %s: %s", self.peer, reason)
        else:
            self.services.refusals.note(reason, self.peer)

    async def _handshake(self) -> None:
        server_nonce = auth.new_nonce()
        header, hello = await self._challenge(server_nonce)
        handshake = auth.Handshake(hello.access_id, server_nonce, hello.nonce, self.binding)
        credential = self._authenticate(hello, handshake)
        self.services.registry.admit(self)  # a member now, within every cap
        self.channel.rbuf.grow(READ_AHEAD_BYTES)  # authenticated: the usual read-ahead
        welcome = self._welcome()
        if credential is not None:  # the node's proof covers the Welcome it sends
            welcome.proof = handshake.proof(credential.key, "node", auth.welcome_digest(welcome))
        await self._reply(header, Op.HELLO, welcome)
        self.is_welcomed = True

    async def _challenge(self, server_nonce: bytes) -> tuple[FrameHeader, msg.Hello]:
        """Send the CHALLENGE; the client's HELLO, in a version this node speaks."""
        challenge = msg.Challenge(
            versions=list(SUPPORTED_VERSIONS),
            nonce=server_nonce,
            node_id=self.services.identity.node_id,
            auth_required=self.services.credentials.announces_auth,
        )
        await self.channel.send([encode_frame(Op.CHALLENGE, challenge, flags=FLAG_RESPONSE)])
        header = await self.channel.recv_header()
        if header.op != Op.HELLO or header.payload_len:
            raise BadRequest("expected HELLO")
        if header.meta_len > MAX_HELLO_BYTES:  # bounded before a byte of it is buffered
            raise TooLarge(f"a HELLO of {header.meta_len} bytes (at most {MAX_HELLO_BYTES})")
        hello = decode_request(Op.HELLO, await self.channel.recv_meta(header.meta_len))
        if not isinstance(hello, msg.Hello):
            raise BadRequest("expected HELLO")
        if hello.version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersion(f"client speaks version {hello.version}")
        return header, hello

    def _authenticate(self, hello: msg.Hello, handshake: auth.Handshake) -> Credential | None:
        """Check the client's proof, if the node knows its access id; who it proved to be
        (None: the node needs no key and the client gave none it knows)."""
        credentials = self.services.credentials
        credential = credentials.credential(hello.access_id)
        if credential is None:
            if credentials.requires_auth:
                self.services.refusals.note("unknown access id", self.peer)
                raise AuthenticationError("access id or key refused")
            return None
        if not handshake.verify(credential.key, "client", hello.proof):
            self.services.refusals.note("authentication failed", self.peer)
            raise AuthenticationError("access id or key refused")
        self.credential = credential
        self.tenant = credential.tenant
        if self.tenant is not None:
            self.account = self.services.accounts.account_of(self.tenant.tag)
        return credential

    def _welcome(self) -> msg.Welcome:
        identity = self.services.identity
        welcome = msg.Welcome(
            node_id=identity.node_id,
            proof=b"",
            host_id=identity.host_id,
            tcp_address=identity.tcp_address,
            arena_path="",
            arena_bytes=0,
            arena_dev=0,
            arena_ino=0,
            arena_id=b"",
            limits=msg.Limits.of(self.limits),
        )
        if self.tenant is not None:
            return welcome  # a tenant never gets the arena: sockets only
        arena = self.arena
        directory = self.store.directory.path
        welcome.arena_path = str(arena.path)
        welcome.arena_bytes = arena.num_bytes
        welcome.arena_dev = arena.dev
        welcome.arena_ino = arena.ino
        welcome.arena_id = arena.arena_id
        if directory is not None:
            welcome.directory_path = str(directory)
        return welcome

    # -- dispatch -------------------------------------------------------------------------

    async def _serve(self, header: FrameHeader) -> None:
        if self.channel.rbuf.holds(header.meta_len):
            await self._serve_frame(header)
            return
        # A frame larger than the read-ahead: its metadata's own buffer is charged to the
        # tenant while the request is served (waiting, within the frame's deadline, for
        # room in its budget).
        registry = self.services.registry
        try:
            await registry.wait_for_buffer(self, header.meta_len, FRAME_TIMEOUT_S)
        except TimeoutError:
            raise TransferTimeout("the tenant's buffer budget stayed spent") from None
        with registry.frame_buffer(self, header.meta_len):
            await self._serve_frame(header)

    async def _serve_frame(self, header: FrameHeader) -> None:
        started = time.perf_counter()
        op_name = _op_name(header.op)
        meta = await self._recv_meta(header)
        payload_left = header.payload_len
        try:
            handler = HANDLERS.get(header.op)
            if handler is None:
                raise BadRequest(f"unexpected op {op_name}")
            request = self._decode(header, meta, op_name)
            if header.op == Op.PUT:
                payload_left = 0  # from here on the PUT handler consumes the payload itself
            if header.op not in _BEFORE_SEALS:  # a write that returned is seen by every read
                await self.services.sealer.wait(getattr(request, "keys", None))
            await handler(self, header, request)
        except (PeerClosed, TransferTimeout, asyncio.CancelledError):
            raise  # the connection is lost, or its framing is: close it
        except KVPoolError as exc:
            if payload_left:
                await self._skip(payload_left)
            if header.wants_reply:
                await self._reply_error(header.op, header.request_id, exc)
            else:  # nobody waits for the answer: say it here
                log.warning("%s from %s without a reply failed: %s", op_name, self.peer, exc)
        except Exception as exc:  # a bug: report it, keep the connection if framing is intact
            log.exception("internal error serving %s", op_name)
            if header.op == Op.PUT:
                raise TransferTimeout("internal error mid-payload") from exc
            if header.wants_reply:
                await self._reply_error(header.op, header.request_id, exc)
        finally:
            self.services.metrics.observe_op(op_name.lower(), time.perf_counter() - started)

    async def _recv_meta(self, header: FrameHeader) -> bytes | bytearray:
        """A request's metadata, which a slow writer gets FRAME_TIMEOUT_S to finish."""
        if self.channel.rbuf.num_buffered >= header.meta_len:  # the usual case: no wait
            return await self.channel.recv_meta(header.meta_len)
        try:
            async with asyncio.timeout(FRAME_TIMEOUT_S):
                return await self.channel.recv_meta(header.meta_len)
        except TimeoutError:
            raise TransferTimeout("timed out receiving a request") from None

    def _decode(self, header: FrameHeader, meta: bytes | bytearray, op_name: str) -> Any:
        """The request, scoped to the connection's tenant, if it may send it."""
        request = decode_request(header.op, meta)
        self._check_permitted(header.op, op_name, request)
        if self.tenant is not None:
            request = _scoped(request, self.tenant)
        if header.op != Op.PUT and header.payload_len:
            raise BadRequest(f"{op_name} carries no payload")
        return request

    def _check_permitted(self, op: int, op_name: str, request: Any) -> None:
        """Who may do what, decided here for every request: a tenant only TENANT_OPS, and a
        DESCRIBE that names no engine to the routers the node tells (a tenant could name
        any pod: only the operator's engines are named); a client of a keyless node over
        TCP everything but ADMIN_OPS; an authenticated operator (the node's key, the
        cluster's identity) or the Unix socket everything."""
        if self.tenant is not None:
            if op not in TENANT_OPS:
                raise Forbidden(f"{op_name} is not open to tenants")
            if op == Op.DESCRIBE and self._names_engine(request):
                raise Forbidden("a tenant's connection cannot name an engine to routers")
        elif self.credential is None and not self.is_local and op in ADMIN_OPS:
            raise Forbidden(f"{op_name} needs the Unix socket or an access key on this node")

    def _names_engine(self, request: msg.DescribeRequest) -> bool:
        """Whether a DESCRIBE names an engine to routers (a node that tells none ignores
        the engine a request names)."""
        return request.engine is not None and self.services.attach_engine is not None

    async def _reply(
        self,
        header: FrameHeader,
        op: int,
        message: msg.Message,
        payload: Sequence[memoryview] = (),
        payload_len: int = 0,
    ) -> None:
        if not header.wants_reply:
            return
        frame = encode_frame(
            op, message, payload_len=payload_len, request_id=header.request_id, flags=FLAG_RESPONSE
        )
        await self._send([frame, *payload], len(frame) + payload_len, "sending a reply")

    async def _reply_error(self, op: int, request_id: int, exc: BaseException) -> None:
        status = status_for_error(exc)
        message = msg.ErrorResponse(message=str(exc)[:1000])
        frame = encode_frame(op, message, request_id=request_id, flags=FLAG_RESPONSE, status=status)
        await self._send([frame], len(frame), "sending an error reply")

    async def _send(self, parts: Sequence[Any], num_bytes: int, what: str) -> None:
        """Send, bounded in time (see MIN_TRANSFER_BYTES_S) once the socket makes us wait:
        a reply the socket takes at once, the usual case, costs no timer."""
        rest = self.channel.send_now(parts)
        if rest:
            async with _unleased_transfer(num_bytes, what):
                await self.channel.send(rest)

    async def _skip(self, num_bytes: int) -> None:
        """Read past a refused request's payload (its framing stays intact)."""
        async with _unleased_transfer(num_bytes, "skipping a refused payload"):
            await self.channel.skip(num_bytes)

    # -- the write path: reserve -> (fill) -> commit ----------------------------------------

    @contextlib.contextmanager
    def _evicting(self) -> Iterator[None]:
        """Around the synchronous store calls of a write (never an await inside): the
        blocks their evictions lost, which no lower tier took, are this connection's, and
        its next put reply (PUT or COMMIT) tells the writer (:meth:`_take_not_kept`); a
        commit that the node seals after its reply counts its publish here too, for the
        reply after.  The store is synchronous and the lower tiers count on the event loop,
        so nobody else's evictions fall in between."""
        before = self.tiers.num_not_kept
        try:
            yield
        finally:
            self._num_not_kept += self.tiers.num_not_kept - before

    def _take_not_kept(self) -> int:
        """What this put reply tells the writer it lost: its evictions no lower tier took,
        and its account's blocks the object store dropped since the last reply."""
        num_not_kept, self._num_not_kept = self._num_not_kept, 0
        return num_not_kept + self.tiers.take_lost(self.account)

    async def _reserve(self, header: FrameHeader, req: msg.ReserveRequest) -> None:
        if len(req.keys) != len(req.sizes):
            raise BadRequest("keys and sizes differ in length")
        await self._writeback_room(req.keys, req.sizes)
        with self._evicting():
            result = self.store.reserve(req.keys, req.sizes, self.owner, req.lease_ms / 1000)
        response = msg.ReserveResponse(
            reservation_id=result.reservation_id,
            statuses=[int(s) for s in result.statuses],
            offsets=[b.offset if b is not None else -1 for b in result.blocks],
            lease_ms=int(result.lease_s * 1000),
        )
        await self._reply(header, Op.RESERVE, response)

    async def _writeback_room(self, keys: Sequence[bytes], sizes: list[int]) -> None:
        """A write that may evict waits (bounded) while the disk's write-back is behind, so
        that what it evicts is written to disk rather than refused (issue 29, point 6).  A
        write that evicts nothing does not wait: another tenant's evictions filling the
        write-back never hold up a write within its own quota and the arena's room."""
        writeback = self.tiers.lower.writeback
        if writeback is not None and self.store.would_evict(keys, sizes):
            deadline = asyncio.get_running_loop().time() + MAX_BACKPRESSURE_S
            await writeback.wait_for_room(sum(sizes), deadline)

    async def _area(self, header: FrameHeader, req: msg.AreaRequest) -> None:
        await self._writeback_room((), [req.num_bytes])
        area = self.store.reserve_area(req.num_bytes, self.owner, req.lease_ms / 1000)
        response = _area_response(area)
        if response is None:
            response = msg.AreaResponse(area_id=0)  # none free now: reserve the usual way
        await self._reply(header, Op.AREA, response)

    async def _commit(self, header: FrameHeader, req: msg.CommitRequest) -> None:
        area: msg.AreaResponse | None = None
        with self._evicting():  # a publish trims down to the low watermark
            if req.area_id and req.checksums is not None:  # hashed as copied in: at once
                store = self.store
                result = store.commit_placed(
                    req.area_id,
                    req.keys,
                    req.sizes,
                    self.owner,
                    req.keep_area,
                    req.checksums,
                    req.origins,
                )
                area = _area_response(store.areas.held_by(self.owner))
                self.services.traffic.published(result, req.replicate)
                placed_codes = cast(list[int], result.statuses)  # IntEnums: sent as codes
                response = msg.CommitResponse(placed_codes, area, self._take_not_kept())
                await self._reply(header, Op.COMMIT, response)
                return
            if req.area_id:
                store = self.store
                placed = store.place(req.area_id, req.keys, req.sizes, self.owner, req.keep_area)
                blocks, statuses = placed.blocks, placed.statuses
                area = _area_response(store.areas.held_by(self.owner))
            else:
                blocks = self.store.take(req.reservation_id, self.owner)
                statuses = [Status.OK if b is not None else Status.NOT_FOUND for b in blocks]
            problem = _per_block_mismatch(req, len(blocks))
            if problem:
                self.store.publish(blocks, [None] * len(blocks))  # dropped, never left pending
                raise BadRequest(problem)
            sealer = self.services.sealer
            sealer.seal(blocks, req.replicate, req.origins, req.checksums, self._evicting)
        codes = cast(list[int], statuses)  # IntEnums: encoded as their codes
        response = msg.CommitResponse(codes, area, self._take_not_kept())
        await self._reply(header, Op.COMMIT, response)

    async def _abort(self, header: FrameHeader, req: msg.AbortRequest) -> None:
        self.store.abort(req.reservation_id, self.owner)
        await self._reply(header, Op.ABORT, msg.Empty())

    async def _put(self, header: FrameHeader, req: msg.PutRequest) -> None:
        problem = _put_mismatch(req, header.payload_len)
        if problem:
            await self._skip(header.payload_len)
            raise BadRequest(problem)
        await self._writeback_room(req.keys, req.sizes)
        with self._evicting():
            result = self.store.reserve(req.keys, req.sizes, self.owner)
        statuses = list(result.statuses)
        async with self._within_lease(result.lease_s, "receiving a PUT payload"):
            checksums = await self._receive_blocks(result.blocks, req.sizes, statuses)
        if result.reservation_id:
            with self._evicting():
                committed = self.store.commit(
                    result.reservation_id, checksums, self.owner, req.origins
                )
            self.services.traffic.published(committed, req.replicate)
        response = msg.PutResponse([int(s) for s in statuses], self._take_not_kept())
        await self._reply(header, Op.PUT, response)

    async def _receive_blocks(
        self, blocks: Sequence[Block | None], sizes: Sequence[int], statuses: list[Status]
    ) -> list[int | None]:
        """Receive a PUT's payload, each block (after its checksum) straight into its
        reserved slot, hashed as it arrives; per block, the checksum to commit it with
        (None: skipped, or it did not match, which ``statuses`` then says)."""
        checksums: list[int | None] = []
        for i, block in enumerate(blocks):
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
        return checksums

    # -- the read path: pin -> (copy) -> unpin ----------------------------------------------

    async def _pin(self, header: FrameHeader, req: msg.PinRequest) -> None:
        wait_s = self.limits.wait(req.wait_ms / 1000)
        result, below = await self.tiers.pin(
            req.keys, req.prefix, self.owner, req.lease_ms / 1000, wait_s
        )
        blocks = result.blocks
        response = msg.PinResponse(
            pin_id=result.pin_id,
            statuses=[Status.OK if b is not None else Status.NOT_FOUND for b in blocks],
            offsets=[b.offset if b is not None else -1 for b in blocks],
            sizes=[b.size if b is not None else 0 for b in blocks],
            checksums=[b.checksum if b is not None else 0 for b in blocks],
            lease_ms=int(result.lease_s * 1000),
            sealed=[b is not None and b.sealed for b in blocks],
        )
        if below:  # not in the arena: the client reads these with a GET, from below DRAM
            response.below = [False] * len(blocks)
            for block in below:
                response.below[block.index] = True
        self.services.traffic.sent(sum(response.sizes))
        await self._reply(header, Op.PIN, response)

    async def _unpin(self, header: FrameHeader, req: msg.UnpinRequest) -> None:
        self.store.unpin(req.pin_id, self.owner)
        await self._reply(header, Op.UNPIN, msg.Empty())

    async def _touch(self, header: FrameHeader, req: msg.KeysRequest) -> None:
        # Blocks a same-host client copied through the shared directory, without a pin.
        keys, num_bytes = self.store.touch(req.keys)
        self.tiers.note_read(keys)
        self.services.traffic.sent(num_bytes)

    async def _get(self, header: FrameHeader, req: msg.GetRequest) -> None:
        """A GET's reply: the pinned blocks from the arena, and what a lower tier serves,
        read a stage at a time, in the keys' order (:class:`~kvpool.tiers.reads.Read`)."""
        wait_s = self.limits.wait(req.wait_ms / 1000)
        async with self.tiers.read(req.keys, req.prefix, self.owner, wait_s) as read:
            if not header.wants_reply:
                return
            response = msg.GetResponse(read.statuses, read.sizes, read.checksums)
            async with self._within_lease(read.lease_s, "sending a GET payload"):
                await self._reply(header, Op.GET, response, read.leading, read.num_bytes)
                async for part in read.rest():
                    await self._send_part(part)
            self.services.traffic.sent(read.num_bytes)

    async def _send_part(self, part: Part) -> None:
        """Send what a read has ready; a stage's bytes within its bound (else the connection
        closes: a stalled reader gives its stage back)."""
        if part.send_within_s is None:
            await self.channel.send(part.views)
            return
        try:
            async with asyncio.timeout(part.send_within_s):
                await self.channel.send(part.views)
        except TimeoutError:
            raise TransferTimeout("the reader did not take a stage from below DRAM") from None

    @contextlib.asynccontextmanager
    async def _within_lease(self, lease_s: float, what: str) -> Any:
        """Bound a transfer into or out of leased memory by that lease: past it, the
        connection closes (which aborts the reservation or drops the pin) before the
        memory could change hands."""
        try:
            async with asyncio.timeout(LeaseLimits.transfer_budget(lease_s)):
                yield
        except TimeoutError:
            raise TransferTimeout(f"timed out {what}") from None

    # -- the rest -------------------------------------------------------------------------

    async def _lookup(self, header: FrameHeader, req: msg.LookupRequest) -> None:
        keys = req.keys
        tiers = self.tiers
        if req.mask:
            present, writing, in_tiers = tiers.presence(keys)
            response = msg.LookupResponse(
                num_prefix=0, present=present, pending=writing, tiers=in_tiers
            )
            await self._reply(header, Op.LOOKUP, response)
            return
        wait_s = self.limits.wait(req.wait_ms / 1000)
        if wait_s and len(set(keys)) != len(keys):
            raise BadRequest("a lookup that waits names each key once")
        num_prefix, pending, in_tiers = tiers.lookup(keys)
        if wait_s and num_prefix < len(keys) and (pending or req.wait_absent):
            num_prefix, pending, in_tiers = await self._park(req, num_prefix, wait_s)
        tiers.record_lookup(keys, num_prefix, in_tiers)
        if req.prefetch_ms and any(in_tiers):  # the hint of a request still queued
            tiers.prefetch(keys[:num_prefix], self.limits.hold(req.prefetch_ms / 1000))
        response = msg.LookupResponse(
            num_prefix=num_prefix, num_pending=int(pending), tiers=in_tiers
        )
        await self._reply(header, Op.LOOKUP, response)

    async def _park(
        self, req: msg.LookupRequest, num_prefix: int, wait_s: float
    ) -> tuple[int, bool, bytes]:
        """Wait, up to ``wait_s``, for the keys after the prefix found: parked on the key the
        prefix stops at, and woken only when that key changes, to go on from there (each
        wake costs what it finds).  Its keys count against the tenant's parked keys while
        it waits; a lookup past that budget answers at once.  The answer is a lookup of
        them all once it is done waiting: the prefix as it is then."""
        keys, tiers = req.keys, self.tiers
        accounts, account = self.services.accounts, self.account
        if not accounts.charge(account, Resource.PARKED_KEYS, len(keys)):
            return tiers.lookup(keys)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        try:
            pending = True
            while num_prefix < len(keys) and (pending or req.wait_absent):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await self.services.changes.wait(keys[num_prefix], remaining)
                num_prefix, pending, _ = tiers.lookup(keys, start=num_prefix)
        finally:
            accounts.credit(account, Resource.PARKED_KEYS, len(keys))
        return tiers.lookup(keys)

    async def _prefetch(self, header: FrameHeader, req: msg.PrefetchRequest) -> None:
        hold_s = self.limits.hold(req.hold_ms / 1000)
        response = self.tiers.prefetch(req.keys, hold_s, req.cancel)
        await self._reply(header, Op.PREFETCH, response)

    async def _delete(self, header: FrameHeader, req: msg.DeleteRequest) -> None:
        """Delete from every tier, for good, and (``replicate``) at the keys' homes."""
        statuses = self.store.delete(req.keys)
        self.services.traffic.deleted(req.keys, req.replicate)
        _, _, in_tiers = self.tiers.presence(req.keys)
        await self.tiers.delete(req.keys)
        for i, tier in enumerate(in_tiers):  # gone from every tier
            if tier != TIER_DRAM and statuses[i] is Status.NOT_FOUND:
                statuses[i] = Status.OK
        await self._reply(header, Op.DELETE, _statuses(statuses))

    async def _retain(self, header: FrameHeader, req: msg.RetainRequest) -> None:
        """Retention hints, on the blocks held in DRAM now (a tenant's within its account of
        retained bytes: past it a block keeps its priority, and the refusal is counted)."""
        retained = self.store.retain(req.keys, req.priority, req.duration_ms / 1000)
        response = msg.RetainResponse(
            retained.num_retained, retained.num_refused, retained.num_missing
        )
        await self._reply(header, Op.RETAIN, response)

    async def _report_corrupt(self, header: FrameHeader, req: msg.KeysRequest) -> None:
        log.warning("a reader reported %d corrupt block(s); dropping them", len(req.keys))
        statuses = self.store.report_corrupt(req.keys)
        await self._reply(header, Op.REPORT_CORRUPT, _statuses(statuses))

    async def _describe(self, header: FrameHeader, req: msg.DescribeRequest) -> None:
        """A namespace's label; and the engine that loads its blocks, if it says, for the
        routers the node tells (only the operator's: :meth:`_check_permitted` refuses a
        tenant's)."""
        attach = self.services.attach_engine
        if (
            req.engine is not None
            and attach is not None
            and not attach(req.namespace_id, req.engine)
        ):
            raise BadRequest("too many engines registered with this node")
        if req.saving not in msg.SAVINGS:
            raise BadRequest(f"saving is one of {', '.join(msg.SAVINGS[1:])}")
        try:
            self.store.describe(req.namespace_id, req.label, saving=req.saving)
        except QuotaExceeded:
            # Past the tenant's rate: refused once a label change would have come back to
            # it (at most a second), so that a stream of them costs the node about one
            # request a second on that connection, not one per round trip.
            rate = self.services.accounts.budgets.label_changes_per_s
            await asyncio.sleep(min(1.0, 1.0 / rate))
            raise
        await self._reply(header, Op.DESCRIBE, msg.Empty())

    async def _stats(self, header: FrameHeader, req: msg.Empty) -> None:
        await self._reply(header, Op.STATS, self.services.stats(self.tenant))

    async def _health(self, header: FrameHeader, req: msg.Empty) -> None:
        identity = self.services.identity
        health = msg.Health(ok=True, node_id=identity.node_id, uptime_s=identity.uptime_s)
        await self._reply(header, Op.HEALTH, health)

    async def _shutdown(self, header: FrameHeader, req: msg.ShutdownRequest) -> None:
        node_id = self.services.identity.node_id
        if req.node_id != node_id:
            raise BadRequest(f"shutdown of node {req.node_id!r} sent to {node_id!r}")
        log.warning(
            "shutdown requested by %s%s",
            self.peer,
            " (drain: the node empties)" if req.drain else "",
        )
        await self._reply(header, Op.SHUTDOWN, msg.Empty())
        self.services.shutdown(req.drain)

    async def _handoff(self, header: FrameHeader, req: msg.HandoffRequest) -> None:
        node_id = self.services.identity.node_id
        if req.node_id != node_id:
            raise BadRequest(f"handoff of node {req.node_id!r} sent to {node_id!r}")
        log.warning("handoff to %s requested by %s", ",".join(req.targets), self.peer)
        result = await self.services.handoff(
            list(req.targets), req.rate_bytes, req.deadline_ms / 1000, req.seal
        )
        response = msg.HandoffResponse(
            num_blocks=result.num_blocks,
            num_bytes=result.num_bytes,
            num_failed=result.num_failed,
            num_left=result.num_left,
            elapsed_ms=int(result.elapsed_s * 1000),
            num_from_disk=result.num_from_disk,
            num_written=result.num_written,
            is_sealed=result.is_sealed,
        )
        await self._reply(header, Op.HANDOFF, response)


@contextlib.asynccontextmanager
async def _unleased_transfer(num_bytes: int, what: str) -> Any:
    """Bound a transfer no lease bounds (see MIN_TRANSFER_BYTES_S): past it, the
    connection closes."""
    try:
        async with asyncio.timeout(FRAME_TIMEOUT_S + num_bytes / MIN_TRANSFER_BYTES_S):
            yield
    except TimeoutError:
        raise TransferTimeout(f"timed out {what}") from None


def _scoped(request: Any, tenant: Tenant) -> Any:
    """The request with every key (and namespace id) it names moved into the tenant's, and
    a PUT's origins within what its blocks pay for (:func:`_paid_origins`)."""
    if isinstance(request, msg.PutRequest) and request.origins:
        request = msgspec.structs.replace(request, origins=_paid_origins(request))
    if isinstance(request, msg.DescribeRequest):
        scoped = tenant.scope_namespace(request.namespace_id)
        return msgspec.structs.replace(request, namespace_id=scoped)
    if hasattr(request, "keys"):
        return msgspec.structs.replace(request, keys=tenant.scope_all(request.keys))
    return request


def _paid_origins(req: msg.PutRequest) -> list[BlockOrigin | None]:
    """A tenant's origins, each kept only if its block pays for it: at most one token id
    per ORIGIN_BYTES_PER_TOKEN bytes of the arena memory the block takes (what its quota
    counts).  An origin sits in the daemon's heap, about 40 bytes a token id; so bounded,
    a tenant's origins cost at most a sixth of its quota, and a block too small for its
    origin is stored without it (its KV events carry no token ids)."""
    origins = req.origins or []
    if len(origins) != len(req.sizes):
        return list(origins)  # refused whole by the PUT's own checks
    return [
        origin
        if origin is None or len(origin.token_ids) * ORIGIN_BYTES_PER_TOKEN <= page_bytes(size)
        else None
        for origin, size in zip(origins, req.sizes, strict=True)
    ]


def _put_mismatch(req: msg.PutRequest, payload_len: int) -> str:
    """What is wrong with a PUT's lists and payload length ("": nothing)."""
    num_keys = len(req.keys)
    if len(req.sizes) != num_keys:
        return "keys, sizes and origins differ in length"
    if req.origins and len(req.origins) != num_keys:
        return "keys, sizes and origins differ in length"
    expected = sum(req.sizes) + CHECKSUM_BYTES * num_keys
    if expected != payload_len:
        return f"payload of {payload_len} bytes, sizes need {expected}"
    return ""


def _per_block_mismatch(req: msg.CommitRequest, num_blocks: int) -> str:
    """Whether a COMMIT's per-block lists name as many blocks as it commits ("": they do)."""
    if req.origins is not None and len(req.origins) != num_blocks:
        return f"{len(req.origins)} origins for {num_blocks} blocks"
    if req.checksums is not None and len(req.checksums) != num_blocks:
        return f"{len(req.checksums)} checksums for {num_blocks} blocks"
    return ""


def _area_response(area: Area | None) -> msg.AreaResponse | None:
    if area is None:
        return None
    return msg.AreaResponse(area.area_id, area.offset, area.num_bytes, int(area.lease_s * 1000))


def _statuses(statuses: Sequence[Status]) -> msg.StatusResponse:
    return msg.StatusResponse(statuses=[int(s) for s in statuses])


_OP_NAMES = {int(op): op.name for op in Op}


def _op_name(op: int) -> str:
    return _OP_NAMES.get(op, "UNKNOWN")


Handler = Callable[[Session, FrameHeader, Any], Awaitable[None]]

# The Session method that serves each request op (CHALLENGE and HELLO belong to the
# handshake, which comes before any of these).
HANDLERS: dict[int, Handler] = {
    Op.LOOKUP: Session._lookup,
    Op.PUT: Session._put,
    Op.GET: Session._get,
    Op.RESERVE: Session._reserve,
    Op.COMMIT: Session._commit,
    Op.ABORT: Session._abort,
    Op.PIN: Session._pin,
    Op.UNPIN: Session._unpin,
    Op.DELETE: Session._delete,
    Op.RETAIN: Session._retain,
    Op.REPORT_CORRUPT: Session._report_corrupt,
    Op.DESCRIBE: Session._describe,
    Op.STATS: Session._stats,
    Op.HEALTH: Session._health,
    Op.SHUTDOWN: Session._shutdown,
    Op.HANDOFF: Session._handoff,
    Op.PREFETCH: Session._prefetch,
    Op.TOUCH: Session._touch,
    Op.AREA: Session._area,
}
