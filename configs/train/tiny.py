"""A few-second run: the tests' tiny hybrid, cut to one Mamba and one attention layer, on the standard library's
json package.

python -m granite_jax.train --config configs/train/tiny.py --config.output_dir=runs/tiny
"""

import os
import sysconfig

from granite_jax.testing import TINY_CONFIG
from granite_jax.training.config import base_config


def get_config():
    c = base_config()
    c.output_dir = "runs/train-tiny"
    c.steps = 20
    c.model.hf.update(TINY_CONFIG, num_hidden_layers=2, layer_types=["mamba", "attention"])
    c.tokenizer.vocab_size = 512
    stdlib = sysconfig.get_paths()["stdlib"]
    c.data.train = os.path.join(stdlib, "json", "*.py")  # ~50 KB
    c.data.held_out = os.path.join(stdlib, "json", "encoder.py")
    c.data.seq_len = 64
    c.batch.rows = 8
    c.batch.micro = 4
    c.optimizer.warmup_steps = 5
    c.eval.every = 10
    c.eval.batches = 2
    c.checkpoint.every = 5
    return c
