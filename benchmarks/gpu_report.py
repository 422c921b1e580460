"""What the Generator's steps will launch on an H200 and how long they should take, predicted without a GPU.

    PYTHONPATH=.aot python benchmarks/gpu_report.py                         # h-tiny, bf16, Pallas SSD: five steps
    PYTHONPATH=.aot python benchmarks/gpu_report.py --steps decode-b1 --layers 6 --json out.json
    PYTHONPATH=.aot python benchmarks/gpu_report.py --budget benchmarks/kernel_budget.json    # what CI runs

Each step (prefill of 512 and 8,192 tokens, decode at batch 1, 8 and 64 over a --cache-len cache) is the Generator's
own (`granite_jax.generation.steps`), with abstract weights of the released model --shape, compiled for an H200 by
XLA's GPU compiler without a GPU (`pallas_kernels.aot`). Its launches are read from the compiled program
(`pallas_kernels.executable`): which kernels run, which of them inside CUDA graphs (XLA command buffers), and each
one's bytes and FLOPs from XLA's cost analysis. A kernel is predicted to take max(bytes / 4.8 TB/s, FLOPs / 989
TFLOP/s), plus 4 us of launch for one outside a graph: a lower bound for what the program runs, since no kernel
reaches the peak. The step's floor is what it must do whatever the program: read the weights its tokens use (each
token's routed experts: the expected number of distinct experts), read or write the KV caches and the Mamba states,
and the model's FLOPs, at the same rates.

One layer of each kind is measured apart, as the difference between models of two and three of the shape's layers
(what is left, the embedding, head and sampler, is "rest"), so that each line says where a step's launches come
from. Conditionals count the branch moving the fewest bytes (greedy sampling); loops their known trip count.

--budget FILE reads the arguments and the largest kernel count allowed for each step from FILE, runs those, and exits
with 1 if a step launches more kernels than its budget (CI runs it at reduced depth). --record-budget writes such a
file from this run. Needs the CUDA PJRT plugin (`make test` installs it into .aot/, hence PYTHONPATH=.aot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a plain checkout

STEPS = {  # name -> (step, batch, tokens): prefill `tokens` prompt tokens, or decode one token a row
    "prefill-512": ("prefill", 1, 512),
    "prefill-8192": ("prefill", 1, 8192),
    "decode-b1": ("decode", 1, 1),
    "decode-b8": ("decode", 8, 1),
    "decode-b64": ("decode", 64, 1),
}
BUDGET_ARGS = ("shape", "layers", "steps", "dtype", "weight_dtype", "ssd_impl", "cache_len", "gpu", "per_layer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, add_shape_argument, output_file_problem, positive_int

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_shape_argument(p, "the weights and dimensions", default="granite-4.0-h-tiny")
    p.add_argument("--layers", type=positive_int, help="only the first LAYERS layers (default: all)")
    p.add_argument("--steps", help=f"comma-separated, of {', '.join(STEPS)} (default: all; with --budget, its own)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activations")
    p.add_argument("--weight-dtype", choices=("bfloat16", "float32"), help="weights (default: --dtype)")
    p.add_argument("--ssd-impl", choices=("pallas", "xla"), default="pallas", help="the Mamba SSD")
    p.add_argument("--cache-len", type=positive_int, default=1024, help="decode steps' KV cache slots")
    p.add_argument("--gpu", choices=("h200", "h100"), default="h200", help="compile target")
    p.add_argument("--no-per-layer", dest="per_layer", action="store_false", help="skip the per-layer split")
    p.add_argument("--top", type=positive_int, default=8, help="costliest kernels listed per step")
    p.add_argument("--json", metavar="PATH", help="also write everything as JSON to PATH")
    p.add_argument("--budget", metavar="FILE", help="run FILE's arguments; exit 1 past its kernel counts")
    p.add_argument("--record-budget", metavar="FILE", help="write this run's arguments and kernel counts to FILE")
    args = p.parse_args(argv)
    if args.budget is not None:
        try:
            with open(args.budget) as f:
                budget = json.load(f)
            for key in BUDGET_ARGS:
                if key != "steps" or args.steps is None:  # --steps picks some of the budget's steps
                    setattr(args, key, budget["args"][key])
            args.budget_kernels = {step: int(n) for step, n in budget["kernels"].items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.fail(f"--budget {args.budget}: not a kernel budget ({type(e).__name__}: {e})")
    args.steps = args.steps if args.steps is not None else ",".join(STEPS)
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()] if isinstance(args.steps, str) else args.steps
    if unknown := [s for s in args.steps if s not in STEPS]:
        p.fail(f"--steps: unknown step {unknown[0]!r}; expected some of {', '.join(STEPS)}")
    for flag in ("json", "record_budget"):
        if (problem := output_file_problem(f"--{flag.replace('_', '-')}", getattr(args, flag))) is not None:
            p.fail(problem)
    return args


# ---------------------------------------------------------------------------------------------- compiling


def step_launches(cfg, args: argparse.Namespace, step: str) -> list:
    """The launches of one run of `step` (a name of STEPS) for the model `cfg`, compiled for args.gpu."""
    import jax.numpy as jnp

    import pallas_kernels
    from granite_jax.generation.steps import abstract_steps, compiler_options
    from granite_jax.ops import Runtime
    from pallas_kernels import aot, executable

    kind, batch, tokens = STEPS[step]
    cache_len = max(args.cache_len, tokens)
    dtype, weight_dtype = jnp.dtype(args.dtype), jnp.dtype(args.weight_dtype or args.dtype)
    runtime = Runtime(ssd=args.ssd_impl, platform="gpu")
    fns = abstract_steps(cfg, batch=batch, prompt_len=tokens, cache_len=cache_len, dtype=dtype,
                         weight_dtype=weight_dtype, runtime=runtime)  # fmt: skip
    fn, fn_args = fns[kind]
    with pallas_kernels.cuda_lowering():  # (weights, prepared, cache, ...): the cache donated, and XLA's options, as
        lowered = aot.lower_for_gpu(fn, fn_args, args.gpu, (2,))  # the Generator compiles its steps
        return executable.launches(lowered, compiler_options(runtime))


def per_layer(cfg, args: argparse.Namespace, step: str) -> dict[str, dict[str, Any]]:
    """The step's totals split into one layer of each kind and the rest (`executable.layer_split`)."""
    from pallas_kernels.executable import layer_split, summary

    return layer_split(cfg, lambda c: summary(step_launches(c, args, step)))


# ---------------------------------------------------------------------------------------------- the floor


def step_floor(cfg, args: argparse.Namespace, step: str) -> dict[str, float]:
    """`floor` of the step named `step` (STEPS) under args' dtypes and cache length."""
    kind, batch, tokens = STEPS[step]
    return floor(cfg, kind, batch, tokens, dtype=args.dtype, weight_dtype=args.weight_dtype, cache_len=args.cache_len)


def floor(
    cfg, kind: str, batch: int, tokens: int, *, dtype: str, weight_dtype: str | None = None, cache_len: int = 0
) -> dict[str, float]:
    """Bytes and FLOPs a step must move whatever the program, and the time they take at the H200's rates: a prefill
    of `tokens` a row, or a decode step of one token a row over a cache of max(cache_len, tokens) slots."""
    import jax.numpy as jnp

    from granite_jax.experiments.throughput import parameter_sizes
    from granite_jax.model import abstract_model
    from pallas_kernels.executable import H200_BYTES_PER_S, H200_FLOPS_PER_S

    act = jnp.dtype(dtype).itemsize
    sizes = parameter_sizes(abstract_model(cfg, dtype=dtype, param_dtype=weight_dtype or dtype))
    experts, k = max(cfg.num_local_experts, 1), cfg.num_experts_per_tok
    touched = 1 - (1 - k / experts) ** (batch * tokens)  # expected share of the experts some token is routed to
    n_attention, n_mamba = cfg.layer_types.count("attention"), cfg.layer_types.count("mamba")
    heads, head_dim = cfg.num_attention_heads, cfg.head_dim
    kv_row = 2 * cfg.num_key_value_heads * head_dim * act  # one slot's K and V
    d_inner = cfg.mamba_expand * cfg.hidden_size
    state = cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state * 4  # float32
    conv = (cfg.mamba_d_conv - 1) * (d_inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state) * act
    active = sizes["dense_params"] + sizes["routed_params"] * k / experts
    nbytes = sizes["dense_bytes"] + sizes["routed_bytes"] * touched
    flops = 2.0 * active * batch * tokens
    if kind == "decode":
        cache = max(cache_len, tokens)
        nbytes += n_attention * batch * cache * kv_row + n_mamba * batch * 2 * (state + conv)  # states read and written
        flops += n_attention * 4.0 * batch * cache * heads * head_dim  # scores and values over the cache
        flops += n_mamba * 6.0 * batch * cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state
    else:
        nbytes += n_attention * batch * tokens * kv_row + n_mamba * batch * (state + conv)  # written once
        flops += n_attention * 2.0 * batch * tokens**2 * heads * head_dim  # causal: half of QK^T and of PV
        chunk = cfg.mamba_chunk_size  # SSD: within chunks (causal half) and through the states
        per_token = chunk * (cfg.mamba_n_groups * cfg.mamba_d_state + cfg.mamba_n_heads * cfg.mamba_d_head)
        flops += n_mamba * batch * tokens * (per_token + 4.0 * cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state)
    seconds = max(nbytes / H200_BYTES_PER_S, flops / H200_FLOPS_PER_S)
    return dict(bytes=nbytes, flops=flops, seconds=seconds, bound="bytes" if nbytes / H200_BYTES_PER_S >= flops /
                H200_FLOPS_PER_S else "flops")  # fmt: skip


# ---------------------------------------------------------------------------------------------- report


def step_table(result: dict[str, Any]) -> str:
    lines = [
        "| step | kernels | outside graphs | copies | GB | GFLOP | predicted ms | floor ms | predicted / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["steps"].items():
        t, floor = s["totals"], s["floor"]
        lines.append(
            f"| {name} | {t['kernels']} | {t['kernels_outside_graphs']} | {t['copies']} | {t['bytes'] / 1e9:.3f} | "
            f"{t['flops'] / 1e9:.1f} | {t['predicted_s'] * 1e3:.3f} | {floor['seconds'] * 1e3:.3f} "
            f"({floor['bound']}) | {t['predicted_s'] / floor['seconds']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def layer_table(result: dict[str, Any]) -> str:
    lines = ["| step | part | kernels | outside graphs | MB | GFLOP | predicted us |", "|---|---|---|---|---|---|---|"]
    for name, s in result["steps"].items():
        for part, t in s.get("per_layer", {}).items():
            lines.append(
                f"| {name} | {part} | {t['kernels']} | {t['kernels_outside_graphs']} | {t['bytes'] / 1e6:.1f} | "
                f"{t['flops'] / 1e9:.2f} | {t['predicted_s'] * 1e6:.1f} |"
            )
    return "\n".join(lines) + "\n"


def top_table(result: dict[str, Any], top: int) -> str:
    lines = [
        "| step | kernel | from | kind | in graph | launches | MB | GFLOP | predicted us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["steps"].items():
        for k in s["launches"][:top]:
            lines.append(
                f"| {name} | {k['name']} | {k['source'].split('/', 1)[-1][-60:]} | {k['kind']} | "
                f"{'yes' if k['graphed'] else 'no'} | {k['count']} | "
                f"{k['bytes'] / 1e6:.2f} | {k['flops'] / 1e9:.3f} | {k['predicted_s'] * 1e6:.1f} |"
            )
    return "\n".join(lines) + "\n"


def report_step(cfg, args: argparse.Namespace, step: str) -> dict[str, Any]:
    import dataclasses

    from pallas_kernels.executable import summary

    launches = step_launches(cfg, args, step)
    rows = [dataclasses.asdict(k) | {"predicted_s": k.seconds()} for k in launches]
    out = dict(
        totals=summary(launches),
        floor=step_floor(cfg, args, step),
        launches=sorted(rows, key=lambda r: -r["predicted_s"]),
    )
    if args.per_layer:
        out["per_layer"] = per_layer(cfg, args, step)
    return out


def over_budget(result: dict[str, Any], budget: dict[str, int]) -> list[str]:
    return [
        f"{step}: {result['steps'][step]['totals']['kernels']} kernels, over its budget of {n}"
        for step, n in budget.items()
        if step in result["steps"] and result["steps"][step]["totals"]["kernels"] > n
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from granite_jax.experiments.common import environment, write_json
    from granite_jax.presets import released_config
    from pallas_kernels import aot

    try:
        aot.gpu_device(args.gpu)
    except aot.AotUnavailableError as e:
        print(f"gpu_report.py: error: {e}; run with PYTHONPATH=.aot after `make test` has installed it",
              file=sys.stderr)  # fmt: skip
        return 2
    cfg = released_config(args.shape)
    if args.layers is not None:
        cfg = cfg.replace(layer_types=cfg.layer_types[: args.layers])
    start = time.perf_counter()
    steps = {}
    for step in args.steps:
        print(f"compiling {step} of {args.shape} ({len(cfg.layer_types)} layers) for {args.gpu}...", file=sys.stderr)
        steps[step] = report_step(cfg, args, step)
    result = dict(
        command="python benchmarks/gpu_report.py " + " ".join(sys.argv[1:] if argv is None else argv),
        jax=jax.__version__,  # the programs are XLA's: another jax version fuses and graphs differently
        shape=args.shape,
        layers=len(cfg.layer_types),
        mamba_layers=cfg.layer_types.count("mamba"),
        attention_layers=cfg.layer_types.count("attention"),
        args={k: v for k, v in vars(args).items() if k != "budget_kernels"},
        steps=steps,
        seconds=time.perf_counter() - start,
        environment=environment(),
    )
    print(step_table(result))
    if args.per_layer:
        print(layer_table(result))
    print(top_table(result, args.top))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.record_budget:
        kernels = {step: s["totals"]["kernels"] for step, s in steps.items()}
        write_json(args.record_budget, dict(args={k: getattr(args, k) for k in BUDGET_ARGS}, kernels=kernels))
        print(f"wrote {args.record_budget}")
    if args.budget and (problems := over_budget(result, args.budget_kernels)):
        print("gpu_report.py: over budget: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
