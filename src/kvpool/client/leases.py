"""The names under which ``Client.reserve`` and ``Client.acquire`` returned their results
before they became transactions (:mod:`kvpool.client.transactions`): a write lease is a
:class:`~kvpool.client.transactions.WriteTransaction`, a read lease a
:class:`~kvpool.client.transactions.ReadTransaction` (``release()`` is its ``end()``).
New code names the transactions."""

from .transactions import ReadTransaction as ReadLease
from .transactions import WriteTransaction as WriteLease

__all__ = ["ReadLease", "WriteLease"]
