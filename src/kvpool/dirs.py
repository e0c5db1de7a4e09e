"""Directories a daemon keeps its files in (the run directory, the disk tier's), checked and
locked the same way wherever they are, whoever runs the daemon (root included).

- :func:`check_owned`: the directory must be the daemon's user's, and nobody the daemon
  does not trust may rename anything on the way to it: every directory above it, up to
  ``/`` (and up to ``/`` from where its symbolic links lead), must be root's or the
  daemon's user's, and not writable by others, nor by a group other than the daemon's,
  unless it is sticky (``/dev/shm``, ``/tmp``: there only an entry's owner may rename it).
  Otherwise another local user could rename the directory away and put one of theirs in
  its place (a socket of theirs where clients look for the node's, a disk directory that
  receives the tenants' blocks).  A ``private`` directory may be written by nobody else
  at all.
- :class:`DirLock`: an exclusive ``flock`` on the directory, held for the daemon's life,
  so that two daemons never share one; a directory somebody holds is refused.  Its
  descriptor (:attr:`DirLock.fd`) is what the daemon opens its files relative to
  (:func:`open_in`, ``O_NOFOLLOW``): a directory renamed or swapped under a running
  daemon, or a symbolic link planted in it, never redirects what it writes.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvpool.errors import ConfigError


def make_dir(path: Path, mode: int, what: str) -> None:
    """Create ``path`` (and its parents) if missing; a directory this user may not create
    stops the start with a message, not a traceback (a Kubernetes hostPath the kubelet made
    root's, where a daemon running as another user can create nothing)."""
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except PermissionError as exc:
        raise ConfigError(
            f"cannot create {what} {path}: {exc.strerror} (this daemon runs as uid "
            f"{os.geteuid()}): make {exc.filename or path.parent} this user's first (the "
            "Kubernetes DaemonSet's init container does), or choose another directory"
        ) from exc


def check_owned(path: Path, *, private: bool = False) -> None:
    """Refuse a directory another user owns or may swap (see the module docstring); with
    ``private``, also one its group or others may write in."""
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid != me:
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
    _check_writers(path, st)
    absolute = Path(os.path.abspath(path))
    _check_ancestors(absolute, follow=False)
    _check_ancestors(Path(os.path.realpath(path)), follow=True)


def _check_ancestors(path: Path, *, follow: bool) -> None:
    """Every directory above ``path`` (``follow``: as the kernel resolves it; else as
    written, where a symbolic link's own directory is what may swap it, and its target is
    checked by the resolved walk)."""
    for ancestor in path.parents:
        st = os.stat(ancestor) if follow else os.lstat(ancestor)
        if stat.S_ISLNK(st.st_mode):
            continue
        if st.st_uid not in (0, os.geteuid()):
            raise ConfigError(
                f"{ancestor}, above a directory of this daemon, belongs to uid {st.st_uid}: "
                "that user could rename the daemon's directory away and put one of theirs "
                "in its place; choose a directory under ones root or this user owns"
            )
        _check_writers(ancestor, st)


def _check_writers(path: Path, st: os.stat_result) -> None:
    """Refuse a directory in which someone the daemon does not trust may rename entries:
    writable by others, or by a group not the daemon's, without the sticky bit."""
    if st.st_mode & stat.S_ISVTX:
        return
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()):
        raise ConfigError(
            f"{path} may be written by others (mode {st.st_mode & 0o7777:o}, group "
            f"{st.st_gid}) without the sticky bit: they could rename the daemon's directory "
            "away and put one of theirs in its place; chmod o-w (or +t) it, or choose "
            "another directory"
        )


def open_in(dir_fd: int | None, name: str, flags: int, mode: int = 0o600) -> int:
    """Open ``name`` in the directory ``dir_fd`` (None: ``name`` is a path), never through
    a symbolic link."""
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)


class DirLock:
    """Exclusive ownership of a directory (``flock``), until :meth:`release`."""

    def __init__(self, path: Path, busy: str):
        """``busy``: the error's text when another process holds the directory."""
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise ConfigError(busy) from None

    @property
    def fd(self) -> int:
        """The directory's descriptor: open its files relative to it (:func:`open_in`)."""
        return self._fd

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
