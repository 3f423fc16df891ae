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

The parts: what a request may hold (`requests.py`), what answers are made of (`replies.py`),
`/metrics` (`metrics.py`), and here the state, the routes (`Api`) and the app.
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

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from moeshard.coordinator.generate import SamplingOptions
from moeshard.coordinator.serve.engine import Engine, QueueFull, Request
from moeshard.coordinator.serve.metrics import jsonable, prometheus_text
from moeshard.coordinator.serve.replies import ChatReply, CompletionReply, TextStream
from moeshard.coordinator.serve.requests import (
    MAX_BODY,
    PROMPT_CHARS_PER_TOKEN,
    BadRequest,
    chat_prompt_ids,
    completion_prompt,
    error_body,
    parse_body,
    sampling,
)

PAGE = Path(__file__).with_name("page.html")  # the chat page at /


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


class Api:
    """The routes over one `ServerState` (its engine already running): a method per route, and
    what they share: the key check, reading a body, running a request."""

    def __init__(self, state: ServerState):
        self.state = state
        # Parsing and tokenizing: one at a time, off the event loop (a big prompt waits its
        # turn there instead of stopping every other connection).
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="serve-parse")
        self.relays: dict[str, Any] = {}  # the running loop and its Relay (made on first use)
        self.page_html = PAGE.read_text(encoding="utf-8")

    # -- what the routes share ----------------------------------------------------------------

    @staticmethod
    def fail(exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.kind, exc.param), status_code=exc.status)

    def refused(self) -> JSONResponse:
        return self.fail(BadRequest("invalid API key", None, 401, "authentication_error"))

    def authorised(self, request: HttpRequest) -> bool:
        if self.state.api_key is None:
            return True
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        return secrets.compare_digest(given.encode(), self.state.api_key.encode())

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def body_of(self, request: HttpRequest) -> dict:
        """The request's JSON body, read within `max_body` bytes, for this server's model."""
        state = self.state
        if not self.authorised(request):
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
        body = await self.off_loop(parse_body, bytes(raw))
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

    @staticmethod
    async def hung_up(http: HttpRequest, req: Request) -> None:
        """Cancel `req` when its client disconnects.  Its body has been read, so the next
        ASGI message is the disconnect (uvicorn sends it when the connection closes): a
        request still waiting in the queue, or an answer that is not streamed, sends nothing
        that could notice it otherwise."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        req.cancel()

    def count(self, name: str, value: float = 1.0) -> None:
        self.state.metrics[name] = self.state.metrics.get(name, 0.0) + value

    @staticmethod
    async def events(inbox: asyncio.Queue):
        """A request's engine events as they arrive in `inbox`, up to its end."""
        while True:
            event = await inbox.get()
            yield event
            if event.kind == "end":
                return

    def submit(self, ids: list[int], opts: SamplingOptions, extra: dict) -> tuple[Request, Any]:
        """The request, and the asyncio queue its events arrive in (handed over from the
        scheduler thread by the `Relay`: no thread hop per token)."""
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
        if self.relays.get("loop") is not loop:
            self.relays["loop"], self.relays["relay"] = loop, Relay(loop)
        relay = self.relays["relay"]

        def listener(event) -> None:
            relay.put(inbox, event)

        engine = self.state.engine
        try:
            req = engine.submit(ids, opts, extra["logprobs"], listener, extra["top_logprobs"])
        except QueueFull as exc:
            self.count("moeshard_requests_rejected_total")
            raise BadRequest(f"the server is busy: {exc}", None, 429, "rate_limit_error") from None
        self.count("moeshard_requests_total")
        self.count("moeshard_prompt_tokens_total", len(ids))
        return req, inbox

    async def run(self, http: HttpRequest, ids, opts, extra, reply) -> Any:
        """Stream (SSE) or collect one request; `reply.chunk(delta, finish, logprob)` and
        `reply.final(text, finish, usage, logprobs)` shape the API's objects.  A client that
        hangs up frees its slot, or its place in the queue, through `hung_up` (a stream also
        when its next event cannot be sent)."""
        req, inbox = self.submit(ids, opts, extra)
        text = TextStream(self.state.tokenizer, extra["stops"])

        def usage() -> dict:
            n = len(req.tokens)
            return {"prompt_tokens": len(ids), "completion_tokens": n,
                    "total_tokens": len(ids) + n}  # fmt: skip

        async def tokens():
            """(delta text, finish or None, the token's Event when logprobs were asked)."""
            try:
                async for event in self.events(inbox):
                    if event.kind == "token":
                        self.count("moeshard_generated_tokens_total")
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

        watcher = asyncio.create_task(self.hung_up(http, req))
        if extra["stream"]:

            async def sse():
                try:
                    async for delta, finish, event in tokens():
                        yield f"data: {json.dumps(reply.chunk(delta, finish, event))}\n\n"
                        if finish is not None:
                            break
                    if extra.get("include_usage"):
                        yield f"data: {json.dumps(reply.final(None, None, usage(), None))}\n\n"
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
        return JSONResponse(reply.final("".join(parts), finish, usage(), logprobs))

    async def answer(self, request: HttpRequest, prompt_ids, chat: bool):
        """A completion or a chat completion: the body checked, the prompt tokenized off the
        loop, the request run; every BadRequest an error in OpenAI's shape."""
        state = self.state
        try:
            body = await self.body_of(request)
            ids = await self.off_loop(prompt_ids, body, state)
            opts, extra = sampling(body, state, len(ids), chat=chat)
            extra["include_usage"] = bool((body.get("stream_options") or {}).get("include_usage"))
            top = bool(extra["top_logprobs"])
            reply = ChatReply(state) if chat else CompletionReply(state, top)
            return await self.run(request, ids, opts, extra, reply)
        except BadRequest as exc:
            return self.fail(exc)

    # -- the routes ------------------------------------------------------------------------

    async def completions(self, request: HttpRequest):
        return await self.answer(request, completion_prompt, chat=False)

    async def chat_completions(self, request: HttpRequest):
        return await self.answer(request, chat_prompt_ids, chat=True)

    def model_entry(self) -> dict:
        return {"id": self.state.model_name, "object": "model",
                "created": int(self.state.started), "owned_by": "moeshard"}  # fmt: skip

    async def models(self, request: HttpRequest):
        if not self.authorised(request):
            return self.refused()
        return JSONResponse({"object": "list", "data": [self.model_entry()]})

    async def model(self, request: HttpRequest):
        """`GET /v1/models/{id}` (OpenAI's retrieve): this model, or 404."""
        if not self.authorised(request):
            return self.refused()
        name, served = request.path_params["model"], self.state.model_name
        if name != served:
            return self.fail(BadRequest(f"model {name!r} is not served here ({served!r} is)",
                                        "model", 404, "not_found_error"))  # fmt: skip
        return JSONResponse(self.model_entry())

    async def health(self, request: HttpRequest):
        if not self.authorised(request):
            return self.refused()
        state, e = self.state, self.state.engine
        stats = state.experts.stats() if state.experts is not None else {}
        body = {"status": "ok", "model": state.model_name, "running": e.running()}
        body |= {"waiting": e.queue_depth(), "experts": jsonable(stats)}
        st = e.stats  # the scheduler's counters: how full its steps were, how busy it was
        body["engine"] = {"steps": st.steps, "batch_rows": st.batch_rows, "busy_s": st.busy_s,
                          "finished": dict(st.finished_by)}  # fmt: skip
        return JSONResponse(body)

    async def page(self, request: HttpRequest):
        """The static chat page, with or without the key: it holds nothing of the server's
        and asks for the key when /v1 answers 401."""
        return HTMLResponse(self.page_html)

    async def metrics(self, request: HttpRequest):
        if not self.authorised(request):
            return self.refused()
        text = prometheus_text(self.state)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def http_error(self, request: HttpRequest, exc: HTTPException) -> JSONResponse:
        """Starlette's own errors (404 for an unknown path, 405 for a method a path does not
        take) in OpenAI's error shape, as every other error of the server is."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message = f"no route {request.url.path} (the API is under /v1)"
        body = error_body(message, kind, None)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def create_app(state: ServerState) -> Starlette:
    """The Starlette application over `state` (its engine already running)."""
    api = Api(state)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/", api.page, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan(api.worker),
        exception_handlers={HTTPException: api.http_error},
    )


def lifespan(worker: ThreadPoolExecutor):
    """The app's lifespan: failed accepts logged at a bounded rate while it runs, the worker
    thread stopped after."""
    from contextlib import asynccontextmanager

    from moeshard.coordinator.serve.connections import AcceptErrors

    @asynccontextmanager
    async def span(app):
        asyncio.get_running_loop().set_exception_handler(AcceptErrors())
        try:
            yield
        finally:
            worker.shutdown(wait=False, cancel_futures=True)

    return span
