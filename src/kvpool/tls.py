"""TLS for every listener (the data port, the admin HTTP, the router) and for the clients
that reach them, on Python's :mod:`ssl` (OpenSSL): TLS 1.2 or later, certificate and key
files, and optionally client certificates (mutual TLS).

A :class:`CertFiles` keeps one server context and reloads the certificate and key into it
when the files change: new connections get the new certificate, open ones keep theirs.  A
CA file given for client certificates is re-read too; OpenSSL only ever adds CAs to a
context, so removing a CA takes a restart.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass

from kvpool.errors import ConfigError

log = logging.getLogger("kvpool.tls")


def _stamp(*paths: str) -> tuple[tuple[int, int], ...]:
    stamps = []
    for path in paths:
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        stamps.append((st.st_mtime_ns, st.st_size) if st is not None else (0, 0))
    return tuple(stamps)


@dataclass
class CertFiles:
    """A server's certificate, key and (for mutual TLS) the CA of its clients."""

    cert: str
    key: str
    client_ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.client_ca:
            self.context.verify_mode = ssl.CERT_REQUIRED
        self._stamp: tuple[tuple[int, int], ...] = ()
        self._load()

    def _load(self) -> None:
        try:
            self.context.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                self.context.load_verify_locations(self.client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS files {self.cert}, {self.key}: {exc}") from exc
        self._stamp = _stamp(self.cert, self.key, self.client_ca)

    def reload(self) -> bool:
        """Load the files again if they changed; whether they did.  Files that do not load
        (e.g. caught mid-rewrite) leave the last good ones in place until the next try."""
        if _stamp(self.cert, self.key, self.client_ca) == self._stamp:
            return False
        try:
            self._load()
        except ConfigError as exc:
            log.warning("TLS files not reloaded (the last good ones stay): %s", exc)
            return False
        log.info("TLS certificate reloaded from %s", self.cert)
        return True


def client_context(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext:
    """A client's context: the server is verified against ``ca`` (else the system's CAs),
    and ``cert``/``key`` are presented for mutual TLS."""
    try:
        context = ssl.create_default_context(cafile=ca or None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert or key:
            context.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS files ({ca or 'system CAs'}, {cert}): {exc}") from exc
    return context
