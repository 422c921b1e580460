"""Training and fine-tuning of Granite 4.0 models (`python -m granite_jax.train`): corpora, a byte-level BPE
tokenizer, the jitted AdamW step, resumable orbax checkpoints, and quality measures."""

from granite_jax.training.corpus import STDLIB, matched_files, split_files, stdlib_sources
from granite_jax.training.quality import function_headers, header_completions, ngram_baselines
from granite_jax.training.step import make_eval_step, make_train_step, optimizer, schedule, token_loss
from granite_jax.training.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_bpe
from granite_jax.training.trainer import train

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "STDLIB",
    "function_headers",
    "header_completions",
    "make_eval_step",
    "make_train_step",
    "matched_files",
    "ngram_baselines",
    "optimizer",
    "schedule",
    "split_files",
    "stdlib_sources",
    "token_loss",
    "train",
    "train_bpe",
]
