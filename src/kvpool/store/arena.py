"""The DRAM arena: one fixed-size, page-aligned file under /dev/shm, mapped by the daemon
and by every client on the same host.

Rules:
- The node directory holding the arena and the Unix socket is created ``0o770`` and the
  arena ``0o660``: only the daemon's user and group can map it.
- The daemon holds an exclusive ``flock`` on the node directory for its whole life; a
  directory somebody holds is refused.
- The node directory must be the daemon's user's, and every directory above it root's or
  the daemon's user's, which nobody else may rename entries in (``/dev/shm``: root's,
  sticky; :func:`kvpool.dirs.check_owned`): a directory another local user created first,
  or could swap (to plant the Unix socket, or read the arena), is refused, never used.
- The arena is opened relative to the node directory's descriptor, never through a
  symbolic link.
- An arena left by an earlier daemon (a crash, ``kill -9``, an upgrade) is kept and mapped
  again if it has the size asked for, so that its blocks can be adopted (see
  :mod:`kvpool.store.journal`); otherwise, or with ``fresh``, it is replaced.
- The file carries its format (:mod:`kvpool.formats`): a header page past the blocks, at
  the file's end, so that the blocks' offsets are those of an arena without one.  It names
  the format version, the release that wrote it and the arena's size.  A header of a
  version this release does not read, or one that fails its checksum, is refused at start
  (:class:`~kvpool.errors.FormatError`), before a byte changes.  An arena of the previous
  format (0.1.0's, no header page) is migrated in place by :meth:`Arena.commit`, once every
  other check of the start has passed: the page is added and written, nothing else moves.
  Until then a kept arena is mapped as it is, its length, contents and mode untouched, so
  that a start refused later leaves it as it found it (an earlier release still adopts it).
- The whole size is allocated up front (``posix_fallocate``): a size the host cannot give
  is refused at start with a clear message, never discovered later as a SIGBUS.
- Its page tables are populated as it is mapped, or behind the daemon for an arena past
  2 GiB (:mod:`kvpool.mapping`): a restart is ready before they are.
- ``close()`` unmaps the arena; ``close(remove=True)`` also removes it (a drain).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import struct
from pathlib import Path

from kvpool.config import PAGE_BYTES, format_size
from kvpool.dirs import DirLock, check_owned, make_dir, open_in
from kvpool.errors import ConfigError
from kvpool.formats import ARENA, RELEASE, STAMP_BYTES, Stamp, pack_stamp, unpack_stamp
from kvpool.mapping import map_shared

ARENA_MODE = 0o660
DIR_MODE = 0o770
HEADER_MAGIC = b"KVPOOLA\0"
HEADER_BYTES = PAGE_BYTES  # the last page of the file
HEADER_SIZE = struct.Struct("<Q")  # after the stamp: the arena's bytes (without the header)


class NodeDirLock:
    """Exclusive ownership of a node directory, held for the daemon's life."""

    def __init__(self, node_dir: Path):
        self.node_dir = node_dir
        make_dir(node_dir, DIR_MODE, "the node directory")
        check_owned(node_dir)
        os.chmod(node_dir, DIR_MODE)
        self._lock = DirLock(
            node_dir,
            f"another kvpool daemon is running in {node_dir}; stop it or use another --name",
        )

    @property
    def fd(self) -> int:
        """The node directory's descriptor: its files are opened relative to it."""
        return self._lock.fd

    def release(self) -> None:
        self._lock.release()


class Arena:
    """A mapped shared-memory file of ``num_bytes`` (a multiple of the page size)."""

    def __init__(
        self,
        path: Path,
        num_bytes: int,
        *,
        hugepages: bool = False,
        fresh: bool = False,
        dir_fd: int | None = None,
    ):
        """``dir_fd``: the node directory's descriptor, which ``path`` is opened relative
        to (its name only; None: by ``path``)."""
        self.path = path
        self.num_bytes = round_up(num_bytes, PAGE_BYTES)
        self.arena_id = secrets.token_bytes(16)
        file_bytes = self.num_bytes + HEADER_BYTES
        self.is_kept = False
        self._dir_fd = dir_fd
        self._name = path.name if dir_fd is not None else str(path)
        # The caller holds the node directory lock: what is here was left by an earlier daemon.
        size = self._size()
        if size is not None and (fresh or size not in (self.num_bytes, file_bytes)):
            # Replaced (asked for, or another size): room for the new one counting the old
            # one's, checked before the old one goes.
            _check_free_space(path.parent, file_bytes - size)
            self._unlink()
            size = None
        self.is_kept = size is not None
        self._kept_bytes = size or 0
        if not self.is_kept:
            _check_free_space(path.parent, file_bytes)
        fd = open_in(dir_fd, self._name, os.O_RDWR | os.O_CREAT, ARENA_MODE)
        # What the header said (checked before a byte changes: a refused arena stays whole);
        # None for a new arena.
        try:
            self.found = _read_stamp(fd, self.num_bytes, path) if self.is_kept else None
        except BaseException:
            os.close(fd)
            raise
        try:
            try:
                if not self.is_kept:
                    os.fchmod(fd, ARENA_MODE)
                    os.posix_fallocate(fd, 0, file_bytes)
                elif not _is_allocated(fd, self._kept_bytes):
                    # Its blocks' memory, within the length it has (the header page of an
                    # arena of the previous format is added by commit()).
                    os.posix_fallocate(fd, 0, self._kept_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ConfigError(
                        f"cannot allocate a {format_size(self.num_bytes)} arena in "
                        f"{path.parent}: {exc.strerror}. Lower --memory or grow /dev/shm."
                    ) from exc
                raise
            if self.found is None:
                _write_header(fd, self.num_bytes)
            self._mmap = map_shared(fd, self.num_bytes)
            if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
                with contextlib.suppress(OSError):
                    self._mmap.madvise(mmap.MADV_HUGEPAGE)
            stat = os.fstat(fd)
            self.dev, self.ino = stat.st_dev, stat.st_ino
        except BaseException:
            os.close(fd)
            if not self.is_kept:
                self._unlink()
            raise
        self._fd = fd
        self.view = memoryview(self._mmap)

    def commit(self) -> None:
        """Once every check of the start has passed: stamp a kept arena with this release's
        format (migrating it in place, O(1): the header page added and written), and give
        it the arena's mode."""
        if not self.is_kept:
            return
        os.fchmod(self._fd, ARENA_MODE)
        if self._kept_bytes < self.num_bytes + HEADER_BYTES:
            os.posix_fallocate(self._fd, self.num_bytes, HEADER_BYTES)
        if self.found != Stamp(ARENA.version, RELEASE):
            _write_header(self._fd, self.num_bytes)

    def _size(self) -> int | None:
        """The size of the file there now, if there is one."""
        try:
            return os.stat(self._name, dir_fd=self._dir_fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            return None

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._name, dir_fd=self._dir_fd)

    def slice(self, offset: int, num_bytes: int) -> memoryview:
        return self.view[offset : offset + num_bytes]

    def close(self, *, remove: bool = False) -> None:
        """Unmap the arena; with ``remove``, delete its file too."""
        if self._fd < 0:
            return
        self.view.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()
        os.close(self._fd)
        self._fd = -1
        if remove:
            self._unlink()


def _read_stamp(fd: int, num_bytes: int, path: Path) -> Stamp:
    """The format of the arena open at ``fd`` (``path``, of ``num_bytes`` without its
    header): the header page's, or the previous format's where there is none (the file is
    exactly ``num_bytes``, or its header page was added and not yet written: all zeros)."""
    header = os.pread(fd, STAMP_BYTES + HEADER_SIZE.size, num_bytes)
    if len(header) < STAMP_BYTES + HEADER_SIZE.size or not any(header):
        return Stamp(1, "")  # the previous format's: no header
    stamp = unpack_stamp(header, HEADER_MAGIC, ARENA, path)
    (size,) = HEADER_SIZE.unpack_from(header, STAMP_BYTES)
    if size != num_bytes:
        raise ARENA.damaged(path, f"header (it says {size} bytes, the file holds {num_bytes})")
    return stamp


def _write_header(fd: int, num_bytes: int) -> None:
    """Stamp the arena (its last page) with this release's format."""
    header = pack_stamp(HEADER_MAGIC, ARENA.version) + HEADER_SIZE.pack(num_bytes)
    os.pwrite(fd, header, num_bytes)


def _is_allocated(fd: int, num_bytes: int) -> bool:
    """Whether every byte of the file is backed by memory already (an arena a daemon
    allocated whole before): then a restart need not allocate it again (a quarter of a
    second for 8 GiB)."""
    return os.fstat(fd).st_blocks * 512 >= num_bytes


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_free_space(directory: Path, num_bytes: int) -> None:
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if num_bytes > free:
        raise ConfigError(
            f"cannot get a {format_size(num_bytes)} arena: {directory} has only "
            f"{format_size(free)} free. Lower --memory or grow /dev/shm."
        )
