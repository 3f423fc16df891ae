"""The tokenizer of a GGUF file (`tokenizer.ggml.*`) rebuilt as a `tokenizers` tokenizer.json.

llama.cpp keeps a BPE tokenizer as its token strings (byte-level, as in tokenizer.json), their
types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), the merges ("a b")
and the name of its pre-tokenizer (`tokenizer.ggml.pre`), whose regex llama.cpp hard-codes
per name (src/llama-vocab.cpp). A pre-tokenizer is rebuilt here only where its form is known
and tested; any other name is refused with the way round it: `--tokenizer tokenizer.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeshard.moe.errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4


def _byte_level_gpt2() -> dict:
    """GPT-2's byte-level pre-tokenizer with its own regex (llama.cpp's "gpt-2")."""
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _split_then_bytes(*patterns: str) -> dict:
    """Splits by each regex in turn (isolating the matches), then bytes to byte-level
    characters without GPT-2's regex: the form of Llama 3's, Qwen2's and DeepSeek-V3's
    tokenizer.json."""
    splits = [
        {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
        for p in patterns
    ]
    last = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {"type": "Sequence", "pretokenizers": [*splits, last]}


# The regexes as the models' tokenizer.json files write them; llama.cpp quotes them beside its
# own adaptations in src/llama-vocab.cpp ("original regex from tokenizer.json"), per pre name.
_LETTERS_DIGITS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{DIGITS}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LETTERS_DIGITS.replace("{DIGITS}", "")  # one digit a piece
_LLAMA3 = _LETTERS_DIGITS.replace("{DIGITS}", "{1,3}")  # up to three digits a piece
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

PRE_TOKENIZERS = {
    "gpt-2": _byte_level_gpt2,
    "qwen2": lambda: _split_then_bytes(_QWEN2),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3),
    "deepseek-v3": lambda: _split_then_bytes(*_DEEPSEEK3),
}


def tokenizer_json(fields: dict, source: Path) -> str:
    """tokenizer.json for the GGUF tokenizer in `fields`."""
    from tokenizers import Tokenizer

    model = _get(fields, "tokenizer.ggml.model", source)
    if model != "gpt2":
        raise CheckpointError(
            f"{source}: its tokenizer is '{model}', not a byte-level BPE ('gpt2'): pass the "
            f"model's tokenizer.json with --tokenizer"
        )
    pre = _get(fields, "tokenizer.ggml.pre", source)
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{source}: pre-tokenizer '{pre}' cannot be rebuilt yet (known: "
            f"{', '.join(PRE_TOKENIZERS)}): pass the model's tokenizer.json with --tokenizer"
        )
    tokens = list(_get(fields, "tokenizer.ggml.tokens", source))
    types = list(_get(fields, "tokenizer.ggml.token_type", source))
    merges = [m.split(" ", 1) for m in _get(fields, "tokenizer.ggml.merges", source)]
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{source}: malformed tokenizer.ggml.* arrays")
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": t != CONTROL,
            "special": t == CONTROL,
        }
        for i, (tok, t) in enumerate(zip(tokens, types, strict=True))
        if t in (CONTROL, USER_DEFINED)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre](),
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    text = json.dumps(spec, ensure_ascii=False)
    try:
        Tokenizer.from_str(text)  # (refused here, not at the first request)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise CheckpointError(f"{source}: its tokenizer does not load: {exc}") from None
    return text


def tokenizer_config(fields: dict, source: Path) -> dict:
    """tokenizer_config.json: the special tokens by name, whether a BOS is added, and the
    chat template where the file has one."""
    tokens = _get(fields, "tokenizer.ggml.tokens", source)
    out: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token")):
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None and 0 <= int(field.contents()) < len(tokens):
            out[name] = tokens[int(field.contents())]
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    out["add_bos_token"] = bool(add_bos.contents()) if add_bos is not None else False
    template = fields.get("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template.contents()
    return out


def _get(fields: dict, key: str, source: Path):
    field = fields.get(key)
    if field is None:
        raise CheckpointError(
            f"{source}: no '{key}' in the file: pass the model's tokenizer.json with --tokenizer"
        )
    return field.contents()
