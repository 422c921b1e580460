"""Scaling: prefill time and peak memory against sequence length; Mamba's linear growth and attention's share.

python -m granite_jax.experiment --config configs/experiments/scaling.py --config.workload.seq_len=4096
python -m granite_jax.experiment --config configs/experiments/scaling.py --config.workload.seq_lens='(512,8192)'
python -m granite_jax.experiment --config configs/experiments/scaling.py:quick      # tiny model, seconds
"""

from granite_jax.experiments.common import default_config, quick


def get_config(arg=None):
    c = default_config("scaling")
    c.workload.seq_len = 2048  # sweeps 256, 512, 1024, 2048 unless workload.seq_lens is set
    c.measure.repeats = 2
    if quick(arg):
        c.model.name = "tiny"
        c.workload.seq_lens = (32, 64, 128)
        c.measure.repeats = 1
    return c
