"""Block keys: the single source of key truth for the connector, the router and the tools.

A key is raw bytes: ``namespace id (16 bytes) + block hash``.

- The namespace id is a digest of everything that makes two blocks incompatible (model and
  revision, dtype, KV layout, parallelism and rank, tenant).  Two engines share blocks
  exactly when they agree on all of it.
- The block hash is the engine's own chained prefix hash (vLLM: ``Request.block_hashes``),
  so one key names its whole prefix.

Python's ``hash()`` is never used: it is randomised per process.  :func:`check_hash_stability`
refuses hash settings that would differ between processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Annotated

import msgspec

from kvpool.errors import ConfigError

NAMESPACE_ID_BYTES = 16
MAX_LABEL_CHARS = 200  # within the protocol's bound on names
MIN_BLOCK_ID_BYTES = 1
MAX_BLOCK_ID_BYTES = 64
MIN_KEY_BYTES = NAMESPACE_ID_BYTES + MIN_BLOCK_ID_BYTES
MAX_KEY_BYTES = NAMESPACE_ID_BYTES + MAX_BLOCK_ID_BYTES
# A request of at least this many keys is handled as columns (numpy, a few calls for the
# whole request), a smaller one a key at a time: each numpy call costs 1-5 µs however small
# its arrays, which a few keys' Python statements undercut (a put of four 2 MiB blocks
# paid ~0.3 ms for a hundred of them).
MIN_COLUMN_KEYS = 32

STABLE_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
SEEDED_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


class Namespace(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that makes the KV of two blocks incompatible.

    Every field takes part in :attr:`id`; add a field rather than overloading one.
    """

    model: str
    revision: str = ""
    dtype: str = ""
    layout: str = ""  # e.g. "cpu", "flash_attn", "mla"
    num_layers: int = 0
    block_size: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    is_mla: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tenant: str = ""
    hash_algo: str = ""
    extra: str = ""

    @property
    def id(self) -> bytes:
        """The 16-byte namespace id: a digest of every field."""
        encoded = msgspec.msgpack.encode(msgspec.structs.asdict(self))
        return hashlib.blake2b(encoded, digest_size=NAMESPACE_ID_BYTES).digest()

    def for_rank(self, tp_rank: int, pp_rank: int, *, mla_any_tp: bool = False) -> Namespace:
        """The namespace one (tensor-parallel, pipeline-parallel) rank of an engine saves
        and loads under: the one place this is decided.

        Each tensor-parallel rank of a dense or GQA model holds its own shard of the heads,
        so its blocks are its own: ``tp_size`` and ``tp_rank`` are part of the namespace.

        MLA's latent KV is not sharded: every tensor-parallel rank holds the same latent
        vector per token, so the ranks of an engine share one copy (``tp_rank`` 0; rank 0
        saves it, every rank loads it: :func:`kvpool.kvcache.ranks.writes_blocks`).
        ``tp_size`` stays: an engine of another tensor-parallel size computed its latents
        with other reductions, and a TP=1 engine that loads a TP=2 engine's prefix answers
        neither as itself nor as the TP=2 engine (measured), so by default that is a miss.
        ``mla_any_tp`` drops it too, for a prefill and a decode of different sizes that are
        meant to share (the deployment guide's TP=8 prefill and TP=1 decode): the decode
        then continues from the prefill's latents, as any disaggregated serving does.
        Pipeline-parallel ranks hold different layers: ``pp_rank`` always stays.
        """
        if self.is_mla:
            tp_size = 1 if mla_any_tp else self.tp_size
            return msgspec.structs.replace(self, tp_size=tp_size, tp_rank=0, pp_rank=pp_rank)
        return msgspec.structs.replace(self, tp_rank=tp_rank, pp_rank=pp_rank)

    def describe(self) -> str:
        """A short human-readable label, shown by ``kvpool status``."""
        parts = [self.model]
        if self.tenant:
            parts.append(f"tenant={self.tenant}")
        if self.dtype:
            parts.append(self.dtype)
        if self.layout:
            parts.append(self.layout)
        if self.tp_size > 1 or self.pp_size > 1:
            parts.append(f"tp{self.tp_rank}/{self.tp_size} pp{self.pp_rank}/{self.pp_size}")
        return " ".join(parts)[:MAX_LABEL_CHARS]

    def key(self, block_hash: bytes) -> bytes:
        """The pool key of one block."""
        return block_key(self.id, block_hash)

    def keys(self, block_hashes: Iterable[bytes]) -> list[bytes]:
        """The pool keys of an ordered list of block hashes (a prefix)."""
        ns_id = self.id
        return [block_key(ns_id, h) for h in block_hashes]


MAX_TOKENS_PER_BLOCK = 4096
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class BlockOrigin(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a block was computed from, carried with its save so that the pool can tell
    routers that index blocks by their tokens (KV events): its token ids, and the hash of
    the block before it in its prefix (empty for a prefix's first block)."""

    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS_PER_BLOCK)]
    parent: Annotated[bytes, msgspec.Meta(max_length=MAX_BLOCK_ID_BYTES)] = b""


# A Kubernetes pod as Kthena names it: ``<pod>.<namespace>`` (253 + 1 + 63 characters).
MAX_POD_CHARS = 320
MAX_MODEL_CHARS = 256
# A node keeps an engine's name this long after the engine last said it; an engine says it
# again this often.
ENGINE_TTL_S = 90.0
ENGINE_REFRESH_S = 30.0


class EngineRef(msgspec.Struct, frozen=True):
    """An engine that loads a namespace's blocks from the node it describes the namespace
    to, as a router names it: its pod (Kthena's ``<pod>.<namespace>``) and the model name
    that requests to it carry (:mod:`kvpool.node.kthena`)."""

    pod: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_POD_CHARS)]
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_CHARS)]


def block_key(namespace_id: bytes, block_hash: bytes) -> bytes:
    """``namespace_id + block_hash``, checked for length."""
    if len(namespace_id) != NAMESPACE_ID_BYTES:
        raise ValueError(f"namespace id must be {NAMESPACE_ID_BYTES} bytes")
    if not MIN_BLOCK_ID_BYTES <= len(block_hash) <= MAX_BLOCK_ID_BYTES:
        raise ValueError(
            f"block hash must be {MIN_BLOCK_ID_BYTES}..{MAX_BLOCK_ID_BYTES} bytes, "
            f"got {len(block_hash)}"
        )
    return namespace_id + bytes(block_hash)


def namespace_of(key: bytes) -> bytes:
    """The namespace id a key belongs to."""
    return key[:NAMESPACE_ID_BYTES]


def is_valid_key(key: bytes) -> bool:
    return MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES


def chained_hashes(tokens: list[int], block_size: int, *, seed: bytes = b"kvpool") -> list[bytes]:
    """A chained sha256 prefix hash per full block of ``tokens``.

    For SDK users without an engine of their own: like vLLM's hashes, each hash covers its
    parent hash and so names the whole prefix.  The connector and the router use the
    engine's own hashes instead (see ``kvpool.integrations.vllm``).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[bytes] = []
    parent = hashlib.sha256(seed).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        parent = hashlib.sha256(parent + msgspec.msgpack.encode(block)).digest()
        hashes.append(parent)
    return hashes


def check_hash_stability(hash_algo: str, environ: Mapping[str, str]) -> None:
    """Refuse a block-hash setting that differs between processes.

    vLLM's chained hash starts from a seed: a fixed string for the sha256 algorithms when
    ``PYTHONHASHSEED`` is unset, but a per-process random value for the xxhash algorithms.
    Keys made from such hashes would never match in another process: a silent 0% hit rate.
    """
    seed = environ.get("PYTHONHASHSEED")
    if hash_algo in SEEDED_HASH_ALGOS and (seed is None or seed == "random"):
        raise ConfigError(
            f"prefix-caching hash algorithm {hash_algo!r} is seeded randomly in every process "
            "unless PYTHONHASHSEED is set, so pool keys would never match across engines. "
            "Set PYTHONHASHSEED to the same value for every engine, or use sha256 (the default)."
        )
    if hash_algo not in STABLE_HASH_ALGOS | SEEDED_HASH_ALGOS:
        raise ConfigError(f"unknown prefix-caching hash algorithm {hash_algo!r}")
