"""What every settings model of :mod:`memkv.config` shares (no other config import)."""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict

__all__ = ["GIB", "MAX_PORT", "Frozen"]

GIB: Final = 1 << 30
MAX_PORT: Final = 65535


class Frozen(BaseModel):
    """A settings model: unknown keys refused, frozen once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
