"""Device memory of Granite 4.0 models, predicted part by part and measured: `python -m granite_jax.memory`."""

from granite_jax.memory.measure import Measurement, measure_run, measure_runs
from granite_jax.memory.plan import PARTS, MemoryPlan, activation_bytes, cache_bytes, fit, predict, weight_bytes

__all__ = [
    "PARTS",
    "Measurement",
    "MemoryPlan",
    "activation_bytes",
    "cache_bytes",
    "fit",
    "measure_run",
    "measure_runs",
    "predict",
    "weight_bytes",
]
