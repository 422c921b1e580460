"""How many GPU kernels one Generator step launches, counted without a GPU (deviceless compile for an H200).

    PYTHONPATH=.aot python benchmarks/gpu_step_kernels.py                       # h-tiny, bf16, Pallas SSD, batch 1
    PYTHONPATH=.aot python benchmarks/gpu_step_kernels.py --ssd-impl xla --json out.json

A decode step of a few milliseconds on a GPU is bound by its launches, not by the bytes it reads (h-tiny reads 2.9 GB
a token, 0.6 ms at an H200's 4.8 TB/s, a fraction of its step: docs/experiments.md). This compiles the Generator's own
steps (`granite_jax.generation.steps`: the decode step with its cache donated, and the prefill of --prompt-len
tokens) for the released model --shape with abstract weights, through XLA's GPU compiler, and counts the thunks of
each by kind (`pallas_kernels.aot.thunk_counts`): kernel launches (XLA's fusions and the Pallas calls), device copies,
loops and conditionals. Loop bodies and both branches of a conditional count once, so this is the program's size, an
upper bound on one greedy step's launches outside loops. It also compiles one- and two-layer models of the same shape
to split the decode step's kernels into one Mamba layer, one attention layer and the rest (embedding, head, sampler).
No GPU is needed, but the CUDA PJRT plugin is (`make test` installs it into .aot/, hence PYTHONPATH=.aot;
pallas_kernels/aot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a plain checkout

KINDS = ("kCustomKernel", "kCopy", "kWhile", "kConditional")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, add_shape_argument, output_file_problem, positive_int

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_shape_argument(p, "the weights and dimensions", default="granite-4.0-h-tiny")
    p.add_argument("--layers", type=positive_int, help="only the first LAYERS layers (default: all)")
    p.add_argument("--batch", type=positive_int, default=1, help="rows per step")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activations")
    p.add_argument("--weight-dtype", choices=("bfloat16", "float32"), help="weights (default: --dtype)")
    p.add_argument("--ssd-impl", choices=("pallas", "xla"), default="pallas", help="the Mamba SSD")
    p.add_argument("--prompt-len", type=positive_int, default=512, help="tokens of the prefill step")
    p.add_argument("--cache-len", type=positive_int, default=1024, help="KV cache slots")
    p.add_argument("--gpu", choices=("h200", "h100", "a100"), default="h200", help="compile target")
    p.add_argument("--json", metavar="PATH", help="also write the counts as JSON to PATH")
    args = p.parse_args(argv)
    if args.prompt_len > args.cache_len:
        p.error(f"--prompt-len {args.prompt_len} does not fit --cache-len {args.cache_len}")
    if (problem := output_file_problem("--json", args.json)) is not None:
        p.error(problem)
    return args


def step_counts(cfg, args: argparse.Namespace, steps: tuple[str, ...] = ("decode", "prefill")) -> dict[str, dict]:
    """Thunk counts of the Generator's steps for the model `cfg` with abstract weights (the cache donated)."""
    import jax.numpy as jnp

    import pallas_kernels
    from granite_jax.generation.steps import abstract_steps
    from granite_jax.ops import Runtime
    from pallas_kernels import aot

    dtype, weight_dtype = jnp.dtype(args.dtype), jnp.dtype(args.weight_dtype or args.dtype)
    shapes = dict(batch=args.batch, prompt_len=args.prompt_len, cache_len=args.cache_len)
    runtime = Runtime(ssd=args.ssd_impl)
    fns = abstract_steps(cfg, **shapes, dtype=dtype, weight_dtype=weight_dtype, runtime=runtime)
    with pallas_kernels.cuda_lowering():  # args: (weights, prepared, cache, ...), the cache donated
        return {
            name: aot.thunk_counts(fns[name][0], *fns[name][1], donate_argnums=(2,), gpu=args.gpu) for name in steps
        }


def marginal_counts(cfg, args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """The decode step's thunks split into one layer of each kind the shape has and the rest, from models of one and
    two of its layers (differences of their counts)."""

    def decode(types: tuple[str, ...]) -> dict[str, int]:
        return step_counts(cfg.replace(layer_types=types), args, ("decode",))["decode"]

    kinds = tuple(sorted(set(cfg.layer_types), key=cfg.layer_types.index))  # in order of first appearance
    base = decode(kinds[:1])
    parts = {}
    for kind in kinds:
        more = decode((kinds[0], kind))
        parts[f"{kind}_layer"] = {k: more.get(k, 0) - base.get(k, 0) for k in KINDS}
    parts["rest"] = {k: base.get(k, 0) - parts[f"{kinds[0]}_layer"][k] for k in KINDS}
    return parts


def table(result: dict[str, Any]) -> str:
    lines = ["| part | kernels | copies | loops | conditionals |", "|---|---|---|---|---|"]
    rows = [(f"{name} step", c) for name, c in result["steps"].items()]
    rows += [(f"decode: {name.replace('_', ' ')}", c) for name, c in result["decode_parts"].items()]
    for label, c in rows:
        lines.append(f"| {label} | " + " | ".join(str(c.get(k, 0)) for k in KINDS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from granite_jax.presets import released_config
    from pallas_kernels import aot

    try:
        aot.gpu_device(args.gpu)
    except aot.AotUnavailableError as e:
        print(f"gpu_step_kernels.py: error: {e}; run with PYTHONPATH=.aot after `make test` has installed it",
              file=sys.stderr)  # fmt: skip
        return 2
    cfg = released_config(args.shape)
    if args.layers is not None:
        cfg = cfg.replace(layer_types=cfg.layer_types[: args.layers])
    print(f"compiling {args.shape} ({len(cfg.layer_types)} layers) for {args.gpu}...", file=sys.stderr)
    import jax

    result = dict(
        jax=jax.__version__,  # the counts are XLA's: another jax version fuses differently
        shape=args.shape,
        layers=len(cfg.layer_types),
        mamba_layers=cfg.layer_types.count("mamba"),
        attention_layers=cfg.layer_types.count("attention"),
        args=vars(args),
        steps=step_counts(cfg, args),
        decode_parts=marginal_counts(cfg, args),
    )
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
