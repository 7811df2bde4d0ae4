"""Ray actors: thin ``@ray.remote`` shells around plain, separately tested classes.

* :mod:`memkv.actors.device` — :class:`DeviceCache`, one per device: hot + warm tiers.
* :mod:`memkv.actors.archive` — :class:`ArchiveService`, one per NVMe node: the cold tier.
* :mod:`memkv.actors.router` — the named ``SessionRouterActor`` around the plain
  :class:`~memkv.router.SessionRouter`: sessions, placement, hotness,
  priority, prefetch, recovery.
* :mod:`memkv.actors.handles` — typed handles over Ray actor handles: the members
  the router talks to (:mod:`memkv.protocol.members`) and the session service.
* :mod:`memkv.actors.router_shards` — :class:`RouterShards`, the client's view of a
  session table split across router shards (which shard owns a session; merged answers).
"""
