"""POST /tokenize and POST /detokenize: what a prompt costs before it is sent.

/tokenize answers in the shape the request is asked in: TGI's (`{"inputs": ...}`, a list of
{id, text, start, stop}, character offsets into the input) or vLLM's (`{"prompt": ...}` or
a chat's `{"messages": ..., "tools": ...}` rendered as /v1/chat/completions renders it,
{count, max_model_len, tokens}). /detokenize is vLLM's ({"tokens": [ids]} -> {"prompt"}).
Both count exactly as generation does: the same tokenizer, the same special tokens."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field, model_validator

from tpserve.errors import NotReadyError, ValidationError
from tpserve.fields import I32_MAX, FailFast, Int, Text, TokenCount, unsupported
from tpserve.server.backend import EngineBackend, not_ready_message
from tpserve.server.openai import ChatMessage
from tpserve.server.tool_prompt import render_chat
from tpserve.server.tools import Tool, plan_tools

# Texts longer than this are tokenized on a worker thread, not on the event loop that every
# other client of the server waits on.
INLINE_CHARS = 8192


class TGITokenizeParameters(BaseModel):
    truncate: TokenCount | None = None  # keep the last `truncate` tokens, as /generate does
    add_special_tokens: bool = True


class TokenizeRequest(BaseModel):
    """TGI's body (`inputs`, `parameters`) or vLLM's (`prompt` or `messages`, with
    `add_special_tokens`: by default true for a prompt, false for a chat, whose template
    writes its own)."""

    inputs: Text | None = None
    parameters: TGITokenizeParameters | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1), FailFast] | None = None
    tools: Annotated[list[Tool], FailFast] | None = None
    # As on /v1/chat/completions, where they change the prompt (a forced call is not told
    # how to write a call; TGI's tool_prompt replaces the sentence before the tool list).
    tool_choice: Any = None
    tool_prompt: Text | None = None
    add_generation_prompt: bool = True
    chat_template: Annotated[Text | None, unsupported(
        "`chat_template` (the model's own template is used)")] = None
    add_special_tokens: bool | None = None
    model: Text | None = None  # vLLM's clients send it; one model is served

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if sum(x is not None for x in (self.inputs, self.prompt, self.messages)) != 1:
            raise ValueError("send the text to tokenize as `inputs` (TGI's form), `prompt` "
                             "or `messages` (vLLM's), one of the three")
        if self.messages is None and (self.tools, self.tool_choice, self.tool_prompt) != (
                None, None, None):
            raise ValueError("`tools`, `tool_choice` and `tool_prompt` go with `messages`")
        if not self.add_generation_prompt:
            raise ValueError("`add_generation_prompt: false` is not supported by tpserve: a "
                             "chat is counted as /v1/chat/completions renders it, with the "
                             "generation prompt")
        return self


class DetokenizeRequest(BaseModel):
    tokens: Annotated[list[Annotated[Int, Field(ge=0, le=I32_MAX)]], Field(fail_fast=True)]
    model: Text | None = None


class TokenizeRoutes:
    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend

    def _ready(self) -> None:
        if not self.backend.ready():
            raise NotReadyError(not_ready_message(self.backend))

    async def _off_loop(self, n_chars: int, fn, *args):
        return fn(*args) if n_chars <= INLINE_CHARS else await asyncio.to_thread(fn, *args)

    async def tokenize(self, req: TokenizeRequest) -> list[dict] | dict:
        self._ready()
        spans_of = getattr(self.backend, "token_spans", None)
        if spans_of is None:
            raise HTTPException(501, "this server's backend cannot tokenize")
        if req.inputs is not None:  # TGI
            p = req.parameters or TGITokenizeParameters()
            text = req.inputs
            spans = await self._off_loop(len(text), spans_of, text, p.add_special_tokens)
            if p.truncate is not None:
                spans = spans[-p.truncate:]
            return [{"id": i, "text": text[a:b], "start": a, "stop": b} for i, a, b in spans]
        if req.messages is not None:
            text = await self._off_loop(
                sum(len(m.model_dump_json()) for m in req.messages), self._render, req)
            special = bool(req.add_special_tokens)
        else:
            text = req.prompt
            special = req.add_special_tokens is not False
        spans = await self._off_loop(len(text), spans_of, text, special)
        return {"count": len(spans), "max_model_len": self.backend.info().max_total_tokens,
                "tokens": [i for i, _, _ in spans]}

    def _render(self, req: TokenizeRequest) -> str:
        """The chat's prompt as /v1/chat/completions renders it (tools, history and all)."""
        plan = plan_tools(req.tools, req.tool_choice, None, None)
        return render_chat(self.backend.apply_chat_template,
                           [m.as_template_input() for m in req.messages], plan, req.tool_prompt)

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self._ready()
        decode = getattr(self.backend, "decode", None)
        if decode is None:
            raise HTTPException(501, "this server's backend cannot detokenize")
        vocab = self.backend.info().extra.get("vocab_size")
        bad = next((t for t in req.tokens if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise ValidationError(f"token id {bad} in `tokens` is not in the model's "
                                  f"vocabulary (0 to {vocab - 1})")
        return {"prompt": await self._off_loop(len(req.tokens), decode, req.tokens)}


def tokenize_router(backend: EngineBackend) -> APIRouter:
    routes = TokenizeRoutes(backend)
    router = APIRouter()
    router.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    router.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    return router
