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

from granite_jax.errors import ConfigError

MAMBA, ATTENTION = "mamba", "attention"
_LAYER_TYPE_ALIASES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a GraniteMoeHybrid model: what its config.json says (how it runs is `ops.Runtime`)."""

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
    initializer_range: float = 0.02  # std of a fresh model's matrices, as transformers' `_init_weights`
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

    def __post_init__(self):
        self._normalize()
        self._check_values()
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

    def _normalize(self) -> None:
        """Lists stored as the tuples the fields hold (so configs hash and compare), one eos_token_id int as a tuple."""
        for name in ("layer_types", "eos_token_id", "time_step_limit"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.eos_token_id, int) and not isinstance(self.eos_token_id, bool):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))

    def _check_values(self) -> None:
        """Each field on its own: layer types known, sizes positive integers, scalars finite numbers."""
        if not isinstance(self.layer_types, tuple):
            raise ConfigError(f"layer_types: expected a sequence of layer types, got {self.layer_types!r}")
        if not self.layer_types:
            raise ConfigError("layer_types: empty; a model needs at least one layer")
        for i, t in enumerate(self.layer_types):
            if t not in (MAMBA, ATTENTION):
                raise ConfigError(f"layer_types[{i}]: unknown layer type {t!r}; expected 'mamba' or 'attention'")
        for name in _POSITIVE_INTS:
            _check_int(name, getattr(self, name), 1)
        _check_int("num_local_experts", self.num_local_experts, 0)
        _check_int("num_experts_per_tok", self.num_experts_per_tok, 0)
        _check_int("intermediate_size", self.intermediate_size, 1 if self.num_local_experts else 0)
        for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier"):
            _check_float(name, getattr(self, name))
        _check_float("rms_norm_eps", self.rms_norm_eps, positive=True)
        _check_float("initializer_range", self.initializer_range, positive=True)
        _check_float("logits_scaling", self.logits_scaling, nonzero=True)
        if self.rope_theta is not None:
            _check_float("rope_theta", self.rope_theta, positive=True)
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0)
        if not isinstance(self.eos_token_id, tuple):
            raise ConfigError(f"eos_token_id: expected a token id or a sequence of them, got {self.eos_token_id!r}")
        for i, token in enumerate(self.eos_token_id):
            _check_int(f"eos_token_id[{i}]", token, 0)
        for name in ("tie_word_embeddings", "mamba_conv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        _check_time_step_limit(self.time_step_limit)

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
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {_json_type(d)}")
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
        hidden = _int(d, "hidden_size", 4096)
        heads = _int(d, "num_attention_heads", 32)
        n_experts = _int(d, "num_local_experts", 8, minimum=0, null=0)
        return cls(
            vocab_size=_int(d, "vocab_size", 32000),
            hidden_size=hidden,
            layer_types=_layer_types(d),
            num_attention_heads=heads,
            num_key_value_heads=_int(d, "num_key_value_heads", heads, null=heads),
            head_dim=_head_dim(d, hidden, heads),
            intermediate_size=_int(d, "intermediate_size", 11008, minimum=0),
            shared_intermediate_size=_int(d, "shared_intermediate_size", 1024),
            num_local_experts=n_experts,
            num_experts_per_tok=_int(d, "num_experts_per_tok", 2, minimum=0, null=0) if n_experts else 0,
            mamba_n_heads=_int(d, "mamba_n_heads", 128),
            mamba_d_head=_mamba_d_head(d, hidden),
            mamba_d_state=_int(d, "mamba_d_state", 256),
            mamba_n_groups=_int(d, "mamba_n_groups", 1),
            mamba_d_conv=_int(d, "mamba_d_conv", 4),
            mamba_expand=_int(d, "mamba_expand", 2),
            mamba_chunk_size=_int(d, "mamba_chunk_size", 256),
            mamba_conv_bias=_bool(d, "mamba_conv_bias", True),
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            initializer_range=_float(d, "initializer_range", 0.02),
            embedding_multiplier=_float(d, "embedding_multiplier", 1.0),
            attention_multiplier=_float(d, "attention_multiplier", 1.0),
            residual_multiplier=_float(d, "residual_multiplier", 1.0),
            logits_scaling=_float(d, "logits_scaling", 1.0),
            rope_theta=_rope_theta(d),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            time_step_limit=_time_step_limit(d.get("time_step_limit", (0.0, math.inf))),
            max_position_embeddings=_int(d, "max_position_embeddings", 2048),
            bos_token_id=_int(d, "bos_token_id", 1, minimum=0, null=None),
            eos_token_id=_eos_token_ids(d.get("eos_token_id", 2)),
            pad_token_id=_int(d, "pad_token_id", None, minimum=0, null=None),
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ModelConfig:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: config.json not found")
        d = read_json_object(path)
        check_model_kind(d, path)
        return cls.from_hf_dict(d, source=path)

    def to_hf_dict(self) -> dict[str, Any]:
        """The inverse of `from_hf_dict`: a config.json dict transformers accepts."""
        d = {
            "model_type": "granitemoehybrid",
            "architectures": [ARCHITECTURE],
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
            "initializer_range": self.initializer_range,
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
    params, scaling = _object(d, "rope_parameters"), _object(d, "rope_scaling")
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')")
    return _float(params if "rope_theta" in params else d, "rope_theta", 10000.0)


def _time_step_limit(value: Any) -> tuple[float, float]:
    """The JSON value as (low, high) floats; `_check_time_step_limit` checks it when the config is built."""
    if value is None:
        return (0.0, math.inf)
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(f"time_step_limit: expected [low, high], got {value!r}")
    return tuple(_json_float(v) for v in value)


def _check_time_step_limit(value: Any) -> None:
    numbers = isinstance(value, tuple) and len(value) == 2
    numbers = numbers and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    if not numbers or not value[0] <= value[1]:
        raise ConfigError(f"time_step_limit: {value!r} must be (low, high), two numbers with low <= high")


def _json_float(v: Any) -> float:
    # transformers 5.x writes infinities as {"__float__": "Infinity"}.
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


# ---------------------------------------------------------------------------------------------- field readers

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "shared_intermediate_size",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_d_state",
    "mamba_n_groups",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_chunk_size",
    "max_position_embeddings",
)
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_MISSING = object()


ARCHITECTURE = "GraniteMoeHybridForCausalLM"


def check_model_kind(d: dict[str, Any], source: str) -> None:
    """A config.json must say it is a GraniteMoeHybrid causal LM: another model's config can hold every field this one
    reads, and would load into wrong weights or wrong math without a word. `architectures` may be absent, as
    transformers allows (`model_type` is what AutoConfig dispatches on); when present it must name the LM head class."""
    model_type = d.get("model_type")
    if model_type != "granitemoehybrid":
        found = "no model_type" if model_type is None else f"model_type {model_type!r}"
        raise ConfigError(f"{source}: {found}; expected 'granitemoehybrid' (a Granite 4.0 config.json)")
    architectures = d.get("architectures", [ARCHITECTURE])
    if architectures != [ARCHITECTURE]:
        raise ConfigError(f"{source}: architectures {architectures!r}; expected [{ARCHITECTURE!r}]")


def read_json_object(path: str, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """The JSON object in the UTF-8 file `path`; `error` naming the file if it is unreadable, not JSON or no object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError, or a number or nesting beyond Python's limits
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")


def _check_float(name: str, value: Any, *, positive: bool = False, nonzero: bool = False) -> None:
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not math.isfinite(value) or (positive and value <= 0) or (nonzero and value == 0):
        expected = "a finite number" + (" > 0" if positive else " != 0" if nonzero else "")
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")


def _int(d: dict[str, Any], name: str, default: int | None, *, minimum: int = 1, null: Any = _MISSING) -> Any:
    """d[name] as an int >= minimum; `null`, if given, stands for a JSON null."""
    value = d.get(name, default)
    if value is None and null is not _MISSING:
        return null
    return _as_int(name, value, minimum)


def _as_int(name: str, value: Any, minimum: int) -> int:
    """`value` as an int >= minimum; an integral float such as 64.0 is accepted too."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    _check_int(name, value, minimum)
    return value


def _float(d: dict[str, Any], name: str, default: float) -> float:
    """d[name] as a float: a JSON number (an int too), never a string; finiteness and sign are checked later."""
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    return float(value)


def _bool(d: dict[str, Any], name: str, default: bool) -> bool:
    value = d.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def _object(d: dict[str, Any], name: str) -> dict[str, Any]:
    value = d.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected an object, got {value!r}")
    return value


def _layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    n_layers = _int(d, "num_hidden_layers", 32)
    raw_types = d.get("layer_types") or d.get("layers_block_type") or [MAMBA] * n_layers
    if not isinstance(raw_types, list | tuple):
        raise ConfigError(f"layer_types: expected a list of layer types, got {raw_types!r}")
    if len(raw_types) != n_layers:
        raise ConfigError(f"layer_types: {len(raw_types)} entries but num_hidden_layers={n_layers}")
    for i, t in enumerate(raw_types):
        if not isinstance(t, str) or t not in _LAYER_TYPE_ALIASES:
            raise ConfigError(f"layer_types[{i}]: unknown layer type {t!r}")
    return tuple(_LAYER_TYPE_ALIASES[t] for t in raw_types)


def _head_dim(d: dict[str, Any], hidden: int, heads: int) -> int:
    if d.get("head_dim") is not None:
        return _int(d, "head_dim", None)
    if hidden % heads:
        raise ConfigError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; set head_dim")
    return hidden // heads


def _mamba_d_head(d: dict[str, Any], hidden: int) -> int:
    if d.get("mamba_d_head", "auto") not in ("auto", None):
        return _int(d, "mamba_d_head", None)
    return _int(d, "mamba_expand", 2) * hidden // _int(d, "mamba_n_heads", 128)


def _eos_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        return (_as_int("eos_token_id", value, 0),)
    return tuple(_as_int(f"eos_token_id[{i}]", v, 0) for i, v in enumerate(value))
