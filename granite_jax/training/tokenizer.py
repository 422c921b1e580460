"""Byte-level BPE tokenizers trained with `tokenizers`, saved as transformers loads them (AutoTokenizer)."""

from __future__ import annotations

import os
from collections.abc import Iterable

# Granite's special tokens and chat template (the role markers of granite-4.0's template, without its tool calls).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
PAD, EOS = "<|pad|>", "<|end_of_text|>"
SPECIAL_TOKENS = [PAD, EOS, "<|start_of_role|>", "<|end_of_role|>"]


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike | None = None, *, progress=False):
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes, Granite's special tokens, then merges) trained on
    `texts`, as a transformers `PreTrainedTokenizerFast` (left padding, Granite's chat template); saved into out_dir
    when given. Every string encodes: bytes never seen fall back to the byte alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE)
    fast.padding_side = "left"
    if out_dir is not None:
        fast.save_pretrained(os.fspath(out_dir))
    return fast
