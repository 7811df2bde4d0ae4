"""A device's block store (:class:`DeviceService`) and what it keeps beside its pool:
read leases and its warm segment's ownership. No Ray: the actor is a shell over it."""

from memkv.device.service import DeviceService

__all__ = ["DeviceService"]
