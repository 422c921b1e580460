"""Model configuration: a frozen dataclass read from a Hugging Face `config.json` (GraniteMoeHybridConfig).

Field semantics follow transformers' `configuration_granitemoehybrid.py`.
Values this port does not implement are rejected with an error naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

MAMBA, ATTENTION = "mamba", "attention"
_LAYER_TYPE_ALIASES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
SSD_IMPLS = ("xla", "naive", "pallas")


class ConfigError(ValueError):
    """A config value that is missing, inconsistent or not supported by granite-jax."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a GraniteMoeHybrid model, plus the SSD implementation used to run it."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # "mamba" | "attention" per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # FFN width of each routed expert
    shared_intermediate_size: int
    num_local_experts: int  # 0 = dense (shared MLP only)
    num_experts_per_tok: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    rms_norm_eps: float = 1e-6
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rope_theta: float | None = None  # None: NoPE
    tie_word_embeddings: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    ssd_impl: str = "xla"

    def __post_init__(self):
        for i, t in enumerate(self.layer_types):
            if t not in (MAMBA, ATTENTION):
                raise ConfigError(f"layer_types[{i}]: unknown layer type {t!r}; expected 'mamba' or 'attention'")
        if self.ssd_impl not in SSD_IMPLS:
            raise ConfigError(f"ssd_impl: {self.ssd_impl!r} is not one of {SSD_IMPLS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.has_mamba:
            if self.mamba_n_heads * self.mamba_d_head != self.mamba_d_inner:
                raise ConfigError(
                    f"mamba_n_heads * mamba_d_head = {self.mamba_n_heads} * {self.mamba_d_head} does not equal "
                    f"mamba_expand * hidden_size = {self.mamba_d_inner}"
                )
            if self.mamba_n_heads % self.mamba_n_groups:
                raise ConfigError(
                    f"mamba_n_groups={self.mamba_n_groups} does not divide mamba_n_heads={self.mamba_n_heads}"
                )
        if self.num_local_experts and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_local_experts={self.num_local_experts}]"
            )
        if self.rope_theta is not None and self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def has_mamba(self) -> bool:
        return MAMBA in self.layer_types

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def mamba_in_proj_dim(self) -> int:
        return self.mamba_d_inner + self.mamba_conv_dim + self.mamba_n_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config") -> ModelConfig:
        """Build from a GraniteMoeHybridConfig dict (4.x or 5.x spelling), rejecting what is not implemented."""
        try:
            return cls._from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{source}: invalid or missing field ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "granitemoehybrid")
        if model_type != "granitemoehybrid":
            raise ConfigError(f"model_type: {model_type!r} is not supported (expected 'granitemoehybrid')")
        for field, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mamba_proj_bias", False)):
            if d.get(field, ok) != ok:
                raise ConfigError(f"{field}: {d[field]!r} is not supported (only {ok!r})")
        hidden = int(d.get("hidden_size", 4096))
        n_layers = int(d.get("num_hidden_layers", 32))
        raw_types = d.get("layer_types") or d.get("layers_block_type") or [MAMBA] * n_layers
        if len(raw_types) != n_layers:
            raise ConfigError(f"layer_types: {len(raw_types)} entries but num_hidden_layers={n_layers}")
        layer_types = []
        for i, t in enumerate(raw_types):
            if t not in _LAYER_TYPE_ALIASES:
                raise ConfigError(f"layer_types[{i}]: unknown layer type {t!r}")
            layer_types.append(_LAYER_TYPE_ALIASES[t])
        heads = int(d.get("num_attention_heads", 32))
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; set head_dim")
            head_dim = hidden // heads
        expand = int(d.get("mamba_expand", 2))
        mamba_heads = int(d.get("mamba_n_heads", 128))
        d_head = d.get("mamba_d_head", "auto")
        if d_head in ("auto", None):
            d_head = expand * hidden // mamba_heads
        eos = d.get("eos_token_id", 2)
        eos = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        n_experts = int(d.get("num_local_experts", 8) or 0)
        return cls(
            vocab_size=int(d.get("vocab_size", 32000)),
            hidden_size=hidden,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(d.get("intermediate_size", 11008)),
            shared_intermediate_size=int(d.get("shared_intermediate_size", 1024)),
            num_local_experts=n_experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 2) or 0) if n_experts else 0,
            mamba_n_heads=mamba_heads,
            mamba_d_head=int(d_head),
            mamba_d_state=int(d.get("mamba_d_state", 256)),
            mamba_n_groups=int(d.get("mamba_n_groups", 1)),
            mamba_d_conv=int(d.get("mamba_d_conv", 4)),
            mamba_expand=expand,
            mamba_chunk_size=int(d.get("mamba_chunk_size", 256)),
            mamba_conv_bias=bool(d.get("mamba_conv_bias", True)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
            attention_multiplier=float(d.get("attention_multiplier", 1.0)),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            logits_scaling=float(d.get("logits_scaling", 1.0)),
            rope_theta=_rope_theta(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            time_step_limit=_time_step_limit(d.get("time_step_limit", (0.0, math.inf))),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id", 1),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ModelConfig:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: config.json not found")
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=path)

    def to_hf_dict(self) -> dict[str, Any]:
        """The inverse of `from_hf_dict`: a config.json dict transformers accepts."""
        d = {
            "model_type": "granitemoehybrid",
            "architectures": ["GraniteMoeHybridForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "mamba_n_heads": self.mamba_n_heads,
            "mamba_d_head": self.mamba_d_head,
            "mamba_d_state": self.mamba_d_state,
            "mamba_n_groups": self.mamba_n_groups,
            "mamba_d_conv": self.mamba_d_conv,
            "mamba_expand": self.mamba_expand,
            "mamba_chunk_size": self.mamba_chunk_size,
            "mamba_conv_bias": self.mamba_conv_bias,
            "mamba_proj_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "embedding_multiplier": self.embedding_multiplier,
            "attention_multiplier": self.attention_multiplier,
            "residual_multiplier": self.residual_multiplier,
            "logits_scaling": self.logits_scaling,
            "position_embedding_type": "nope" if self.rope_theta is None else "rope",
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "pad_token_id": self.pad_token_id,
        }
        if self.head_dim != self.hidden_size // self.num_attention_heads:
            d["head_dim"] = self.head_dim
        if self.rope_theta is not None:
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.time_step_limit != (0.0, math.inf):
            d["time_step_limit"] = list(self.time_step_limit)
        return d


def _rope_theta(d: dict[str, Any]) -> float | None:
    kind = d.get("position_embedding_type")
    if kind in (None, "nope"):
        return None
    if kind != "rope":
        raise ConfigError(f"position_embedding_type: {kind!r} is not supported (expected 'nope', 'rope' or null)")
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


def _time_step_limit(value: Any) -> tuple[float, float]:
    if value is None:
        return (0.0, math.inf)
    lo, hi = (_json_float(v) for v in value)
    if not lo <= hi:
        raise ConfigError(f"time_step_limit: {value!r} must be (low, high) with low <= high")
    return (lo, hi)


def _json_float(v: Any) -> float:
    # transformers 5.x writes infinities as {"__float__": "Infinity"}.
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)
