"""Chat formatting: a conversation -> the prompt text a chat model was trained on.

Where the checkpoint's `tokenizer_config.json` has a `chat_template`, it is rendered with
Jinja2 the way transformers renders it: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the variables `messages`, `add_generation_prompt`, the special tokens
(`bos_token`, `eos_token`, ...), and the helpers `raise_exception`, `strftime_now` and the
`tojson` filter.  A template list (``[{"name": "default", "template": ...}, ...]``) uses its
"default" entry.

Kimi K3 ships no Jinja template: its tokenizer code formats turns itself ("XTML"; read from
the encoder derived from moonshotai/Kimi-K3's encoding_k3.py).  `k3_prompt` writes that
format: each turn ``<|open|>message role="ROLE"<|sep|>...<|close|>message<|sep|>
<|end_of_msg|>``; an assistant turn holds an optional ``think`` section and a ``response``
one; the generation prompt opens an assistant message and its ``think`` section (or, with
thinking off, its ``response``).  The release's default "thinking effort" system message is
not added.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from moeshard.moe.errors import MoeshardError

K3_MODEL_TYPES = ("kimi_k3",)


TEMPLATE_FILE = "chat_template.jinja"  # where transformers now saves it (gpt-oss ships one)


def load_template(model_dir: Path) -> tuple[str | None, dict[str, str]]:
    """(the chat_template text or None, the special tokens by role) of a model directory:
    `chat_template.jinja` where it has one (as transformers reads it first), else
    tokenizer_config.json's `chat_template`."""
    path = model_dir / "tokenizer_config.json"
    config = {}
    if path.exists():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MoeshardError(f"{path}: not readable JSON ({exc})") from None
        if not isinstance(config, dict):
            raise MoeshardError(f"{path}: expected a JSON object")
    template = config.get("chat_template")
    if (model_dir / TEMPLATE_FILE).exists():
        try:
            template = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MoeshardError(f"{model_dir / TEMPLATE_FILE}: not readable ({exc})") from None
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise MoeshardError(f"{path}: chat_template must be a string or a list of named ones")
    tokens = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
    return template, tokens


def render(template: str, messages: list[dict[str, Any]], tokens: dict[str, str], **extra) -> str:
    """A Jinja2 chat template rendered as transformers renders it."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # a runtime dependency (pyproject.toml): a broken install
        raise MoeshardError("chat templates need the jinja2 package (pip install jinja2)") from None

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, **tokens, **extra)
    except TemplateError as exc:
        raise MoeshardError(f"the chat template failed: {exc}") from None


def k3_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool, thinking: bool) -> str:
    """Kimi K3's turn format (see the module docstring)."""
    parts = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        opening = f'<|open|>message role="{role}"<|sep|>'
        if role == "assistant":
            body = ""
            if m.get("reasoning_content"):
                body += f"<|open|>think<|sep|>{m['reasoning_content']}<|close|>think<|sep|>"
            body += f"<|open|>response<|sep|>{content}<|close|>response<|sep|>"
        else:
            body = content
        parts.append(f"{opening}{body}<|close|>message<|sep|><|end_of_msg|>")
    if add_generation_prompt:
        section = "think" if thinking else "response"
        parts.append(f'<|open|>message role="assistant"<|sep|><|open|>{section}<|sep|>')
    return "".join(parts)


def chat_prompt(
    model_dir: Path,
    model_type: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    thinking: bool = True,
) -> str:
    """The prompt text for `messages` (role/content dicts): the checkpoint's chat template,
    else Kimi K3's format for a K3, else an error saying there is none."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MoeshardError(f"a chat message needs a role and content, not {m!r}")
    template, tokens = load_template(model_dir)
    if template is not None:
        return render(
            template, messages, tokens, add_generation_prompt=add_generation_prompt,
            enable_thinking=thinking,
        )  # fmt: skip
    if model_type in K3_MODEL_TYPES:
        return k3_prompt(messages, add_generation_prompt, thinking)
    raise MoeshardError(
        f"{model_dir}: no chat template ({TEMPLATE_FILE}, or chat_template in "
        "tokenizer_config.json); give the prompt as plain text"
    )
