"""One contract, every eviction policy (as foyer runs one suite over every algorithm).

Each check below states a rule of :class:`~kvpool.store.eviction.EvictionPolicy`'s
docstring and runs on every policy a node can name (``NAME_TO_POLICY``), bare and inside
each wrapper the store puts around it (:class:`~kvpool.store.retention.Retention`,
:class:`~kvpool.store.holds.QueueAwareEviction`).  The last test runs the same checks on
policies broken on purpose, so that each check is seen to fail where its rule is broken.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.retention import DEFAULT_PRIORITY
from kvpool.store.eviction import Allowed, EvictionPolicy, LRUPolicy
from kvpool.store.holds import Holds, QueueAwareEviction
from kvpool.store.leases import LeaseLedger
from kvpool.store.policies import NAME_TO_POLICY, new_policy
from kvpool.store.retention import Retention

NUM_SLOTS = 256
PAGE = 4096


def key_of(slot: int) -> bytes:
    return b"\x00" * 16 + slot.to_bytes(8, "big")


def bare(name: str) -> EvictionPolicy:
    return new_policy(name)


def retained(name: str) -> EvictionPolicy:
    return Retention(new_policy(name))


def queue_aware(name: str) -> EvictionPolicy:
    return QueueAwareEviction(new_policy(name), Holds(1 << 30, LeaseLedger()))


WRAPPERS: dict[str, Callable[[str], EvictionPolicy]] = {
    "bare": bare,
    "retention": retained,
    "holds": queue_aware,
}
CASES = [(name, wrap) for name in sorted(NAME_TO_POLICY) for wrap in WRAPPERS]


def bound(policy: EvictionPolicy) -> EvictionPolicy:
    policy.bind(NUM_SLOTS, key_of)
    return policy


def drain(policy: EvictionPolicy, allowed: Allowed | None = None) -> list[int]:
    """Evict every candidate one pass offers (the caller removes and forgets each)."""
    evicted = []
    for slot in policy.victims(allowed):
        evicted.append(slot)
        policy.remove(slot)
        policy.forget(slot)
    return evicted


def kept_pass(policy: EvictionPolicy, limit: int = 10 * NUM_SLOTS) -> list[int]:
    """One pass whose every candidate is kept (a queued request holds it)."""
    return list(itertools.islice(policy.victims(), limit))


# -- the checks: each takes a bound policy ----------------------------------------------


def check_victims_are_only_what_is_held(policy: EvictionPolicy) -> None:
    touched = list(range(0, 60, 3))
    for slot in touched:
        policy.touch(slot)
    offered = kept_pass(policy)
    assert set(offered) <= set(touched)
    assert len(offered) == len(set(offered)), "a pass offered a slot twice"


def check_every_held_block_is_eventually_evictable(policy: EvictionPolicy) -> None:
    touched = list(range(40))
    policy.touch_many(np.array(touched[:20]))
    for slot in touched[20:]:
        policy.touch(slot)
    assert len(policy) == 40
    assert sorted(drain(policy)) == touched
    assert len(policy) == 0
    assert list(policy.victims()) == []


def check_a_removed_block_is_never_a_victim(policy: EvictionPolicy) -> None:
    for slot in range(50):
        policy.touch(slot)
    removed = {3, 7, 11}
    for slot in removed:
        policy.remove(slot)
    many = np.arange(20, 60)  # (MIN_COLUMN_KEYS or more: the columns' path)
    policy.remove_many(many)
    removed |= set(many.tolist())
    assert len(policy) == 50 - len(removed & set(range(50)))
    assert not removed & set(drain(policy))


def check_pinned_and_incomplete_blocks_are_skipped(policy: EvictionPolicy) -> None:
    # Incomplete (reserved, never committed): never touched.  Pinned: removed until its
    # last pin drops, then touched again.
    for slot in range(10):
        policy.touch(slot)
    policy.remove(4)  # pinned
    assert 4 not in kept_pass(policy)
    assert not set(range(10, NUM_SLOTS)) & set(kept_pass(policy))
    policy.touch(4)  # unpinned
    assert 4 in drain(policy)


def check_least_recently_used_first(policy: EvictionPolicy) -> None:
    # With nothing learned yet and no prefixes named, every policy is LRU.
    for slot in range(10):
        policy.touch(slot)
    policy.touch(3)  # read again
    assert drain(policy) == [0, 1, 2, 4, 5, 6, 7, 8, 9, 3]


def check_a_kept_candidate_goes_behind_the_others(policy: EvictionPolicy) -> None:
    for slot in range(10):
        policy.touch(slot)
    passing = policy.victims()
    assert next(passing) == 0  # kept: neither removed nor touched
    assert next(passing) == 1, "the kept candidate was offered again"
    passing.close()
    offered = kept_pass(policy)
    assert len(offered) == 10 and offered[-1] == 0
    assert len(kept_pass(policy)) == 10, "a pass of kept candidates did not end"


def check_removes_and_touches_during_a_pass(policy: EvictionPolicy) -> None:
    for slot in range(10):
        policy.touch(slot)
    offered = []
    for slot in policy.victims():
        offered.append(slot)
        policy.remove(slot)
        policy.forget(slot)
        if slot == 0:
            policy.remove(5)  # pinned meanwhile
            policy.touch(1)  # read meanwhile: the most recent now
    assert offered == [0, 2, 3, 4, 6, 7, 8, 9, 1]


def check_batches_are_their_slots_one_at_a_time(policy: EvictionPolicy) -> None:
    # Compared with a twin built by the same factory: ``touch_many`` and ``remove_many``
    # against single calls (the twin is attached by the caller as ``policy.twin``).
    twin = policy.twin  # type: ignore[attr-defined]
    rng = random.Random(3)
    for _ in range(200):
        slots = rng.sample(range(NUM_SLOTS), rng.randint(1, 60))
        if rng.random() < 0.6:
            for slot in slots:
                twin.touch(slot)
            policy.touch_many(np.array(slots, dtype=np.int64))
        else:
            for slot in slots:
                twin.remove(slot)
            policy.remove_many(np.array(slots, dtype=np.int64))
        assert len(policy) == len(twin)
    assert drain(policy) == drain(twin)


def check_tenants_keep_to_their_groups(policy: EvictionPolicy) -> None:
    for slot in range(20):
        policy.touch(slot)
    policy.regroup(lambda slot: slot % 2)
    policy.touch(20)
    policy.touch(21)
    assert drain(policy, lambda group: group == 1) == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21]
    policy.regroup(None)  # the groups merge, in their order
    assert drain(policy) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]


def check_recency_follows_the_touches(policy: EvictionPolicy) -> None:
    for slot in (5, 2, 9):
        policy.touch(slot)
    policy.touch(5)
    stamps = policy.recency(np.array([2, 9, 5])).tolist()
    assert stamps == sorted(stamps) and len(set(stamps)) == 3


def check_a_restart_adopts_its_blocks_in_order(policy: EvictionPolicy) -> None:
    order = np.array([7, 3, 30, 1, *range(40, 80)])
    policy.adopt(order)
    assert len(policy) == len(order)
    assert drain(policy) == order.tolist()


def check_a_forgotten_slot_is_a_new_block(policy: EvictionPolicy) -> None:
    for slot in range(5):
        policy.touch(slot)
    for slot in (0, 1):
        policy.remove(slot)
        policy.forget(slot)
    policy.link(2, 0)  # (a forgotten parent: nothing to follow)
    policy.touch(0)  # the slot reused by a new block
    assert drain(policy) == [2, 3, 4, 0]


def check_a_prefix_outlives_its_extensions(policy: EvictionPolicy) -> None:
    if not policy.follows_prefixes:
        return  # (the store calls ``link`` only for a policy that follows prefixes)
    for slot in range(6):
        policy.touch(slot)
    for child, parent in ((1, 0), (2, 1), (4, 3)):
        policy.link(child, parent)
    offered = drain(policy)
    assert offered.index(2) < offered.index(1) < offered.index(0)
    assert offered.index(4) < offered.index(3)
    assert sorted(offered) == list(range(6))


CHECKS = [
    check_victims_are_only_what_is_held,
    check_every_held_block_is_eventually_evictable,
    check_a_removed_block_is_never_a_victim,
    check_pinned_and_incomplete_blocks_are_skipped,
    check_least_recently_used_first,
    check_a_kept_candidate_goes_behind_the_others,
    check_removes_and_touches_during_a_pass,
    check_batches_are_their_slots_one_at_a_time,
    check_tenants_keep_to_their_groups,
    check_recency_follows_the_touches,
    check_a_restart_adopts_its_blocks_in_order,
    check_a_forgotten_slot_is_a_new_block,
    check_a_prefix_outlives_its_extensions,
]


def run_check(check: Callable[[EvictionPolicy], None], new: Callable[[], EvictionPolicy]) -> None:
    policy = bound(new())
    policy.twin = bound(new())  # type: ignore[attr-defined]
    check(policy)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__[len("check_") :])
@pytest.mark.parametrize(("name", "wrap"), CASES)
def test_every_policy_keeps_the_contract(check, name, wrap):
    run_check(check, lambda: WRAPPERS[wrap](name))


# -- the wrappers' own rules, around every policy ------------------------------------------


@pytest.mark.parametrize("name", sorted(NAME_TO_POLICY))
def test_retention_offers_low_priorities_first_and_high_ones_last(name):
    policy = bound(Retention(new_policy(name)))
    for slot in range(8):
        policy.touch(slot)
    assert policy.set_priority(2, DEFAULT_PRIORITY + 1, 0.0, PAGE, is_listed=True)
    assert policy.set_priority(6, DEFAULT_PRIORITY - 1, 0.0, PAGE, is_listed=True)
    assert drain(policy) == [6, 0, 1, 3, 4, 5, 7, 2]
    assert policy.num_retained == 0  # (each forgotten: back at the default)


@pytest.mark.parametrize("name", sorted(NAME_TO_POLICY))
def test_holds_keep_a_held_block_until_its_hold_ends(name):
    holds = Holds(1 << 30, LeaseLedger())
    policy = bound(QueueAwareEviction(new_policy(name), holds))
    for slot in range(6):
        policy.touch(slot)
    assert holds.hold(key_of(1), PAGE, 60.0, fetched=False)
    assert drain(policy) == [0, 2, 3, 4, 5]
    holds.read([key_of(1)])
    assert drain(policy) == [1]


# -- the checks fail where a rule is broken --------------------------------------------------


class ForgetsRemovals(LRUPolicy):
    """Breaks: a removed block is never a victim."""

    def remove(self, slot: int) -> None:
        pass

    def remove_many(self, slots: np.ndarray) -> None:
        pass


class MostRecentFirst(LRUPolicy):
    """Breaks: least recently used first (and a kept candidate goes behind the others)."""

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        order = list(super().victims(allowed))  # one kept pass: every slot once
        return iter(order[::-1])


class IgnoresGroups(LRUPolicy):
    """Breaks: a pass takes only from the groups it is allowed."""

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        return super().victims(None)


class BatchesBackwards(LRUPolicy):
    """Breaks: a batch is its slots one at a time, in order."""

    def touch_many(self, slots: np.ndarray) -> None:
        super().touch_many(slots[::-1])


class OffersTheUntouched(LRUPolicy):
    """Breaks: victims only from what is held (and pinned blocks skipped)."""

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        yield NUM_SLOTS - 1
        yield from super().victims(allowed)


BROKEN = [
    (ForgetsRemovals, check_a_removed_block_is_never_a_victim),
    (ForgetsRemovals, check_pinned_and_incomplete_blocks_are_skipped),
    (MostRecentFirst, check_least_recently_used_first),
    (MostRecentFirst, check_a_kept_candidate_goes_behind_the_others),
    (MostRecentFirst, check_a_restart_adopts_its_blocks_in_order),
    (IgnoresGroups, check_tenants_keep_to_their_groups),
    (BatchesBackwards, check_batches_are_their_slots_one_at_a_time),
    (OffersTheUntouched, check_victims_are_only_what_is_held),
    (OffersTheUntouched, check_pinned_and_incomplete_blocks_are_skipped),
]


@pytest.mark.parametrize(("broken", "check"), BROKEN, ids=lambda x: x.__name__)
def test_a_check_fails_on_a_policy_that_breaks_its_rule(broken, check):
    with pytest.raises(AssertionError):
        run_check(check, broken)
