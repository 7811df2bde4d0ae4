"""Start or join a Ray cluster and find or create memkv's actors.

>>> import memkv.cluster
>>> cluster = memkv.cluster.connect()          # doctest: +SKIP  (embedded local Ray)
>>> cluster = memkv.cluster.connect("auto")    # doctest: +SKIP  (join a running cluster)
"""

from memkv.cluster.connect import LOOPBACK_ENV, MemkvCluster, connect

__all__ = ["LOOPBACK_ENV", "MemkvCluster", "connect"]
