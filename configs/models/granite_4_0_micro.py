"""granite-4.0-micro: published architecture, a config.json dict from `granite_jax.presets.RELEASED`.

python -m granite_jax.compare --config granite-4.0-micro
"""

from ml_collections import config_dict


def get_config(arg=None) -> config_dict.ConfigDict:
    from granite_jax.presets import RELEASED

    return config_dict.ConfigDict(RELEASED["granite-4.0-micro"])
