"""Random GraniteMoeHybrid checkpoints in Hugging Face format, made with transformers, for tests and benchmarks; and
the float64 attention oracle of the model and kernel tests.

Nothing is downloaded: the weights are transformers' random init under a fixed seed and the tokenizer is a byte-level
BPE trained in-process on a small built-in text, saved with a Granite-style chat template.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

import numpy as np

TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=64,
    intermediate_size=64,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=1,
    mamba_chunk_size=16,
    position_embedding_type="nope",
    embedding_multiplier=12.0,
    logits_scaling=8.0,
    residual_multiplier=0.22,
    attention_multiplier=0.0078125,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

_CORPUS = (
    "Granite is a family of language models. The hybrid design mixes Mamba-2 state space layers with attention. "
    "Long context at constant decode memory, many sequences at once. The quick brown fox jumps over the lazy dog. "
    "def forward(x): return x * 2 + 1  # numbers 0123456789 and punctuation: ,.;:!?()[]{}<>=+-*/"
)


def make_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 320):
    """Train a small byte-level BPE with Granite's special tokens and chat template; save it into out_dir."""
    from granite_jax.training.tokenizer import train_bpe

    return train_bpe([_CORPUS] * 4, vocab_size, out_dir)


def make_checkpoint(
    out_dir: str | os.PathLike,
    seed: int = 0,
    *,
    tokenizer: bool = True,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **config: Any,
) -> str:
    """Save a random GraniteMoeHybridForCausalLM (TINY_CONFIG updated by `config`) and a tokenizer into out_dir."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    fields = TINY_CONFIG | config
    if tokenizer:
        tok = make_tokenizer(out_dir)
        fields.setdefault("vocab_size", len(tok))
        fields.setdefault("eos_token_id", tok.eos_token_id)
        fields.setdefault("pad_token_id", tok.pad_token_id)
        fields.setdefault("bos_token_id", None)
    fields.setdefault("vocab_size", 320)
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**fields)).to(getattr(torch, dtype)).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    with _quiet_transformers():
        model.save_pretrained(out_dir, **kwargs)
    return out_dir


# The matrices the released FP8 checkpoints quantize: every Linear and the experts, not the router nor the head.
FLOAT8_TARGETS = re.compile(
    r"model\.layers\.\d+\.(mamba\.(in|out)_proj|self_attn\.[qkvo]_proj|shared_mlp\.(input|output)_linear"
    r"|block_sparse_moe\.(input|output)_linear)\.weight"
)
FLOAT8_QUANTIZATION = {  # config.json's block, as llm-compressor's FP8_DYNAMIC scheme writes it
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear", "GraniteMoeHybridParallelExpertsLinear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head", "re:.*block_sparse_moe.router"],
}


def make_float8_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dequantized: bool = False) -> str:
    """Write `src_dir`'s checkpoint in the released FP8 checkpoints' format, quantized with torch (independently of
    granite-jax): FLOAT8_TARGETS as float8 e4m3 with a bfloat16 `weight_scale` per output channel ([out, 1], the
    experts' [E, out, 1]; scale = max |w| / 448 over the input channels), the rest in bfloat16, and config.json's
    `quantization_config`. dequantized: instead, the float32 checkpoint of exactly those values (q * scale), with no
    quantization_config: what the float8 one means."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = os.fspath(src_dir), os.fspath(out_dir)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tensors = {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if not FLOAT8_TARGETS.fullmatch(name):
            tensors[name] = w.to(torch.bfloat16).to(torch.float32 if dequantized else torch.bfloat16)
            continue
        scale = (w.float().abs().amax(dim=-1, keepdim=True) / 448.0).clamp_min(1e-12).to(torch.bfloat16)
        q = (w.float() / scale.float()).to(torch.float8_e4m3fn)
        if dequantized:
            tensors[name] = q.float() * scale.float()
        else:
            tensors[name], tensors[name + "_scale"] = q, scale
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if not dequantized:
        config["quantization_config"] = FLOAT8_QUANTIZATION
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars off (it draws them on non-terminals too), as they were afterwards."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def attention_float64(q, k, v, query_slots, pad, scale):
    """Masked softmax attention in float64 numpy: q (b, T, kv, rep, hd), k/v (b, kv, S, hd); query t of row b sees the
    slots [pad[b], query_slots[t]]."""
    q, k, v = (np.asarray(np.asarray(t, np.float32), np.float64) for t in (q, k, v))  # bfloat16 via float32
    query_slots, pad = np.asarray(query_slots), np.asarray(pad)
    slots = np.arange(k.shape[2])
    mask = (slots[None, None, :] <= query_slots[None, :, None]) & (slots[None, None, :] >= pad[:, None, None])
    scores = np.einsum("btkrd,bksd->bkrts", q, k) * scale
    scores = np.where(mask[:, None, None], scores, -np.inf)
    with np.errstate(invalid="ignore"):  # padding queries see no key at all: NaN rows, never compared
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bkrts,bksd->btkrd", probs, v)


def main(argv: list[str] | None = None) -> None:
    from granite_jax import cli

    parser = cli.ArgumentParser(
        prog="python -m granite_jax.testing",
        description="Write a random tiny GraniteMoeHybrid checkpoint (transformers format) with a tokenizer, "
        "for trying the commands without downloading weights. Its weights are random: the text it generates is "
        "gibberish by design. For real text, see the README's 'Real weights'.",
    )
    parser.add_argument("out_dir", help="directory to write config.json, model.safetensors and tokenizer files into")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights (default 0)")
    args = parser.parse_args(argv)
    out = make_checkpoint(args.out_dir, args.seed)
    print(
        f"wrote a random tiny Granite 4.0 checkpoint to {out} (config.json, model.safetensors, tokenizer). Its weights "
        "are random, so its text is gibberish by design: it is for trying the commands and for tests.\n"
        f"Try: python -m granite_jax.generate --model {out} --prompt 'Hello'"
    )


if __name__ == "__main__":
    main()
