"""What `moeshard serve` answers with: text deltas out of token ids (`TextStream`: partial
characters and stop sequences held back), the logprobs objects of both endpoints, ids."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from moeshard.coordinator.harmony import HarmonyChannels, speaks_harmony, split
from moeshard.coordinator.tokenizer import IncrementalText

if TYPE_CHECKING:
    from moeshard.coordinator.serve.app import ServerState


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


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class CompletionReply:
    """The objects of one `/v1/completions` answer: `chunk` for each streamed token, `final`
    for the whole answer (or, with text None, a stream's closing usage chunk)."""

    def __init__(self, state: ServerState, top: bool):
        self.state, self.top = state, top
        self.id, self.created = new_id("cmpl"), int(time.time())
        self.offset = 0  # characters of the completion before the next token's (text_offset)

    def _object(self, choices: list, **more) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.state.model_name, "choices": choices, **more}  # fmt: skip

    def chunk(self, delta: str, finish: str | None, event) -> dict:
        choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        if event is not None:
            choice["logprobs"] = completion_logprobs(self.state, [event], self.offset, self.top)
            self.offset += len(choice["logprobs"]["tokens"][0])
        return self._object([choice])

    def final(self, text: str | None, finish: str | None, usage: dict, events) -> dict:
        choices = [] if text is None else [{
            "index": 0, "text": text, "finish_reason": finish,
            "logprobs": None if events is None else completion_logprobs(
                self.state, events, 0, self.top),
        }]  # fmt: skip
        return self._object(choices, usage=usage)


class ChatReply:
    """The objects of one `/v1/chat/completions` answer, as `CompletionReply`'s.  A model
    that answers in harmony (gpt-oss) has its analysis channel in `reasoning_content` and its
    other channels in `content`, the markers taken out (`moeshard.coordinator.harmony`)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.id, self.created = new_id("chatcmpl"), int(time.time())
        self.first = True  # the first chunk names the role
        self.channels = HarmonyChannels() if speaks_harmony(state.model_type) else None

    def _object(self, kind: str, choices: list, **more) -> dict:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.state.model_name, "choices": choices, **more}  # fmt: skip

    def chunk(self, delta: str, finish: str | None, event) -> dict:
        d = {"content": delta}
        if self.channels is not None:
            reasoning, content = self.channels.feed(delta)
            if finish is not None:
                more_reasoning, more_content = self.channels.flush()
                reasoning, content = reasoning + more_reasoning, content + more_content
            d = {"content": content}
            if reasoning:
                d["reasoning_content"] = reasoning
        if self.first:
            d["role"], self.first = "assistant", False
        choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        if event is not None:
            choice["logprobs"] = chat_logprobs(self.state, [event])
        return self._object("chat.completion.chunk", [choice])

    def final(self, text: str | None, finish: str | None, usage: dict, events) -> dict:
        if text is None:  # the usage chunk of a stream
            return self._object("chat.completion.chunk", [], usage=usage)
        message = {"role": "assistant", "content": text}
        if self.channels is not None:
            reasoning, message["content"] = split(text)
            message["reasoning_content"] = reasoning
        choice = {
            "index": 0, "message": message,
            "finish_reason": finish,
            "logprobs": None if events is None else chat_logprobs(self.state, events),
        }  # fmt: skip
        return self._object("chat.completion", [choice], usage=usage)
