"""The node's tiers below DRAM and the chain over them.

- :mod:`~kvpool.tiers.tier`: the :class:`~kvpool.tiers.tier.Tier` protocol, the KV-event
  sink the tiers report through, and other nodes as a read-only source.
- :mod:`~kvpool.tiers.disk`, :mod:`~kvpool.tiers.objects` (with :mod:`~kvpool.tiers.bucket`):
  the two tiers.
- :mod:`~kvpool.tiers.writeback`, :mod:`~kvpool.tiers.admission`: DRAM evictions on their
  way to disk.
- :mod:`~kvpool.tiers.lower`: the lower tiers as one object (which holds a key, reading in
  order).
- :mod:`~kvpool.tiers.lookup`, :mod:`~kvpool.tiers.promotion`, :mod:`~kvpool.tiers.reads`,
  :mod:`~kvpool.tiers.prefetch`: lookups, the one promotion path, a read across the tiers
  (below DRAM included), prefetches.
- :mod:`~kvpool.tiers.chain`: :class:`~kvpool.tiers.chain.Tiers`, the facade the node uses
  over them; deletes, the tenants' shares of the lower tiers, statistics.
- :mod:`~kvpool.tiers.build`: the lower tiers built from a node's configuration.
"""
