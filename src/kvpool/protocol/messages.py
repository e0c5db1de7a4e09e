"""The msgpack message headers of every operation, with their bounds.

Each frame carries one of these as its msgpack header (see :mod:`kvpool.protocol.frames`);
the op code in the fixed header says which.  Lists and byte strings carry ``msgspec.Meta``
bounds, so decoding rejects an oversized count before anything is allocated for it.

Operations (request -> response):

=============  ========================================  =====================================
op             request                                   response (+ raw payload)
=============  ========================================  =====================================
CHALLENGE      (server speaks first on accept)           -
HELLO          version, access id, nonce, HMAC proof     Welcome: node identity, arena, limits
LOOKUP         ordered keys, optional bounded wait        longest present prefix (or mask)
PUT            keys, sizes + payload (checksum, block)*   status per key; blocks not kept (1)
GET            keys                                       status, size, checksum per key
                                                          + payload of the found blocks
RESERVE        keys, sizes (same-node writers)            status and arena offset per key
AREA           bytes wanted (same-node writers)           write area: id, arena offset, size
COMMIT         reservation id (or area id, keys, sizes);  status per key (+ the area held now);
               the writer's checksum per key, if it       blocks not kept (1)
               hashed the blocks as it copied them
ABORT          reservation id                             -
PIN            keys (same-node readers)                   pin id, offset, size, checksum per key
UNPIN          pin id                                     - (sent without waiting for a reply)
DELETE         keys                                       status per key
RETAIN         keys, a retention priority and duration    blocks retained, refused, missing
REPORT_CORRUPT keys a reader found corrupt                status per key
DESCRIBE       namespace id and label; the engine that    -
               loads its blocks, if it says (2)
STATS          -                                          NodeStats
HEALTH         -                                          Health
SHUTDOWN       the node's id; whether to drain (empty it) - (then the node stops)
HANDOFF        the node's id; the nodes to hand its       blocks handed, failed, left; when
               blocks to; a rate and a deadline           it is done (or at the deadline)
=============  ========================================  =====================================

(1) How many blocks the write's evictions lost: evicted from DRAM to make room for it, and
taken by no lower tier (see :class:`PutResponse`).

(2) Its pod and model as a router names them, for routers that learn where blocks are from
the node (:mod:`kvpool.node.kthena`); a node that does not know the field ignores it.

Compatibility (:mod:`kvpool.formats` rule 5 for the wire): a release speaks its own version
and the previous release's.  A new op or a new field with a default is no new version (a
node of the previous release answers an op it does not know with ``BadRequest``, and
msgpack readers skip fields they do not know), except in a Welcome: both proofs cover a
digest of the Welcome as each side decodes it again, so a field an older client drops would
fail its proof.  A Welcome that grows is a new protocol version.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from kvpool.keys import MAX_KEY_BYTES, MIN_KEY_BYTES, NAMESPACE_ID_BYTES, BlockOrigin, EngineRef
from kvpool.limits import MAX_WAIT_S, LeaseLimits
from kvpool.retention import MAX_DURATION_S, MAX_PRIORITY, MIN_PRIORITY
from kvpool.stats import AccountStats, FormatStats, NamespaceStats, PrefetchStats, TierStats

PROTOCOL_VERSION = 3  # 2: sealed commits; 3: proofs bound to the connection and Welcome
SUPPORTED_VERSIONS = (3,)

MAX_KEYS_PER_REQUEST = 16384
MAX_BLOCK_BYTES = 256 << 20
MAX_AREA_BYTES = 1 << 30
MAX_WAIT_MS = int(MAX_WAIT_S * 1000)
# The longest lease or hold a request may name on the wire: a bound on the message, not a
# grant (the node grants at most its LeaseLimits, announced in its Welcome).
MAX_LEASE_MS = 600_000
MAX_NAME_LEN = 256
MAX_TIERS = 8
MAX_ACCOUNTS = 1024  # a tenants file's tenants, at most (kvpool.tenants.MAX_TENANTS)
MAX_MESSAGE_LEN = 4096
NONCE_BYTES = 32
CHECKSUM_BYTES = 8

Key = Annotated[bytes, msgspec.Meta(min_length=MIN_KEY_BYTES, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_BYTES)]
Sizes = Annotated[list[Size], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
Checksum = Annotated[int, msgspec.Meta(ge=0)]  # a uint64
Checksums = Annotated[list[Checksum], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
# Per key, what the block was computed from (None where the writer does not say): the
# node's KV events carry it.  The frame's header bound (MAX_META_BYTES) bounds the total.
Origins = Annotated[list[BlockOrigin | None], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
Statuses = Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
Offsets = Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LEN)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Proof = Annotated[bytes, msgspec.Meta(max_length=64)]
WaitMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_WAIT_MS)]
# A requested lease; 0 asks for the node's bound, and the node never grants more than it.
LeaseMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LEASE_MS)]


class Op(enum.IntEnum):
    CHALLENGE = 1
    HELLO = 2
    LOOKUP = 3
    PUT = 4
    GET = 5
    RESERVE = 6
    COMMIT = 7
    ABORT = 8
    PIN = 9
    UNPIN = 10
    DELETE = 11
    REPORT_CORRUPT = 12
    DESCRIBE = 13
    STATS = 14
    HEALTH = 15
    SHUTDOWN = 16
    PREFETCH = 17
    TOUCH = 18  # no reply: blocks a same-host client read through the shared directory
    AREA = 19  # a write area for a same-host client (see kvpool.store.areas)
    HANDOFF = 20  # hand this node's blocks to other nodes (a node leaving the cluster)
    RETAIN = 21  # a retention priority for blocks held (kvpool.retention)


class Message(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """Base of every message header."""


class Challenge(Message):
    versions: Annotated[list[int], msgspec.Meta(max_length=16)]
    nonce: Nonce
    node_id: Name
    auth_required: bool


class Hello(Message):
    version: int
    access_id: Name
    nonce: Nonce
    proof: Proof = b""
    host_id: Name = ""
    client_name: Name = ""


class Limits(Message):
    """The node's lease limits (:class:`kvpool.limits.LeaseLimits`), as its Welcome
    announces them: the most it grants, whatever a client asks for."""

    pin_ms: int
    reserve_ms: int  # reservations and write areas
    hold_ms: int  # prefetch holds
    default_hold_ms: int
    wait_ms: int  # a lookup's or a read's wait for blocks

    @classmethod
    def of(cls, limits: LeaseLimits) -> Limits:
        return cls(
            pin_ms=_ms(limits.pin_s),
            reserve_ms=_ms(limits.reserve_s),
            hold_ms=_ms(limits.hold_s),
            default_hold_ms=_ms(limits.default_hold_s),
            wait_ms=_ms(limits.wait_s),
        )

    def lease_limits(self) -> LeaseLimits:
        return LeaseLimits(
            pin_s=self.pin_ms / 1000,
            reserve_s=self.reserve_ms / 1000,
            hold_s=self.hold_ms / 1000,
            default_hold_s=self.default_hold_ms / 1000,
            wait_s=self.wait_ms / 1000,
        )


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class Welcome(Message):
    node_id: Name
    proof: Proof
    host_id: Name
    tcp_address: Name
    arena_path: Name
    arena_bytes: int
    arena_dev: int
    arena_ino: int
    arena_id: bytes
    max_keys: int = MAX_KEYS_PER_REQUEST
    directory_path: Name = ""  # the shared directory of the arena's blocks, if any
    max_block_bytes: int = MAX_BLOCK_BYTES
    # The node's lease limits (None: a node from before they were announced).
    limits: Limits | None = None


class LookupRequest(Message):
    keys: Keys
    wait_ms: WaitMs = 0
    wait_absent: bool = False  # also wait for keys nobody has started writing yet
    mask: bool = False  # report presence of every key, not just the prefix length
    # Also bring the prefix's blocks held only in lower tiers into DRAM, and keep them
    # there this long for the request that will read them (0: no prefetch).
    prefetch_ms: LeaseMs = 0


class LookupResponse(Message):
    num_prefix: int
    present: Annotated[list[bool], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)] = []
    num_pending: int = 0
    # With ``mask``: which keys are being written (reserved, not yet committed).
    pending: Annotated[list[bool], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)] = []
    # The tier (TIER_*) of each block of the prefix (with ``mask``: of each present key).
    tiers: Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)] = b""


class PutRequest(Message):
    """The payload holds, for each key in order, its 8-byte little-endian xxh3 checksum and
    then its block: a sender hashes one block while the previous one is in flight."""

    keys: Keys
    sizes: Sizes
    replicate: bool = True  # write through to the keys' home nodes
    origins: Origins | None = None


class StatusResponse(Message):
    statuses: Statuses


class PutResponse(StatusResponse):
    """A PUT's statuses, and how many blocks the put's evictions lost: blocks it evicted
    from DRAM that no lower tier took (the disk's write-back refused or dropped them), so
    they are gone (0 where the lower tiers took every one, or nothing was evicted)."""

    num_not_kept: int = 0


class GetRequest(Message):
    keys: Keys
    prefix: bool = False  # stop at the first miss
    # How long the caller waits for blocks to come up from lower tiers (0: the node's bound).
    wait_ms: WaitMs = 0


class GetResponse(Message):
    statuses: Statuses
    sizes: Sizes
    checksums: Checksums


class ReserveRequest(Message):
    keys: Keys
    sizes: Sizes
    lease_ms: LeaseMs = 0


class ReserveResponse(Message):
    reservation_id: int
    statuses: Statuses
    offsets: Offsets
    lease_ms: int = 0  # the lease granted


class CommitRequest(Message):
    """Publish a filled reservation, or (``area_id``) the blocks of ``keys`` that the writer
    put one after another at the front of its write area (page-aligned).  ``checksums``:
    one per block, computed by the writer over the bytes it copied in; without them the
    node hashes the blocks itself (it *seals* them: see :mod:`kvpool.node.sealing`).
    ``keep_area``: the rest of the write area stays where it is, even if it is short (the
    writer copies its next blocks there before this COMMIT's reply comes back)."""

    reservation_id: int = 0
    replicate: bool = True
    origins: Origins | None = None
    area_id: int = 0
    keys: Keys = []
    sizes: Sizes = []
    checksums: Checksums | None = None
    keep_area: bool = False


class AreaRequest(Message):
    num_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_AREA_BYTES)]
    lease_ms: LeaseMs = 0


class AreaResponse(Message):
    area_id: int  # 0: no free extent that large now
    offset: int = 0
    num_bytes: int = 0
    lease_ms: int = 0


class CommitResponse(Message):
    """A status per key; for a commit in a write area, the area the connection holds now
    (the rest of the old one, or a fresh one once the rest ran short; None: none)."""

    statuses: Statuses
    area: AreaResponse | None = None
    # As PutResponse's, for this commit and the RESERVE or AREA before it on the connection.
    num_not_kept: int = 0


class AbortRequest(Message):
    reservation_id: int


class PinRequest(Message):
    keys: Keys
    prefix: bool = False
    lease_ms: LeaseMs = 0
    wait_ms: WaitMs = 0  # as GetRequest's


class PinResponse(Message):
    pin_id: int
    statuses: Statuses
    offsets: Offsets
    sizes: Sizes
    checksums: Checksums
    lease_ms: int = 0  # the lease granted
    # Per key: the node hashed the block's arena bytes itself, so a same-host reader need
    # not hash them again (empty: none is).
    sealed: Annotated[list[bool], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)] = []
    # Per key: not in the arena, but a lower tier holds it, and DRAM had no room to bring
    # it up: read it with a GET, which streams it from there (empty: none is).
    below: Annotated[list[bool], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)] = []


class UnpinRequest(Message):
    pin_id: int


class PrefetchRequest(Message):
    """Bring these blocks into DRAM (from disk, the object store or other nodes) and keep
    them there for up to ``hold_ms`` or until read; ``cancel``: no longer needed."""

    keys: Keys
    hold_ms: LeaseMs = 0  # 0: the node's default
    cancel: bool = False


class PrefetchResponse(Message):
    num_in_dram: int = 0  # already there (now held)
    num_started: int = 0  # being brought up
    num_refused: int = 0  # past the node's bound on bytes in flight
    num_absent: int = 0  # held in no tier the node can read


class KeysRequest(Message):
    keys: Keys


class DeleteRequest(Message):
    keys: Keys
    replicate: bool = True  # also delete the copies written through to the keys' homes


class RetainRequest(Message):
    """Give the blocks of ``keys`` held now ``priority`` for ``duration_ms`` (0: until they
    leave the node), leaves first (:mod:`kvpool.retention`)."""

    keys: Keys
    priority: Annotated[int, msgspec.Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
    duration_ms: Annotated[int, msgspec.Meta(ge=0, le=int(MAX_DURATION_S * 1000))] = 0


class RetainResponse(Message):
    num_retained: int
    num_refused: int = 0  # past the tenant's account of retained bytes
    num_missing: int = 0  # not held in this node's DRAM


SAVINGS = ("", "eager", "evicting")


class DescribeRequest(Message):
    namespace_id: Annotated[
        bytes, msgspec.Meta(min_length=NAMESPACE_ID_BYTES, max_length=NAMESPACE_ID_BYTES)
    ]
    label: Name
    engine: EngineRef | None = None
    # When the engine that writes the namespace saves: one of SAVINGS ("" : not said).
    saving: Annotated[str, msgspec.Meta(max_length=16)] = ""


class Empty(Message):
    pass


class ErrorResponse(Message):
    message: Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE_LEN)] = ""


class ShutdownRequest(Message):
    node_id: Name  # the node meant (as its Welcome said): no default, nothing stops by chance
    drain: bool = False  # empty the node (every tier) as it stops


class HandoffRequest(Message):
    """Hand the node's blocks (DRAM hottest first, then its disk's, then those written
    meanwhile), each to its home among ``targets`` (TCP addresses of other nodes), at most
    ``rate_bytes`` a second, until ``deadline_ms``; with ``seal``, then stop taking writes
    if every block was placed (a drain about to empty the node)."""

    node_id: Name  # the node meant (as its Welcome said)
    targets: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=64)]
    rate_bytes: Annotated[int, msgspec.Meta(ge=1 << 20, le=1 << 40)] = 256 << 20
    deadline_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 60_000
    seal: bool = False


class HandoffResponse(Message):
    num_blocks: int  # stored at their homes (or already there)
    num_bytes: int
    num_failed: int  # a target refused them or did not answer in time (or unverified)
    num_left: int  # still held, not tried: the deadline came first
    elapsed_ms: int
    num_from_disk: int = 0  # of the handed, read from the disk tier
    num_written: int = 0  # blocks written to the node while the handoff ran
    is_sealed: bool = False  # every block placed, and the node takes no more writes


class NodeStats(Message):
    node_id: str
    host_id: str
    tcp_address: str
    capacity_bytes: int
    used_bytes: int
    reserved_bytes: int
    num_blocks: int
    num_pinned: int
    hits: int
    misses: int
    puts: int
    evictions: int
    bytes_in: int
    bytes_out: int
    num_connections: int
    uptime_s: float
    namespaces: list[NamespaceStats] = []
    peers: list[str] = []
    corrupt_reports: int = 0  # blocks readers or the scrubber found corrupt (and dropped)
    # Retention hints (kvpool.retention): blocks at a priority other than the default now,
    # blocks hints gave a priority (ever), and blocks refused past an account.
    retained_blocks: int = 0
    retained: int = 0
    retention_refused: int = 0
    kthena_written: int = 0  # owner changes of Kthena's entries written to its Redis
    kthena_dropped: int = 0  # ... and dropped (the queue full, or Redis down past retries)
    scrubbed_bytes: int = 0  # re-hashed by the scrubber (kvpool.node.sealing)
    scrub_dropped: int = 0  # blocks the scrubber found damaged
    area_bytes: int = 0  # free memory same-host writers hold as write areas
    tiers: Annotated[list[TierStats], msgspec.Meta(max_length=MAX_TIERS)] = []
    prefetch: PrefetchStats | None = None
    # What the node's bookkeeping costs (node-wide; 0 in a tenant's view): the index's heap,
    # estimated in O(1); the receive buffers of the open connections; the daemon's anonymous
    # resident memory as the kernel counts it (everything, index included).
    metadata_bytes: int = 0
    connection_buffer_bytes: int = 0
    heap_bytes: int = 0
    release: str = ""  # the node's kvpool release ("": 0.1.0, before it was announced)
    formats: Annotated[list[FormatStats], msgspec.Meta(max_length=16)] = []
    # Each tenant's use of each budget (kvpool.store.accounts), its arena bytes and quota
    # among them; in a tenant's view, its own only.
    accounts: Annotated[list[AccountStats], msgspec.Meta(max_length=MAX_ACCOUNTS)] = []
    # Connections still in their handshake, and those closed to make room for newer ones.
    num_strangers: int = 0
    strangers_evicted: int = 0


class Health(Message):
    ok: bool
    node_id: str
    uptime_s: float


REQUEST_TYPES: dict[Op, type[Message]] = {
    Op.HELLO: Hello,
    Op.LOOKUP: LookupRequest,
    Op.PUT: PutRequest,
    Op.GET: GetRequest,
    Op.RESERVE: ReserveRequest,
    Op.COMMIT: CommitRequest,
    Op.ABORT: AbortRequest,
    Op.PIN: PinRequest,
    Op.UNPIN: UnpinRequest,
    Op.DELETE: DeleteRequest,
    Op.REPORT_CORRUPT: KeysRequest,
    Op.DESCRIBE: DescribeRequest,
    Op.STATS: Empty,
    Op.HEALTH: Empty,
    Op.SHUTDOWN: ShutdownRequest,
    Op.HANDOFF: HandoffRequest,
    Op.PREFETCH: PrefetchRequest,
    Op.TOUCH: KeysRequest,
    Op.AREA: AreaRequest,
    Op.RETAIN: RetainRequest,
}

RESPONSE_TYPES: dict[Op, type[Message]] = {
    Op.CHALLENGE: Challenge,
    Op.HELLO: Welcome,
    Op.LOOKUP: LookupResponse,
    Op.PUT: PutResponse,
    Op.GET: GetResponse,
    Op.RESERVE: ReserveResponse,
    Op.COMMIT: CommitResponse,
    Op.ABORT: Empty,
    Op.PIN: PinResponse,
    Op.UNPIN: Empty,
    Op.DELETE: StatusResponse,
    Op.REPORT_CORRUPT: StatusResponse,
    Op.DESCRIBE: Empty,
    Op.STATS: NodeStats,
    Op.HEALTH: Health,
    Op.SHUTDOWN: Empty,
    Op.HANDOFF: HandoffResponse,
    Op.PREFETCH: PrefetchResponse,
    Op.TOUCH: Empty,
    Op.AREA: AreaResponse,
    Op.RETAIN: RetainResponse,
}
