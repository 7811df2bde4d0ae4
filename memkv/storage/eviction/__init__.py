"""Which memory-tier block leaves first: horizon (the default), prefix-aware LRU-K, LRU.

Every policy tracks keys only (``BlockHash`` bytes in the store, ints in the
trace replay); the tier owns the bytes. A policy is told about every
``insert`` (a newly cached block, which counts as an access), ``access`` (a
hit), ``remove`` (gone for another reason), ``pin``/``unpin`` (refcounted; a
pinned key is never a victim) and chooses *and forgets* a victim in
``pop_victim``. Expected outcomes are return values (``None``: nothing can be
evicted); misuse raises :class:`~memkv.errors.InvalidInputError`.

:mod:`.policy` is the interface, :mod:`.lru` the baseline, :mod:`.horizon`
the default (O(1): the least likely to be read within the cache's horizon,
learned online), :mod:`.lru_k` the design article's policy (its docstring
derives the exact victim search; ~10x horizon's cost per access, and behind it
at small sizes of the Mooncake trace: ``memkv bench eviction``);
:func:`make_policy` builds one from an :class:`~memkv.storage.config.EvictionConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memkv.errors import ConfigError
from memkv.storage.config import EvictionConfig
from memkv.storage.eviction.horizon import HorizonPolicy
from memkv.storage.eviction.lru import LRUPolicy
from memkv.storage.eviction.lru_k import DEFAULT_GHOST_FLOOR, MIN_AGE, LRUKPolicy, lru_k_score
from memkv.storage.eviction.policy import EvictionPolicy

__all__ = [
    "DEFAULT_GHOST_FLOOR",
    "MIN_AGE",
    "POLICIES",
    "EvictionPolicy",
    "HorizonPolicy",
    "LRUKPolicy",
    "LRUPolicy",
    "lru_k_score",
    "make_policy",
]


def _make_lru(config: EvictionConfig) -> EvictionPolicy[Any]:
    return LRUPolicy()


def _make_horizon(config: EvictionConfig) -> EvictionPolicy[Any]:
    return HorizonPolicy()


def _make_lru_k(config: EvictionConfig) -> EvictionPolicy[Any]:
    return LRUKPolicy(
        config.k,
        prefix_aware=config.prefix_aware,
        recency_guard=config.recency_guard,
        inherit=config.inherit,
    )


#: Policy constructors by ``EvictionConfig.policy``.
POLICIES: dict[str, Callable[[EvictionConfig], EvictionPolicy[Any]]] = {
    "horizon": _make_horizon,
    "lru": _make_lru,
    "lru_k": _make_lru_k,
}


def make_policy(config: EvictionConfig) -> EvictionPolicy[Any]:
    """A fresh policy as ``config`` describes.

    Args:
        config: the eviction settings (policy name, ``k``, ``prefix_aware``).

    Returns:
        An empty policy.

    Raises:
        ConfigError: unknown policy name.

    Example:
        >>> make_policy(EvictionConfig(policy="lru")).pop_victim(0.0) is None
        True
    """
    factory = POLICIES.get(config.policy)
    if factory is None:
        raise ConfigError(
            f"unknown eviction policy {config.policy!r}; expected one of {sorted(POLICIES)}"
        )
    return factory(config)
