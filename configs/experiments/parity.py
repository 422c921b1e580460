"""Parity: per-layer error of granite-jax against transformers (same weights, same prompts).

python -m granite_jax.experiment --config configs/experiments/parity.py
python -m granite_jax.experiment --config configs/experiments/parity.py --config.model.checkpoint=DIR
python -m granite_jax.experiment --config configs/experiments/parity.py:quick      # tiny model, seconds
"""

from granite_jax.experiments.common import default_config, quick


def get_config(arg=None):
    c = default_config("parity")
    c.workload.batch = 2
    c.workload.seq_len = 320  # crosses one 256-token SSD chunk boundary
    c.measure.tolerance = 1e-4  # largest relative error accepted as parity (float32; use ~3e-2 for bfloat16)
    if quick(arg):
        c.model.name = "tiny"
        c.workload.seq_len = 40
    return c
