"""Stored Responses API responses, for `previous_response_id`, GET and DELETE
/v1/responses/{id} and its input_items: a bounded map in the HTTP process's memory.

Each entry keeps the whole conversation it ended (the input items it was given, those of the
turns it continued first) and its output items, so continuing one is a lookup, not a walk
up a chain whose middle may have been dropped. Consecutive turns share their item dicts
(a list of references is copied, not the items), and items are never changed once stored.

Bounds: a count and a byte estimate (the JSON size of the response and of its input items,
earlier turns included, so the shared items are counted once per entry that holds them: an
upper bound on what the store holds). Past either, the least recently used entries go;
reading one (GET, input_items, previous_response_id) makes it recent. An age limit (ttl_s,
on a monotonic clock, so a wall-clock step neither expires nor revives anything) drops
entries that old whether read or not: lookups answer them as unknown, and every put,
lookup or delete first drops all expired entries, oldest first, so an expired entry's memory
goes with the next request that touches the store, not only with a lookup of its own id.

Owners: each entry holds the tag of the API key that stored it (security.py: an HMAC of the
key, never the key); a lookup with another tag finds nothing, exactly as for an unknown id,
and changes nothing (no LRU bump). Without keys every tag is b"": one scope.

One store per app, used from its event loop only, so no lock.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a dependency, guarded as server/streaming.py does
    orjson = None

Item = dict[str, Any]


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object, as answered
    input_items: tuple[Item, ...]  # oldest first, earlier turns' inputs and outputs included
    input_bytes: int  # json_size of input_items
    output_bytes: int  # json_size of the output items
    nbytes: int  # what the store counts for it: the body and the input items
    owner: bytes = b""  # the storing key's tag (security.py: key_tag); b"": no keys
    stored_at: float = 0.0  # the store's clock when it was kept

    @property
    def conversation(self) -> tuple[Item, ...]:
        """The items a response continuing this one starts from."""
        return self.input_items + tuple(self.body["output"])

    @property
    def conversation_bytes(self) -> int:
        return self.input_bytes + self.output_bytes


def json_size(value: Any) -> int:
    """Bytes of `value` as compact UTF-8 JSON. orjson when installed: every stored response
    is measured as it is answered, and it is ~10x faster (server/streaming.py)."""
    if orjson is not None:
        return len(orjson.dumps(value, default=str))
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                          default=str).encode())


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int, ttl_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """max_responses 0 turns the store off: nothing is kept. ttl_s: seconds an entry is
        kept at most (0: no age limit). clock: monotonic seconds (tests pass their own)."""
        if max_responses < 0 or max_bytes < 0 or ttl_s < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recent first
        # Oldest first: LRU order is not age order, and this finds every expired entry
        # without a walk over the live ones.
        self._by_age: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict[str, Any], input_items: tuple[Item, ...],
            input_bytes: int, owner: bytes = b"") -> bool:
        """Keep a finished response (input_bytes: json_size of input_items, which the caller
        adds up turn by turn) for `owner`. False when it was not kept: the store is off, or
        this one alone is over the byte bound."""
        body_bytes = json_size(body)
        entry = StoredResponse(body, input_items, input_bytes, json_size(body["output"]),
                               body_bytes + input_bytes, owner, self.clock())
        if not self.enabled or entry.nbytes > self.max_bytes:
            return False
        self._drop_expired()
        self._remove(body["id"])
        self._entries[body["id"]] = self._by_age[body["id"]] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.max_responses or self.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

    def get(self, response_id: str, owner: bytes = b"") -> StoredResponse | None:
        """The entry `owner` stored under this id, now the most recent; None when there is
        none (unknown, deleted, dropped, expired, or another key's)."""
        self._drop_expired()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: bytes = b"") -> bool:
        """Forget the entry `owner` stored under this id; False when get would find none."""
        self._drop_expired()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        self._remove(response_id)
        return True

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            del self._by_age[response_id]
            self.nbytes -= entry.nbytes

    def _drop_expired(self) -> None:
        if not self.ttl_s:
            return
        oldest = self.clock() - self.ttl_s
        while self._by_age:
            response_id, entry = next(iter(self._by_age.items()))
            if entry.stored_at > oldest:
                return
            self._remove(response_id)
