"""The session router's logic, in plain classes (no Ray): the table
(:mod:`.state`), the devices and their recovery (:mod:`.members`), the
archives and garbage (:mod:`.collector`), the other shards (:mod:`.peers`),
the append path (:mod:`.appends`), background prefetch (:mod:`.background`)
and the service that ties them together (:mod:`.service`)."""

from memkv.router.service import SessionRouter
from memkv.router.state import RouterState

__all__ = ["RouterState", "SessionRouter"]
