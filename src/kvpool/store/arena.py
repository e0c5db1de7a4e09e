"""The DRAM arena: one fixed-size, page-aligned file under /dev/shm, mapped by the daemon
and by every client on the same host.

Rules:
- The node directory holding the arena and the Unix socket is created ``0o770`` and the
  arena ``0o660``: only the daemon's user and group can map it.
- The daemon holds an exclusive ``flock`` on the node directory for its whole life.  At
  start, an arena or socket left in a directory nobody holds is stale (a crashed daemon)
  and is reclaimed; a directory somebody holds is refused.
- The whole size is allocated up front (``posix_fallocate``): a size the host cannot give
  is refused at start with a clear message, never discovered later as a SIGBUS.
- ``close()`` unmaps and removes the arena.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
from pathlib import Path

from kvpool.config import PAGE_BYTES, format_size
from kvpool.errors import ConfigError

ARENA_MODE = 0o660
DIR_MODE = 0o770


class NodeDirLock:
    """Exclusive ownership of a node directory, held for the daemon's life."""

    def __init__(self, node_dir: Path):
        self.node_dir = node_dir
        node_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):
            os.chmod(node_dir, DIR_MODE)
        self._fd = os.open(node_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ConfigError(
                f"another kvpool daemon is running in {node_dir}; stop it or use another --name"
            ) from None

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


class Arena:
    """A mapped shared-memory file of ``num_bytes`` (a multiple of the page size)."""

    def __init__(self, path: Path, num_bytes: int, *, hugepages: bool = False):
        self.path = path
        self.num_bytes = round_up(num_bytes, PAGE_BYTES)
        self.arena_id = secrets.token_bytes(16)
        if path.exists():
            path.unlink()  # stale: the caller holds the node directory lock
        _check_free_space(path.parent, self.num_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, ARENA_MODE)
        try:
            os.fchmod(fd, ARENA_MODE)
            try:
                os.posix_fallocate(fd, 0, self.num_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ConfigError(
                        f"cannot allocate a {format_size(self.num_bytes)} arena in "
                        f"{path.parent}: {exc.strerror}. Lower --memory or grow /dev/shm."
                    ) from exc
                raise
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, self.num_bytes, flags)
            if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
                with contextlib.suppress(OSError):
                    self._mmap.madvise(mmap.MADV_HUGEPAGE)
            stat = os.fstat(fd)
            self.dev, self.ino = stat.st_dev, stat.st_ino
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd = fd
        self.view = memoryview(self._mmap)

    def slice(self, offset: int, num_bytes: int) -> memoryview:
        return self.view[offset : offset + num_bytes]

    def close(self) -> None:
        """Unmap and remove the arena file."""
        if self._fd < 0:
            return
        self.view.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()
        os.close(self._fd)
        self._fd = -1
        self.path.unlink(missing_ok=True)


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
