"""The archive process's wing: the cold tier's service over segment files
(:mod:`.service`) and the router journal replicas it keeps (:mod:`.journal_replica`).
No Ray: the actor (memkv.actors.archive) is a shell over it."""
