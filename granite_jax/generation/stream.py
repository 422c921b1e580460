"""One row's generated text: incremental detokenization, stop tokens and stop strings, streamed pieces.

Text is decoded from the growing id list and extended only when a token completes a character (an incomplete UTF-8
sequence waits for the next token). A tail that could begin a stop string is held back from the stream until the
next tokens settle it, so streamed text never shows a stop string and always adds up to the final text.
"""

from __future__ import annotations

from collections.abc import Sequence


class RowStream:
    """One row's generated tokens: incremental detokenization, stop token/string detection, streamed text."""

    def __init__(self, row: int, tokenizer, stop_ids, stop_strings: tuple[str, ...], callback, at_max_position=False):
        self.row, self.tokenizer, self.stop_ids, self.stop_strings = row, tokenizer, stop_ids, stop_strings
        self.callback = callback
        self.length_reason = "max_position" if at_max_position else "length"
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of text already streamed
        self._prefix, self._read = 0, 0  # incremental-decode offsets into ids
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop_token"
        elif self.tokenizer is not None:
            self._append_text()
        self._stream()

    def finish(self) -> None:
        """Mark the row finished by length (if still running), settle the final text and stream the rest."""
        if self.finish_reason is None:
            self.finish_reason = self.length_reason
        if self.tokenizer is not None:
            ids = self.ids[:-1] if self.finish_reason == "stop_token" else self.ids
            self.text = _cut_at_stop(self._decode(ids), self.stop_strings)
        self._stream(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _append_text(self) -> None:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        start = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        if self.stop_strings:
            window = max(map(len, self.stop_strings))
            cut = _cut_at_stop(self.text, self.stop_strings, start=max(0, start - window + 1))
            if len(cut) < len(self.text):
                self.text, self.finish_reason = cut, "stop_string"

    def _stream(self, final: bool = False) -> None:
        if self.callback is None:
            return
        end = len(self.text) if final or self.done else len(self.text) - _held_back(self.text, self.stop_strings)
        if end > self.emitted:
            self.callback(self.row, self.text[self.emitted : end])
            self.emitted = end


def _cut_at_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> str:
    hits = [i for s in stop_strings if (i := text.find(s, start)) >= 0]
    return text[: min(hits)] if hits else text


def _held_back(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest tail of text that could begin a stop string (not streamed until resolved)."""
    return max(
        (k for s in stop_strings for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0
    )
