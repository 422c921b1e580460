"""Float8 weights against bfloat16: logits error and greedy agreement on the test checkpoints.

    python benchmarks/float8_accuracy.py                 # random tiny checkpoints (granite_jax.testing)
    python benchmarks/float8_accuracy.py --model DIR --json OUT.json

Both models compute in bfloat16 on the same checkpoint; one keeps the weights in bfloat16, the other quantizes the
matrices to float8 at load (one scale per output channel). Two float8 forms are measured: the plain product (the
weights widened to bfloat16: CPUs, and GPUs before Hopper) and the GPU backend's (activations quantized to float8 per
row too, for tensor cores' FP8 GEMMs), which is plain JAX and runs here as it would on an H200. Printed per
checkpoint: the logits' relative L2 error teacher-forced on the bfloat16 model's greedy continuation, and the share of
greedy tokens that agree (and how far the first divergence is, on average).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Test checkpoints: the tiny MoE hybrid at transformers' initialisation and at a wider one (peakier logits, so greedy
# choices are not near-ties), and a dense hybrid.
CHECKPOINTS = {
    "tiny MoE hybrid": {},
    "tiny MoE hybrid, init 0.1": {"initializer_range": 0.1},
    "tiny dense hybrid, init 0.1": {"initializer_range": 0.1, "num_local_experts": 0, "num_experts_per_tok": 0},
}


def parse_args(argv=None) -> argparse.Namespace:
    sys.path.insert(0, ROOT)  # runs from a plain checkout
    from granite_jax.cli import ArgumentParser, model_dir, output_file_problem, positive_int

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--model", type=model_dir, default=None, help="a checkpoint directory (default: the random test checkpoints)"
    )
    p.add_argument("--prompts", type=positive_int, default=8, help="random prompts per checkpoint")
    p.add_argument("--prompt-len", type=positive_int, default=16, help="tokens per prompt")
    p.add_argument("--new-tokens", type=positive_int, default=32, help="greedy tokens per prompt")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if problem := output_file_problem("--json", args.json):
        p.fail(problem)
    return args


def greedy(model, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """The greedy continuations (n, new_tokens) of prompts (n, T), no stop token."""
    from granite_jax import Generator

    results = Generator(model=model).generate(
        [list(map(int, p)) for p in prompts], max_new_tokens=new_tokens, stop_token_ids=[]
    )
    return np.asarray([r.token_ids for r in results])


def measure(model_dir: str, args: argparse.Namespace) -> dict:
    import jax.numpy as jnp

    from granite_jax import Runtime
    from granite_jax.checkpoint import load_model

    reference = load_model(model_dir, dtype="bfloat16", weight_dtype="bfloat16")
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, reference.cfg.vocab_size, (args.prompts, args.prompt_len))
    want = greedy(reference, prompts, args.new_tokens)
    sequences = jnp.asarray(np.concatenate([prompts, want], axis=1))
    want_logits = np.asarray(reference(sequences).astype(jnp.float32))
    out = {}
    for form, runtime in (("float8 (plain product)", Runtime()), ("float8 (GPU: FP8 GEMMs)", Runtime(platform="gpu"))):
        model = load_model(model_dir, dtype="bfloat16", weight_dtype="float8", runtime=runtime)
        logits = np.asarray(model(sequences).astype(jnp.float32))
        got = greedy(model, prompts, args.new_tokens)
        diverged = [
            int(np.argmax(row != ref)) if np.any(row != ref) else args.new_tokens for row, ref in zip(got, want)
        ]
        out[form] = dict(
            logits_rel_err=float(np.linalg.norm(logits - want_logits) / np.linalg.norm(want_logits)),
            greedy_agreement=float(np.mean(got == want)),
            mean_first_divergence=float(np.mean(diverged)),
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from granite_jax.experiments.common import environment, write_json
    from granite_jax.testing import make_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = (
            {args.model: args.model}
            if args.model
            else {
                name: make_checkpoint(os.path.join(tmp, str(i)), **config)
                for i, (name, config) in enumerate(CHECKPOINTS.items())
            }
        )
        for name, path in checkpoints.items():
            for form, result in measure(path, args).items():
                rows.append(dict(checkpoint=name, weights=form, **result))
    print("| checkpoint | weights (bfloat16 arithmetic) | logits error vs bfloat16 | greedy agreement | diverges at |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['checkpoint']} | {r['weights']} | {r['logits_rel_err']:.2%} | {r['greedy_agreement']:.1%} | "
            f"{r['mean_first_divergence']:.1f} of {args.new_tokens} |"
        )
    if args.json:
        command = "python benchmarks/float8_accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_json(args.json, dict(command=command.strip(), rows=rows, environment=environment()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
