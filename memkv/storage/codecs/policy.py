"""Which codec each tier uses, checked against the session's exactness rules."""

from __future__ import annotations

from typing import Literal

from memkv.errors import InvalidInputError
from memkv.storage.codecs.base import _check_bool
from memkv.storage.codecs.lossless import NoneCodec
from memkv.storage.codecs.registry import CODECS
from memkv.storage.config import CodecConfig

Tier = Literal["warm", "cold"]
_TIERS: tuple[Tier, ...] = ("warm", "cold")


class CodecPolicy:
    """Chooses the codec of a block by tier and use.

    Rules, in order:

    1. A block rewritten often (``update_count >= hot_update_threshold``) is
       stored with ``none``: it would be re-encoded before it paid back.
    2. Warm tier: ``config.warm_codec`` (lossless; ``none`` by default, since
       fp16 KV compresses by ~1.18x at best without loss).
    3. Cold tier, session offline: ``config.cold_lossy_codec`` (Delta+RL).
    4. Cold tier, history at least ``cold_min_turns_old`` turns old:
       ``config.cold_codec`` (zstd). Younger cold history uses the warm codec,
       since it is likely read back soon. The default of 0 sends all online
       cold history to ``cold_codec``; the design article's figure is 10.

    Args:
        config: the codec settings.
        cold_min_turns_old: see rule 4; defaults to ``config.cold_min_turns_old``.

    Raises:
        InvalidInputError: a configured codec name is unknown, or
            ``cold_min_turns_old`` is negative.
    """

    def __init__(self, config: CodecConfig, *, cold_min_turns_old: int | None = None) -> None:
        if cold_min_turns_old is None:
            cold_min_turns_old = config.cold_min_turns_old
        for field in ("warm_codec", "cold_codec", "cold_lossy_codec"):
            value = getattr(config, field)
            if value not in CODECS:
                raise InvalidInputError(
                    f"CodecConfig.{field} = {value!r}; expected one of {sorted(CODECS)}"
                )
        if not CODECS[config.warm_codec].lossless:
            raise InvalidInputError(
                f"CodecConfig.warm_codec must be lossless, got {config.warm_codec!r}"
            )
        _check_count("cold_min_turns_old", cold_min_turns_old)
        self._config = config
        self._cold_min_turns_old = cold_min_turns_old

    def choose(
        self, tier: Tier, *, update_count: int, offline: bool = False, turns_old: int = 0
    ) -> str:
        """The registry name of the codec for a block.

        Args:
            tier: ``"warm"`` or ``"cold"``.
            update_count: times the block was rewritten.
            offline: the session's user is offline (long idle).
            turns_old: turns since the block was written.

        Raises:
            InvalidInputError: unknown tier or a negative count.
        """
        if tier not in _TIERS:
            raise InvalidInputError(f"tier must be one of {list(_TIERS)}, got {tier!r}")
        _check_count("update_count", update_count)
        _check_count("turns_old", turns_old)
        _check_bool("offline", offline)
        cfg = self._config
        if update_count >= cfg.hot_update_threshold:
            return NoneCodec.name
        if tier == "warm":
            return cfg.warm_codec
        if offline:
            return cfg.cold_lossy_codec
        if turns_old >= self._cold_min_turns_old:
            return cfg.cold_codec
        return cfg.warm_codec


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{name} must be a non-negative int, got {value!r}")
