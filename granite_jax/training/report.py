"""A run's reporting: metrics as JSON lines, the progress bar (on a terminal) or log lines, the loss curve as PNG."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class MetricsLog:
    """metrics.jsonl: one JSON object a line (training rows: step, loss, tokens, grad_norm, lr, tokens_per_s;
    evaluation rows: step, held_out_loss). A resumed run first drops the rows after its checkpoint's step."""

    def __init__(self, path: str, keep_through: int):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        if os.path.isfile(path):
            with open(path) as f:
                self.rows = [row for row in map(json.loads, filter(str.strip, f)) if row["step"] <= keep_through]
        partial = f"{path}.partial-{os.getpid()}"
        with open(partial, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.rows)
        os.replace(partial, path)

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def last(self, key: str) -> float | None:
        return next((row[key] for row in reversed(self.rows) if key in row), None)


class Window:
    """Tokens trained since the last reset, and their rate in tokens per second of wall time."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.tokens, self.start = 0.0, time.perf_counter()

    def add(self, tokens: float) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)


class Progress:
    """A tqdm bar with loss and tokens/s (ETA by tqdm) on a terminal; elsewhere one line a report on stderr."""

    def __init__(self, total: int, start: int, *, enabled: bool | None = None):
        self.tty = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.bar = total, None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def show(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        else:
            print(f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(rows: list[dict[str, Any]], path: str) -> None:
    """Training loss (and its running mean) and held-out loss against the step, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    held = [(r["step"], r["held_out_loss"]) for r in rows if "held_out_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), lw=0.8, alpha=0.5, label="training loss")
    if held:
        ax.plot(*zip(*held), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    partial = f"{path}.partial-{os.getpid()}.png"
    fig.savefig(partial, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(partial, path)


def training_flops_per_token(cfg, seq_len: int) -> float:
    """Model FLOPs a trained token costs: 3x the forward's (backward twice the forward, as in PaLM's MFU, no
    rematerialisation counted). The forward: 2 per weight a token meets (projections, the k routed experts and the
    shared MLP, the router, the head), attention over seq_len / 2 keys on average (causal), and the SSD's matrix
    products (chunk states, their read-out, the causal half of the diagonal blocks, C B^T per group)."""
    H, per_token = cfg.hidden_size, 0
    for kind in cfg.layer_types:
        if kind == "mamba":
            per_token += H * (cfg.mamba_in_proj_dim + cfg.mamba_d_inner)
            h, p, g, n, chunk = (
                cfg.mamba_n_heads,
                cfg.mamba_d_head,
                cfg.mamba_n_groups,
                cfg.mamba_d_state,
                cfg.mamba_chunk_size,
            )
            per_token += (4 * h * p * n + chunk * h * p + 2 * chunk * g * n) / 2  # counted as multiply-adds
        else:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            per_token += H * (2 * q + 2 * kv) + 2 * q * seq_len / 2
        if cfg.num_local_experts:
            per_token += H * cfg.num_local_experts + cfg.num_experts_per_tok * 3 * H * cfg.intermediate_size
        per_token += 3 * H * cfg.shared_intermediate_size
    per_token += H * cfg.vocab_size
    return 3.0 * 2.0 * per_token
