"""The node's tiers below DRAM and the chain over them.

- :mod:`~kvpool.tiers.tier`: the :class:`~kvpool.tiers.tier.Tier` protocol, the KV-event
  sink the tiers report through, and other nodes as a read-only source.
- :mod:`~kvpool.tiers.disk`, :mod:`~kvpool.tiers.objects` (with :mod:`~kvpool.tiers.bucket`):
  the two tiers.
- :mod:`~kvpool.tiers.writeback`, :mod:`~kvpool.tiers.admission`: DRAM evictions on their
  way to disk.
- :mod:`~kvpool.tiers.chain`: lookups, the one promotion path, prefetches, statistics.
- :mod:`~kvpool.tiers.build`: the lower tiers built from a node's configuration.
"""
