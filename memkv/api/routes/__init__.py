"""The gateway's routes, one module per resource; :func:`memkv.api.app.create_app`
includes every router.

* :mod:`.health` — ``/healthz``, ``/readyz``, ``/metrics``, the status page.
* :mod:`.sessions` — the session lifecycle under ``/v1/sessions``.
* :mod:`.appends` — ``POST /v1/sessions/{id}/turns`` (also the block port's appends).
* :mod:`.reads` — a session's blocks, and blocks by key.
* :mod:`.leases` — same-host block leases.
* :mod:`.cluster` — ``/v1/match`` and ``/v1/stats``.
"""
