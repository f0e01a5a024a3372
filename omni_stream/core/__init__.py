"""The server's rules, sans-I/O: one core that every door (websocket, HTTP, SSE) calls into.

No sockets, no event loop needed to drive it: the doors in
``omni_stream.server`` turn bytes into calls here and what the core
decides back into bytes. docs/design.md draws the core and its doors.

- :mod:`.principal`: who a client is (a token's name, a websocket
  connection, an HTTP client's address), decided once at the door.
- :mod:`.tokens`: named tokens and what each grants.
- :mod:`.origin`: the Origin and Host rules.
- :mod:`.limits`: every bound (``ServerLimits``), keyword or environment.
- :mod:`.rules`: the rules of docs/protocol.md and docs/http.md for every
  door, keyed on principals: admission, ownership, attach, cancel, rates,
  connections, fair shares.
- :mod:`.admission`: the checks a request passes before the engine;
  :mod:`.load` (``busy``, fair shares) and :mod:`.estimate` (its memory)
  beside it; :mod:`.inputs` (input images, from their header).
- :mod:`.gate`: at most ``max_active`` requests in the engine; who goes next.
- :mod:`.records`: each request's record, its watchers and its retention.
- :mod:`.outbox`: one client's bounded, latest-wins send queue.
- :mod:`.memory`: the process's memory bound (``max_memory_bytes``).
- :mod:`.rates`: token buckets (messages a second per principal).
- :mod:`.metrics`: the Prometheus metrics of one server.
"""
