"""What ``memkv demo`` runs: its settings, light to import (the CLI's option defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DemoSettings"]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """What the demo runs (the command-line options)."""

    sessions: int = 4
    turns: int = 3
    # An agent's system prompt with tool schemas runs to thousands of tokens.
    system_tokens: int = 2048
    user_tokens: int = 64
    new_tokens: int = 16
    block_tokens: int = 256
    seed: int = 0
    repeats: int = 3
    model: Path | None = None
    port: int = 0
