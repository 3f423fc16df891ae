"""What `moeshard serve` accepts: OpenAI's request fields checked by hand, each bad one a
`BadRequest` that becomes an HTTP error in OpenAI's shape (`error_body`), and the prompt of a
completion or a chat as token ids. A stranger's body is bounded here too: its nesting
(`too_deep`), its prompt's characters before they are tokenized."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from moeshard.coordinator.chat import chat_prompt
from moeshard.coordinator.generate import SamplingOptions
from moeshard.moe.errors import MoeshardError

if TYPE_CHECKING:
    from moeshard.coordinator.serve.app import ServerState

MAX_TOKENS_DEFAULT = 16  # OpenAI's completions default
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
