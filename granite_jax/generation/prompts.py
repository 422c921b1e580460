"""Prompts as token ids: text through the tokenizer (and its chat template), or ids as given, validated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from granite_jax.errors import GenerationError
from granite_jax.sampling import check_utf8, is_int

Prompts = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


class PromptEncoder:
    """Turns a prompt or a batch into token ids for a model of `vocab_size` tokens. `source` names where the
    tokenizer came from, in errors (None: it was given)."""

    def __init__(self, tokenizer: Any, vocab_size: int, source: str | None = None):
        self.tokenizer, self.vocab_size, self.source = tokenizer, vocab_size, source

    def encode(
        self, prompts: Prompts, *, chat: bool = False, system: str | None = None
    ) -> tuple[list[str | None], list[list[int]]]:
        """(prompt texts or None, token ids) of a prompt or batch: strings, or token ids (a list of ints, or a list of
        lists). `chat` applies the tokenizer's chat template, with `system` as the system message."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence | np.ndarray) or isinstance(prompts, bytes | bytearray):
            raise GenerationError(
                f"prompts must be a string, token ids, or a list of either; got {type(prompts).__name__}"
            )
        if system is not None and not isinstance(system, str):
            raise GenerationError(f"system must be a string or None, got {type(system).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise GenerationError("no prompts given")
        if all(is_int(p) for p in prompts):
            prompts = [prompts]  # one pre-tokenized prompt
        if all(isinstance(p, str) for p in prompts):
            return prompts, [self._tokenize(i, p, chat, system) for i, p in enumerate(prompts)]
        if chat:
            raise GenerationError("chat=True needs text prompts, not token ids")
        ids = [self._ids(i, p) for i, p in enumerate(prompts)]
        return [None] * len(ids), ids

    def check_vocab(self, what: str, ids: Sequence[int], hint: str = "") -> None:
        """GenerationError naming the first id outside [0, vocab_size)."""
        if bad := [i for i in ids if not 0 <= i < self.vocab_size]:
            raise GenerationError(f"{what} {bad[0]} is outside [0, vocab_size={self.vocab_size}){hint}")

    def _tokenize(self, index: int, prompt: str, chat: bool, system: str | None) -> list[int]:
        if not prompt:
            raise GenerationError(f"prompt {index + 1} is empty")
        for name, text in ((f"prompt {index + 1}", prompt), ("the system message", system or "")):
            check_utf8(name, text)
        if self.tokenizer is None:
            where = f"{self.source}: no tokenizer files (tokenizer.json / tokenizer_config.json)"
            raise GenerationError(f"{where if self.source else 'no tokenizer was given'}; pass token ids")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise GenerationError(f"{self.source}: the tokenizer has no chat template")
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise GenerationError(f"prompt {index + 1} is empty after tokenization")
        hint = ": the tokenizer files do not match this checkpoint"
        self.check_vocab(f"prompt {index + 1}: the tokenizer gave token id", ids, hint)
        return list(ids)

    def _ids(self, index: int, ids) -> list[int]:
        if isinstance(ids, str) or not isinstance(ids, Sequence | np.ndarray):
            raise GenerationError("prompts must be all strings or all lists of token ids")
        ids = [int(i) for i in ids] if all(is_int(i) for i in ids) else None
        if ids is None:
            raise GenerationError(f"prompt {index + 1}: token ids must be integers")
        if not ids:
            raise GenerationError(f"prompt {index + 1} is empty")
        self.check_vocab(f"prompt {index + 1}: token id", ids)
        return ids
