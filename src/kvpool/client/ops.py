"""Client operations, free of I/O: the protocol logic of every call, in one place.

Each operation is a generator that yields *effects* and receives their results:

- :class:`Request` — send a frame (and its payload buffers); no result.
- :class:`Send` — send more payload of that frame; no result.
- :class:`Recv` — receive the response frame; result ``(message, payload_len)``; an error
  status raises the matching exception (see :mod:`kvpool.errors`).
- :class:`RecvInto` — receive payload bytes into a view, feeding a hasher; no result.
- :class:`Skip` — receive and drop payload bytes.
- :class:`Compute` — CPU work such as copies and checksums; result ``fn()``.
- :class:`Touched` — blocks were read without asking the node: tell it (a ``TOUCH``, no
  reply) with the connection's next request; no result.

A driver (:meth:`kvpool.client.connection.Connection.run`) performs the effects.  Every
outcome that is not an error comes back as a value: statuses per key, never exceptions.

The same-host path through the node's arena is in :mod:`kvpool.client.reads`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from kvpool import checksum as ck
from kvpool.buffers import byte_view
from kvpool.errors import (
    STATUS_OF_CODE,
    AuthenticationError,
    ProtocolError,
    Status,
    UnsupportedVersion,
    UsageError,
)
from kvpool.formats import RELEASE
from kvpool.keys import BlockOrigin, EngineRef
from kvpool.protocol import auth
from kvpool.protocol.messages import (
    CHECKSUM_BYTES,
    MAX_LEASE_MS,
    MAX_WAIT_MS,
    PROTOCOL_VERSION,
    AbortRequest,
    Challenge,
    DeleteRequest,
    DescribeRequest,
    Empty,
    GetRequest,
    GetResponse,
    HandoffRequest,
    HandoffResponse,
    Health,
    Hello,
    KeysRequest,
    LookupRequest,
    LookupResponse,
    Message,
    NodeStats,
    Op,
    PrefetchRequest,
    PrefetchResponse,
    PutRequest,
    PutResponse,
    RetainRequest,
    RetainResponse,
    ShutdownRequest,
    StatusResponse,
    UnpinRequest,
    Welcome,
)

T = TypeVar("T")

# The longest wait and hold a request can carry: the protocol's bounds on a message, not
# grants (the node clamps what it is asked for to its own lease limits).
MAX_WAIT_S = MAX_WAIT_MS / 1000
MAX_HOLD_S = MAX_LEASE_MS / 1000


@dataclass
class Retained:
    """What a retention hint did, in blocks (:mod:`kvpool.retention`)."""

    num_retained: int = 0
    num_refused: int = 0  # past the tenant's account of retained bytes
    num_missing: int = 0  # not held


@dataclass(slots=True)
class Request:
    op: Op
    message: Message
    payload: Sequence[memoryview] = ()
    payload_len: int = 0
    no_reply: bool = False


@dataclass(slots=True)
class Send:
    """More payload of the request just started."""

    parts: Sequence[memoryview | bytes]


@dataclass(slots=True)
class Recv:
    op: Op
    type: type[Message]


@dataclass(slots=True)
class RecvInto:
    view: memoryview
    hasher: Any


@dataclass(slots=True)
class Skip:
    num_bytes: int


@dataclass(slots=True)
class Compute:
    fn: Callable[[], Any]
    num_bytes: int = 0


@dataclass(slots=True)
class Touched:
    keys: Sequence[bytes]


Effect = Request | Send | Recv | RecvInto | Skip | Compute | Touched
Op_ = Generator[Effect, Any, T]


@dataclass(slots=True)
class PutResult:
    """Per-key outcome of a put: OK (written), EXISTS (already stored), PENDING (someone
    else is writing it), or why it was not stored.  ``num_not_kept``: blocks the node
    evicted from DRAM to make room for this put that no lower tier took (the disk's
    write-back refused or dropped them): other blocks, now gone from the pool, which the
    node's stats count as refused and dropped.  0 when the lower tiers took every block
    evicted, or nothing was."""

    statuses: list[Status]
    num_not_kept: int = 0

    @property
    def num_stored(self) -> int:
        return sum(s in (Status.OK, Status.EXISTS) for s in self.statuses)

    @property
    def all_stored(self) -> bool:
        return self.num_stored == len(self.statuses)


@dataclass(slots=True)
class GetResult:
    """Per-key outcome of a get.  ``sizes[i]`` is the block size, or -1 where the block was
    not delivered; ``values`` holds the bytes when no destination buffers were given."""

    statuses: list[Status]
    sizes: list[int]
    values: list[bytearray | None] = field(default_factory=list)

    @property
    def found(self) -> list[bool]:
        return [s is Status.OK for s in self.statuses]

    @property
    def num_found(self) -> int:
        return sum(self.found)

    @property
    def num_prefix(self) -> int:
        """How many leading keys were delivered."""
        for i, status in enumerate(self.statuses):
            if status is not Status.OK:
                return i
        return len(self.statuses)


def statuses_of(codes: Sequence[int]) -> list[Status]:
    try:
        return [STATUS_OF_CODE[code] for code in codes]
    except KeyError as exc:
        raise ProtocolError(f"unknown status code {exc.args[0]}") from None


def check_len(what: str, values: Sequence[Any], num: int) -> None:
    if len(values) != num:
        raise ProtocolError(f"node answered {len(values)} {what} for {num} keys")


# -- handshake ----------------------------------------------------------------------------


def handshake(
    access_id: str, access_key: str, host_id: str, client_name: str, binding: bytes
) -> Op_[Welcome]:
    """Authenticate (``binding``: the connection as this side sees it, which both proofs
    cover: :func:`kvpool.protocol.auth.client_binding`); the node's Welcome, once the node
    proved it knows the key and that the Welcome is its own."""
    challenge, _ = yield Recv(Op.CHALLENGE, Challenge)
    if PROTOCOL_VERSION not in challenge.versions:
        raise UnsupportedVersion(
            f"the node speaks kvpool protocol {challenge.versions}, this client "
            f"{RELEASE} speaks {PROTOCOL_VERSION}: upgrade the older side"
        )
    handshake = auth.Handshake(access_id, challenge.nonce, auth.new_nonce(), binding)
    proof = handshake.proof(access_key, "client") if access_key else b""
    hello = Hello(
        version=PROTOCOL_VERSION,
        access_id=access_id,
        nonce=handshake.client_nonce,
        proof=proof,
        host_id=host_id,
        client_name=client_name,
    )
    yield Request(Op.HELLO, hello)
    welcome, _ = yield Recv(Op.HELLO, Welcome)
    if access_key and not handshake.verify(
        access_key, "node", welcome.proof, auth.welcome_digest(welcome)
    ):
        raise AuthenticationError("node could not prove it knows the access key")
    return welcome


# -- lookups ------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class LookupState:
    """The longest stored prefix, whether the key after it is being written, and where each
    block of the prefix lives (``kvpool.protocol.messages.TIER_*``: DRAM, disk, another
    node...; empty from a node that does not say)."""

    num_prefix: int
    is_next_pending: bool
    tiers: bytes = b""

    def num_in(self, tier: int) -> int:
        """How many blocks of the prefix live in ``tier``."""
        return self.tiers.count(tier)


def lookup(
    keys: Sequence[bytes], wait_s: float = 0.0, wait_absent: bool = False, prefetch_s: float = 0.0
) -> Op_[LookupState]:
    request = LookupRequest(
        keys=list(keys),
        wait_ms=int(min(wait_s, MAX_WAIT_S) * 1000),
        wait_absent=wait_absent,
        prefetch_ms=int(min(prefetch_s, MAX_HOLD_S) * 1000),
    )
    yield Request(Op.LOOKUP, request)
    response, _ = yield Recv(Op.LOOKUP, LookupResponse)
    if not 0 <= response.num_prefix <= len(keys):
        raise ProtocolError(f"lookup prefix {response.num_prefix} of {len(keys)} keys")
    tiers = response.tiers
    if tiers and len(tiers) != response.num_prefix:
        raise ProtocolError(f"{len(tiers)} tiers for a prefix of {response.num_prefix}")
    return LookupState(response.num_prefix, bool(response.num_pending), tiers)


def prefetch(keys: Sequence[bytes], hold_s: float, cancel: bool) -> Op_[PrefetchResponse]:
    request = PrefetchRequest(
        keys=list(keys), hold_ms=int(min(hold_s, MAX_HOLD_S) * 1000), cancel=cancel
    )
    yield Request(Op.PREFETCH, request)
    response, _ = yield Recv(Op.PREFETCH, PrefetchResponse)
    return response


def exists(keys: Sequence[bytes]) -> Op_[list[bool]]:
    present, _ = yield from presence(keys)
    return present


def presence(keys: Sequence[bytes]) -> Op_[tuple[list[bool], list[bool]]]:
    """Which keys are stored, and which are being written."""
    yield Request(Op.LOOKUP, LookupRequest(keys=list(keys), mask=True))
    response, _ = yield Recv(Op.LOOKUP, LookupResponse)
    check_len("presence flags", response.present, len(keys))
    pending = list(response.pending) or [False] * len(keys)  # a node that does not say
    check_len("pending flags", pending, len(keys))
    return list(response.present), pending


# -- writes -------------------------------------------------------------------------------


def put_stream(
    keys: Sequence[bytes],
    views: Sequence[memoryview],
    replicate: bool,
    origins: Sequence[BlockOrigin | None] | None = None,
) -> Op_[PutResult]:
    """Send the blocks inline (another host, or no shared arena).  Each block goes out right
    after its checksum is computed, so hashing one overlaps the transfer of the last."""
    sizes = [len(v) for v in views]
    total = sum(sizes) + CHECKSUM_BYTES * len(sizes)
    request = PutRequest(
        keys=list(keys),
        sizes=sizes,
        replicate=replicate,
        origins=list(origins) if origins is not None else None,
    )
    yield Request(Op.PUT, request, payload_len=total)
    for view in views:
        digest = yield Compute(partial(ck.checksum, view), len(view))
        yield Send([digest.to_bytes(CHECKSUM_BYTES, "little"), view])
    response, _ = yield Recv(Op.PUT, PutResponse)
    check_len("statuses", response.statuses, len(keys))
    return PutResult(statuses_of(response.statuses), response.num_not_kept)


# -- reads --------------------------------------------------------------------------------


def destinations(
    dsts: Sequence[memoryview] | None,
    sizes: Sequence[int],
    statuses: list[Status],
    max_bytes: int | None = None,
) -> list[memoryview | None]:
    """Where each block goes: the caller's buffer, else a new one (at most ``max_bytes`` in
    all, decided from the sizes the node announced before any block arrives; the blocks
    past it are ``REFUSED`` and skipped)."""
    out: list[memoryview | None] = []
    budget = max_bytes
    for i, (status, size) in enumerate(zip(statuses, sizes, strict=True)):
        if status is not Status.OK:
            out.append(None)
        elif dsts is None and budget is not None and size > budget:
            statuses[i] = Status.REFUSED
            out.append(None)
        elif dsts is None:
            if budget is not None:
                budget -= size
            out.append(memoryview(bytearray(size)))
        elif len(dsts[i]) < size:
            statuses[i] = Status.REFUSED  # the caller's buffer is too small for this block
            out.append(None)
        else:
            out.append(dsts[i] if len(dsts[i]) == size else dsts[i][:size])
    return out


def lower_tier_wait_ms(timeout_s: float) -> int:
    """How long a read may wait on a node for blocks from its lower tiers: most of the
    caller's deadline, the rest left for the transfer."""
    return max(1, min(int(timeout_s * 750), MAX_WAIT_MS))


def get_stream(
    keys: Sequence[bytes],
    dsts: Sequence[memoryview] | None,
    prefix: bool,
    wait_ms: int = 0,
    max_bytes: int | None = None,
) -> Op_[GetResult]:
    """Receive the blocks inline, verifying each checksum as its bytes arrive (with no
    ``dsts``, into new buffers of at most ``max_bytes`` in all: see :func:`destinations`)."""
    yield Request(Op.GET, GetRequest(keys=list(keys), prefix=prefix, wait_ms=wait_ms))
    response, payload_len = yield Recv(Op.GET, GetResponse)
    for what in ("statuses", "sizes", "checksums"):
        check_len(what, getattr(response, what), len(keys))
    statuses = statuses_of(response.statuses)
    sizes = [s if st is Status.OK else 0 for s, st in zip(response.sizes, statuses, strict=True)]
    if sum(sizes) != payload_len:
        raise ProtocolError(f"GET payload of {payload_len} bytes, sizes add up to {sum(sizes)}")
    targets = destinations(dsts, sizes, statuses, max_bytes)
    corrupt: list[bytes] = []
    for i, target in enumerate(targets):
        if target is None:
            if sizes[i]:
                yield Skip(sizes[i])
            continue
        hasher = ck.new_hasher()
        yield RecvInto(target, hasher)
        if hasher.intdigest() != response.checksums[i]:
            statuses[i] = Status.CHECKSUM_MISMATCH
            corrupt.append(keys[i])
    if corrupt:
        yield from report_corrupt(corrupt)
    return get_result(statuses, sizes, targets, dsts is None)


def get_result(
    statuses: list[Status], sizes: list[int], targets: list[memoryview | None], keep: bool
) -> GetResult:
    delivered = [s if st is Status.OK else -1 for s, st in zip(sizes, statuses, strict=True)]
    values: list[bytearray | None] = []
    if keep:
        values = [
            t.obj if t is not None and st is Status.OK else None  # type: ignore[misc]
            for t, st in zip(targets, statuses, strict=True)
        ]
    return GetResult(statuses, delivered, values)


def abort(reservation_id: int) -> Op_[None]:
    yield Request(Op.ABORT, AbortRequest(reservation_id=reservation_id), no_reply=True)


def unpin(pin_id: int) -> Op_[None]:
    yield Request(Op.UNPIN, UnpinRequest(pin_id=pin_id), no_reply=True)


def touch(keys: Sequence[bytes]) -> Op_[None]:
    """Tell the node these blocks were read without a pin (through its directory)."""
    yield Touched(keys)


# -- maintenance --------------------------------------------------------------------------


def report_corrupt(keys: Sequence[bytes]) -> Op_[None]:
    yield Request(Op.REPORT_CORRUPT, KeysRequest(keys=list(keys)))
    yield Recv(Op.REPORT_CORRUPT, StatusResponse)


def retain(keys: Sequence[bytes], priority: int, duration_s: float) -> Op_[RetainResponse]:
    """A retention priority for the blocks of ``keys`` the node holds (kvpool.retention)."""
    request = RetainRequest(keys=list(keys), priority=priority, duration_ms=int(duration_s * 1000))
    yield Request(Op.RETAIN, request)
    response, _ = yield Recv(Op.RETAIN, RetainResponse)
    return response


def delete(keys: Sequence[bytes], replicate: bool = True) -> Op_[list[Status]]:
    """Delete ``keys`` (``replicate``: the node deletes its write-through copies at the
    keys' homes too)."""
    yield Request(Op.DELETE, DeleteRequest(keys=list(keys), replicate=replicate))
    response, _ = yield Recv(Op.DELETE, StatusResponse)
    check_len("statuses", response.statuses, len(keys))
    return statuses_of(response.statuses)


def describe(
    namespace_id: bytes, label: str, engine: EngineRef | None = None, saving: str = ""
) -> Op_[None]:
    request = DescribeRequest(
        namespace_id=namespace_id, label=label[:256], engine=engine, saving=saving
    )
    yield Request(Op.DESCRIBE, request)
    yield Recv(Op.DESCRIBE, Empty)


def stats() -> Op_[NodeStats]:
    yield Request(Op.STATS, Empty())
    response, _ = yield Recv(Op.STATS, NodeStats)
    return response


def shutdown(node_id: str, drain: bool) -> Op_[None]:
    yield Request(Op.SHUTDOWN, ShutdownRequest(node_id=node_id, drain=drain))
    yield Recv(Op.SHUTDOWN, Empty)


def handoff(
    node_id: str, targets: Sequence[str], rate_bytes: int, deadline_s: float, seal: bool = False
) -> Op_[HandoffResponse]:
    """Ask the node to hand its blocks to ``targets`` (an operator's call; ``seal``: then
    stop taking writes, if every block was placed); its answer comes when the handoff is
    done, at its deadline at the latest."""
    request = HandoffRequest(
        node_id=node_id,
        targets=list(targets),
        rate_bytes=rate_bytes,
        deadline_ms=max(1, int(deadline_s * 1000)),
        seal=seal,
    )
    yield Request(Op.HANDOFF, request)
    response, _ = yield Recv(Op.HANDOFF, HandoffResponse)
    return response


def health() -> Op_[Health]:
    yield Request(Op.HEALTH, Empty())
    response, _ = yield Recv(Op.HEALTH, Health)
    return response


def check_buffers(
    keys: Sequence[bytes], buffers: Sequence[Any] | None, *, writable: bool
) -> list[memoryview] | None:
    if buffers is None:
        return None
    if len(buffers) != len(keys):
        raise UsageError(f"{len(keys)} keys but {len(buffers)} buffers")
    try:
        return [byte_view(b, writable=writable) for b in buffers]
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
