"""Retention hints: how long an application wants a prefix kept, in TensorRT-LLM's terms.

A hint names token ranges of a request, each with a *priority* from 0 to 100 and an
optional *duration*:

- the node evicts lower priorities first (``DEFAULT_PRIORITY`` is every unhinted block's),
  and within one priority the least recently used first, a prefix's leaves before its root;
- once its duration has passed a block reverts to the default priority, as if last used
  then (no duration: until it leaves the node);
- a block takes the highest priority of the ranges that overlap it (and the session's);
- a *session* (``session_id``) keeps its newest prefix at ``SESSION_PRIORITY`` for
  ``session_s`` (at most ``MAX_DURATION_S``): an agent's context between tool calls, a
  conversation between turns.

Hints are advisory: what a tenant may hold above the default priority is an account of the
tenant ledger (:class:`kvpool.store.accounts.Resource` ``RETAINED_BYTES``), and a block past
it stays at the default priority (the refusal is counted).  Memory pressure still evicts:
when every block is above the default, the lowest go first.  Hints are not journaled: a
restarted node holds every block at the default priority.

The engines' connectors read hints from a request's ``kv_transfer_params``::

    {"kvpool_retention": {"ranges": [{"start": 0, "end": 4096, "priority": 90,
                                       "duration_s": 600}],
                          "session_id": "chat-42", "session_s": 300}}

and the SDK takes them as :meth:`kvpool.Client.retain` (a priority for keys held now).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.errors import ConfigError

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default: unhinted blocks
SESSION_PRIORITY = 60  # a session's newest prefix, for session_s
DEFAULT_SESSION_S = 300.0
MAX_DURATION_S = 24 * 3600.0  # the longest a hint may keep a block above the default
MAX_RANGES = 64  # per request
PARAMS_KEY = "kvpool_retention"  # in a request's kv_transfer_params


@dataclass(frozen=True)
class TokenRange:
    """Tokens ``start`` to ``end`` (exclusive; None: to the end) at ``priority``, for
    ``duration_s`` (0: until the block leaves)."""

    start: int
    end: int | None
    priority: int
    duration_s: float = 0.0


@dataclass(frozen=True)
class Hint:
    """A request's retention hint."""

    ranges: tuple[TokenRange, ...] = ()
    session_id: str = ""
    session_s: float = DEFAULT_SESSION_S

    def block_priorities(self, first: int, last: int, block_size: int) -> list[tuple[int, float]]:
        """Per block ``first`` to ``last`` (exclusive), its ``(priority, duration_s)``:
        the highest of the ranges that overlap it and the session's; where none does, the
        default (duration 0)."""
        out = []
        for i in range(first, last):
            begin, end = i * block_size, (i + 1) * block_size
            best: tuple[int, float] | None = None
            if self.session_id:
                best = (SESSION_PRIORITY, self.session_s)
            for r in self.ranges:
                overlaps = r.start < end and (r.end is None or r.end > begin)
                if overlaps and (best is None or r.priority > best[0]):
                    best = (r.priority, r.duration_s)
            out.append(best if best is not None else (DEFAULT_PRIORITY, 0.0))
        return out


def by_hint(
    keys: Sequence[bytes], hints: Sequence[tuple[int, float]]
) -> dict[tuple[int, float], list[bytes]]:
    """The keys of each ``(priority, duration_s)`` other than the default: one retention
    request each."""
    out: dict[tuple[int, float], list[bytes]] = {}
    for key, hint in zip(keys, hints, strict=True):
        if hint[0] != DEFAULT_PRIORITY:
            out.setdefault(hint, []).append(key)
    return out


def check_priority(priority: int) -> int:
    if not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ConfigError(f"a retention priority is an integer {MIN_PRIORITY}-{MAX_PRIORITY}")
    return priority


def check_duration(duration_s: float) -> float:
    if not isinstance(duration_s, int | float) or not 0 <= duration_s <= MAX_DURATION_S:
        raise ConfigError(f"a retention duration is 0 to {MAX_DURATION_S:g} seconds")
    return float(duration_s)


def hint_from(params: Mapping[str, object] | None) -> Hint | None:
    """The hint in a request's ``kv_transfer_params`` (None: none).  A malformed hint
    raises ConfigError (the connector logs it and treats the request as unhinted)."""
    if not params or PARAMS_KEY not in params:
        return None
    raw = params[PARAMS_KEY]
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{PARAMS_KEY} is an object")
    ranges = raw.get("ranges", ())
    if not isinstance(ranges, Sequence) or len(ranges) > MAX_RANGES:
        raise ConfigError(f"{PARAMS_KEY}.ranges is a list of at most {MAX_RANGES}")
    parsed = []
    for r in ranges:
        if not isinstance(r, Mapping):
            raise ConfigError(f"{PARAMS_KEY}.ranges holds objects")
        start, end = r.get("start", 0), r.get("end")
        if (
            not isinstance(start, int)
            or start < 0
            or (end is not None and not isinstance(end, int))
        ):
            raise ConfigError(f"{PARAMS_KEY}: a range's start and end are token indices")
        priority = check_priority(r.get("priority", DEFAULT_PRIORITY))
        duration = check_duration(r.get("duration_s", 0.0))
        parsed.append(TokenRange(start, end, priority, duration))
    session_id = raw.get("session_id", "")
    if not isinstance(session_id, str) or len(session_id) > 256:
        raise ConfigError(f"{PARAMS_KEY}.session_id is a string of at most 256 characters")
    session_s = check_duration(raw.get("session_s", DEFAULT_SESSION_S))
    return Hint(tuple(parsed), session_id, session_s)


def as_params(hint: Hint) -> dict[str, object]:
    """``hint`` as ``kv_transfer_params`` carry it (what a router or a client sends)."""
    body: dict[str, object] = {
        "ranges": [
            {"start": r.start, "end": r.end, "priority": r.priority, "duration_s": r.duration_s}
            for r in hint.ranges
        ]
    }
    if hint.session_id:
        body["session_id"] = hint.session_id
        body["session_s"] = hint.session_s
    return {PARAMS_KEY: body}
