"""tiny: the 4-layer MoE hybrid of the tests (`granite_jax.testing.TINY_CONFIG`, 320-token vocabulary), ~0.4M params.

`get_config("dense")` drops the routed experts (shared MLP only).
"""

from ml_collections import config_dict


def get_config(arg=None) -> config_dict.ConfigDict:
    from granite_jax.testing import TINY_CONFIG

    fields = dict(TINY_CONFIG, vocab_size=320)
    if arg == "dense":
        fields.update(num_local_experts=0, num_experts_per_tok=0)
    elif arg:
        raise ValueError(f"configs/models/tiny.py: unknown variant {arg!r}; expected 'dense' or nothing")
    return config_dict.ConfigDict(fields)
