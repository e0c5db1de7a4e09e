"""Every persistent format kvpool writes, the version this release writes of each, and the
versions it reads: its compatibility window (at least the previous release's: rule 2 below;
for operators, docs/operations/upgrades.md, "Versioned formats").

======================  =========================================  ===========================
format                  where                                      its stamp
======================  =========================================  ===========================
``arena``               the node's shared-memory file              a header page past the
                                                                   blocks, at the file's end
``journal``             beside the arena                           the header's version byte
                                                                   (``KVPOOLJ1``, ``KVPOOLJ2``)
                                                                   and a STAMP record per start
``disk tier``           ``PATH/kvpool-disk.id``                    its one line
``disk segment``        ``PATH/seg-*.kvs``; an object-store pack   a header at offset 0
                        is a segment uploaded whole
``object index``        ``index/*.idx`` in the bucket              ``version``,
                                                                   ``kvpool_version``
``delete object``       ``deletes/*.del`` in the bucket            ``version``,
                                                                   ``kvpool_version``
======================  =========================================  ===========================

Not listed, as nothing adopts them: the shared directory beside the arena
(:mod:`kvpool.directory`, its own ``VERSION``: each daemon makes a new one, and a client
that does not know its version reads through the node), the Unix socket, and the cluster's
membership records in etcd (they live as long as a lease; JSON, unknown fields ignored).

Version 1 of each is what kvpool 0.1.0 wrote: no stamp beyond the journal's ``KVPOOLJ1``
and the bucket objects' ``version`` field.  A file without a stamp is read as version 1,
written by 0.1.0 or earlier.

Rules (each has a test in tests/test_formats.py and beside each format's own tests):

1. Each file carries its format version and the release that wrote it (:data:`RELEASE`);
   ``kvpool status`` shows both for the arena, the journal and the disk tier, and what a
   start migrated.
2. A release reads the versions from :attr:`Format.oldest` to :attr:`Format.version`: at
   least the previous release's.  A file of an older version in the window is adopted as it
   is and migrated in place, in O(1) at start (a header rewritten, a stamp appended): a
   start never rewrites what it adopts, so the restart bound holds at millions of blocks.
   Immutable files (sealed disk segments, packs) stay in their version until they go.
3. A node's own file of a version outside the window, or whose stamp fails its checksum, is
   refused at start with a :class:`~kvpool.errors.FormatError` that names the file, both
   versions, and the way to empty the node (``--fresh``): never adopted in part, never
   silently replaced by an empty pool, never read as something it is not.
4. A shared object (the bucket's) of a version outside the window is not read (another
   node of another release wrote it): logged and counted; a delete object that cannot be
   read hides every pack written before it, so a deleted block never comes back.
5. A change that old readers would misread is a new version; a change they can ignore
   (a new msgpack field with a default, a new wire op) is not.  The CHANGELOG names each.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvpool.errors import FormatError

# The release this code is: the writer every stamp names.  pyproject.toml's version too.
RELEASE = "0.2.0"
# How a stamp names a release that wrote no stamps.
UNSTAMPED_RELEASE = "0.1.0 or earlier"
MAX_RELEASE_BYTES = 20

# The command that empties a node whose files this release refuses.
EMPTY_COMMAND = "start it with --fresh (KVPOOL_FRESH=1), which empties the node"


@dataclass(frozen=True, slots=True)
class Format:
    """One persistent format: the version this release writes, and the oldest it reads."""

    name: str
    version: int
    oldest: int

    def check(self, version: int, writer: str, where: object) -> None:
        """Refuse a file of ``version`` (written by ``writer``) at ``where`` unless this
        release reads it (rule 3)."""
        if not self.oldest <= version <= self.version:
            newer = version > self.version
            raise FormatError(
                f"{where}: {self.name} format {version}, written by kvpool "
                f"{writer or UNSTAMPED_RELEASE}; this kvpool {RELEASE} reads {self.name} "
                f"formats {self.oldest} to {self.version}. "
                + (
                    f"Run kvpool {writer or 'of that release'} on it again, or "
                    if newer
                    else "Upgrade through the releases between, or "
                )
                + EMPTY_COMMAND
                + "."
            )

    def damaged(self, where: object, what: str = "format stamp") -> FormatError:
        """The refusal of a file whose stamp is damaged (rule 3)."""
        return FormatError(
            f"{where}: the {self.name}'s {what} is damaged (it fails its checksum), so its "
            f"format is unknown and nothing in it is adopted; this kvpool {RELEASE} writes "
            f"{self.name} format {self.version}. To empty the node, {EMPTY_COMMAND}."
        )


ARENA = Format("arena", version=2, oldest=1)
JOURNAL = Format("journal", version=2, oldest=1)
DISK_TIER = Format("disk tier", version=2, oldest=1)
DISK_SEGMENT = Format("disk segment", version=2, oldest=1)
OBJECT_INDEX = Format("object index", version=1, oldest=1)
DELETE_OBJECT = Format("delete object", version=1, oldest=1)

FORMATS = (ARENA, JOURNAL, DISK_TIER, DISK_SEGMENT, OBJECT_INDEX, DELETE_OBJECT)


@dataclass(frozen=True, slots=True)
class Stamp:
    """A file's format version and the release that wrote it ("" where it wrote no stamp)."""

    version: int
    writer: str

    def describe(self) -> str:
        return f"{self.version} (kvpool {self.writer or UNSTAMPED_RELEASE})"


# A binary stamp: the format's magic, its version, the writer's release (ASCII, NUL
# padded), and a checksum of the three.
STAMP = struct.Struct(f"<8sI{MAX_RELEASE_BYTES}s")
STAMP_CHECKSUM = struct.Struct("<Q")
STAMP_BYTES = STAMP.size + STAMP_CHECKSUM.size


def pack_stamp(magic: bytes, version: int, writer: str = RELEASE) -> bytes:
    body = STAMP.pack(magic, version, writer.encode("ascii")[:MAX_RELEASE_BYTES])
    return body + STAMP_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def unpack_stamp(data: bytes | memoryview, magic: bytes, fmt: Format, where: object) -> Stamp:
    """The stamp at the start of ``data``, which must begin with ``magic``; a stamp that
    fails its checksum is refused (:meth:`Format.damaged`), one of a version outside the
    window too (:meth:`Format.check`)."""
    body = bytes(data[: STAMP.size])
    (expected,) = STAMP_CHECKSUM.unpack_from(data, STAMP.size)
    found, version, writer = STAMP.unpack(body)
    if found != magic or xxhash.xxh3_64_intdigest(body) != expected:
        raise fmt.damaged(where)
    release = writer.rstrip(b"\0").decode("ascii", "replace")
    fmt.check(version, release, where)
    return Stamp(version, release)


def has_magic(data: bytes | memoryview, magic: bytes) -> bool:
    return len(data) >= STAMP_BYTES and bytes(data[: len(magic)]) == magic
