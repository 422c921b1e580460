"""Prefill and decode throughput of granite-jax and transformers on the same random checkpoint, on this CPU.

    python benchmarks/throughput.py                       # granite-4.0-h-350m shape, batch 1 and 8
    python benchmarks/throughput.py --layers 4 --new-tokens 8 --prompt-len 64   # a quick look

Builds (once, cached in --work-dir) a random-weight checkpoint of a released shape with transformers, then measures in
one run: the memory bandwidth (best of a few streaming reductions over a 1 GiB array, numpy and XLA), granite-jax's
`Generator.measure` (greedy, EOS ignored, compilation excluded) and transformers' `generate` (greedy, EOS ignored),
each at every batch size. Prefill tokens/s = batch * prompt_len / time to first token; decode tokens/s = batch *
(new_tokens - 1) / time for the remaining tokens. The batch-1 decode floor is parameter bytes / bandwidth: one decode
step has to read every weight once (the tied embedding once, as the output head).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

GIB = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints a table (and, with --json, a JSON document).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--shape", default="granite-4.0-h-350m", help="released architecture (granite_jax.presets.RELEASED)")
    p.add_argument(
        "--layers", type=int, default=None, help="keep the first N layers, one of them attention (a quicker run)"
    )
    p.add_argument("--checkpoint", default=None, help="use this checkpoint directory instead of a random one")
    p.add_argument("--work-dir", default="/tmp/granite_jax_bench", help="where random checkpoints are cached")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=17, help="generated tokens per sequence (the first is prefill's)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and activations")
    p.add_argument("--repeats", type=int, default=2, help="granite-jax timed runs per measurement (best kept)")
    p.add_argument("--hf-repeats", type=int, default=1, help="transformers timed runs per measurement (best kept)")
    p.add_argument("--skip-transformers", action="store_true", help="measure granite-jax only")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH ('-': stdout)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.new_tokens < 2 or args.prompt_len < 1 or min(args.batch_sizes) < 1:
        p.error("need --new-tokens >= 2, --prompt-len >= 1 and batch sizes >= 1")
    return args


# ---------------------------------------------------------------------------------------------- setup


def random_checkpoint(args: argparse.Namespace) -> str:
    """A random-weight checkpoint of the requested shape (built with transformers, cached by shape)."""
    from granite_jax.presets import RELEASED
    from granite_jax.testing import make_checkpoint

    config = dict(RELEASED[args.shape])
    name = args.shape
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
        kinds = config["layer_types"][: args.layers]
        if "attention" not in kinds:  # keep the model hybrid (transformers also fails on attention-free caches)
            kinds[len(kinds) // 2] = "attention"
        config["layer_types"] = kinds
        name += f"-{args.layers}l"
    out = os.path.join(args.work_dir, f"{name}-{args.dtype}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        print(f"building a random {name} checkpoint in {out} ...", file=sys.stderr)
        config.pop("model_type", None)
        make_checkpoint(out, 0, tokenizer=False, dtype=args.dtype, **config)
    return out


def memory_bandwidth(repeats: int = 5) -> dict[str, float]:
    """Read bandwidth in GB/s over 1 GiB of float32, best of a few runs: a numpy sum, an XLA sum, a numpy
    matrix-vector product (BLAS, all cores) and XLA matrix-vector products with the matrix in both layouts, (out, in)
    being the decode step's own access pattern (`model.Linear`); XLA spreads them over all cores."""
    import jax
    import jax.numpy as jnp

    host = np.ones(GIB // 4, np.float32)
    flat = jnp.ones(GIB // 4, jnp.float32)
    host_rows = host.reshape(-1, 8192)
    host_vector = np.ones(8192, np.float32)
    matrix = jnp.ones((8192, GIB // 4 // 8192), jnp.float32)  # (in, out)
    rows = jnp.ones((GIB // 4 // 8192, 8192), jnp.float32)  # (out, in)
    vector = jnp.ones((1, 8192), jnp.float32)
    total, matvec = jax.jit(jnp.sum), jax.jit(jnp.matmul)
    matvec_rows = jax.jit(lambda v, w: jax.lax.dot_general(v, w, (((1,), (1,)), ((), ()))))
    runs = {
        "numpy_sum": lambda: host.sum(),
        "numpy_matvec": lambda: host_rows @ host_vector,
        "xla_sum": lambda: total(flat).block_until_ready(),
        "xla_matvec": lambda: matvec(vector, matrix).block_until_ready(),
        "xla_matvec_rows": lambda: matvec_rows(vector, rows).block_until_ready(),
    }
    best = dict.fromkeys(runs, math.inf)
    for run in runs.values():  # warm up (compile, page in)
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t)
    return {k: GIB / v / 1e9 for k, v in best.items()}


# ---------------------------------------------------------------------------------------------- measurements


def granite_jax_rows(ckpt: str, args: argparse.Namespace, bar) -> tuple[list[dict[str, Any]], int]:
    from granite_jax.generate import Generator
    from granite_jax.model import count_params

    generator = Generator(ckpt, dtype=args.dtype)
    param_bytes = count_params(generator.model) * np.dtype(args.dtype).itemsize
    rows = []
    for b in args.batch_sizes:
        warm = generator.measure(b, args.prompt_len, 2)  # compile, and touch every buffer once
        runs = [generator.measure(b, args.prompt_len, args.new_tokens, seed=i) for i in range(args.repeats)]
        rows.append(
            dict(
                impl="granite-jax",
                batch=b,
                prefill_tok_s=max(t.prefill_tokens_per_s for t in runs),
                decode_tok_s=max(t.decode_tokens_per_s for t in runs),
                compile_s=warm.compile_s,
            )
        )
        bar.update()
    return rows, param_bytes


def transformers_rows(ckpt: str, args: argparse.Namespace, bar) -> list[dict[str, Any]]:
    """transformers' greedy `generate`, timed per step by a logits processor: it runs right after each forward, so
    the first call ends the prefill and the spacing of the later calls is the decode step."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def timed_generate(ids, n: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds for the n - 1 tokens after the first)."""
        clock = StepClock()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                logits_processor=LogitsProcessorList([clock]),
            )
        return clock.times[0] - start, clock.times[-1] - clock.times[0]

    rows = []
    rng = np.random.default_rng(0)
    for b in args.batch_sizes:
        timed_generate(torch.from_numpy(rng.integers(0, vocab, (b, 16))), 2)  # warm up, on a short prompt
        ids = torch.from_numpy(rng.integers(0, vocab, (b, args.prompt_len)))
        runs = [timed_generate(ids, args.new_tokens) for _ in range(args.hf_repeats)]
        rows.append(
            dict(
                impl="transformers",
                batch=b,
                prefill_tok_s=b * args.prompt_len / min(r[0] for r in runs),
                decode_tok_s=b * (args.new_tokens - 1) / min(r[1] for r in runs),
            )
        )
        bar.update()
    return rows


# ---------------------------------------------------------------------------------------------- report


def table(rows: list[dict[str, Any]], floor_tok_s: float) -> str:
    lines = [
        "| implementation | batch | prefill tok/s | decode tok/s | decode vs transformers | batch-1 decode vs floor |",
        "|---|---|---|---|---|---|",
    ]
    hf = {r["batch"]: r["decode_tok_s"] for r in rows if r["impl"] == "transformers"}
    for r in rows:
        decode = r["decode_tok_s"]
        speedup = f"{decode / hf[r['batch']]:.2f}x" if r["impl"] != "transformers" and r["batch"] in hf else ""
        of_floor = f"{decode / floor_tok_s:.0%}" if r["batch"] == 1 else ""
        cells = [r["impl"], r["batch"], f"{r['prefill_tok_s']:.1f}", f"{decode:.2f}", speedup, of_floor]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    ckpt = args.checkpoint or random_checkpoint(args)
    stages = len(args.batch_sizes) * (1 if args.skip_transformers else 2) + 1
    with tqdm(total=stages, desc="benchmark", unit="stage", file=sys.stderr) as bar:
        bandwidth = memory_bandwidth()
        bar.update()
        rows, param_bytes = granite_jax_rows(ckpt, args, bar)
        if not args.skip_transformers:
            rows += transformers_rows(ckpt, args, bar)
    gbs = max(bandwidth.values())
    floor_tok_s = gbs * 1e9 / param_bytes
    header = (
        f"checkpoint: {ckpt} ({param_bytes / 1e9:.2f} GB of {args.dtype} parameters); prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens; jax {jax.__version__} on {os.cpu_count()} CPU cores\n"
        f"memory bandwidth: {gbs:.2f} GB/s (best of " + ", ".join(f"{k} {v:.2f}" for k, v in bandwidth.items()) + "); "
        f"batch-1 decode floor (parameter bytes / bandwidth): {floor_tok_s:.2f} tok/s"
    )
    print(header)
    print(table(rows, floor_tok_s))
    if args.json:
        doc = dict(
            checkpoint=ckpt,
            args={k: v for k, v in vars(args).items() if k != "json"},
            param_bytes=param_bytes,
            bandwidth_gb_s=bandwidth,
            decode_floor_tok_s=floor_tok_s,
            rows=rows,
        )
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
