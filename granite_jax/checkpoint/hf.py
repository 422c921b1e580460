"""Hugging Face checkpoints: safetensors in, safetensors out.

A table maps every checkpoint name to a path in the NNX state and a transform (linear weights keep torch's
[out, in] layout, see `model.Linear`; expert weights and the conv are rearranged); each tensor's shape is checked
against the abstract model before it is placed, and so is its dtype (a floating-point one: integer tensors are
refused, not cast). Tensors are read one at a time and cast to the dtype of the parameter they become, so peak host
memory stays near one copy of the model. Only safetensors are read: pickled `.bin`/`.pt` checkpoints are refused,
never unpickled. `export_safetensors` writes a model back through the same table, inverted.

Float8 weights (`model.FLOAT8`): a model with them takes a float8 checkpoint's matrices and their `weight_scale`s as
they are, and quantizes a wider checkpoint's matrices as it loads them, one tensor at a time. Float8 checkpoints are the
released FP8 ones' format: compressed-tensors "float-quantized", 8-bit float weights with one scale per output channel
([out, 1]; [E, out, 1] for the experts), activations quantized dynamically (nothing stored for them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from granite_jax.config import ModelConfig, read_json_object
from granite_jax.errors import CheckpointError
from granite_jax.model import FLOAT8, quantize

SOURCE_DTYPES = ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn")  # anything else is an error
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
FLOAT8_STORED = "F8_E4M3"  # safetensors' name; its numpy reader has no float8 type, so these are read from the bytes


@dataclasses.dataclass(frozen=True)
class Transform:
    """How a checkpoint tensor becomes an NNX parameter, and the checkpoint shape a parameter shape implies."""

    apply: Callable[[Any], Any]
    source_shape: Callable[[tuple[int, ...]], tuple[int, ...]]


KEEP = Transform(lambda w: w, lambda s: s)
EXPERTS = Transform(lambda w: w.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]))  # [E, out, in] -> [E, in, out]
CONV = Transform(lambda w: w[:, 0, :].T, lambda s: (s[1], 1, s[0]))  # depthwise Conv1d [C, 1, K] -> [K, C]
SCALE = Transform(lambda w: w[..., 0], lambda s: (*s, 1))  # a float8 matrix's scales [..., out, 1] -> [..., out]
# (checkpoint name regex, NNX state path template, transform)
_L = r"model\.layers\.(\d+)\."
NAME_MAP: tuple[tuple[str, str, Transform], ...] = (
    (r"model\.embed_tokens\.weight", "embed_tokens.embedding", KEEP),
    (r"model\.norm\.weight", "norm.weight", KEEP),
    (r"lm_head\.weight", "lm_head.weight", KEEP),
    (_L + r"(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight", KEEP),
    (_L + r"mamba\.(in_proj|out_proj)\.weight", r"layers.\1.mamba.\2.weight", KEEP),
    (_L + r"mamba\.conv1d\.weight", r"layers.\1.mamba.conv_weight", CONV),
    (_L + r"mamba\.conv1d\.bias", r"layers.\1.mamba.conv_bias", KEEP),
    (_L + r"mamba\.(dt_bias|A_log|D)", r"layers.\1.mamba.\2", KEEP),
    (_L + r"mamba\.norm\.weight", r"layers.\1.mamba.norm.weight", KEEP),
    (_L + r"self_attn\.([qkvo])_proj\.weight", r"layers.\1.self_attn.\2_proj.weight", KEEP),
    (_L + r"block_sparse_moe\.router\.layer\.weight", r"layers.\1.block_sparse_moe.router.weight", KEEP),
    (_L + r"block_sparse_moe\.(input|output)_linear\.weight", r"layers.\1.block_sparse_moe.\2_linear", EXPERTS),
    # transformers 5's in-memory names (save_pretrained(..., save_original_format=False)): the same tensors renamed
    (_L + r"block_sparse_moe\.router\.weight", r"layers.\1.block_sparse_moe.router.weight", KEEP),
    (_L + r"block_sparse_moe\.experts\.gate_up_proj", r"layers.\1.block_sparse_moe.input_linear", EXPERTS),
    (_L + r"block_sparse_moe\.experts\.down_proj", r"layers.\1.block_sparse_moe.output_linear", EXPERTS),
    (_L + r"shared_mlp\.(input|output)_linear\.weight", r"layers.\1.shared_mlp.\2_linear.weight", KEEP),
    # float8 checkpoints: each quantized matrix's per-output-channel scales (SCALE_SUFFIX on its parameter's path)
    (_L + r"mamba\.(in_proj|out_proj)\.weight_scale", r"layers.\1.mamba.\2.weight_scale", SCALE),
    (_L + r"self_attn\.([qkvo])_proj\.weight_scale", r"layers.\1.self_attn.\2_proj.weight_scale", SCALE),
    (
        _L + r"block_sparse_moe\.(input|output)_linear\.weight_scale",
        r"layers.\1.block_sparse_moe.\2_linear_scale",
        SCALE,
    ),
    (_L + r"shared_mlp\.(input|output)_linear\.weight_scale", r"layers.\1.shared_mlp.\2_linear.weight_scale", SCALE),
)
SCALE_SUFFIX = "_scale"  # a float8 matrix at path P has its scales at P + SCALE_SUFFIX (model.Linear, model.MoE)


def map_name(name: str) -> tuple[str, Transform] | None:
    """The NNX state path and transform for a checkpoint tensor name, or None if the name is not a model tensor."""
    for pattern, target, transform in NAME_MAP:
        if m := re.fullmatch(pattern, name):
            return m.expand(target), transform
    return None


# ---------------------------------------------------------------------------------------------- files


def load_config(model_dir: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory's config.json (Hugging Face or orbax)."""
    d = os.fspath(model_dir)
    if not os.path.isdir(d):
        raise CheckpointError(f"{d}: model directory not found")
    return ModelConfig.from_json(os.path.join(d, "config.json"))


FLOAT8_FORMAT = dict(quant_method="compressed-tensors", format="float-quantized")
FLOAT8_WEIGHTS = dict(num_bits=8, type="float", strategy="channel", symmetric=True)


def is_float8_checkpoint(model_dir: str | os.PathLike) -> bool:
    """Whether config.json's `quantization_config` declares float8 weights in the format this importer reads (see the
    module docstring); CheckpointError naming the field for any other quantization."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        return False
    q = read_json_object(path, CheckpointError).get("quantization_config")
    if q is None:
        return False
    where = f"{path}: quantization_config"
    groups = q.get("config_groups") if isinstance(q, dict) else None
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: expected compressed-tensors config_groups, got {q!r:.120}")
    for key, want in FLOAT8_FORMAT.items():
        if q.get(key) != want:
            raise CheckpointError(f"{where}.{key}: expected {want!r} (float8 weights), got {q.get(key)!r}")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        for key, want in FLOAT8_WEIGHTS.items():
            got = weights.get(key) if isinstance(weights, dict) else None
            if got != want:
                raise CheckpointError(f"{where}.config_groups.{name}.weights.{key}: expected {want!r}, got {got!r}")
        acts = group.get("input_activations")
        if isinstance(acts, dict) and not acts.get("dynamic", False):
            raise CheckpointError(
                f"{where}.config_groups.{name}.input_activations: static activation scales are not supported "
                "(expected dynamic: true)"
            )
    return True


def headers_dtype(files: dict[str, tuple[str, ...] | None]) -> str | None:
    """The one dtype the safetensors `files` store their tensors in, read from their headers; None if they mix."""
    dtypes = set()
    for path, names in files.items():
        try:
            with safe_open(path, framework="numpy") as f:
                dtypes |= {f.get_slice(name).get_dtype() for name in (names if names is not None else f.keys())}
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
    return SAFETENSORS_DTYPES.get(dtypes.pop()) if len(dtypes) == 1 else None


def checkpoint_files(model_dir: str | os.PathLike) -> dict[str, tuple[str, ...] | None]:
    """The safetensors files of a HF checkpoint directory, each with the tensor names its index assigns to it
    (None: a single-file checkpoint, every tensor in it)."""
    d = os.fspath(model_dir)
    if not os.path.isdir(d):
        raise CheckpointError(f"{d}: model directory not found")
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        return _index_shards(index)
    single = os.path.join(d, "model.safetensors")
    if os.path.isfile(single):
        return {single: None}
    pickles = [f for f in os.listdir(d) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    if pickles:
        raise CheckpointError(
            f"{d}: found only pickled weights ({', '.join(sorted(pickles))}); granite-jax never unpickles files. "
            "Convert them to safetensors first, e.g. with transformers: "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
        )
    raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json")


def _index_shards(index: str) -> dict[str, tuple[str, ...]]:
    """The shards a `model.safetensors.index.json` names, each with its tensor names; every entry checked."""
    weight_map = read_json_object(index, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: weight_map: expected a non-empty object of tensor name -> shard file, got {weight_map!r:.80}"
        )
    d = os.path.dirname(index)
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
            raise CheckpointError(
                f"{index}: weight_map[{name!r}]: expected the file name of a shard in {d}, got {shard!r}"
            )
        shards.setdefault(os.path.join(d, shard), []).append(name)
    missing = sorted(os.path.basename(s) for s in shards if not os.path.isfile(s))
    if missing:
        raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
    return {path: tuple(names) for path, names in sorted(shards.items())}


def iter_tensors(files: dict[str, tuple[str, ...] | None]) -> Iterator[tuple[str, str, Any]]:
    """Yield (file, name, array) one tensor at a time: each file's assigned tensors (all of them for None)."""
    for path, names in files.items():
        try:
            handle = safe_open(path, framework="numpy")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
        with handle as f:  # the header checked by safetensors; the tensors read from the file's bytes
            present = set(f.keys())
            for name in names if names is not None else f.keys():
                if name not in present:
                    raise CheckpointError(f"{path}: no tensor {name!r}, though the index assigns it to this file")
                try:
                    tensor = _read_tensor(path, name)
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"{path}: tensor {name!r} cannot be read, file truncated? ({e})") from None
                yield path, name, tensor


STORED_DTYPES = {  # safetensors' dtype names -> NumPy's (ml_dtypes' for the narrow floats)
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(jax.numpy.bfloat16),
    FLOAT8_STORED: np.dtype(jax.numpy.float8_e4m3fn),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


def _read_tensor(path: str, name: str) -> np.ndarray:
    """A tensor read from the file's bytes into memory of its own (the format: an 8-byte little-endian header length,
    a JSON header giving each tensor's dtype, shape and byte range, then the data). Not through a memory map: the
    pages of a mapped file count in the process's resident memory until the file is closed, a second copy of a
    one-file checkpoint by the time its last tensor is read."""
    data_start, header = _safetensors_header(path, os.stat(path).st_mtime_ns)
    entry = header[name]
    begin, end = entry["data_offsets"]
    dtype = STORED_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(
            f"{path}: tensor {name!r} has dtype {entry['dtype']}, expected one of {', '.join(SOURCE_DTYPES)}"
        )
    tensor = np.empty(entry["shape"], dtype)
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        read = f.readinto(memoryview(tensor.reshape(-1).view(np.uint8)))
    if read != end - begin or tensor.nbytes != end - begin:
        raise ValueError(f"{end - begin} bytes expected, {read} read")
    return tensor


@functools.lru_cache(maxsize=4)  # parsed once per file, not once per tensor (thousands in a large checkpoint)
def _safetensors_header(path: str, mtime_ns: int) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (length,) = np.frombuffer(f.read(8), "<u8")
        return 8 + int(length), json.loads(f.read(int(length)))


# ---------------------------------------------------------------------------------------------- import


def read_weights(
    files: dict[str, tuple[str, ...] | None],
    expected: dict[str, Any],
    progress: bool,
    placement: dict[str, jax.sharding.Sharding] | None = None,
    relayout: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> dict[str, jax.Array]:
    """The model's parameters {NNX path: array} from the safetensors `files`, every tensor mapped by `NAME_MAP`,
    checked against `expected` (the abstract model's {path: shape and dtype}) and cast to its parameter's dtype, or
    quantized to float8 with its scales where the parameter is float8 and the tensor is not. `placement`: each
    parameter's sharding (None: the default device), each tensor placed straight into its shards. `relayout(path,
    host array)`: the parameter's layout from the checkpoint's (on the host, before the placement; the Mamba rows'
    blocks over a mesh, `sharding.to_blocks`), its shape in `expected` being the checkpoint's."""
    values: dict[str, jax.Array] = {}
    source: dict[str, str] = {}
    head = None  # an lm_head.weight beside a tied config: accepted if it equals the embedding, as transformers does
    # Closed before an error propagates, so the error prints on a line of its own; drawn on a terminal only.
    with tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=None if progress else True) as bar:
        for path, name, tensor in iter_tensors(files):
            mapped = map_name(name)
            if mapped is None:
                raise CheckpointError(f"{path}: unexpected tensor {name!r} (not part of a GraniteMoeHybrid model)")
            target, transform = mapped
            if target == "lm_head.weight" and target not in expected:
                head = path, tensor
                continue
            if target not in expected:
                raise CheckpointError(
                    f"{path}: tensor {name!r} does not exist in this model's config (maps to {target})"
                )
            if target in source:
                raise CheckpointError(f"{path}: tensor {name!r} sets {target}, which {source[target]!r} already set")
            if np.dtype(tensor.dtype).name not in SOURCE_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has dtype {np.dtype(tensor.dtype).name}, expected one of "
                    f"{', '.join(SOURCE_DTYPES)} (only float8 quantized checkpoints are read)"
                )
            want = transform.source_shape(tuple(expected[target].shape))
            if tuple(tensor.shape) != want:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {want}"
                )
            where = None if placement is None else placement[target]
            tensor = transform.apply(tensor)
            if relayout is not None:
                tensor = relayout(target, tensor)
            for placed, value in _placed(path, name, target, tensor, expected, where).items():
                values[placed], source[placed] = value, name
            bar.update()
    first = next(iter(files))
    missing = sorted(set(expected) - set(values))
    if missing == ["lm_head.weight"]:
        raise CheckpointError(
            f"{first}: no lm_head.weight but config has tie_word_embeddings=false; "
            "set tie_word_embeddings=true or add the head"
        )
    if missing:
        raise CheckpointError(
            f"{os.path.dirname(first)}: missing tensor(s) for {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    if head is not None:
        embedding = np.asarray(values["embed_tokens.embedding"])
        path, tensor = head
        if tensor.shape != embedding.shape or not np.array_equal(tensor.astype(embedding.dtype), embedding):
            raise CheckpointError(
                f"{path}: lm_head.weight differs from the embedding but config.json has tie_word_embeddings=true; "
                "set it to false to use the separate head"
            )
    return values


def _placed(
    path: str, name: str, target: str, tensor: np.ndarray, expected: dict[str, Any], where: Any = None
) -> dict[str, jax.Array]:
    """{path: device array} a checkpoint tensor becomes: its parameter in that parameter's dtype, cast on the host
    (numpy views and one copy) and then transferred; a wider matrix under a float8 parameter is transferred as it is
    and quantized there (`model.quantize`), giving its scales too."""
    want = np.dtype(expected[target].dtype)
    stored_float8 = tensor.dtype == FLOAT8
    if stored_float8 and want != FLOAT8 and not target.endswith(SCALE_SUFFIX):
        raise CheckpointError(
            f"{path}: tensor {name!r} is stored in float8; load this checkpoint with weight dtype float8 "
            f"(arithmetic in bfloat16), not {want.name}"
        )
    if want == FLOAT8 and not stored_float8:
        q, scale = quantize(jax.device_put(np.ascontiguousarray(tensor), where), axis=1)
        return {target: q, target + SCALE_SUFFIX: scale}
    with np.errstate(over="ignore"):  # values past the dtype's range become inf: load_model refuses them
        return {target: jax.device_put(np.ascontiguousarray(tensor.astype(want, copy=False)), where)}


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict of parameters as {"a.b.0.c": leaf}."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    """`flatten`'s inverse (digit keys become ints, as NNX's lists index them)."""
    tree: dict = {}
    for key, v in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[int(leaf) if leaf.isdigit() else leaf] = v
    return tree


# ---------------------------------------------------------------------------------------------- export


_UNDO = {id(KEEP): lambda w: w, id(EXPERTS): lambda w: w.transpose(0, 2, 1)}
_UNDO[id(CONV)] = lambda w: w.T[:, None, :]  # [K, C] -> depthwise Conv1d [C, 1, K]


def _inverse_entry(pattern: str, target: str) -> tuple[re.Pattern, str]:
    """(regex over NNX paths, HF-name template) from one `NAME_MAP` entry (non-nested groups, escaped dots)."""
    groups = re.findall(r"\([^()]*\)", pattern)
    name_template = pattern
    for i, g in enumerate(groups, 1):
        name_template = name_template.replace(g, f"\\{i}", 1)
    name_template = name_template.replace("\\.", ".")
    path_regex = re.escape(target)
    for i, g in enumerate(groups, 1):
        path_regex = path_regex.replace(re.escape(f"\\{i}"), f"(?P<g{i}>{g[1:-1]})", 1)
    return re.compile(path_regex), name_template


_INVERSE = [(*_inverse_entry(pattern, target), transform) for pattern, target, transform in NAME_MAP]


def hf_name(path: str) -> tuple[str, Transform]:
    """The Hugging Face checkpoint name of an NNX state path, and the import transform that maps it (`map_name`)."""
    for path_regex, name_template, transform in _INVERSE:
        if m := path_regex.fullmatch(path):
            name = re.sub(r"\\(\d)", lambda g: m.group(f"g{g.group(1)}"), name_template)
            if map_name(name) != (path, transform):  # the table is not invertible at this entry
                raise CheckpointError(f"NNX parameter {path!r}: {name!r} does not import back to it")
            return name, transform
    raise CheckpointError(f"NNX parameter {path!r} has no Hugging Face checkpoint name")


def hf_tensors(model: nnx.Module) -> dict[str, Any]:
    """The model's parameters as float32 numpy arrays under their Hugging Face checkpoint names and layouts; float8
    matrices dequantized (q times its channels' scales), which is what they mean to transformers' model; rows laid
    out in a mesh's blocks put back in transformers' order."""
    from granite_jax.sharding import transformers_order

    flat = transformers_order(model)
    out = {}
    for path, value in flat.items():
        if path.endswith(SCALE_SUFFIX):
            continue
        value = np.asarray(value, np.float32)
        if path + SCALE_SUFFIX in flat:  # scales run along the output channels: all axes but 1, the input's
            value = value * np.expand_dims(np.asarray(flat[path + SCALE_SUFFIX], np.float32), 1)
        name, transform = hf_name(path)
        out[name] = np.array(_UNDO[id(transform)](value), order="C")  # a writable copy
    return out


def export_safetensors(model: nnx.Module, out_dir: str | os.PathLike, *, dtype: str = "float32") -> str:
    """Write the model as a Hugging Face checkpoint (model.safetensors + config.json) that transformers loads."""
    import torch
    from safetensors.torch import save_file

    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    tensors = {k: torch.from_numpy(v).to(getattr(torch, dtype)) for k, v in hf_tensors(model).items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf_dict() | {"dtype": dtype}, f, indent=2)
    return out
