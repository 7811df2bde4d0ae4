"""Shared memory between memkv's processes on one host: segments, who owns them, and
their reclamation when an owner dies (the wing every shared-memory segment moves to)."""
