"""The bucket the object tier shares: how its objects are named and encoded, and the S3
client (obstore) that reaches it.

Under ``s3://BUCKET/PREFIX``, ``packs/<writer>-<segment>.kvs`` holds a disk segment as the
disk wrote it, and ``index/<writer>-<segment>.idx`` its :class:`PackIndex` (msgpack, every
size bounded): the blocks it holds, where, and their checksums.  ``deletes/<writer>-<n>.del``
is a :class:`DeleteList`: keys deleted, hidden in the packs uploaded before it.

Formats (:mod:`kvpool.formats`): an index and a delete object carry their format version
(``version``) and the release that wrote them (``kvpool_version``); an index also names its
pack's format (a disk segment's, ``pack_format``).  Fields added since format 1 have
defaults, so that 0.1.0's objects read as format 1 and 0.1.0 reads this release's.  An
object of a format this release does not read is not read (:meth:`PackIndex.check`,
:meth:`DeleteList.check`).

obstore raises its own exception classes and Python's (``FileNotFoundError``,
``TimeoutError``...); ``STORE_ERRORS``, ``NOT_FOUND`` and ``REFUSED`` name them in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any
from urllib.parse import urlparse

import msgspec
from obstore.exceptions import BaseError as ObjectStoreError
from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store

from kvpool.config import ObjectStoreConfig
from kvpool.errors import ConfigError, FormatError
from kvpool.formats import DELETE_OBJECT, DISK_SEGMENT, OBJECT_INDEX

STORE_ERRORS = (ObjectStoreError, OSError)
NOT_FOUND = (NotFoundError, FileNotFoundError)
REFUSED = (PermissionDeniedError, UnauthenticatedError, PermissionError)

INDEX_VERSION = OBJECT_INDEX.version
PACKS = "packs/"
INDEXES = "index/"
DELETES = "deletes/"
MAX_INDEX_BYTES = 16 << 20
MAX_PACK_BLOCKS = 1 << 20
MAX_OBJECT_KEY_BYTES = 80


class PackIndex(msgspec.Struct, forbid_unknown_fields=False):
    """The index object of one pack (msgpack): which blocks it holds, and where."""

    version: int
    pack: Annotated[str, msgspec.Meta(max_length=256)]
    pack_bytes: int
    written_at: float  # unix time of the upload: the eviction order
    writer: Annotated[str, msgspec.Meta(max_length=256)]
    keys: Annotated[
        list[Annotated[bytes, msgspec.Meta(max_length=MAX_OBJECT_KEY_BYTES)]],
        msgspec.Meta(max_length=MAX_PACK_BLOCKS),
    ]
    offsets: Annotated[list[int], msgspec.Meta(max_length=MAX_PACK_BLOCKS)]
    sizes: Annotated[list[int], msgspec.Meta(max_length=MAX_PACK_BLOCKS)]
    checksums: Annotated[list[int], msgspec.Meta(max_length=MAX_PACK_BLOCKS)]
    kvpool_version: Annotated[str, msgspec.Meta(max_length=32)] = ""  # "": 0.1.0 or earlier
    pack_format: int = 1  # the pack's: a disk segment's format

    def check(self) -> None:
        """Refuse (``ValueError``) an index this release cannot read, or that names blocks
        outside its pack."""
        n = len(self.keys)
        _check_format(OBJECT_INDEX.check, self.version, self.kvpool_version, self.pack)
        _check_format(DISK_SEGMENT.check, self.pack_format, self.kvpool_version, self.pack)
        if not (len(self.offsets) == len(self.sizes) == len(self.checksums) == n):
            raise ValueError("index columns of different lengths")
        for offset, size in zip(self.offsets, self.sizes, strict=True):
            if offset < 0 or size <= 0 or offset + size > self.pack_bytes:
                raise ValueError("a block outside its pack")


class DeleteList(msgspec.Struct, forbid_unknown_fields=False):
    """A delete object (msgpack): keys a node deleted at ``written_at``, hidden in every
    pack uploaded before then."""

    version: int
    written_at: float
    writer: Annotated[str, msgspec.Meta(max_length=256)]
    keys: Annotated[
        list[Annotated[bytes, msgspec.Meta(max_length=MAX_OBJECT_KEY_BYTES)]],
        msgspec.Meta(max_length=MAX_PACK_BLOCKS),
    ]
    kvpool_version: Annotated[str, msgspec.Meta(max_length=32)] = ""

    def check(self) -> None:
        """Refuse (``ValueError``) a delete object this release cannot read."""
        _check_format(DELETE_OBJECT.check, self.version, self.kvpool_version, self.writer)


def _check_format(
    check: Callable[[int, str, object], None], version: int, writer: str, where: str
) -> None:
    try:
        check(version, writer, where)
    except FormatError as exc:
        raise ValueError(str(exc)) from exc


decode_deletes = msgspec.msgpack.Decoder(DeleteList).decode

_decode_index = msgspec.msgpack.Decoder(PackIndex).decode
_encode = msgspec.msgpack.Encoder().encode


decode_index = msgspec.msgpack.Decoder(PackIndex).decode
encode_index = msgspec.msgpack.Encoder().encode


def open_store(config: ObjectStoreConfig, *, timeout_s: float, retries: int) -> S3Store:
    """An obstore client for the configured bucket; credentials as AWS clients find them."""
    parsed = urlparse(config.url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigError(f"--object-store {config.url!r}: use s3://BUCKET[/PREFIX]")
    options: dict[str, Any] = {
        "timeout": timedelta(seconds=timeout_s),
        "connect_timeout": timedelta(seconds=min(timeout_s, 2.0)),
    }
    endpoint = config.endpoint_url  # plaintext off loopback refused (NodeConfig.validate)
    if endpoint.startswith("http://"):
        options["allow_http"] = True
    kwargs: dict[str, Any] = {}
    if endpoint:
        kwargs["endpoint"] = endpoint
        kwargs["virtual_hosted_style_request"] = False
    if config.region:
        kwargs["region"] = config.region
    retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=timeout_s * (retries + 1))}
    return S3Store(
        parsed.netloc,
        prefix=parsed.path.strip("/") or None,
        client_options=options,  # type: ignore[arg-type]
        retry_config=retry,  # type: ignore[arg-type]
        **kwargs,
    )


def index_name(pack: str) -> str:
    return pack[: -len(".kvs")] + ".idx"
