"""Start or join a Ray cluster and find or create memkv's actors.

>>> import memkv.cluster
>>> cluster = memkv.cluster.connect()          # doctest: +SKIP  (embedded local Ray)
>>> cluster = memkv.cluster.connect("auto")    # doctest: +SKIP  (join a running cluster)
>>> cluster = memkv.cluster.attach("auto")     # doctest: +SKIP  (a client: creates nothing)
"""

from memkv.cluster.connect import LOOPBACK_ENV, attach, connect
from memkv.cluster.memkv_cluster import MemkvCluster

__all__ = ["LOOPBACK_ENV", "MemkvCluster", "attach", "connect"]
