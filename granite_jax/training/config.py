"""The fields every training config has, with their defaults (`python -m granite_jax.train`, docs/training.md).

The configs in configs/train/ start from `base_config()` and change what they need; any field can be overridden on
the command line as --config.SECTION.FIELD=VALUE. A config may have no other field (`schema`).
"""

from ml_collections import config_dict


def base_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.output_dir = "runs/train"  # the run's directory: a run started again with its config resumes there
    c.seed = 0  # parameters' initialisation and the order of the batches
    c.init_from = ""  # fine-tune this checkpoint (Hugging Face directory or orbax); "": train from scratch
    c.steps = 1000  # optimizer updates
    c.log_every = 10  # steps between metrics rows (and log lines off a terminal)
    c.memory_gb = 0.0  # memory a step may use; 0: what the device has free

    c.model = config_dict.ConfigDict()
    c.model.preset = ""  # a released architecture to start from (granite-4.0-h-350m, ...), "" for none
    c.model.hf = config_dict.ConfigDict()  # config.json fields over the preset's (vocabulary: the tokenizer's)
    c.model.dtype = "float32"  # arithmetic: float32 or bfloat16
    c.model.param_dtype = "float32"  # the weights and optimizer state: float32 or bfloat16
    c.model.remat = False  # recompute each layer's activations in the backward pass (less memory, ~1/3 more compute)

    c.tokenizer = config_dict.ConfigDict()
    c.tokenizer.path = ""  # a directory with a tokenizer; "": the checkpoint's, or a BPE trained on the training split
    c.tokenizer.vocab_size = 4096  # of the trained BPE

    c.data = config_dict.ConfigDict()
    c.data.train = "stdlib"  # comma-separated globs of text files, or "stdlib": this Python's standard library
    c.data.held_out = ""  # globs of held-out files; "": a share of data.train's files
    c.data.held_out_fraction = 0.05  # that share, chosen by a hash of each file's name
    c.data.exclude = ""  # comma-separated patterns of files left out of both, e.g. "test/*" (stdlib: library paths)
    c.data.seq_len = 512  # tokens a row

    c.batch = config_dict.ConfigDict()
    c.batch.rows = 16  # rows an optimizer step
    c.batch.micro = 16  # rows a forward and backward pass; rows / micro of them are accumulated

    c.optimizer = config_dict.ConfigDict()
    c.optimizer.learning_rate = 3e-3  # peak, after the linear warm-up
    c.optimizer.warmup_steps = 100
    c.optimizer.final_lr_ratio = 0.1  # the cosine decay ends at learning_rate times this
    c.optimizer.weight_decay = 0.1
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.clip_norm = 1.0  # global gradient norm

    c.eval = config_dict.ConfigDict()
    c.eval.every = 100  # steps between held-out evaluations (0: only the final one)
    c.eval.batches = 8  # micro-batches of held-out rows each evaluation reads (the final one reads all)
    c.eval.headers = 0  # held-out Python function headers to complete at the end (0: none)
    c.eval.max_new_tokens = 128  # tokens a completion

    c.checkpoint = config_dict.ConfigDict()
    c.checkpoint.every = 100  # steps between orbax checkpoints
    c.checkpoint.keep = 3  # checkpoints kept

    c.export = config_dict.ConfigDict()
    c.export.dtype = "float32"  # of the exported model.safetensors: float32 or bfloat16
    return c


def schema(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """The fields a training config must have: `base_config()`'s, with `model.hf` as the config holds it (any
    config.json fields: `ModelConfig` checks them)."""
    expected = base_config()
    if hasattr(config, "keys") and hasattr(config.get("model"), "keys") and hasattr(config.model.get("hf"), "keys"):
        expected.model.hf = config_dict.ConfigDict(config.model.hf.to_dict())
    return expected
