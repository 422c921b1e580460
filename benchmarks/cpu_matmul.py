"""The decode products of a released model's shape: granite_jax.cpu_matmul's kernel against XLA's dot, on this CPU.

    python benchmarks/cpu_matmul.py                              # h-350m's weight shapes, 1-16 rows
    python benchmarks/cpu_matmul.py --rows 8 --json out.json

For every distinct (out, in) weight shape of the model (and the tied head), a jitted chain of products against
enough different weight matrices to overflow the caches, so each product reads its weights from memory as in a
decode step; kernel and XLA timed alternately in one run, best of --repeats. Prints GB/s of weights read and the
ratio; `linear` only sends MIN_ROWS..MAX_ROWS rows to the kernel, the other row counts show why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a plain checkout


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--shape", default="granite-4.0-h-350m", help="weight shapes of this released architecture")
    p.add_argument("--rows", default="1,2,4,8,16", help="comma-separated rows of x (the decode batch size)")
    p.add_argument("--chain-mib", type=int, default=192, help="weights read per timed call, MiB (beyond the caches)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (best kept)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if min(args.rows) < 1 or args.chain_mib < 1 or args.repeats < 1:
        p.error("need rows >= 1, --chain-mib >= 1 and --repeats >= 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: the parent directory does not exist")
    return args


def weight_shapes(name: str) -> list[tuple[int, int]]:
    """Distinct (out, in) shapes of the model's Linear weights and its output head."""
    from flax import nnx

    from granite_jax.model import Granite, Linear, abstract_model
    from granite_jax.presets import released_config

    cfg = released_config(name)
    model: Granite = abstract_model(cfg)
    shapes = {tuple(m.weight.shape) for _, m in nnx.iter_graph(model) if isinstance(m, Linear)}
    shapes.add((cfg.vocab_size, cfg.hidden_size))
    return sorted(shapes)


def measure(shape: tuple[int, int], rows: int, chain_bytes: int, repeats: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from granite_jax import cpu_matmul

    n, k = shape
    count = max(1, -(-chain_bytes // (n * k * 4)))
    rng = np.random.default_rng(0)
    weights = [jax.device_put(rng.standard_normal((n, k), np.float32)) for _ in range(count)]
    x = jax.device_put(rng.standard_normal((rows, k), np.float32))
    fns = {
        "kernel": jax.jit(lambda x, ws: sum(cpu_matmul._kernel(x, w) for w in ws)),
        "xla": jax.jit(lambda x, ws: sum(cpu_matmul.dot(x, w) for w in ws)),
    }
    best = {}
    for name, fn in fns.items():
        fn(x, weights).block_until_ready()
        best[name] = float("inf")
    for _ in range(repeats):  # alternate, so both see the same machine
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x, weights).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - start)
    read = count * n * k * 4
    return dict(
        out=n,
        inp=k,
        rows=rows,
        matrices=count,
        kernel_gb_s=read / best["kernel"] / 1e9,
        xla_gb_s=read / best["xla"] / 1e9,
        kernel_vs_xla=best["xla"] / best["kernel"],
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from granite_jax import cpu_matmul

    if not cpu_matmul.available():
        print(f"error: the kernel is not available here: {cpu_matmul.unavailable_reason()}", file=sys.stderr)
        return 2
    shapes = weight_shapes(args.shape)
    work = [(s, r) for s in shapes for r in args.rows]
    results = [
        measure(s, r, args.chain_mib << 20, args.repeats)
        for s, r in tqdm(work, desc="products", unit="shape", file=sys.stderr)
    ]
    print(
        f"{args.shape} weight shapes, float32; GB/s of weights read (kernel used for rows "
        f"{cpu_matmul.MIN_ROWS}-{cpu_matmul.MAX_ROWS})"
    )
    print("| W (out x in) | rows | kernel GB/s | XLA GB/s | kernel / XLA |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['out']} x {r['inp']} | {r['rows']} | {r['kernel_gb_s']:.1f} | {r['xla_gb_s']:.1f} | "
            f"{r['kernel_vs_xla']:.2f}x |"
        )
    if args.json:
        from granite_jax.experiments.common import environment

        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results, environment=environment()), f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
