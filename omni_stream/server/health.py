"""``/health``'s answer: the engine's health, the server's load and counts, and one status.

:func:`health_payload` reads a running :class:`~omni_stream.server.service.Service`
(its engine's ``health()``, its rules' load and books) and says, in one
body, whether it can serve: ``ok`` (200), ``busy`` (200: a full server is
healthy, and a 503 would make a liveness probe restart it, killing the
work it is busy with), or ``not_started``, ``shutting_down``, ``dead``
(503), the engine's own counts under ``engine``. It reads and changes
nothing; the door that serves it (``asgi.py``) and the tests call it
through ``Service.health_payload``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.rules import NOT_STARTED

if TYPE_CHECKING:
    from .service import Service

__all__ = ["health_payload"]


def health_payload(service: Service) -> tuple[int, dict[str, Any]]:
    """``/health``: (HTTP status, body). 200 while it can serve, busy included."""
    rules = service.rules
    health = service.engine.health()
    payload = health.to_dict()
    load = rules.load(health)
    # One meaning for active and queued: the server's (load's), which
    # counts the requests waiting in the gate; the engine's own counts
    # (where requests sit inside it) are under "engine".
    engine_view = {"active": payload["active"], "queued": payload["queued"]}
    payload.update(active=load.active, queued=load.queued, engine=engine_view)
    payload["server"] = {
        "connections": len(rules.clients),
        "principals": len(rules.open_by_principal),
        "requests": len(service.registry.running()),
        "retained": len(service.registry.retained()),
    }
    payload["load"] = load.to_dict()
    if not service.started:
        # Mounted without its lifespan: a 200 here would be a zombie
        # that passes every probe and refuses every request.
        payload.update(status="not_started", ok=False, reason=NOT_STARTED)
    elif service.closing and health.ok:
        payload.update(status="shutting_down", ok=False, reason="the server is shutting down")
    elif health.ok and load.busy:
        # 200: a full server is healthy (a 503 would make a liveness
        # probe restart it, killing the work it is busy with).
        payload.update(
            status="busy",
            reason=f"the server holds {load.held} requests, max_active + max_queued; "
            "a generate gets error busy",
        )
        payload["load"]["retry_after_s"] = rules.retry_after(load)
    if service.fatal is not None and payload["ok"]:
        # A failed server task (stay_dead keeps the process up): not
        # able to serve, though the engine is.
        payload.update(status="dead", ok=False, reason=str(service.fatal))
    return (200 if payload["ok"] else 503), payload
