"""The Responses API over the response store (server/responses_store.py): the stored
response `previous_response_id` continues, the keeper that stores an answer when it
finishes, and GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items.

An unknown id is a 404 on the routes over stored responses, and a 422 naming the field as
`previous_response_id` (OpenAI answers 400 there: the request is what is wrong). Another API
key's response, or an expired one, is answered exactly as an unknown id (the store finds
nothing), so a key holder who learns an id cannot tell that it exists."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from tpserve.errors import NotFoundError, ValidationError
from tpserve.server.responses_history import (
    InputItemsQuery,
    RetrieveQuery,
    input_items_page,
    parse_query,
    stored_item,
)
from tpserve.server.responses_request import ResponsesRequest
from tpserve.server.responses_store import Item, ResponseStore, StoredResponse, json_size
from tpserve.server.security import key_tag
from tpserve.server.streaming import AnswerResponse


class Keeper:
    """Puts one finished response in the store, with the conversation that made it."""

    def __init__(self, store: ResponseStore, earlier: StoredResponse | None,
                 given: list[Item], owner: bytes) -> None:
        self.store = store
        self.owner = owner
        self.items = (earlier.conversation if earlier else ()) + tuple(given)
        self.nbytes = (earlier.conversation_bytes if earlier else 0) + json_size(given)

    def keep(self, body: dict) -> dict:
        # `store` was echoed true; false when this one alone is over the byte bound.
        body["store"] = self.store.put(body, self.items, self.nbytes, self.owner)
        return body


class StoredResponses:
    """The store's side of the Responses API: the response a request continues, the keeper
    of what it answers, and the routes over stored responses."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def keeper(self, req: ResponsesRequest, earlier: StoredResponse | None,
               request: Request) -> Keeper | None:
        """What stores the answer to `req` (already accepted), or None when it is not kept."""
        if not self.store.enabled or req.store is False:
            return None
        return Keeper(self.store, earlier, [stored_item(i) for i in req.input_items()],
                      key_tag(request.state))

    def _stored(self, response_id: str, request: Request) -> StoredResponse:
        entry = self.store.get(response_id, key_tag(request.state))
        if entry is None:
            off = "" if self.store.enabled else " (the response store is off: " \
                "--responses-store-size 0)"
            raise NotFoundError(f"no stored response has id {response_id[:80]!r}{off}")
        return entry

    def earlier(self, req: ResponsesRequest, request: Request) -> StoredResponse | None:
        """The stored response `previous_response_id` continues (a 422 when there is none,
        as OpenAI answers 400)."""
        if req.previous_response_id is None:
            return None
        if not self.store.enabled:
            raise ValidationError("`previous_response_id` needs the response store, which "
                                  "is off on this server (--responses-store-size 0): send "
                                  "the whole conversation in `input`")
        entry = self.store.get(req.previous_response_id, key_tag(request.state))
        if entry is None:
            raise ValidationError(
                f"`previous_response_id`: no stored response has id "
                f"{req.previous_response_id[:80]!r} (never stored, deleted, dropped by the "
                "store's bounds or age limit, or made before the server restarted): send "
                "the whole conversation in `input`")
        return entry

    async def retrieve(self, response_id: str, request: Request) -> Response:
        parse_query(RetrieveQuery, request.query_params)
        return AnswerResponse(self._stored(response_id, request).body)

    async def delete(self, response_id: str, request: Request) -> dict:
        self._stored(response_id, request)
        self.store.delete(response_id, key_tag(request.state))
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, response_id: str, request: Request) -> Response:
        query = parse_query(InputItemsQuery, request.query_params)
        return AnswerResponse(input_items_page(self._stored(response_id, request).input_items, query))
