"""The hybrid's memory saving, predicted: granite-4.0-h-tiny against a same-width attention-only model, from 4K to 1M
tokens of context and 1 to 64 sessions, against one H200's memory.

    python benchmarks/memory_saving.py                          # h-tiny; 4K..1M tokens; 1, 8, 64 sessions; 141 GB
    python benchmarks/memory_saving.py --json OUT.json --png OUT.png --capacity 139GiB

Every number is a prediction (`granite_jax.memory.predict`, platform "gpu"), not a measurement: the weights, the KV
cache and the Mamba states are the exact byte sizes of the arrays granite-jax would allocate; the activations are the
plan's estimate of a 512-token prefill segment's peak. The largest context that fits is `granite_jax.memory.fit`.

The attention-only model is "the micro architecture scaled to match": granite-4.0-micro (attention-only, H=2560,
40 q / 8 kv heads of head_dim 64) brought to the hybrid's width. It is the hybrid's own config with every layer an
attention layer, and micro's attention layout at the hybrid's hidden size: head_dim 64 as micro; q heads = H / 64 (24
for h-tiny's H=1536, so q heads * head_dim = H as in micro); kv heads the divisor of the q heads nearest micro's 5:1
grouping (24 / 5 = 4.8: 4 kv heads, not 6), the nearer one and also the smaller cache, so the baseline is never
inflated and the saving shown is, if anything, understated. The hybrid's own attention layout (12 q / 4 kv heads of
128) is not micro's: in all 40 layers it would double the attention-only model's KV cache. Embeddings, norms, the MoE
and the shared MLP are the hybrid's, so only the mixers differ; position encoding (NoPE here, RoPE in micro) does not
change memory.

The authors claim ~72% lower memory for the hybrids in long-context, multi-session use; this script prints the
predicted saving of the total (weights included) and, separately, of the parts that grow with context and sessions
(KV cache + Mamba state). For h-tiny the latter tends to 1 - 8/40 KiB per token = 80%; the total to about 71%, as the
plan's activations hold copies of one attention layer's K and V, twice as wide in h-tiny's layer as in the baseline's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIM = 0.72  # "the authors claim ~72% lower memory"
MICRO_HEAD_DIM, MICRO_GROUPING = 64, 5  # granite-4.0-micro: head_dim 64, 40 q heads per 8 kv heads
UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
UNITS["TIB"] = 2**40
DEFAULT_CONTEXTS = ",".join(str(4096 << i) for i in range(9))  # 4K .. 1M


def byte_size(text: str) -> float:
    """argparse type: a byte count, plain ("141e9") or with a unit ("141GB", "139 GiB")."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count such as 141e9 or 141GB, got {text!r}")
    return float(m.group(1)) * UNITS[(m.group(2) or "").upper()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, ROOT)  # runs from a plain checkout
    from granite_jax.cli import ArgumentParser, output_file_problem, positive_ints
    from granite_jax.presets import RELEASED

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="granite-4.0-h-tiny", choices=sorted(RELEASED), metavar="NAME",
                   help="the hybrid (a released architecture with Mamba layers)")  # fmt: skip
    p.add_argument(
        "--capacity",
        type=byte_size,
        default="141GB",
        help="device memory: one H200's 141 GB as NVIDIA states it; bytes, or with a unit (139GiB)",
    )
    p.add_argument("--sessions", type=positive_ints, default="1,8,64", help="comma-separated session counts")
    p.add_argument("--contexts", type=positive_ints, default=DEFAULT_CONTEXTS, help="comma-separated context lengths")
    p.add_argument("--dtype", choices=("bfloat16", "float8"), default="bfloat16",
                   help="bfloat16 weights, or float8 ones (bfloat16 arithmetic and caches either way)")  # fmt: skip
    p.add_argument("--json", default=None, metavar="FILE", help="also write the prediction as JSON")
    p.add_argument("--png", default=None, metavar="FILE", help="also plot it")
    args = p.parse_args(argv)
    for flag in ("json", "png"):
        if problem := output_file_problem(f"--{flag}", getattr(args, flag)):
            p.fail(problem)
    if "mamba" not in RELEASED[args.shape]["layer_types"]:
        p.fail(f"--shape {args.shape}: has no Mamba layers, so no attention-only counterpart to compare")
    return args


def micro_kv_heads(q_heads: int) -> int:
    """The divisor of `q_heads` nearest micro's q:kv grouping of 5:1 (ties: fewer kv heads, the smaller cache)."""
    divisors = [d for d in range(1, q_heads + 1) if q_heads % d == 0]
    return min(divisors, key=lambda d: (abs(d - q_heads / MICRO_GROUPING), d))


def attention_only(cfg: Any) -> Any:
    """The micro architecture scaled to `cfg`'s width: every layer attention, micro's head_dim and grouping."""
    q_heads = cfg.hidden_size // MICRO_HEAD_DIM
    return cfg.replace(
        layer_types=("attention",) * cfg.num_layers,
        num_attention_heads=q_heads,
        num_key_value_heads=micro_kv_heads(q_heads),
        head_dim=MICRO_HEAD_DIM,
    )


def dtype_options(name: str) -> dict[str, Any]:
    """`predict`'s dtype keywords for --dtype: float8 is a weight format over bfloat16 arithmetic."""
    import jax.numpy as jnp

    from granite_jax.model import FLOAT8

    return dict(dtype=jnp.bfloat16, weight_dtype=FLOAT8 if name == "float8" else None, platform="gpu")


def growing(plan: Any) -> int:
    """The bytes that grow with context and sessions: the KV cache and the Mamba states."""
    return plan.kv_cache + plan.mamba_state


def row(hybrid: Any, attn: Any, capacity: float) -> dict[str, Any]:
    return dict(
        context=hybrid.context,
        sessions=hybrid.sessions,
        hybrid=hybrid.as_dict(),
        attention_only=attn.as_dict(),
        saving_total=1 - hybrid.total / attn.total,
        saving_kv_and_state=1 - growing(hybrid) / growing(attn),
        hybrid_fits=hybrid.total <= capacity,
        attention_only_fits=attn.total <= capacity,
    )


def largest(models: dict[str, Any], capacity: float, sessions: list[int], options: dict[str, Any]) -> list[dict]:
    """Per session count: each model's largest context in `capacity` and the hybrid's multiple of the other's."""
    from granite_jax.memory import fit

    out = []
    for s in sessions:
        tokens = {name: fit(cfg, int(capacity), sessions=s, **options) for name, cfg in models.items()}
        ratio = tokens["hybrid"] / tokens["attention_only"] if tokens["attention_only"] else float("inf")
        out.append(dict(sessions=s, **{f"{k}_context": v for k, v in tokens.items()}, ratio=ratio))
    return out


def summary(cfg: Any, options: dict[str, Any]) -> dict[str, Any]:
    """A config's mixer layout and size: parameters counted as bfloat16 weight bytes / 2."""
    import jax.numpy as jnp

    from granite_jax.memory import plan

    wide = plan.weight_bytes(cfg, dtype=jnp.bfloat16, weight_dtype=jnp.bfloat16)
    return dict(
        layers=cfg.num_layers,
        attention_layers=[i for i, t in enumerate(cfg.layer_types) if t == "attention"],
        mamba_layers=sum(t == "mamba" for t in cfg.layer_types),
        hidden_size=cfg.hidden_size,
        q_heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        experts=f"{cfg.num_local_experts} of width {cfg.intermediate_size}, top {cfg.num_experts_per_tok}",
        shared_width=cfg.shared_intermediate_size,
        parameters=wide // 2,
        weight_bytes=plan.weight_bytes(
            cfg, dtype=options["dtype"], weight_dtype=options["weight_dtype"] or jnp.bfloat16
        ),
    )


def percent(x: float) -> str:
    """x as a whole percentage, without the "-0%" a small negative rounds to."""
    return f"{round(x, 2) + 0.0:.0%}"


def tokens(n: int) -> str:
    """4096 -> 4K, 1048576 -> 1M (powers of two as the contexts are usually named)."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def gb(n: float) -> str:
    return f"{n / 1e9:,.1f}"


def print_table(rows: list[dict], fits: list[dict], names: dict[str, str], capacity: float) -> None:
    h, a = names["hybrid"], names["attention_only"]
    print(f"Predicted memory (GB), {h} against {a}; fits: within {gb(capacity)} GB\n")
    print(f"| context | sessions | {h} | {a} | saving | {h} KV+state | {a} KV | saving (KV+state) | fits ({h} / {a}) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        fit_marks = "/".join("yes" if r[k] else "no" for k in ("hybrid_fits", "attention_only_fits"))
        print(
            f"| {tokens(r['context'])} | {r['sessions']} | {gb(r['hybrid']['total'])} | "
            f"{gb(r['attention_only']['total'])} | {percent(r['saving_total'])} | "
            f"{gb(r['hybrid']['kv_cache'] + r['hybrid']['mamba_state'])} | {gb(r['attention_only']['kv_cache'])} | "
            f"{percent(r['saving_kv_and_state'])} | {fit_marks} |"
        )
    print(f"\nLargest context that fits {gb(capacity)} GB (predicted)\n")
    print(f"| sessions | {h} | {a} | ratio |\n|---:|---:|---:|---:|")
    for f in fits:
        print(f"| {f['sessions']} | {f['hybrid_context']:,} | {f['attention_only_context']:,} | {f['ratio']:.1f}x |")


def gb_axis(ax: Any, values: list[float]) -> None:
    """A log axis spanning `values` with plain 1-2-5 tick labels (GB), not powers of ten."""
    low, high = min(values) * 0.8, max(values) * 1.25
    ticks = [m * 10**e for e in range(-1, 6) for m in (1, 2, 5) if low <= m * 10**e <= high]
    ax.set_yticks(ticks, [f"{t:,g}" for t in ticks])
    ax.set_yticks([], minor=True)
    ax.set_ylim(low, high)


def plot(path: str, rows: list[dict], names: dict[str, str], capacity: float, sessions: list[int]) -> None:
    from granite_jax.experiments.common import matplotlib_pyplot

    plt = matplotlib_pyplot()
    fig, (mem, save) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = dict(zip(sessions, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    for s in sessions:
        rs = [r for r in rows if r["sessions"] == s]
        x = [r["context"] for r in rs]
        for key, style in (("hybrid", "-"), ("attention_only", "--")):
            label = f"{names[key]}, {s} session{'s' * (s > 1)}"
            mem.plot(x, [r[key]["total"] / 1e9 for r in rs], style, color=colours[s], marker=".", label=label)
        label = f"total, {s} session{'s' * (s > 1)}"
        save.plot(x, [100 * r["saving_total"] for r in rs], "-", color=colours[s], marker=".", label=label)
    # KV cache and states both scale with the session count, so their saving is the same for every count: one line
    rs = [r for r in rows if r["sessions"] == sessions[0]]
    kv = [100 * r["saving_kv_and_state"] for r in rs]
    save.plot([r["context"] for r in rs], kv, ":", color="black", marker=".", label="KV cache + state, any sessions")
    mem.axhline(capacity / 1e9, color="black", lw=1)
    mem.annotate(f"one H200: {capacity / 1e9:.0f} GB", (rows[0]["context"], capacity / 1e9 * 1.15), fontsize=8)
    save.axhline(100 * CLAIM, color="grey", ls="-.", lw=1)
    save.annotate("authors' claim: ~72%", (rows[0]["context"], 100 * CLAIM + 2), fontsize=8, color="grey")
    mem.set(yscale="log", ylabel="predicted memory (GB)", title="Predicted device memory (solid: hybrid)")
    save.set(ylabel="predicted saving (%)", title="Predicted saving of the hybrid, by session count")
    gb_axis(mem, [r[k]["total"] / 1e9 for r in rows for k in ("hybrid", "attention_only")] + [capacity / 1e9])
    contexts = sorted({r["context"] for r in rows})
    for ax in (mem, save):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [tokens(t) for t in contexts])
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{names['hybrid']} vs {names['attention_only']}: prediction (granite_jax.memory), not measurement")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import flax
    import jax

    from granite_jax.experiments.common import write_json
    from granite_jax.memory import predict
    from granite_jax.presets import released_config

    hybrid = released_config(args.shape)
    models = dict(hybrid=hybrid, attention_only=attention_only(hybrid))
    names = dict(hybrid=args.shape.removeprefix("granite-4.0-"), attention_only="attention-only")
    options = dtype_options(args.dtype)
    configs = {k: summary(cfg, options) for k, cfg in models.items()}
    rows = [
        row(*(predict(cfg, context=t, sessions=s, **options) for cfg in models.values()), args.capacity)
        for s in args.sessions
        for t in args.contexts
    ]
    fits = largest(models, args.capacity, args.sessions, options)
    for key, c in configs.items():
        print(
            f"{names[key]}: {c['layers'] - c['mamba_layers']} attention layers of {c['q_heads']} q / {c['kv_heads']} "
            f"kv heads x {c['head_dim']}, {c['mamba_layers']} Mamba; {c['parameters'] / 1e9:.2f}B parameters, "
            f"{c['weight_bytes'] / 1e9:.2f} GB of {args.dtype} weights"
        )
    print()
    print_table(rows, fits, names, args.capacity)
    if args.png:
        plot(args.png, rows, names, args.capacity, args.sessions)
    if args.json:
        doc = dict(
            kind="prediction",
            command="python benchmarks/memory_saving.py " + " ".join(sys.argv[1:] if argv is None else argv),
            claim=f"the authors claim ~{CLAIM:.0%} lower memory",
            capacity_bytes=args.capacity,
            dtype=args.dtype,
            names=names,
            configs=configs,
            rows=rows,
            fits=fits,
            software=dict(jax=jax.__version__, flax=flax.__version__),
        )
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
