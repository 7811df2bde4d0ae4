"""Layouts as callers send them, parsed and checked once per distinct dict (the router's
hot path: every create names one)."""

from __future__ import annotations

from typing import Any

from memkv.protocol.layout import KVLayout

__all__ = ["LAYOUTS", "LayoutCache", "parse_layout"]


class LayoutCache:
    """Layouts as callers send them, each parsed and checked once.

    A fleet's sessions name a handful of layouts, and parsing one (checks and a
    fingerprint hash) was a tenth of the router's own work per create. The key
    holds each value's type beside it, so a value that compares equal to a
    valid one (``True`` for ``1``) is still parsed, and refused, on its own.
    """

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        self._parsed: dict[tuple[Any, ...], tuple[KVLayout, dict[str, Any]]] = {}

    def parse(self, layout: KVLayout | dict[str, Any]) -> tuple[KVLayout, dict[str, Any]]:
        """``(layout, its canonical dict)``; the dict is shared: never change it."""
        if isinstance(layout, KVLayout):
            return layout, layout.to_dict()
        try:
            key = tuple((k, type(v), v) for k, v in layout.items())
            hash(key)
        except (AttributeError, TypeError):  # not a dict, or unhashable values
            parsed = KVLayout.from_dict(layout)  # raises the error naming what is expected
            return parsed, parsed.to_dict()
        found = self._parsed.get(key)
        if found is None:
            parsed = KVLayout.from_dict(layout)
            if len(self._parsed) >= self._limit:
                self._parsed.clear()
            found = self._parsed[key] = (parsed, parsed.to_dict())
        return found


#: The router process's cache (layouts are few; one parse each).
LAYOUTS = LayoutCache()


def parse_layout(layout: KVLayout | dict[str, Any]) -> KVLayout:
    """A layout dict as :meth:`KVLayout.from_dict` reads it, parsed once per distinct dict."""
    return LAYOUTS.parse(layout)[0]
