"""ComfyUI's websocket door: ``/ws?clientId=...``, what a ComfyUI client listens on.

asgi.py sends a websocket here when its URL carries ``clientId`` (ours
never does), after the same handshake checks as our own (Host, token,
Origin, the core's refusal of one more client: front_door.py). A
:class:`ComfyConnection` is a :class:`~omni_stream.server.websocket.ClientConnection`
(one client of the core, its bounded outbox, closed with 1001 at shutdown)
that differs in two ways:

- it does not take requests: a ComfyUI client posts them over HTTP
  (``POST /prompt`` with its ``client_id``); what it sends here is read
  and dropped, within its principal's rate;
- its writer turns each message of the prompts it watches into ComfyUI's
  frames (``omni_stream.comfyui.messages``: JSON messages, binary
  previews), one outbox item at a time, each item's frames within
  ``send_timeout_s``; a client that stops reading is closed (1008) as on
  our own websocket, and a slow one gets the latest progress and preview.

Which prompts it watches: its principal's (:class:`ComfySockets` keys the
open ones by owner and ``clientId``) posted with its ``clientId``, those
posted while it is open and those still running when it connects (a
client that posts first and connects after, as comfy-api-simplified does,
hears the rest of its prompt, from its latest progress and preview).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.websockets import WebSocket

from ..comfyui import PromptBook, Translator, status
from ..core.outbox import Outgoing
from ..core.principal import Principal
from .websocket import ClientConnection

if TYPE_CHECKING:
    from ..core.rules import Rules
    from .service import Service

__all__ = ["ComfyConnection", "ComfySockets"]

logger = logging.getLogger("omni_stream.server")

#: The longest clientId kept (ComfyUI's are uuid4 strings).
MAX_CLIENT_ID = 128


class ComfySockets:
    """The open ComfyUI websockets, by owner (principal key) and clientId."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], dict[str, ComfyConnection]] = {}

    def add(self, conn: ComfyConnection) -> None:
        self._open.setdefault((conn.owner, conn.client_id), {})[conn.id] = conn

    def remove(self, conn: ComfyConnection) -> None:
        key = (conn.owner, conn.client_id)
        found = self._open.get(key)
        if found is not None:
            found.pop(conn.id, None)
            if not found:
                del self._open[key]

    def of(self, owner: str, client_id: str | None) -> list[ComfyConnection]:
        if client_id is None:
            return []
        return list(self._open.get((owner, client_id), {}).values())


class ComfyConnection(ClientConnection):
    """One ComfyUI websocket (see the module docstring).

    ``owner``: the principal key its prompts are posted under (its token's
    name, else its address: what ``POST /prompt`` calls them); ``client_id``:
    its ``clientId``. It registers itself with ``sockets`` and watches its
    running prompts of ``book`` once :meth:`run` starts.
    """

    def __init__(
        self,
        ws: WebSocket,
        *,
        rules: Rules,
        service: Service,
        principal: Principal,
        owner: str,
        client_id: str,
        book: PromptBook,
        sockets: ComfySockets,
    ) -> None:
        super().__init__(ws, rules=rules, service=service, principal=principal)
        self.owner = owner
        self.client_id = client_id[:MAX_CLIENT_ID]
        self._book = book
        self._sockets = sockets
        self._translator = Translator(book.plan, self._remaining)

    def _remaining(self) -> int:
        return self._book.remaining(self.owner)

    async def run(self) -> None:
        self._sockets.add(self)
        for prompt in self._book.running(self.owner, self.client_id):
            prompt.record.watch(self.id, self.outbox, attached=False)
        try:
            await super().run()
        finally:
            self._sockets.remove(self)

    async def _handle(self, data: str | bytes) -> None:
        # ComfyUI's frontend may send a few messages (its feature flags): nothing a client
        # says here changes what it hears, so each is dropped (read at its principal's rate).
        return

    def _greeting(self) -> list[str | bytes]:
        # ComfyUI's first message: the queue, and the client's id.
        return [status(self._remaining(), sid=self.client_id)]

    def _frames(self, message: Outgoing) -> list[str | bytes]:
        # ComfyUI's messages and binary previews, from the typed message's fields (the writer,
        # its bounds and latest-wins are our websocket's: websocket.py).
        return list(self._translator.frames(message))
