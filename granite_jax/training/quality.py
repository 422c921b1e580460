"""What a trained model is worth: held-out loss beside n-gram baselines, and whether its code completions parse.

Baselines are the cross-entropy of the held-out tokens under a unigram and a bigram model counted on the training
stream: the bigram interpolated with the unigram by Witten-Bell (a context's weight is its count over its count plus
its number of distinct followers), the unigram add-one smoothed, so every token has a probability and nothing is
tuned on the held-out set.
"""

from __future__ import annotations

import ast

import numpy as np

from granite_jax.training.corpus import read_text


def ngram_baselines(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> dict[str, float]:
    """Mean cross-entropy (nats per token) of held_out[1:] under the unigram and the bigram model of `train`."""
    unigram = (np.bincount(train, minlength=vocab_size) + 1.0) / (len(train) + vocab_size)
    pairs = train[:-1].astype(np.int64) * vocab_size + train[1:]
    keys, counts = np.unique(pairs, return_counts=True)
    context_count = np.bincount(train[:-1], minlength=vocab_size).astype(np.float64)
    followers = np.bincount(keys // vocab_size, minlength=vocab_size).astype(np.float64)
    prev, nxt = held_out[:-1], held_out[1:]
    query = prev.astype(np.int64) * vocab_size + nxt
    at = np.clip(np.searchsorted(keys, query), 0, len(keys) - 1)
    pair_count = np.where(keys[at] == query, counts[at], 0).astype(np.float64)
    seen = context_count[prev] > 0
    weight = np.where(seen, context_count[prev] / np.maximum(context_count[prev] + followers[prev], 1.0), 0.0)
    bigram = weight * pair_count / np.maximum(context_count[prev], 1.0) + (1.0 - weight) * unigram[nxt]
    return {"unigram": float(-np.log(unigram[nxt]).mean()), "bigram": float(-np.log(bigram).mean())}


def function_headers(files: list[str], count: int) -> list[str]:
    """Up to `count` distinct function headers, dedented: from each parseable file in order, its first one-line
    `def ...:` not taken already (generated modules such as the codecs share theirs)."""
    headers: list[str] = []
    for path in files:
        try:
            text = read_text(path)
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.body and node.body[0].lineno == node.lineno + 1:
                line = lines[node.lineno - 1].strip()
                if line.startswith("def ") and line.endswith(":") and line not in headers:
                    headers.append(line)
                    break
        if len(headers) == count:
            break
    return headers


def function_body(completion: str) -> str:
    """The completion of a header (the rest of its line, then the body) up to its first dedent: the lines before the
    first non-blank line indented less than the body's first line (Python's DEDENT, so a body may take any depth, as
    a method's header shown dedented gets one), and, if generation stopped before one, without its last, unfinished
    line."""
    lines = completion.split("\n")
    end = _dedent(lines)
    return "\n".join(lines[:end] if end is not None else lines[:-1])


def ends(completion: str) -> bool:
    """Whether the completion's body ends at a dedent of its own, not cut short by the token limit."""
    return _dedent(completion.split("\n")) is not None


def _dedent(lines: list[str]) -> int | None:
    """The index of the first non-blank line after the first that is indented less than the body's first line (or at
    column 0), if any."""
    depth = None
    for i, line in enumerate(lines[1:], start=1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if depth is None:
            depth = indent
        if indent < depth or indent == 0:
            return i
    return None


def parses(header: str, body: str) -> bool:
    try:
        ast.parse(header + body)
    except (SyntaxError, ValueError):
        return False
    return True


def header_completions(generator, headers: list[str], max_new_tokens: int) -> dict:
    """Greedy completions of `headers` by a `Generator`, cut at the first dedent: the share whose function parses as
    Python (`ast.parse`), the share that also ends at a dedent of its own (a body cut short by the token limit, its
    unfinished last line dropped, may parse too), and each header with its body."""
    # The prompt ends at the colon: a trailing newline would split the "newline + indent" token BPE learned.
    results = generator.generate(headers, max_new_tokens=max_new_tokens)
    items = []
    for header, result in zip(headers, results):
        body = function_body(result.text)
        items.append({"header": header, "body": body, "parses": parses(header, body), "ends": ends(result.text)})
    n = max(len(items), 1)
    share = sum(item["parses"] for item in items) / n
    ended = sum(item["parses"] and item["ends"] for item in items) / n
    return {"parse_share": share, "parse_and_end_share": ended, "count": len(items), "completions": items}
