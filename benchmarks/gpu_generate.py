"""Generation with the Pallas SSD on a GPU: the same greedy tokens as the XLA SSD, and both speeds (one prepared run).

    python benchmarks/gpu_generate.py --out benchmarks/results/gpu_generate-$(date +%F)-h200.json

Writes a random hybrid MoE checkpoint (`granite_jax.testing.make_checkpoint`, large initial weights so that greedy
continuations vary; Mamba heads of 64 x state 128 as in the released models, chunk 64) into a temporary directory, then
generates greedily for a left-padded batch of a short and a long prompt with `Runtime(ssd="xla")` and
`Runtime(ssd="pallas")`, in float32 and bfloat16, through `granite_jax.generation.Generator` (prefill kernels on the
prompt, the decode kernel on every new token). Prints, per dtype and prompt, how many leading tokens agree, and the
tokens/s of each run.

Exit status: 0 when the float32 runs agree on every token (bfloat16 rounding differs between the two paths, so its
agreement is reported, not required); 1 otherwise; 2 without a GPU (unless --smoke). `--smoke` runs the same at tiny
sizes (two layers) on CPU with the kernels interpreted, to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

# Run from a plain checkout (no install): the packages live beside benchmarks/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECKPOINT = dict(
    initializer_range=1.0, hidden_size=256, mamba_n_heads=8, mamba_d_head=64, mamba_d_state=128, mamba_chunk_size=64
)
# granite_jax.testing.TINY_CONFIG otherwise (chunk 16), two of its layers: one Mamba (the SSD compared), one attention
SMOKE_CHECKPOINT = dict(initializer_range=1.0, num_hidden_layers=2, layer_types=["mamba", "attention"])
SENTENCE = "The hybrid design mixes Mamba-2 state space layers with attention."
IMPLS = ("xla", "pallas")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, output_file_problem, positive_int

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="greedy tokens per prompt")
    p.add_argument("--repeats", type=positive_int, default=20, help="copies of the sentence in the long prompt")
    p.add_argument("--out", help="write the JSON results here (also printed)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU with interpreted kernels (script check)")
    args = p.parse_args(argv)
    if (problem := output_file_problem("--out", args.out, make_dir=True)) is not None:
        p.error(problem)
    return args


def run_once(loaded, impl: str, prompts: list[str], max_new_tokens: int) -> dict[str, Any]:
    """Generate with `loaded`'s weights (a Generator: read from disk once per dtype) through the SSD `impl`."""
    from granite_jax.compare import greedy
    from granite_jax.generation import Generator

    runtime = loaded.model.runtime.replace(ssd=impl)
    generator = Generator(model=loaded.model, tokenizer=loaded.tokenizer, runtime=runtime)
    results = generator.generate(prompts, greedy(max_new_tokens))
    timing = results[0].timing
    return dict(
        token_ids=[list(r.token_ids) for r in results],
        prefill_tokens_per_s=timing.prefill_tokens_per_s,
        decode_tokens_per_s=timing.decode_tokens_per_s,
        timing=timing.as_dict(),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    import pallas_kernels
    from granite_jax.compare import leading_agreement
    from granite_jax.generation import Generator
    from granite_jax.testing import make_checkpoint

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        print("no GPU: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    if args.smoke:  # interpreted kernels are slow: a shorter long prompt and fewer tokens
        args.repeats, args.max_new_tokens = min(args.repeats, 3), min(args.max_new_tokens, 8)
    prompts = ["Granite is", " ".join([SENTENCE] * args.repeats)]
    summary: dict[str, Any] = dict(device_kind=device.device_kind, jax=jax.__version__, prompts=prompts, runs={})
    context = pallas_kernels.interpret_mode() if args.smoke else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as model_dir, context:
        make_checkpoint(model_dir, **(SMOKE_CHECKPOINT if args.smoke else CHECKPOINT))
        for dtype in ("float32", "bfloat16"):
            loaded = Generator(model_dir, dtype=dtype)
            runs = {impl: run_once(loaded, impl, prompts, args.max_new_tokens) for impl in IMPLS}
            agree = [leading_agreement(a, b) for a, b in zip(runs["xla"]["token_ids"], runs["pallas"]["token_ids"])]
            summary["runs"][dtype] = runs | dict(agreeing_tokens=agree)
            for i, n in enumerate(agree):
                print(f"{dtype} prompt {i}: pallas equals xla for the first {n}/{args.max_new_tokens} tokens")
            for impl in IMPLS:
                r = runs[impl]
                speeds = f"prefill {r['prefill_tokens_per_s']:.0f} tok/s, decode {r['decode_tokens_per_s']:.0f}"
                print(f"{dtype} {impl}: {speeds}")
    agree32 = summary["runs"]["float32"]["agreeing_tokens"]
    summary["ok"] = all(n == args.max_new_tokens for n in agree32)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
