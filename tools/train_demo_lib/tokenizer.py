"""The demo tokenizer: byte-level BPE trained on the training split; <|endoftext|> separates
(and starts) documents."""

from __future__ import annotations

import torch

EOT = "<|endoftext|>"


def add_bos_post_processor(tok, eot_id: int) -> None:
    """Make encode() start every text with <|endoftext|>, the document separator the model saw
    before each document in training, so any consumer of tokenizer.json (transformers, or
    moeshard through the tokenizers library) prompts the model the way it was trained."""
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, docs, eot_id: int) -> torch.Tensor:
    ids = []
    encs = tok.encode_batch([t for _, t in docs])
    for e in encs:
        ids.append(eot_id)  # <|endoftext|> doubles as BOS/document separator
        ids.extend(e.ids)
    ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)
