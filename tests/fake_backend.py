"""A deterministic EngineBackend for HTTP tests, and a helper running an app under uvicorn.

The fake "model" echoes the prompt's words, cycling, one word per token (" word").
A word `</s>` in the prompt is emitted as the special EOS token and ends generation.
Stop sequences are matched on the generated text, as the engine does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import uvicorn

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, SamplingParams, TokenInfo
from tpserve.errors import GenerationError, ValidationError

EOS = TokenInfo(id=2, text="</s>", logprob=-0.01, special=True)
FAKE_SEED = 4242  # reported when sampling without an explicit seed


def stop_safe_prefix(text: str, stops: tuple[str, ...], final: bool) -> str:
    """The part of `text` before any stop string; unless final, also short of any suffix
    that could still become one."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    if cuts:
        return text[: min(cuts)]
    if final:
        return text
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


# The text of every word token made so far, by id: decode() spells them as a tokenizer would.
WORD_TEXTS: dict[int, str] = {}


def word_token(word: str, position: int) -> TokenInfo:
    # Stable ids (crc32, not hash(), which is salted per process) and distinct logprobs.
    tid = 3 + zlib.crc32(word.encode()) % 30000
    WORD_TEXTS[tid] = " " + word
    return TokenInfo(id=tid, text=" " + word, logprob=-0.1 * (position + 1))


@dataclass
class Call:
    prompt: str
    params: SamplingParams
    truncate: int | None
    add_special_tokens: bool


@dataclass
class FakeBackend:
    info_: ModelInfo = field(
        default_factory=lambda: ModelInfo(
            model_id="fake/echo",
            model_dtype="float32",
            model_device_type="cpu",
            tp_size=2,
            max_input_tokens=64,
            max_total_tokens=128,
            max_concurrent_requests=4,
            max_stop_sequences=3,
            max_top_n_tokens=3,
        )
    )
    is_ready: bool = True
    # Raised by generate() itself, before any event (e.g. OverloadedError, RuntimeError).
    raise_on_generate: BaseException | None = None
    # Raise GenerationError after this many events were produced.
    fail_after: int | None = None
    # What fail_after raises (default: GenerationError("fake engine failure")).
    fail_exception: BaseException | None = None
    token_delay: float = 0.0
    has_chat_template: bool = True
    calls: list[Call] = field(default_factory=list)
    # Set (from the server thread) when a stream was closed before its final event.
    aborted: threading.Event = field(default_factory=threading.Event)
    # Generations started and not yet ended (finished, failed or aborted): the fake's
    # "request slots", which must return to 0 however clients behave.
    active: int = 0

    def reset(self) -> FakeBackend:
        """Back to a healthy, idle fake (module-scoped servers share one instance)."""
        fresh = FakeBackend()
        for name in ("is_ready", "raise_on_generate", "fail_after", "fail_exception",
                     "token_delay", "has_chat_template"):
            setattr(self, name, getattr(fresh, name))
        self.calls.clear()
        self.aborted.clear()
        return self

    def stop(self) -> None:
        """Nothing to stop (a TPReplica stops its backend when it goes away)."""

    def ready(self) -> bool:
        return self.is_ready

    def info(self) -> ModelInfo:
        return self.info_

    def count_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        return len(text.split())

    def token_spans(self, text: str, add_special_tokens: bool = True
                    ) -> list[tuple[int, int, int]]:
        """Words as tokens (as count_tokens counts them), id = the word's length."""
        import re

        return [(m.end() - m.start(), m.start(), m.end()) for m in re.finditer(r"\S+", text)]

    def decode(self, ids: list[int]) -> str:
        """Word tokens the fake generated as their text (" word"); other ids, a token-id
        prompt's, as words: id 7 is the word "t7"."""
        if ids and all(i in WORD_TEXTS for i in ids):
            return "".join(WORD_TEXTS[i] for i in ids)
        return " ".join(f"t{i}" for i in ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        # Like a template without tool support: `tools` changes nothing.
        if not self.has_chat_template:
            raise ValidationError("this model has no chat template")
        turns = [f"{m['role']}: {m['content']}" for m in messages]
        return " ".join([*turns, "assistant:"])

    def generate(
        self,
        prompt: str,
        params: SamplingParams,
        truncate: int | None = None,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[GenerationEvent]:
        self.calls.append(Call(prompt, params, truncate, add_special_tokens))
        if self.raise_on_generate is not None:
            raise self.raise_on_generate
        if not isinstance(prompt, str):  # token ids: their words, as decode() spells them
            prompt = self.decode(prompt)
        words = prompt.split() or ["</s>"]  # a blank prompt: "generate" EOS at once
        if truncate is not None:
            words = words[-truncate:]
        n_prompt = len(words)
        if n_prompt > self.info_.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have at most {self.info_.max_input_tokens} tokens (got {n_prompt})"
            )
        if n_prompt + params.max_new_tokens > self.info_.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.info_.max_total_tokens}"
            )
        return self._stream(words, params)

    async def _stream(
        self, words: list[str], params: SamplingParams
    ) -> AsyncIterator[GenerationEvent]:
        seed = None if params.greedy else (params.seed if params.seed is not None else FAKE_SEED)
        prefill = (
            [
                TokenInfo(id=word_token(w, 0).id, text=w, logprob=None if i == 0 else -1.0)
                for i, w in enumerate(words)
            ]
            if params.prompt_logprobs
            else []
        )
        text = sent = ""
        finished = False
        self.active += 1  # only the server's event loop thread touches it
        try:
            for i in range(params.max_new_tokens):
                if self.fail_after is not None and i >= self.fail_after:
                    raise self.fail_exception or GenerationError("fake engine failure")
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                word = words[i % len(words)]
                tok = EOS if word == "</s>" else word_token(word, i)
                if not tok.special:
                    text += tok.text
                reason = None
                if tok.special:
                    reason = "eos_token"
                elif any(s in text for s in params.stop):
                    reason = "stop_sequence"
                elif i + 1 == params.max_new_tokens:
                    reason = "length"
                if not params.include_stop_str_in_output and not tok.special:
                    # As the engine's output processor: cut the stop string, hold back text
                    # that could be its start, the last token carries the rest.
                    safe = stop_safe_prefix(text, params.stop, final=reason is not None)
                    tok = TokenInfo(tok.id, safe[len(sent):], tok.logprob, tok.special)
                    sent = safe
                top = [word_token(f"alt{k}", i) for k in range(params.top_n_tokens)]
                event = GenerationEvent(token=tok, top_tokens=top or None)
                if reason is not None:
                    finished = True
                    event.finished = True
                    event.generated_text = (text if params.include_stop_str_in_output
                                            else sent)
                    event.finish_reason = reason
                    event.generated_tokens = i + 1
                    event.seed = seed
                    event.prompt_tokens = len(words)
                    event.prefill = prefill
                    if prefill and params.top_n_tokens:
                        # alternatives ranked below the prompt's own word (-1.0)
                        event.prefill_top = [[] if j == 0 else [
                            TokenInfo(k + 1, f" p{k}", -2.0 - k)
                            for k in range(params.top_n_tokens)] for j in range(len(prefill))]
                yield event
                if finished:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            # Closed or cancelled before the final event: what the server does on
            # disconnect. (The server also closes finished streams; that is no abort.)
            if not finished:
                self.aborted.set()
            raise
        finally:
            self.active -= 1


@contextlib.contextmanager
def serve(app: object) -> Iterator[str]:
    """Run `app` with uvicorn on a free 127.0.0.1 port in a thread; yield its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)

