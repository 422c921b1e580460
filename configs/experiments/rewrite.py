"""Rewrite: naive vs rewritten (`rewriter.rewrite`) vs "xla" SSD, time and compiled memory across sequence lengths.

Uses the Mamba dimensions of the model (`model.name`, or the config.json of `model.checkpoint`; no weights are read).
`workload.ssd_impl` and `workload.rewriter` do not apply: all three variants are always measured, in float32. The
measurement is `granite_jax.experiments.rewrite.bench_length` (benchmarks/rewrite_ssd.py runs it too).

    python -m granite_jax.experiment --config configs/experiments/rewrite.py
    python -m granite_jax.experiment --config configs/experiments/rewrite.py --config.model.name=granite-4.0-h-tiny
    python -m granite_jax.experiment --config configs/experiments/rewrite.py:quick     # tiny dims, seconds
"""

from granite_jax.experiments.common import default_config, quick


def get_config(arg=None):
    c = default_config("rewrite")
    c.workload.seq_len = 2048  # sweeps 256 ... 2048 unless workload.seq_lens is set (naive: ~1 min a call at 2048)
    c.measure.repeats = 5  # timed calls of the rewritten and xla SSDs per length (interleaved)
    c.measure.naive_repeats = 2  # timed calls of the naive SSD per length
    c.measure.max_naive_seconds = 300.0  # skip the naive SSD where one call is predicted to take longer
    if quick(arg):
        c.model.name = "tiny"
        c.workload.seq_lens = (128, 256)  # long enough for the rewriter to take its sites (min_flops)
        c.measure.repeats = 1
        c.measure.naive_repeats = 1
    return c
