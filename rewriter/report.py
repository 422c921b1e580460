"""Command line: print (and optionally save) the rewriter's report for a granite-jax model part, built abstractly.

    python -m rewriter.report --config configs/rewriter/h_tiny_mamba.py --config.seq_len=8192
    python -m rewriter.report --config configs/rewriter/h_tiny_mamba.py --config.target=model --config.json_out=r.json

Parameters and inputs are `jax.ShapeDtypeStruct`s (`nnx.eval_shape`), so a report at full model size allocates
nothing. This module is the only part of the package that knows about granite-jax; the rewriter itself finds the
sites in whatever jaxpr it is given. A missing config file, a field unknown or missing (in the file or an override),
a value of the wrong type or out of range ends with one line and exit code 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_dict, config_flags

from granite_jax import cli
from granite_jax.config import ConfigError
from rewriter.api import analyze
from rewriter.options import Options
from rewriter.site import Report

TARGETS = ("mamba_layer", "ssd", "model")
PROG = "rewriter.report"
MAMBA_DIMS = ("hidden_size", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_chunk_size")
# The fields the report reads and their types: the schema a config file must match (configs/rewriter/*.py set the
# values). Every target reads all of them: the Mamba dims make the model config that the ssd target takes its shapes
# from.
FIELD_TYPES: dict[str, type] = dict(
    model=str,
    target=str,
    batch=int,
    seq_len=int,
    dtype=str,
    **dict.fromkeys(MAMBA_DIMS, int),
    min_flops=float,
    min_dim=int,
    fuse_chains=bool,
    precision=object,  # a name ("auto", "highest", ...) or a jax.lax.Precision
    json_out=str,
)
CONFIG_HELP = (
    "Report config file, e.g. configs/rewriter/h_tiny_mamba.py. Override any field with --config.FIELD=VALUE: "
    "model (a granite_jax.presets name supplying the architecture), target (mamba_layer: one naive Mamba-2 layer; "
    "ssd: the naive SSD function alone; model: the whole language model), batch, seq_len, dtype (float32, bfloat16, "
    "float16), the Mamba dims (hidden_size, mamba_n_heads, mamba_d_head, mamba_d_state, mamba_n_groups, "
    "mamba_chunk_size), the rewriter options (min_flops, min_dim: unset for the backend's default, fuse_chains, "
    "precision) and json_out (also save the report as JSON there). See docs/rewriter.md."
)


def config_schema() -> config_dict.ConfigDict:
    """A new config with exactly the fields the report reads (`FIELD_TYPES`), all unset."""
    return config_dict.ConfigDict({name: config_dict.placeholder(t) for name, t in FIELD_TYPES.items()})


def model_config(c: config_dict.ConfigDict):
    """The preset architecture with the config's Mamba dims."""
    from granite_jax.presets import released_config

    try:
        return released_config(c.model, **{f: c[f] for f in MAMBA_DIMS})
    except KeyError as e:
        raise ValueError(f"--config.model: {e.args[0]}") from None


def naive_runtime():
    """The naive SSD (the rewriter's input), and no platform kernels: the report is of plain JAX, whatever runs it."""
    from granite_jax.ops import Runtime

    return Runtime(ssd="naive", kernels=False)


def build(c: config_dict.ConfigDict) -> tuple[Callable, tuple[Any, ...]]:
    """(function, abstract arguments) for the configured target, running the naive SSD in plain JAX."""
    from flax import nnx

    from granite_jax import ops
    from granite_jax.model import Granite, MambaMixer
    from granite_jax.ssd import ssd_chunked_naive

    if c.target not in TARGETS:
        raise ValueError(f"--config.target: {c.target!r} is not one of {', '.join(TARGETS)}")
    for name in ("batch", "seq_len"):
        if c[name] < 1:
            raise ValueError(f"--config.{name} must be >= 1, got {c[name]}")
    if c.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--config.dtype: {c.dtype!r} is not one of float32, bfloat16, float16")
    cfg = model_config(c)
    dtype = jnp.dtype(c.dtype)
    sds = jax.ShapeDtypeStruct
    b, T = c.batch, c.seq_len
    if c.target == "ssd":
        h, p, g, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state
        args = (sds((b, T, h, p), dtype), sds((b, T, h), jnp.float32), sds((h,), jnp.float32))
        args += (sds((b, T, g, n), dtype), sds((b, T, g, n), dtype), sds((h,), jnp.float32))
        return functools.partial(ssd_chunked_naive, chunk_size=cfg.mamba_chunk_size), args
    if c.target == "mamba_layer":
        module = nnx.eval_shape(lambda: MambaMixer(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(module)

        def mamba_layer(state, x):
            with ops.using(naive_runtime()):
                return nnx.merge(graphdef, state)(x)[0]

        return mamba_layer, (state, sds((b, T, cfg.hidden_size), dtype))
    module = nnx.eval_shape(
        lambda: Granite(cfg, dtype=dtype, param_dtype=dtype, runtime=naive_runtime(), rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(module)

    def model(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    return model, (state, sds((b, T), jnp.int32))


def report_for(c: config_dict.ConfigDict) -> Report:
    fn, args = build(c)
    try:
        options = Options(min_flops=c.min_flops, min_dim=c.min_dim, fuse_chains=c.fuse_chains, precision=c.precision)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--config.{e}") from None  # Options' messages start with the field's name
    report = analyze(fn, *args, options=options)
    report.function = f"{c.model} {c.target} (naive SSD), batch {c.batch} x {c.seq_len} tokens, {c.dtype}"
    return report


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {' '.join(argv[1:])}")
    c = flags.FLAGS.config
    if c is None:
        cli.fail(PROG, "--config is required, e.g. --config configs/rewriter/h_tiny_mamba.py")
    if (problem := cli.output_file_problem("--config.json_out", c.json_out)) is not None:
        cli.fail(PROG, problem)
    try:
        cli.use_compilation_cache(None)  # $GRANITE_JAX_COMPILATION_CACHE: a directory, or off
        report = report_for(c)
    except (ValueError, ConfigError) as e:
        cli.fail(PROG, str(e))
    print(report)
    if c.json_out:
        report.to_json(c.json_out)
        print(f"saved {c.json_out}")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Callable[[list[str]], list[str]]:
    """Define --config on `flag_values` and return the command's `app.run(flags_parser=)`: bad flags, config files
    and overrides end with one line and exit code 2."""
    config = config_flags.DEFINE_config_file("config", None, CONFIG_HELP, flag_values=flag_values)
    schema = lambda _: config_schema()  # one kind of report config: the file does not choose its schema
    return cli.flags_parser(PROG, config, "a rewriter report", "target", schema, flag_values=flag_values)


if __name__ == "__main__":
    # Defined only when run as a command, so importing this module next to other absl commands defines no flags.
    app.run(main, flags_parser=define_flags())
