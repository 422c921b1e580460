"""Token streams and the batches drawn from them.

A split's files are tokenized once into one stream, each file followed by the end-of-text token, and kept beside the
run (`tokens_file`): a resumed or repeated run reads it back. Training rows are windows of seq_len + 1 tokens of that
stream; each epoch shifts the windows by a random offset and visits them in a random order, both drawn from the seed
and the epoch alone. So the rows of step s are a function of (seed, s): a resumed run draws exactly the batches the
uninterrupted run would have, with no loader state to checkpoint.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from granite_jax.training.corpus import read_text


def tokenize_files(files: list[str], tokenizer, eos_id: int) -> np.ndarray:
    """The files' tokens as one int32 stream, each file followed by `eos_id`."""
    encoded = tokenizer.backend_tokenizer.encode_batch([read_text(f) for f in files], add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids + [eos_id], np.int32) for e in encoded] or [np.zeros(0, np.int32)])


def cached_tokens(path: str, files: list[str], tokenizer, eos_id: int) -> np.ndarray:
    """`tokenize_files`, read from `path` (.npy) when an earlier run wrote it; written atomically otherwise."""
    if os.path.isfile(path):
        return np.load(path, allow_pickle=False)
    tokens = tokenize_files(files, tokenizer, eos_id)
    partial = f"{path}.partial-{os.getpid()}.npy"
    np.save(partial, tokens, allow_pickle=False)
    os.replace(partial, path)
    return tokens


@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows of a language-modelling batch: inputs and targets (..., T) int32, mask (..., T) 1.0 where the target is
    a real token (0.0 past the end of the stream: padding carries no loss)."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray

    def reshaped(self, *shape: int) -> Batch:
        return Batch(*(a.reshape(*shape, a.shape[-1]) for a in (self.inputs, self.targets, self.mask)))


def windows(stream: np.ndarray, seq_len: int, offset: int, pad_id: int) -> Batch:
    """The stream from `offset` cut into rows of seq_len targets (the last row padded and masked)."""
    body = stream[offset:]
    n = max(-(-(len(body) - 1) // seq_len), 0)
    padded = np.full(n * seq_len + 1, pad_id, np.int32)
    padded[: len(body)] = body[: len(padded)]
    mask = np.zeros(n * seq_len + 1, np.float32)
    mask[1 : len(body)] = 1.0
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    rows = padded[idx]
    return Batch(rows[:, :-1], rows[:, 1:], mask[idx][:, 1:])


class Sampler:
    """Training rows, as a function of the step: step s takes rows [s * rows, (s + 1) * rows) of the sequence of
    epochs, each epoch the same number of whole windows of the stream, at a random offset, in a random order, both
    drawn from (seed, epoch). A stream shorter than two rows gives one row a epoch, padded."""

    def __init__(self, stream: np.ndarray, seq_len: int, seed: int, pad_id: int):
        self.stream, self.seq_len, self.seed, self.pad_id = stream, seq_len, seed, pad_id
        self.rows_per_epoch = max((len(stream) - seq_len) // seq_len, 1)
        self._epoch: tuple[int, Batch, np.ndarray] | None = None

    def _epoch_rows(self, epoch: int) -> tuple[Batch, np.ndarray]:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.seq_len)) if epoch and self.rows_per_epoch > 1 else 0
            rows = windows(self.stream, self.seq_len, offset, self.pad_id)
            n = self.rows_per_epoch
            self._epoch = (epoch, Batch(rows.inputs[:n], rows.targets[:n], rows.mask[:n]), rng.permutation(n))
        return self._epoch[1], self._epoch[2]

    def batch(self, step: int, rows: int) -> Batch:
        """The `rows` rows of step `step` (a batch that crosses an epoch's end takes the next epoch's first rows)."""
        picked = []
        i, end = step * rows, (step + 1) * rows
        while i < end:
            epoch, index = divmod(i, self.rows_per_epoch)
            all_rows, order = self._epoch_rows(epoch)
            chosen = order[index : index + min(end - i, self.rows_per_epoch - index)]
            picked.append(Batch(all_rows.inputs[chosen], all_rows.targets[chosen], all_rows.mask[chosen]))
            i += len(chosen)
        return Batch(*(np.concatenate([getattr(b, f) for b in picked]) for f in ("inputs", "targets", "mask")))
