"""Load on `python -m granite_jax.serve`: throughput and latency at rising concurrency, measured with streaming clients.

    python benchmarks/serve_load.py                                   # a random small hybrid on this CPU
    python benchmarks/serve_load.py --model ckpt/granite-4.0-h-tiny --dtype bfloat16 --concurrency 1,8,32,64
    python benchmarks/serve_load.py --shape granite-4.0-h-tiny --layers 8 --dtype bfloat16   # a GPU, no weights

The server runs as users run it (a process on localhost); each of C clients sends streaming completion requests
back to back (a closed loop: a new request arrives whenever one ends, so prefills keep landing among the running
decodes) for --seconds. Per level: output tokens/s over that window (the tokens that arrived in it), time to first
token, and the gaps between streamed tokens (inter-token latency) p50 and p99 over every request. Ratios: each
level's throughput over concurrency 1's, measured in the same run; p99 over p50 ITL; and the engine's ceiling: a
decode step of that many rows timed in this process before the server starts, C / t(C) tokens/s, against which each
level's throughput is given. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

# A random hybrid of a small model's shape (about 30M parameters): Mamba-2 layers with one attention layer, MoE with
# the shared MLP, NoPE; the tokenizer is granite_jax.testing's byte-level BPE.
SMALL = dict(
    hidden_size=384,
    num_hidden_layers=8,
    layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 4,
    num_attention_heads=6,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=256,
    shared_intermediate_size=512,
    mamba_n_heads=12,
    mamba_d_head=64,
    mamba_d_state=64,
    mamba_chunk_size=64,
    tie_word_embeddings=False,
    embedding_multiplier=1.0,
)
PROMPTS = [
    "def forward(x):",
    "The hybrid design mixes Mamba-2 state space layers with attention, so that",
    "Granite is a family of language models.",
    "Long context at constant decode memory, many sequences at once: the quick brown fox jumps over the lazy dog",
]


def parse_args(argv=None) -> argparse.Namespace:
    from granite_jax.cli import (
        ArgumentParser,
        model_dir,
        output_file_problem,
        positive_float,
        positive_int,
        positive_ints,
    )
    from granite_jax.presets import RELEASED

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=model_dir, default=None, help="checkpoint to serve (None: a random small hybrid)")
    p.add_argument(
        "--shape", choices=sorted(RELEASED), default=None, help="random weights of this released shape instead"
    )
    p.add_argument("--layers", type=positive_int, default=None, help="with --shape: N layers, same attention share")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the server's --dtype")
    p.add_argument("--concurrency", type=positive_ints, default="1,8,32,64", help="client counts, one level each")
    p.add_argument("--seconds", type=positive_float, default=20.0, help="each level's window of load")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per request (EOS ignored)")
    p.add_argument("--max-batch", type=positive_int, default=64, help="the server's --max-batch")
    p.add_argument("--prefill-budget", type=positive_int, default=32, help="the server's --prefill-budget")
    p.add_argument("--feed-below", type=positive_int, default=16, help="the server's --feed-below")
    p.add_argument("--out", default=None, help="JSON path (a PNG is written beside it; None: JSON on stdout)")
    args = p.parse_args(argv)
    if problem := output_file_problem("--out", args.out):
        p.error(problem)
    if args.layers is not None and args.shape is None:
        p.error("--layers needs --shape")
    return args


async def one_request(client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming request; return when it was sent and when each of its tokens arrived (one event a token)."""
    sent, stamps = time.perf_counter(), []
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["finish_reason"] is None:
                    stamps.append(time.perf_counter())
    return {"sent": sent, "stamps": stamps}


async def level(url: str, clients: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    """C clients send requests back to back for `seconds`; throughput counts the tokens that arrived in that window
    (the requests still running at its end finish, for their latencies, but their later tokens are not counted)."""
    import httpx

    async def client_loop(client, index: int, deadline: float) -> list[dict[str, Any]]:
        out, r = [], 0
        while time.perf_counter() < deadline:
            body = {
                "prompt": PROMPTS[(index + r) % len(PROMPTS)] + f" ({index}.{r})",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            out.append(await one_request(client, url, body))
            r += 1
        return out

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + seconds
        results = await asyncio.gather(*(client_loop(client, i, deadline) for i in range(clients)))
    done = [r for rs in results for r in rs]
    gaps = np.concatenate([np.diff(r["stamps"]) for r in done])
    ttft = np.asarray([r["stamps"][0] - r["sent"] for r in done])
    tokens = sum(int(np.sum(np.asarray(r["stamps"]) <= deadline)) for r in done)
    return {
        "concurrency": clients,
        "requests": len(done),
        "tokens_in_window": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "itl_p50_s": float(np.percentile(gaps, 50)),
        "itl_p99_s": float(np.percentile(gaps, 99)),
    }


def random_shape(name: str | None, layers: int | None) -> dict[str, Any]:
    """config.json fields of the random model: SMALL, or a released shape with `layers` layers."""
    if name is None:
        return SMALL
    from granite_jax.experiments.common import with_num_layers
    from granite_jax.presets import RELEASED, released_config

    cfg = released_config(name)
    cfg = cfg if layers is None else with_num_layers(cfg, layers)
    fields = {k: v for k, v in RELEASED[name].items() if k != "model_type"}
    return fields | dict(num_hidden_layers=len(cfg.layer_types), layer_types=list(cfg.layer_types))


def decode_step_seconds(model: str, dtype: str, sizes: list[int], clock: int = 256, repeats: int = 20) -> dict:
    """A decode step's time at each batch size, the rows `clock` tokens long, measured in this process before the
    server starts: the engine's ceiling is C / t(C) tokens/s at C clients (every row decoding, no prefill)."""
    import jax

    from granite_jax.generation import Generator
    from granite_jax.sampling import SamplingConfig
    from granite_jax.serving import rows

    generator = Generator(model, dtype=dtype)
    steps, out = generator.steps, {}
    for size in sizes:
        cache = rows.reclock(steps.cache(size, clock + 64, np.zeros(size, np.int32)), np.int32(-clock))
        params = jax.device_put(SamplingConfig.row_params([SamplingConfig()] * size))
        tokens = np.zeros(size, np.int32)
        for i in range(repeats + 3):
            if i == 3:
                start = time.perf_counter()
            _, ids, cache = steps.decode(generator.prepared(size), cache, tokens, params, tokens)
            np.asarray(ids)
        out[size] = (time.perf_counter() - start) / repeats
    return out


def start_server(args, model: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "granite_jax.serve", "--model", model, "--port", "0", "--dtype", args.dtype]
    command += ["--max-batch", str(args.max_batch), "--prefill-budget", str(args.prefill_budget), "--max-context"]
    command += ["1024", "--log-level", "error", "--feed-below", str(args.feed_below)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in server.stderr:
        if line.startswith("serving "):
            return server, line.split(" on ")[1].strip()
    raise SystemExit(f"the server did not start (exit {server.wait()})")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["tokens_per_s"] for r in rows], "o-", label="served")
    a.plot(c, [r["ceiling_tokens_per_s"] for r in rows], "s--", label="ceiling: C rows / one step's time")
    a.legend()
    a.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    for key, style in (("itl_p50_s", "o-"), ("itl_p99_s", "s--"), ("ttft_p50_s", "^:")):
        b.plot(c, [r[key] * 1e3 for r in rows], style, label=key.replace("_s", ""))
    b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from granite_jax.testing import make_checkpoint

            model = make_checkpoint(os.path.join(tmp, "model"), seed=0, **random_shape(args.shape, args.layers))
        step = decode_step_seconds(model, args.dtype, sorted({1, *(min(c, args.max_batch) for c in args.concurrency)}))
        server, base = start_server(args, model)
        try:
            url = f"{base}/v1/completions"
            rows = []
            for clients in args.concurrency:
                rows.append(asyncio.run(level(url, clients, args.seconds, args.max_tokens)))
                r = rows[-1]
                r["throughput_vs_c1"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
                r["itl_p99_over_p50"] = r["itl_p99_s"] / r["itl_p50_s"]
                rows_run = min(clients, args.max_batch)
                r["decode_step_s"] = step[rows_run]
                r["ceiling_tokens_per_s"] = rows_run / step[rows_run]
                r["of_ceiling"] = r["tokens_per_s"] / r["ceiling_tokens_per_s"]
                r["ceiling_vs_c1"] = r["ceiling_tokens_per_s"] * step[1]
                print(
                    f"c={clients:3d}  {r['tokens_per_s']:8.1f} tok/s ({r['throughput_vs_c1']:5.2f}x c1)  "
                    f"TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms  ITL p50 {r['itl_p50_s'] * 1e3:6.1f} ms "
                    f"p99 {r['itl_p99_s'] * 1e3:6.1f} ms ({r['itl_p99_over_p50']:.2f}x)  "
                    f"step {step[rows_run] * 1e3:5.1f} ms: "
                    f"{r['of_ceiling']:.0%} of {r['ceiling_tokens_per_s']:.0f} tok/s ({r['ceiling_vs_c1']:.2f}x c1)",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(60)
    shape = None if args.model else random_shape(args.shape, args.layers)
    result = {"model": args.model or f"random {args.shape or 'small hybrid'}", "shape": shape, "levels": rows}
    result |= {"dtype": args.dtype, "max_tokens": args.max_tokens, "max_batch": args.max_batch}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        plot(rows, os.path.splitext(args.out)[0] + ".png")
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
