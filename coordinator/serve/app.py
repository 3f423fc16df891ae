"""The OpenAI-compatible HTTP API over the continuous-batching engine.

Starlette (the ASGI toolkit under FastAPI: small, typed, maintained, with a streaming
response that notices a client going away) served by uvicorn.  No request-model library: the
few fields OpenAI's API defines are checked here, and every bad one is an HTTP 400 in OpenAI's
error shape ``{"error": {"message", "type", "param", "code"}}``, so its client raises its usual
`BadRequestError`.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true``:
server-sent events of chunks, then ``data: [DONE]``), ``GET /v1/models`` (and
``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` (Prometheus text), and ``GET /`` a
chat page (one static file, `page.html`, that streams from the chat endpoint).  With an API
key every route but the page wants ``Authorization: Bearer KEY`` (401 otherwise): /health
and /metrics too, as in network mode they name the nodes, their addresses and the session.
The page holds no data and asks for the key itself.  A full queue is HTTP 429.

A stranger's request costs what it is allowed to cost: a body over `max_body` is refused
before it is read (Content-Length) or while it is (the bytes streamed), JSON nested deeper
than `MAX_JSON_DEPTH` is a 400, a prompt over `max_prompt_chars` is a 400 before it is
tokenized, and parsing and tokenizing run on one worker thread, off the event loop, so that
/health and the streams of other requests keep moving.  Connections are bounded in
`connections.py`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.chat import chat_prompt
from coordinator.generate import SamplingOptions
from coordinator.serve.engine import Engine, QueueFull, Request
from coordinator.tokenizer import IncrementalText
from moe.errors import MoeshardError

MAX_TOKENS_DEFAULT = 16  # OpenAI's completions default
PAGE = Path(__file__).with_name("page.html")  # the chat page at /
MAX_BODY = 4 << 20  # bytes of a request body (a long chat is well under a megabyte)
MAX_JSON_DEPTH = 32  # nesting of a request body (OpenAI's bodies nest 4 or 5 deep)
# A prompt's characters per token of --context, at most: no tokenizer we serve makes a token
# of more characters outside degenerate text, and the cap bounds the time a prompt costs to
# tokenize (65,536 characters: ~20 ms for the demo model's tokenizer) before its length in
# tokens is known.
PROMPT_CHARS_PER_TOKEN = 32
SAMPLING_LIMITS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's: a bias is in -100..100
LOGIT_BIAS_MAX_TOKENS = 1024  # entries a request may bias (each costs every one of its steps)
# Fields OpenAI defines that this server does not do: refused by name when they ask for
# something (answering as if they were not there would be silently wrong).
UNSUPPORTED = {
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
    "tools": lambda v: v not in (None, []),
    "functions": lambda v: v not in (None, []),
    "response_format": lambda v: v not in (None, {"type": "text"}),
}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind=None):
        super().__init__(message)
        self.param, self.status = param, status
        self.kind = kind or "invalid_request_error"


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any  # encode(text) -> ids, decode(ids) -> text
    model_name: str
    model_dir: Any  # pathlib.Path of the model directory (chat template)
    model_type: str
    context: int  # prompt + max_tokens must fit
    eos_ids: tuple[int, ...]
    api_key: str | None = None
    started: float = field(default_factory=time.time)
    metrics: dict[str, float] = field(default_factory=dict)
    experts: Any = None  # the experts backend, for its stats
    max_prompt_chars: int = 0  # characters of a prompt (or a chat's contents); 0: 32 x context
    max_body: int = MAX_BODY  # bytes of a request body
    guard: Any = None  # the connection guard (connections.ConnectionGuard), for /metrics

    def prompt_chars(self) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.context


def error_body(message: str, kind: str, param: str | None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- request checking ------------------------------------------------------------------------


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{key}' must be a number", key)
    low, high = SAMPLING_LIMITS.get(key, (float("-inf"), float("inf")))
    if not low <= value <= high:
        raise BadRequest(f"'{key}' must be between {low:g} and {high:g}, not {value}", key)
    return float(value)


def _int(body: dict, key: str, default: int | None, low: int = 0) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadRequest(f"'{key}' must be an integer >= {low}", key)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a string or a list of up to 4 strings", "stop")
    if len(stops) > 4:
        raise BadRequest("'stop' takes at most 4 sequences", "stop")
    return stops


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias in -100..100}, as (id, bias) pairs."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest("'logit_bias' must map token ids to numbers", "logit_bias")
    if len(bias) > LOGIT_BIAS_MAX_TOKENS:
        raise BadRequest(f"logit_bias: at most {LOGIT_BIAS_MAX_TOKENS} tokens, not {len(bias)}",
                         "logit_bias")  # fmt: skip
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab:
            raise BadRequest(f"logit_bias: {key!r} is not a token id in 0..{vocab - 1}",
                             "logit_bias")  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(f"logit_bias: the bias of {key} must be a number", "logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise BadRequest(f"logit_bias: {value} is outside -100..100", "logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def sampling(
    body: dict, state: ServerState, prompt_tokens: int, chat: bool = False
) -> tuple[SamplingOptions, dict]:
    """SamplingOptions from OpenAI's fields, and the rest of what a request asked."""
    for name, asks in UNSUPPORTED.items():
        if asks(body.get(name)):
            raise BadRequest(f"'{name}' is not supported by this server", name)
    if _int(body, "n", 1, low=1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    max_tokens = _int(body, "max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", MAX_TOKENS_DEFAULT, low=1)
    if prompt_tokens + max_tokens > state.context:
        raise BadRequest(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is more than "
            f"the {state.context} tokens this server plans for (serve --context)",
            "max_tokens",
        )
    opts = SamplingOptions(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        seed=_int(body, "seed", None),
        top_k=_int(body, "top_k", 0),  # (not OpenAI's: as vLLM and llama.cpp's server take it)
        eos_ids=state.eos_ids,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        logit_bias=_logit_bias(body, state.engine.model.config.vocab_size),
    )
    logprobs, top = _logprobs(body, chat)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    extra = {"stops": _stops(body), "logprobs": logprobs, "top_logprobs": top, "stream": stream}
    return opts, extra


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(give each token's log-probability?, how many most likely alternatives with it), as
    the two endpoints ask: completions `logprobs: N` (0..5), chat `logprobs: true` with
    `top_logprobs: N` (0..20)."""
    logprobs = body.get("logprobs")
    if chat:
        if logprobs not in (None, False, True):
            raise BadRequest("'logprobs' must be true or false", "logprobs")
        top = _int(body, "top_logprobs", 0) or 0
        if top > 20 or (top and not logprobs):
            raise BadRequest("'top_logprobs' is 0..20 and needs 'logprobs': true", "top_logprobs")
        return bool(logprobs), top
    if logprobs in (None, False):
        return False, 0
    if logprobs is True:  # (not OpenAI's, but clients send it)
        return True, 0
    if not isinstance(logprobs, int) or not 0 <= logprobs <= 5:
        raise BadRequest("'logprobs' must be an integer in 0..5", "logprobs")
    return True, logprobs


def token_logprob(state: ServerState, token: int, logprob: float) -> dict:
    """One token's entry in chat logprobs: its text, log-probability and UTF-8 bytes (null
    for a token that is part of a character: its text alone is not valid UTF-8)."""
    text = state.tokenizer.decode([token]) if state.tokenizer is not None else ""
    raw = None if "\ufffd" in text else list(text.encode("utf-8"))
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(state: ServerState, events: list) -> dict:
    """Chat's `logprobs` object for these token events."""
    content = []
    for e in events:
        entry = token_logprob(state, e.token, e.logprob)
        entry["top_logprobs"] = [token_logprob(state, t, p) for t, p in e.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(state: ServerState, events: list, offset: int, top: bool) -> dict:
    """Completions' (legacy) `logprobs` object for these token events, the first at character
    `offset` of the completion: tokens, token_logprobs, top_logprobs, text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if top else None,
           "text_offset": []}  # fmt: skip
    for e in events:
        text = token_logprob(state, e.token, e.logprob)["token"]
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["text_offset"].append(offset)
        offset += len(text)
        if top:
            alternatives = {}
            for t, p in e.top:
                alternatives.setdefault(token_logprob(state, t, p)["token"], p)
            out["top_logprobs"].append(alternatives)
    return out


def completion_prompt(body: dict, state: ServerState) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise BadRequest("this model has no tokenizer: give the prompt as token ids", "prompt")
        if len(prompt) > state.prompt_chars():
            raise BadRequest(f"the prompt is over {state.prompt_chars()} characters", "prompt")
        ids = state.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if len(prompt) > state.context:
            raise BadRequest(f"the prompt is over the {state.context} tokens of --context",
                             "prompt")  # fmt: skip
        ids = list(prompt)
    else:
        raise BadRequest("'prompt' must be a non-empty string or a list of token ids", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty (it encodes to no tokens)", "prompt")
    vocab = state.engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise BadRequest(f"token ids must be in 0..{vocab - 1}", "prompt")
    return ids


def chat_prompt_ids(body: dict, state: ServerState) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                             "developer", "tool"):  # fmt: skip
            raise BadRequest("each message needs a role (system, user or assistant)", "messages")
        if not isinstance(m.get("content"), str | type(None)):
            raise BadRequest("message content must be a string", "messages")
    if state.tokenizer is None:
        raise BadRequest("this model has no tokenizer: use /v1/completions with token ids")
    if sum(len(m.get("content") or "") for m in messages) > state.prompt_chars():
        raise BadRequest(f"the messages are over {state.prompt_chars()} characters", "messages")
    try:
        text = chat_prompt(state.model_dir, state.model_type, messages)
    except MoeshardError as exc:
        raise BadRequest(str(exc), "messages") from None
    return state.tokenizer.encode(text)


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object, or BadRequest (not JSON, not an object, nested deeper
    than MAX_JSON_DEPTH: the parser itself gives up with RecursionError near 1,000)."""
    deep = BadRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH}")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not JSON") from None
    except RecursionError:
        raise deep from None
    if too_deep(body, MAX_JSON_DEPTH):
        raise deep
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def too_deep(value: Any, limit: int) -> bool:
    """Are `value`'s lists and objects nested deeper than `limit`?  (Without recursion.)"""
    if not isinstance(value, dict | list):
        return False
    stack = [(value, 1)]  # (a list or an object, its depth)
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


# -- streaming text out of tokens ------------------------------------------------------------


class TextStream:
    """Token ids in, text deltas out: held back while the text ends in a partial UTF-8
    character (`IncrementalText`) or could still become a stop sequence; `stopped` once
    one appears."""

    def __init__(self, tokenizer, stops: list[str]):
        self.stops = stops
        self.decoded = IncrementalText(tokenizer.decode) if tokenizer is not None else None
        self.sent = 0  # characters of the text already given out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.decoded is None:
            return ""
        self.decoded.push(token)
        text = self.decoded.text
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.stopped = True
                out, self.sent = text[self.sent : at], at
                return out
        safe = len(text)
        for stop in self.stops:  # keep back a tail that could begin a stop sequence
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - n : safe] == stop[:n]:
                    safe -= n
                    break
        out, self.sent = text[self.sent : max(self.sent, safe)], max(self.sent, safe)
        return out

    def rest(self) -> str:
        if self.stopped or self.decoded is None:
            return ""
        self.decoded.flush()
        text = self.decoded.text
        out, self.sent = text[self.sent :], len(text)
        return out


class Relay:
    """Events from the scheduler thread to the event loop, one wake-up for all that arrive
    before the loop runs: a step of 16 sequences emits 16 tokens back to back, and waking
    the loop once for each (a write to its self-pipe, a pass of the loop) cost a share of
    the step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: deque = deque()  # (asyncio.Queue, Event)
        self.lock = threading.Lock()
        self.scheduled = False

    def put(self, inbox: asyncio.Queue, event) -> None:
        """Called on the scheduler thread."""
        with self.lock:
            self.pending.append((inbox, event))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed (the server is stopping): nobody listens
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.pending, self.scheduled = self.pending, deque(), False
        for inbox, event in items:
            inbox.put_nowait(event)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


# -- the routes ------------------------------------------------------------------------------


def create_app(state: ServerState):
    """The Starlette application over `state` (its engine already running)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HttpRequest
    from starlette.responses import (
        HTMLResponse,
        JSONResponse,
        PlainTextResponse,
        StreamingResponse,
    )
    from starlette.routing import Route

    def fail(exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.kind, exc.param), status_code=exc.status)

    def authorised(request: HttpRequest) -> bool:
        if state.api_key is None:
            return True
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        return secrets.compare_digest(given.encode(), state.api_key.encode())

    # Parsing and tokenizing: one at a time, off the event loop (a big prompt waits its turn
    # there instead of stopping every other connection).
    worker = ThreadPoolExecutor(1, thread_name_prefix="serve-parse")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    async def body_of(request: HttpRequest) -> dict:
        if not authorised(request):
            raise BadRequest("invalid API key", None, 401, "authentication_error")
        too_big = BadRequest(f"the request body is over {state.max_body} bytes", None, 413)
        length = request.headers.get("content-length", "0")
        if not length.isdigit():
            raise BadRequest("Content-Length is not a number")
        if int(length) > state.max_body:  # refused before a byte of it is read
            raise too_big
        raw = bytearray()
        try:
            async for piece in request.stream():  # (a chunked body declares no length)
                raw += piece
                if len(raw) > state.max_body:
                    raise too_big
        except ClientDisconnect:  # gone, or closed for sending its body too slowly
            raise BadRequest("the client went away before its request was read") from None
        body = await off_loop(parse_body, bytes(raw))
        model = body.get("model")
        if model is None:  # (OpenAI's API requires it, and its clients always send it)
            raise BadRequest(
                f"you must provide a model parameter (this server serves {state.model_name!r})",
                "model",
            )
        if model != state.model_name:
            raise BadRequest(f"model {model!r} is not served here ({state.model_name!r} is)",
                             "model", 404, "not_found_error")  # fmt: skip
        return body

    async def hung_up(http: HttpRequest, req: Request) -> None:
        """Cancel `req` when its client disconnects.  Its body has been read, so the next
        ASGI message is the disconnect (uvicorn sends it when the connection closes): a
        request still waiting in the queue, or an answer that is not streamed, sends nothing
        that could notice it otherwise."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        req.cancel()

    relays: dict[str, Any] = {}  # the running loop and its Relay (made on first use)

    def count(name: str, value: float = 1.0) -> None:
        state.metrics[name] = state.metrics.get(name, 0.0) + value

    async def events(req: Request, inbox: asyncio.Queue):
        """The engine's events for `req` as they arrive in `inbox`."""
        while True:
            event = await inbox.get()
            yield event
            if event.kind == "end":
                return

    def submit(ids: list[int], opts: SamplingOptions, extra: dict) -> tuple[Request, Any]:
        """The request, and the asyncio queue its events arrive in (handed over from the
        scheduler thread by the `Relay`: no thread hop per token)."""
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
        if relays.get("loop") is not loop:
            relays["loop"], relays["relay"] = loop, Relay(loop)
        relay = relays["relay"]

        def listener(event) -> None:
            relay.put(inbox, event)

        try:
            req = state.engine.submit(ids, opts, extra["logprobs"], listener, extra["top_logprobs"])
        except QueueFull as exc:
            count("moeshard_requests_rejected_total")
            raise BadRequest(f"the server is busy: {exc}", None, 429, "rate_limit_error") from None
        count("moeshard_requests_total")
        count("moeshard_prompt_tokens_total", len(ids))
        return req, inbox

    async def run(http: HttpRequest, ids, opts, extra, chunk, final) -> Any:
        """Stream (SSE) or collect one request; `chunk(delta, finish, logprob)` and
        `final(text, finish, usage, logprobs)` shape the API's objects.  A client that hangs
        up frees its slot, or its place in the queue, through `hung_up` (a stream also when
        its next event cannot be sent)."""
        req, inbox = submit(ids, opts, extra)
        text = TextStream(state.tokenizer, extra["stops"])

        def usage() -> dict:
            n = len(req.tokens)
            return {"prompt_tokens": len(ids), "completion_tokens": n,
                    "total_tokens": len(ids) + n}  # fmt: skip

        async def tokens():
            """(delta text, finish or None, the token's Event when logprobs were asked)."""
            try:
                async for event in events(req, inbox):
                    if event.kind == "token":
                        count("moeshard_generated_tokens_total")
                        delta = text.push(event.token)
                        if text.stopped:
                            req.cancel()
                            yield delta, "stop", event if req.logprobs else None
                            return
                        yield delta, None, event if req.logprobs else None
                    else:
                        if event.finish == "error":
                            raise RuntimeError(event.error)
                        finish = {"eos": "stop", "length": "length"}.get(event.finish, "stop")
                        yield text.rest(), finish, None
                        return
            finally:
                req.cancel()  # a client gone (or done): its slot is freed at the next step

        watcher = asyncio.create_task(hung_up(http, req))
        if extra["stream"]:

            async def sse():
                try:
                    async for delta, finish, event in tokens():
                        yield f"data: {json.dumps(chunk(delta, finish, event))}\n\n"
                        if finish is not None:
                            break
                    if extra.get("include_usage"):
                        yield f"data: {json.dumps(final(None, None, usage(), None))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    watcher.cancel()

            return StreamingResponse(sse(), media_type="text/event-stream")
        parts, finish, scored = [], "stop", []
        try:
            async for delta, end, event in tokens():
                parts.append(delta)
                if event is not None:
                    scored.append(event)
                if end is not None:
                    finish = end
                    break
        finally:
            watcher.cancel()
        logprobs = scored if req.logprobs else None
        return JSONResponse(final("".join(parts), finish, usage(), logprobs))

    async def completions(request: HttpRequest):
        try:
            body = await body_of(request)
            ids = await off_loop(completion_prompt, body, state)
            opts, extra = sampling(body, state, len(ids))
            extra["include_usage"] = bool((body.get("stream_options") or {}).get("include_usage"))
        except BadRequest as exc:
            return fail(exc)
        rid, created = new_id("cmpl"), int(time.time())

        offset = [0]  # characters of the completion before the next token's (text_offset)
        top = bool(extra["top_logprobs"])

        def chunk(delta, finish, event):
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            if event is not None:
                choice["logprobs"] = completion_logprobs(state, [event], offset[0], top)
                offset[0] += len(choice["logprobs"]["tokens"][0])
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": state.model_name, "choices": [choice]}  # fmt: skip

        def final(text, finish, usage, events):
            choices = [] if text is None else [{
                "index": 0, "text": text, "finish_reason": finish,
                "logprobs": None if events is None else completion_logprobs(
                    state, events, 0, top),
            }]  # fmt: skip
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": state.model_name, "choices": choices, "usage": usage}  # fmt: skip

        try:
            return await run(request, ids, opts, extra, chunk, final)
        except BadRequest as exc:
            return fail(exc)

    async def chat_completions(request: HttpRequest):
        try:
            body = await body_of(request)
            ids = await off_loop(chat_prompt_ids, body, state)
            opts, extra = sampling(body, state, len(ids), chat=True)
            extra["include_usage"] = bool((body.get("stream_options") or {}).get("include_usage"))
        except BadRequest as exc:
            return fail(exc)
        rid, created = new_id("chatcmpl"), int(time.time())
        first = [True]

        def chunk(delta, finish, event):
            d = {"content": delta}
            if first[0]:
                d["role"], first[0] = "assistant", False
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            if event is not None:
                choice["logprobs"] = chat_logprobs(state, [event])
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": state.model_name, "choices": [choice]}  # fmt: skip

        def final(text, finish, usage, events):
            if text is None:  # the usage chunk of a stream
                return {"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": state.model_name, "choices": [], "usage": usage}  # fmt: skip
            choice = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None if events is None else chat_logprobs(state, events),
            }  # fmt: skip
            return {"id": rid, "object": "chat.completion", "created": created,
                    "model": state.model_name, "choices": [choice], "usage": usage}  # fmt: skip

        try:
            return await run(request, ids, opts, extra, chunk, final)
        except BadRequest as exc:
            return fail(exc)

    def model_entry() -> dict:
        return {"id": state.model_name, "object": "model", "created": int(state.started),
                "owned_by": "moeshard"}  # fmt: skip

    async def models(request: HttpRequest):
        if not authorised(request):
            return fail(BadRequest("invalid API key", None, 401, "authentication_error"))
        return JSONResponse({"object": "list", "data": [model_entry()]})

    async def model(request: HttpRequest):
        """`GET /v1/models/{id}` (OpenAI's retrieve): this model, or 404."""
        if not authorised(request):
            return fail(BadRequest("invalid API key", None, 401, "authentication_error"))
        name = request.path_params["model"]
        if name != state.model_name:
            return fail(BadRequest(f"model {name!r} is not served here ({state.model_name!r} "
                                   "is)", "model", 404, "not_found_error"))  # fmt: skip
        return JSONResponse(model_entry())

    def refused() -> JSONResponse:
        return fail(BadRequest("invalid API key", None, 401, "authentication_error"))

    async def health(request: HttpRequest):
        if not authorised(request):
            return refused()
        e = state.engine
        stats = state.experts.stats() if state.experts is not None else {}
        body = {"status": "ok", "model": state.model_name, "running": e.running()}
        body |= {"waiting": e.queue_depth(), "experts": _jsonable(stats)}
        st = e.stats  # the scheduler's counters: how full its steps were, how busy it was
        body["engine"] = {"steps": st.steps, "batch_rows": st.batch_rows, "busy_s": st.busy_s,
                          "finished": dict(st.finished_by)}  # fmt: skip
        return JSONResponse(body)

    page_html = PAGE.read_text(encoding="utf-8")

    async def page(request: HttpRequest):
        """The static chat page, with or without the key: it holds nothing of the server's
        and asks for the key when /v1 answers 401."""
        return HTMLResponse(page_html)

    async def metrics(request: HttpRequest):
        if not authorised(request):
            return refused()
        return PlainTextResponse(prometheus_text(state), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", page, methods=["GET"]),
    ]

    async def http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
        """Starlette's own errors (404 for an unknown path, 405 for a method a path does not
        take) in OpenAI's error shape, as every other error of the server is."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message = f"no route {request.url.path} (the API is under /v1)"
        body = error_body(message, kind, None)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    return Starlette(
        routes=routes,
        lifespan=lifespan(worker),
        exception_handlers={HTTPException: http_error},
    )


def lifespan(worker: ThreadPoolExecutor):
    """The app's lifespan: failed accepts logged at a bounded rate while it runs, the worker
    thread stopped after."""
    from contextlib import asynccontextmanager

    from coordinator.serve.connections import AcceptErrors

    @asynccontextmanager
    async def span(app):
        asyncio.get_running_loop().set_exception_handler(AcceptErrors())
        try:
            yield
        finally:
            worker.shutdown(wait=False, cancel_futures=True)

    return span


def _jsonable(value):
    """The experts backend's stats as JSON (numbers, strings, lists and dicts of them)."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return {}


def label_value(value: Any) -> str:
    """`value` as a Prometheus label value: backslash, double quote and line feed escaped,
    as the text exposition format wants (a node's name is a stranger's text: unescaped, a
    line feed in it would start a sample line of its own)."""
    text = str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(state: ServerState) -> str:
    """The counters and gauges in Prometheus' text format."""
    e = state.engine
    s = e.stats
    up = max(time.time() - state.started, 1e-9)
    lines = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"])

    metric("moeshard_requests_total", "counter", "requests accepted",
           state.metrics.get("moeshard_requests_total", 0))  # fmt: skip
    metric("moeshard_requests_rejected_total", "counter", "requests refused: queue full",
           state.metrics.get("moeshard_requests_rejected_total", 0))  # fmt: skip
    name = "moeshard_requests_finished_total"
    why = "eos; length; cancelled: the client left or a stop sequence ended the text; error"
    lines += [f"# HELP {name} requests ended, by why ({why})", f"# TYPE {name} counter"]
    for reason, n in sorted(dict(s.finished_by).items()):
        lines.append(f'{name}{{reason="{label_value(reason)}"}} {n}')
    metric("moeshard_prompt_tokens_total", "counter", "prompt tokens in", s.prompt_tokens)
    metric("moeshard_generated_tokens_total", "counter", "tokens out", s.generated_tokens)
    metric("moeshard_tokens_per_second", "gauge", "tokens out per second of engine work",
           s.generated_tokens / s.busy_s if s.busy_s else 0.0)  # fmt: skip
    metric("moeshard_uptime_seconds", "gauge", "seconds since start", up)
    metric("moeshard_queue_depth", "gauge", "requests waiting for a slot", e.queue_depth())
    metric("moeshard_batch_size", "gauge", "sequences running now", e.running())
    guard = state.guard
    if guard is not None:
        metric("moeshard_http_connections", "gauge", "client connections open", guard.count())
        metric("moeshard_http_connections_timed_out_total", "counter",
               "connections closed for not sending a request's headers or body in time",
               guard.timed_out)  # fmt: skip
        metric("moeshard_http_connections_evicted_total", "counter",
               "connections still reading a request closed at the cap for a newer one",
               guard.evicted)  # fmt: skip
        metric("moeshard_http_connections_refused_total", "counter",
               "connections closed at once: at the cap, every open one being answered",
               guard.refused)  # fmt: skip
    metric("moeshard_batch_size_mean", "gauge", "sequences per step, mean",
           s.batch_rows / s.steps if s.steps else 0.0)  # fmt: skip
    lines += s.first_token.prometheus(
        "moeshard_time_to_first_token_seconds", "from a request's arrival to its first token"
    )
    lines += s.inter_token.prometheus(
        "moeshard_inter_token_latency_seconds", "between a request's successive tokens"
    )
    lines += s.request_time.prometheus(
        "moeshard_request_duration_seconds", "from a request's arrival to its end, whatever why"
    )
    if getattr(s, "held", None) is not None and s.held.snapshot()[2]:  # nodes, audited
        lines += s.held.prometheus(
            "moeshard_token_audit_wait_seconds",
            "from a token being made to its being sent: the audits it rests on settling",
        )
        metric("moeshard_rollbacks_total", "counter", "sequences undone: a node caught lying",
               s.rollbacks)  # fmt: skip
    stats = state.experts.stats() if state.experts is not None else {}
    hits, misses = stats.get("hits"), stats.get("misses")
    if hits is not None and misses is not None and hits + misses:
        metric("moeshard_expert_cache_hit_ratio", "gauge", "expert cache hits / lookups",
               hits / (hits + misses))  # fmt: skip
    nodes = [n for n in stats.get("nodes", []) or [] if n.get("mean_ms", n.get("ewma_ms"))]
    if nodes:
        name = "moeshard_node_call_latency_ms"
        lines += [f"# HELP {name} smoothed round trip of a call to the node",
                  f"# TYPE {name} gauge"]  # fmt: skip
    for node in nodes:
        label = label_value(node.get("name") or node.get("addr", "?"))
        lines.append(f'{name}{{node="{label}"}} {node.get("mean_ms", node.get("ewma_ms")):g}')
    return "\n".join(lines) + "\n"
