"""Report config: the naive Mamba-2 layer of granite-4.0-h-tiny (48 heads x 64, state 128, one group, chunk 256).

python -m rewriter.report --config configs/rewriter/h_tiny_mamba.py --config.batch=1 --config.seq_len=8192
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.model = "granite-4.0-h-tiny"  # granite_jax.presets name supplying the fields not set below
    c.target = "mamba_layer"  # "mamba_layer" | "ssd" (the naive SSD function alone) | "model" (the whole LM)
    c.batch = 1
    c.seq_len = 8192
    c.dtype = "float32"  # activations and parameters
    c.hidden_size = 1536
    c.mamba_n_heads = 48
    c.mamba_d_head = 64
    c.mamba_d_state = 128
    c.mamba_n_groups = 1
    c.mamba_chunk_size = 256
    # rewriter options (rewriter.Options)
    c.min_flops = 1e6
    c.min_dim = config_dict.placeholder(int)  # None: the default backend's (16 on GPU, 2 on CPU)
    c.fuse_chains = True
    c.precision = "auto"
    c.json_out = config_dict.placeholder(str)  # also save the report as JSON here
    return c
