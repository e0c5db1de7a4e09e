"""Per-namespace statistics of a store: blocks, bytes, hits, misses and puts, and the
human-readable label a client gave the namespace.

The table is bounded: past ``MAX_NAMESPACES`` rows, further namespaces are counted together
in one row (``(other namespaces)``), so that no client can grow it without bound; a lookup
never adds a row.  A tenant's namespaces (they start with its tag, :mod:`kvpool.tenants`)
take at most ``MAX_NAMESPACES_PER_TAG`` rows, so that one tenant's DESCRIBE calls cannot
fill the table and empty every other tenant's labels and statistics.

A label is printable text (:func:`is_label`): no control characters, no escape sequences,
so that whatever shows it (a terminal, a page) shows the characters and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from kvpool.errors import BadRequest
from kvpool.keys import MIN_COLUMN_KEYS, NAMESPACE_ID_BYTES, namespace_of
from kvpool.stats import NamespaceStats
from kvpool.store.index import KeyColumns, groups_by_prefix
from kvpool.tenants import TAG_BYTES

# Namespaces tracked one by one (each is a row in STATS and /metrics); past this, together.
MAX_NAMESPACES = 1024
MAX_NAMESPACES_PER_TAG = 128  # namespaces with one tenant tag (a tenant's)
OTHER_NAMESPACE = b"\xff" * 16


def is_label(text: str) -> bool:
    """Whether ``text`` may be a namespace's label: printable characters only (no control
    characters: an ESC would reach an operator's terminal as a command)."""
    return text.isprintable()


class NamespaceTable:
    def __init__(self) -> None:
        self.rows: dict[bytes, NamespaceStats] = {}
        self._rows_per_tag: dict[bytes, int] = {}

    def _has_room(self, ns: bytes) -> bool:
        return (
            len(self.rows) < MAX_NAMESPACES
            and self._rows_per_tag.get(ns[:TAG_BYTES], 0) < MAX_NAMESPACES_PER_TAG
        )

    def _add_row(self, ns: bytes) -> NamespaceStats:
        usage = self.rows[ns] = NamespaceStats(namespace_id=ns.hex())
        tag = ns[:TAG_BYTES]
        self._rows_per_tag[tag] = self._rows_per_tag.get(tag, 0) + 1
        return usage

    def _drop_row(self, ns: bytes) -> None:
        del self.rows[ns]
        tag = ns[:TAG_BYTES]
        left = self._rows_per_tag.pop(tag, 1) - 1
        if left:
            self._rows_per_tag[tag] = left

    def __iter__(self) -> Iterator[NamespaceStats]:
        return iter(self.rows.values())

    def added(self, key: bytes, size: int) -> None:
        usage = self._row(namespace_of(key))
        usage.num_blocks += 1
        usage.used_bytes += size
        usage.puts += 1

    def added_many(self, columns: KeyColumns, sizes: np.ndarray) -> None:
        """:meth:`added` of a commit's blocks, a row at a time."""
        if len(columns) < MIN_COLUMN_KEYS or columns.rows is None:
            for key, size in zip(columns.keys, sizes.tolist(), strict=True):
                self.added(key, size)
            return
        for ns, members in groups_by_prefix(columns.rows, NAMESPACE_ID_BYTES):
            usage = self._row(ns)
            usage.num_blocks += len(members)
            usage.used_bytes += int(sizes[members].sum())
            usage.puts += len(members)

    def adopted(self, totals: Iterable[tuple[bytes, tuple[int, int]]]) -> None:
        """Count the blocks adopted at a warm restart (as :meth:`added`, with no puts), as
        ``(namespace id, (blocks, bytes))`` summed per namespace: they are millions, the
        rows few."""
        for ns, (num_blocks, num_bytes) in totals:
            usage = self._row(ns)
            usage.num_blocks += num_blocks
            usage.used_bytes += num_bytes

    def removed(self, key: bytes, size: int) -> None:
        ns = namespace_of(key)
        if ns not in self.rows:
            ns = OTHER_NAMESPACE
        usage = self.rows[ns]
        usage.num_blocks -= 1
        usage.used_bytes -= size
        if not usage.num_blocks and not usage.label:
            self._drop_row(ns)  # nothing left to report

    def looked_up(self, keys: Sequence[bytes], num_found: int) -> None:
        # Only namespaces the node already knows: a lookup must not grow the table.
        usage = self.rows.get(namespace_of(keys[0])) if keys else None
        if usage is not None:
            usage.hits += num_found
            usage.misses += len(keys) - num_found

    def would_change(self, namespace_id: bytes, label: str) -> bool:
        """Whether :meth:`label` would change the namespace's label (a label that is not
        printable text is refused: :class:`BadRequest`)."""
        if not is_label(label):
            raise BadRequest("a namespace's label must be printable text")
        usage = self.rows.get(namespace_id)
        if usage is None:
            return self._has_room(namespace_id)
        return usage.label != label

    def label(self, namespace_id: bytes, label: str) -> bool:
        """Set a namespace's label; whether it changed."""
        if not is_label(label):
            raise BadRequest("a namespace's label must be printable text")
        usage = self.rows.get(namespace_id)
        if usage is None and self._has_room(namespace_id):
            usage = self._add_row(namespace_id)
        if usage is None or usage.label == label:
            return False
        usage.label = label
        return True

    def say_saving(self, namespace_id: bytes, saving: str) -> None:
        """When the namespace's engine saves, as it says (a row it has already)."""
        usage = self.rows.get(namespace_id)
        if usage is not None:
            usage.saving = saving

    def labels(self) -> dict[bytes, str]:
        return {ns: usage.label for ns, usage in self.rows.items() if usage.label}

    def reset_puts(self) -> None:
        for usage in self.rows.values():
            usage.puts = 0

    def _row(self, ns: bytes) -> NamespaceStats:
        usage = self.rows.get(ns)
        if usage is None:
            if not self._has_room(ns):
                ns = OTHER_NAMESPACE  # past a cap, the rest are counted together
                usage = self.rows.get(ns)
            if usage is None:
                usage = self._add_row(ns)
                if ns == OTHER_NAMESPACE:
                    usage.label = "(other namespaces)"
        return usage
