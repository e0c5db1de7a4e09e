"""Directories a daemon keeps its files in (the run directory, the disk tier's), checked and
locked the same way wherever they are.

- :func:`check_owned`: a directory another local user owns is refused, never used (one
  created first to swap a socket or read what the daemon writes); a ``private`` one is
  also refused when its group or others may write in it.
- :class:`DirLock`: an exclusive ``flock`` on the directory, held for the daemon's life,
  so that two daemons never share one; a directory somebody holds is refused.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvpool.errors import ConfigError


def check_owned(path: Path, *, allow_root: bool = False, private: bool = False) -> None:
    """Refuse a directory another user owns (or, for root's, one anybody may rename entries
    in: world-writable without the sticky bit); with ``private``, one its group or others
    may write in."""
    st = os.stat(path)
    me = os.geteuid()
    owner_ok = st.st_uid == me or (allow_root and st.st_uid == 0)
    if st.st_uid == 0 and st.st_uid != me and st.st_mode & 0o002 and not st.st_mode & 0o1000:
        owner_ok = False
    if not owner_ok:
        raise ConfigError(
            f"{path} belongs to uid {st.st_uid}, not to this daemon's user ({me}): another "
            "user may have created it to take the daemon's files; remove it, or choose "
            "another directory"
        )
    if private and st.st_mode & 0o022:
        raise ConfigError(
            f"{path} may be written by its group or by others (mode {st.st_mode & 0o777:o}): "
            "they could plant or swap the daemon's files; chmod go-w it, or choose another "
            "directory"
        )


class DirLock:
    """Exclusive ownership of a directory (``flock``), until :meth:`release`."""

    def __init__(self, path: Path, busy: str):
        """``busy``: the error's text when another process holds the directory."""
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise ConfigError(busy) from None

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
