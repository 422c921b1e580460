"""Throughput: prefill and decode tokens per second, granite-jax vs transformers (same weights, greedy, CPU or GPU).

python -m granite_jax.experiment --config configs/experiments/throughput.py
python -m granite_jax.experiment --config configs/experiments/throughput.py --config.workload.batch_sizes='(1,4,16)'
python -m granite_jax.experiment --config configs/experiments/throughput.py --noconfig.measure.transformers
python -m granite_jax.experiment --config configs/experiments/throughput.py:quick      # tiny model
"""

from ml_collections import config_dict

from granite_jax.experiments.common import default_config, quick


def get_config(arg=None):
    c = default_config("throughput")
    c.workload.seq_len = 512  # prompt tokens per row
    c.workload.new_tokens = 32
    c.workload.batch_sizes = (1, 8)  # one row per batch size (workload.batch is used when this is empty)
    c.measure.repeats = 2
    c.measure.transformers = True  # also time transformers on the same weights (its CPU reference path)
    c.measure.floor_probe_mib = 1024  # bandwidth probe size for the batch-1 decode floor (0: no probe)
    c.measure.floor_pairs = 5  # batch-1 runs each between two sustained reads of the same bytes (0: none)
    c.measure.torch_threads = config_dict.placeholder(int)  # torch's intra-op threads (default: torch's own choice)
    if quick(arg):
        c.model.name = "tiny"
        c.workload.seq_len = 16
        c.workload.new_tokens = 4
        c.workload.batch_sizes = (1, 2)
        c.measure.repeats = 1
        c.measure.floor_probe_mib = 16
        c.measure.floor_pairs = 2
    return c
