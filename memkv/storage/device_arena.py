"""The hot tier's arena: one ``torch.empty`` buffer on a device (``cuda:N``, or ``cpu``),
or CUDA managed memory where unified memory is asked for.

Example:
    >>> with DeviceArena(capacity_bytes=1 << 20, min_unit_bytes=1 << 16) as arena:
    ...     a = arena.allocate(4096)
    ...     v = arena.write(a, torch.ones(1024))
    ...     float(arena.view(a, (1024,), torch.float32).sum())
    1024.0
"""

from __future__ import annotations

import torch

from memkv.errors import (
    InvalidInputError,
)
from memkv.storage.arena import Arena

__all__ = ["DeviceArena"]


class DeviceArena(Arena):
    """An arena in device memory: the hot tier.

    Args:
        capacity_bytes: bytes; a positive multiple of ``min_unit_bytes``.
        min_unit_bytes: the buddy unit (``AllocatorConfig.min_unit_bytes``).
        device: ``cuda:N`` on a GPU node, ``cpu`` where there is none.
        slab_classes_per_doubling: see :class:`Arena`.

    Raises:
        ConfigError: bad capacity or unit.
        InvalidInputError: ``device`` is not a torch device.
    """

    def __init__(
        self,
        capacity_bytes: int,
        min_unit_bytes: int,
        device: str | torch.device = "cpu",
        *,
        slab_classes_per_doubling: int | None = None,
        unified_memory: bool = False,
    ) -> None:
        self._validate(capacity_bytes, min_unit_bytes, slab_classes_per_doubling)
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidInputError(
                f"expected a torch device such as 'cpu' or 'cuda:0', got {device!r}: {e}"
            ) from e
        self._device = dev
        self._managed = None
        if unified_memory and dev.type == "cuda":
            # Managed memory preferring this device (memkv.gpu_kernels.unified).
            from memkv.gpu_kernels.unified import ManagedArena

            self._managed = ManagedArena(capacity_bytes, dev.index or 0)
            buffer = self._managed.tensor()
        else:
            buffer = torch.empty(capacity_bytes, dtype=torch.uint8, device=dev)
        super().__init__(buffer, min_unit_bytes, slab_classes_per_doubling)

    @property
    def device(self) -> torch.device:
        """Where the buffer lives."""
        return self._device

    def _release(self) -> None:
        # Dropping the buffer reference (done by close) is all there is: the
        # caching allocator gets the memory back once no view refers to it.
        # A managed arena is freed explicitly.
        if self._managed is not None:
            self._managed.close()
