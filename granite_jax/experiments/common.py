"""What every experiment and `granite_jax.compare` share: resolving a model, timing a call, compiled memory, outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from granite_jax import ops, sharding
from granite_jax.checkpoint import DTYPES, WEIGHT_DTYPES, dtype_name, load_model
from granite_jax.cli import load_config
from granite_jax.config import ATTENTION, MAMBA, ConfigError, ModelConfig
from granite_jax.errors import InputError
from granite_jax.model import Granite, count_params, weight_dtype
from granite_jax.ops import SSD_IMPLS, Runtime
from granite_jax.presets import RELEASED


class ExperimentError(InputError):
    """Bad experiment input (config value, model name, directory); the message is meant for the command line."""


# ---------------------------------------------------------------------------------------------- models


def model_names() -> list[str]:
    return [*RELEASED, "tiny"]


def model_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The architecture called `name`: a released model ('granite-4.0-h-350m' or 'h-350m'), 'tiny', or a config file
    (`configs/models/x.py`, optionally `:arg`) whose `get_config()` returns a config.json dict."""
    hf = _model_dict(name)
    try:
        cfg = ModelConfig.from_hf_dict(hf, source=name)
    except ConfigError as e:
        raise ExperimentError(str(e)) from None
    return cfg if num_layers is None else with_num_layers(cfg, num_layers)


def _model_dict(name: str) -> dict[str, Any]:
    path, _, arg = name.partition(":")
    if path.endswith(".py"):
        return _load_config_file(path, arg or None)
    key = name if name.startswith("granite-") else f"granite-4.0-{name}"
    if key in RELEASED:
        return dict(RELEASED[key])
    if name == "tiny":
        from granite_jax.testing import TINY_CONFIG

        return dict(TINY_CONFIG, vocab_size=320)
    raise ExperimentError(
        f"unknown model {name!r}; expected one of {', '.join(model_names())} or a configs/models file"
    )


def _load_config_file(path: str, arg: str | None) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ExperimentError(f"{path}: model config file not found")
    try:
        config = load_config(path, arg)
    except Exception as e:  # not a config file, the file's own check of its argument, or a broken file
        raise ExperimentError(f"{path}: get_config({arg or ''}) failed: {e}") from None
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if "hidden_size" not in fields or "num_hidden_layers" not in fields:
        raise ExperimentError(
            f"{path}: not a model config (no hidden_size / num_hidden_layers); model configs are in configs/models/"
        )
    return fields


def with_num_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """`cfg` with n layers and the same share of attention layers (at least one if it had any), spread evenly."""
    if n < 1:
        raise ExperimentError(f"model.num_layers must be >= 1, got {n}")
    n_attn = cfg.layer_types.count(ATTENTION)
    keep = 0 if n_attn == 0 else min(n, max(1, round(n * n_attn / cfg.num_layers)))
    at = {int((j + 0.5) * n / keep) for j in range(keep)}
    return cfg.replace(layer_types=tuple(ATTENTION if i in at else MAMBA for i in range(n)))


def random_model(
    cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=None, runtime: Runtime | None = None, seed: int = 0
) -> Granite:
    """Random weights (transformers' initialisation, drawn under `seed`) of the architecture `cfg`, in
    `param_dtype` (None: dtype), run with `runtime` (None: the default)."""
    return Granite(cfg, dtype=dtype, param_dtype=param_dtype or dtype, runtime=runtime, rngs=nnx.Rngs(seed))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from: a checkpoint directory (HF or orbax) or random weights of a named architecture."""

    checkpoint: str | None = None
    name: str | None = None
    num_layers: int | None = None
    seed: int = 0

    def describe(self) -> str:
        if self.checkpoint:
            return self.checkpoint
        layers = "" if self.num_layers is None else f", {self.num_layers} layers"
        return f"random weights of {self.name} (seed {self.seed}{layers})"

    def load(
        self,
        *,
        dtype: str = "float32",
        weight_dtype: str | None = None,
        ssd_impl: str = "xla",
        progress: bool = False,
        mesh: str | None = None,
    ) -> Granite:
        """The model, computing in `dtype` on weights kept in `weight_dtype` (None: dtype), its SSD `ssd_impl` (one
        of `ops.SSD_IMPLS`) and the platform's kernels where they run (`ops.Runtime`); over `mesh` ("data=2,model=4",
        `sharding.parse_mesh`) if given."""
        dtype, weights = check_dtypes(dtype, weight_dtype)
        check_ssd_impl(ssd_impl)
        if mesh is not None:
            if ssd_impl == "pallas":
                raise ExperimentError("workload.mesh: the Pallas SSD does not run over a mesh; use ssd_impl 'xla'")
            try:
                mesh = sharding.parse_mesh(mesh)
            except InputError as e:
                raise ExperimentError(f"workload.mesh: {e}") from None
        runtime = Runtime(ssd=ssd_impl)
        if self.checkpoint:
            if self.num_layers is not None:
                raise ExperimentError("model.num_layers applies to random weights only; unset it or model.checkpoint")
            if not os.path.isdir(self.checkpoint):
                raise ExperimentError(f"{self.checkpoint}: model directory not found")
            weights = None if weight_dtype is None else weights  # None: as the checkpoint allows (float8 stays)
            kw = dict(dtype=dtype, weight_dtype=weights, runtime=runtime, progress=progress, mesh=mesh)
            return load_model(self.checkpoint, **kw)
        if not self.name:
            raise ExperimentError("no model: set a checkpoint directory or the name of an architecture")
        cfg = model_config(self.name, self.num_layers)
        model = random_model(
            cfg, dtype=DTYPES[dtype], param_dtype=WEIGHT_DTYPES[weights], runtime=runtime, seed=self.seed
        )
        return model if mesh is None else sharding.shard_model(model, mesh)


def check_dtypes(dtype: Any, weight_dtype: Any = None) -> tuple[str, str]:
    """(dtype, weight dtype) as names (`checkpoint.DTYPES`; weight_dtype None: dtype); ExperimentError naming the bad
    one otherwise."""
    try:
        dtype = dtype_name("dtype", dtype)
        return dtype, dtype if weight_dtype is None else dtype_name("weight_dtype", weight_dtype, WEIGHT_DTYPES)
    except InputError as e:
        raise ExperimentError(str(e)) from None


def model_summary(model: Granite) -> dict[str, Any]:
    cfg = model.cfg
    return dict(
        num_params=count_params(model),
        num_layers=cfg.num_layers,
        mamba_layers=cfg.layer_types.count(MAMBA),
        attention_layers=cfg.layer_types.count(ATTENTION),
        hidden_size=cfg.hidden_size,
        num_local_experts=cfg.num_local_experts,
        dtype=str(jnp.dtype(model.dtype)),
        weight_dtype=weight_dtype(model),
        ssd_impl=model.runtime.ssd,
    )


def random_tokens(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length), dtype=np.int32)


# ---------------------------------------------------------------------------------------------- measuring


def time_call(fn: Callable[[], Any], *, repeats: int = 3, warmup: int = 1) -> dict[str, float]:
    """Wall-clock seconds of `fn()` (its result blocked on): median, min and max over `repeats` after `warmup` runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times))


def compiled_memory(compiled) -> dict[str, int]:
    """Memory an XLA executable needs (bytes): arguments, outputs, temporaries, and their sum as the peak bound."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    out = dict(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(getattr(stats, "alias_size_in_bytes", 0)),
    )
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def sweep_lengths(seq_lens: Sequence[int] | None, seq_len: int, start: int = 256) -> list[int]:
    """`seq_lens` if given, else powers of two from `start` up to and including `seq_len`."""
    if seq_lens:
        lengths = sorted({int(n) for n in seq_lens})
    else:
        lengths = [2**k for k in range(int(math.log2(start)), int(math.log2(max(seq_len, 1))) + 1) if 2**k <= seq_len]
        if not lengths or lengths[-1] != seq_len:
            lengths.append(seq_len)
    if lengths[0] < 1:
        raise ExperimentError(f"sequence lengths must be >= 1, got {lengths}")
    return lengths


def environment() -> dict[str, Any]:
    import flax

    device = jax.devices()[0]
    return dict(
        jax=jax.__version__,
        flax=flax.__version__,
        backend=jax.default_backend(),
        device=getattr(device, "device_kind", str(device)),
        device_count=jax.device_count(),
        cpu_count=os.cpu_count(),
        cpu_model=cpu_model(),
        python=platform.python_version(),
        platform=platform.platform(),
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,  # 1, 5, 15 min, at the end
        kernels=ops.describe(Runtime()),  # what runs besides plain JAX by default here (the CPU kernels)
    )


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere, or without the optional `granite_jax.cpu`,
    `platform.processor()`)."""
    try:
        from granite_jax.cpu.build import cpuinfo
    except ImportError:
        return platform.processor()
    return cpuinfo("model name") or platform.processor()


# ---------------------------------------------------------------------------------------------- output


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default, allow_nan=True)
        f.write("\n")


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic | jax.Array | np.ndarray):
        return np.asarray(x).tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of `rows` (dicts); numbers are formatted to 4 significant digits."""
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(format_value(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def format_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float | np.floating):
        if math.isnan(v):
            return "nan"
        return f"{v:.3e}" if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6) else f"{v:.4g}"
    return str(v)


def matplotlib_pyplot():
    """pyplot with the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------------------- configs and results


def default_config(experiment: str):
    """The fields every experiment config has; `configs/experiments/*.py` start from this and change defaults.

    model: `checkpoint` (HF or orbax directory) or random weights of `name` (`num_layers` shrinks it, same share of
    attention layers); workload: what runs; measure: how it is measured; output_dir: where results go.
    """
    from ml_collections import config_dict

    c = config_dict.ConfigDict()
    c.experiment = experiment
    c.model = config_dict.ConfigDict(
        dict(
            checkpoint=config_dict.placeholder(str),
            name="granite-4.0-h-350m",
            num_layers=config_dict.placeholder(int),
            seed=0,
        )
    )
    c.workload = config_dict.ConfigDict(
        dict(
            batch=1,
            seq_len=512,  # prompt tokens; sweeps go over seq_lens, or powers of two up to seq_len
            seq_lens=config_dict.placeholder(tuple),
            new_tokens=32,
            dtype="float32",
            # granite-jax's weights (None: dtype); bfloat16 under dtype float32 computes in float32 on the weights
            # as stored (half the weight memory; transformers still runs in dtype, on the same values, so a
            # weight_dtype that dtype cannot hold is refused where transformers runs)
            weight_dtype=config_dict.placeholder(str),
            ssd_impl="xla",
            # a device mesh for granite-jax, e.g. "data=2,model=4" (granite_jax.sharding; transformers runs on one
            # device): the weights loaded straight into their shards
            mesh=config_dict.placeholder(str),
            rewriter=False,  # run granite-jax's forward through rewriter.rewrite
            # where transformers runs (parity, throughput): auto (CUDA when granite-jax runs on a GPU and torch sees
            # one), cpu or cuda
            torch_device="auto",
        )
    )
    c.measure = config_dict.ConfigDict(dict(repeats=3, warmup=1))
    c.output_dir = config_dict.placeholder(str)  # default: runs/<experiment>-<timestamp>
    return c


@dataclasses.dataclass
class Result:
    """What an experiment returns: a table (rows), headline numbers (summary), notes and plots to draw."""

    title: str
    rows: list[dict[str, Any]]
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    columns: list[str] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    plots: dict[str, Callable[[str], None]] = dataclasses.field(default_factory=dict)  # file name -> draw(path)
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    workload: dict[str, Any] = dataclasses.field(default_factory=dict)  # the workload fields this experiment used


def check_workload(workload) -> None:
    """Clear errors for workload values no experiment can run."""
    try:
        check_dtypes(workload.dtype, workload.weight_dtype)
    except ExperimentError as e:
        raise ExperimentError(f"workload.{e}") from None
    if workload.ssd_impl not in SSD_IMPLS:
        raise ExperimentError(f"workload.ssd_impl: {workload.ssd_impl!r} is not one of {', '.join(SSD_IMPLS)}")
    if workload.torch_device not in TORCH_DEVICES:
        raise ExperimentError(
            f"workload.torch_device: {workload.torch_device!r} is not one of {', '.join(TORCH_DEVICES)}"
        )
    for name in ("batch", "seq_len", "new_tokens"):
        if workload[name] < 1:
            raise ExperimentError(f"workload.{name} must be >= 1, got {workload[name]}")
    check_ssd_impl(workload.ssd_impl)
    bad = lambda n: isinstance(n, bool) or not isinstance(n, int) or n < 1
    if workload.seq_lens is not None and any(bad(n) for n in workload.seq_lens):
        raise ExperimentError(f"workload.seq_lens must be positive integers, got {workload.seq_lens}")


def torch_matmul_precision(dtype: str):
    """float32 products in full float32, as torch computes them by default; without it JAX may use TF32 on GPUs
    (no effect on CPU). Wraps every comparison with transformers and every experiment."""
    return jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()


def check_ssd_impl(ssd_impl: str) -> None:
    """ExperimentError where `ssd_impl` is not one of `ops.SSD_IMPLS`, or cannot run here (pallas without a GPU)."""
    if ssd_impl not in SSD_IMPLS:
        raise ExperimentError(f"ssd_impl: {ssd_impl!r} is not one of {', '.join(SSD_IMPLS)}")
    if ssd_impl == "pallas":
        import pallas_kernels

        try:
            pallas_kernels.check_available()
        except pallas_kernels.PallasUnavailableError as e:
            raise ExperimentError(str(e)) from None


# Lower bounds of the measure fields experiments read (an experiment's config has those it uses).
MEASURE_BOUNDS = dict(repeats=1, warmup=0, naive_repeats=1, floor_pairs=0, floor_probe_mib=0, tolerance=0.0)


def check_measure(measure) -> None:
    for name, least in MEASURE_BOUNDS.items():
        if name in measure and not _at_least(measure[name], least):
            kind = "an integer" if isinstance(least, int) else "a number"
            raise ExperimentError(f"measure.{name} must be {kind} >= {least}, got {measure[name]!r}")
    if measure.get("max_naive_seconds") is not None and not _at_least(measure.max_naive_seconds, 0.0, strict=True):
        raise ExperimentError(f"measure.max_naive_seconds must be a number > 0, got {measure.max_naive_seconds!r}")


def check_model(model) -> None:
    if not _at_least(model.seed, 0):
        raise ExperimentError(f"model.seed must be an integer >= 0, got {model.seed!r}")
    if model.num_layers is not None and not _at_least(model.num_layers, 1):
        raise ExperimentError(f"model.num_layers must be an integer >= 1, got {model.num_layers!r}")


def _at_least(value: Any, least: int | float, strict: bool = False) -> bool:
    """value is a number (an integer where `least` is one) >= least (> least if strict), and finite."""
    kinds = int if isinstance(least, int) else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        return False
    return value > least if strict else value >= least


def share_gpu_with_torch() -> None:
    """Have JAX allocate GPU memory as it needs it, so that transformers fits beside it (JAX preallocates 75% of the
    GPU by default). Takes effect only before JAX starts its backend: the commands call it before anything runs."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


TORCH_DEVICES = ("auto", "cpu", "cuda")


def resolve_torch_device(choice: str, flag: str = "--torch-device") -> str:
    """transformers' device for `choice` (of TORCH_DEVICES, set by `flag`): 'auto' is CUDA when granite-jax runs on a
    GPU and torch sees one."""
    if choice == "cpu":
        return "cpu"
    import torch

    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise ExperimentError(f"{flag} cuda: torch {torch.__version__} sees no CUDA device; use cpu")
    if choice == "cuda":
        return "cuda"
    return "cuda" if has_cuda and jax.default_backend() == "gpu" else "cpu"


def set_torch_threads(n: int | None, flag: str) -> None:
    """torch's intra-op thread count (None: torch's own choice)."""
    if n is None:
        return
    if isinstance(n, bool) or n < 1:
        raise ExperimentError(f"{flag} must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)


@contextlib.contextmanager
def output_dir(out: str, flag: str) -> Iterator[str]:
    """Create the output directory before any work, so a bad path fails at once and not after a long run; if the
    work inside fails (an exception, Ctrl-C included) and leaves the directory this made empty, remove it."""
    created = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ExperimentError(f"{flag}: cannot create {out} ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ExperimentError(f"{flag}: {out} is not writable")
    try:
        yield out
    except BaseException:
        if created and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
        raise


def quick(arg: str | None) -> bool:
    """An experiment config's argument: 'quick' (tiny model, seconds) or nothing."""
    if arg not in (None, "", "quick"):
        raise ValueError(f"unknown argument {arg!r}; expected ':quick' or nothing")
    return arg == "quick"


def model_spec(config) -> ModelSpec:
    return ModelSpec(config.model.checkpoint, config.model.name, config.model.num_layers, config.model.seed)


def load_config_of(config) -> ModelConfig:
    """The architecture of the experiment's model without reading weights: the checkpoint's config.json, or the name."""
    if config.model.checkpoint:
        from granite_jax.checkpoint import load_config

        if not os.path.isdir(config.model.checkpoint):
            raise ExperimentError(f"{config.model.checkpoint}: model directory not found")
        return load_config(config.model.checkpoint)
    return model_config(config.model.name, config.model.num_layers)
