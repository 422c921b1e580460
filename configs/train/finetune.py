"""Fine-tune a checkpoint on text files: on a GPU, bfloat16 weights with rematerialised layers.

    python -m granite_jax.train --config configs/train/finetune.py --config.init_from=granite-4.0-h-350m \\
        --config.data.train='corpus/*.txt' --config.output_dir=runs/finetune

init_from: a Hugging Face directory (config.json, safetensors, tokenizer) or an orbax one; its tokenizer is used.
Without a checkpoint, --config.init_from='' --config.model.preset=granite-4.0-h-350m trains that architecture from
random weights with a BPE trained on the data (what the GPU script measures where no weights can be fetched).
"""

from granite_jax.training.config import base_config


def get_config():
    c = base_config()
    c.output_dir = "runs/finetune"
    c.init_from = ""  # set on the command line
    c.steps = 200
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"  # master weights and AdamW state in float32, arithmetic in bfloat16
    c.model.remat = True
    c.data.seq_len = 2048
    c.data.held_out_fraction = 0.05
    c.batch.rows = 16
    c.batch.micro = 8
    c.optimizer.learning_rate = 2e-5
    c.optimizer.warmup_steps = 20
    c.optimizer.weight_decay = 0.0
    c.eval.every = 50
    c.eval.batches = 4
    c.checkpoint.every = 100
    c.checkpoint.keep = 2
    c.export.dtype = "bfloat16"
    return c
