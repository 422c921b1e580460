"""Run one config-driven experiment and write its results.

    python -m granite_jax.experiment --config configs/experiments/scaling.py --config.workload.seq_len=4096
    python -m granite_jax.experiment --config configs/experiments/parity.py --config.model.checkpoint=DIR

A config file (ml_collections, `get_config()`) names the experiment and has four sections: `model` (a checkpoint
directory, or random weights of a named architecture), `workload` (batch, prompt length, new tokens, dtype, SSD
implementation, rewriter on/off), `measure` (repeats and experiment-specific switches) and `output_dir`. Any field can
be overridden on the command line as `--config.SECTION.FIELD=VALUE`. Values are type-checked and unknown fields are
refused, on the command line and in the file, which must have every field its experiment reads (`KIND_FIELDS`).
Experiments: rewrite, parity, throughput, scaling (`granite_jax/experiments/`, docs/experiments.md).

Writes into the output directory (default runs/<experiment>-<timestamp>): results.json (every number, the config
used, the environment), results.md (the table) and PNG plots. Compiled programs are kept between runs in JAX's
persistent cache, as by the other commands ($GRANITE_JAX_COMPILATION_CACHE: a directory, or off), except by the
rewrite experiment, which measures compilation.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any, NoReturn

from absl import app
from ml_collections import config_dict, config_flags

from granite_jax.cli import fail, flags_parser, use_compilation_cache
from granite_jax.errors import InputError
from granite_jax.experiments.common import (
    ExperimentError,
    Result,
    check_measure,
    check_model,
    check_workload,
    default_config,
    environment,
    markdown_table,
    output_dir,
    share_gpu_with_torch,
    torch_matmul_precision,
    write_json,
)

EXPERIMENTS = {
    "rewrite": "granite_jax.experiments.rewrite",
    "parity": "granite_jax.experiments.parity",
    "throughput": "granite_jax.experiments.throughput",
    "scaling": "granite_jax.experiments.scaling",
}
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Experiment config file, e.g. configs/experiments/scaling.py; FILE:quick runs a tiny model in seconds. "
    "Override any field with --config.SECTION.FIELD=VALUE: --config.model.checkpoint=DIR (HF or orbax), "
    "--config.model.name=granite-4.0-h-350m (random weights), --config.model.num_layers=N, --config.model.seed=N, "
    "--config.workload.batch=N, --config.workload.seq_len=N, --config.workload.seq_lens='(256,1024)', "
    "--config.workload.new_tokens=N, --config.workload.dtype=bfloat16, --config.workload.weight_dtype=bfloat16 "
    "(weights only, under dtype float32), --config.workload.ssd_impl=naive|xla|pallas, --config.workload.rewriter, "
    "--config.workload.torch_device=auto|cpu|cuda (where transformers runs), "
    "--config.measure.repeats=N, --config.measure.warmup=N, --config.output_dir=DIR. Per experiment: parity "
    "measure.tolerance; rewrite measure.naive_repeats, measure.max_naive_seconds; throughput workload.batch_sizes, "
    "measure.transformers, measure.floor_probe_mib, measure.floor_pairs, measure.torch_threads. "
    "See docs/experiments.md.",
    lock_config=True,
)
PROG = "granite_jax.experiment"
MEASURES_COMPILATION = ("rewrite",)  # experiments that time compilation: a cached program would hide it
# The fields each kind of experiment reads besides `default_config`'s, and their types; with those, the schema a config
# file must match (`config_schema`): the file sets their values (configs/experiments/<kind>.py: the defaults). Every
# field of default_config is required of every kind: `run` checks the model, workload and measure sections before the
# kind runs, so no section is unused. A field the kind does not read is refused, as on the command line.
KIND_FIELDS: dict[str, dict[str, dict[str, type]]] = {
    "rewrite": dict(measure=dict(naive_repeats=int, max_naive_seconds=float)),
    "parity": dict(measure=dict(tolerance=float)),
    "throughput": dict(
        workload=dict(batch_sizes=tuple),
        measure=dict(transformers=bool, floor_probe_mib=int, floor_pairs=int, torch_threads=int),
    ),
    "scaling": {},
}


def config_schema(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """A new config with exactly the fields an experiment of `config`'s kind reads (values: placeholders and defaults,
    types: what a file may set); ValueError for a kind that does not exist."""
    kind = config["experiment"]
    if not isinstance(kind, str) or kind not in EXPERIMENTS:
        raise ValueError(f"experiment: {kind!r} is not one of {', '.join(EXPERIMENTS)}")
    schema = default_config(kind)
    for section, fields in KIND_FIELDS[kind].items():
        for name, field_type in fields.items():
            schema[section][name] = config_dict.placeholder(field_type)
    return schema


def run(config) -> str:
    """Run the experiment `config` describes; write results.json, results.md and plots. Returns the output dir."""
    if config.experiment not in EXPERIMENTS:
        raise ExperimentError(f"experiment: {config.experiment!r} is not one of {', '.join(EXPERIMENTS)}")
    check_model(config.model)
    if loads_transformers(config) and config.workload.torch_device != "cpu":
        share_gpu_with_torch()  # before anything starts JAX's backend (check_workload may, for ssd_impl="pallas")
    check_workload(config.workload)
    check_measure(config.measure)
    out = config.output_dir or os.path.join("runs", f"{config.experiment}-{time.strftime('%Y%m%d-%H%M%S')}")
    with output_dir(out, "output_dir"):  # a failed run leaves no empty directory behind
        module = importlib.import_module(EXPERIMENTS[config.experiment])
        start = time.perf_counter()
        with torch_matmul_precision(config.workload.dtype):
            result: Result = module.run(config)
    elapsed = time.perf_counter() - start
    plots = [name for name, draw in result.plots.items() if draw(os.path.join(out, name)) is not False]
    write_json(os.path.join(out, "results.json"), _record(config, result, plots, elapsed))
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report(config, result, plots))
    return out


def loads_transformers(config) -> bool:
    """Whether the experiment runs transformers beside granite-jax (the others leave JAX's GPU allocator as it is)."""
    return config.experiment == "parity" or (config.experiment == "throughput" and config.measure.transformers)


def _record(config, result: Result, plots: list[str], elapsed: float) -> dict[str, Any]:
    return dict(
        experiment=config.experiment,
        title=result.title,
        command=" ".join(["python -m granite_jax.experiment", *sys.argv[1:]]),
        config=json.loads(config.to_json()),
        model=result.model,
        workload=result.workload,
        summary=result.summary,
        rows=result.rows,
        notes=result.notes,
        plots=plots,
        elapsed_s=elapsed,
        finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        environment=environment(),
    )


def report(config, result: Result, plots: list[str]) -> str:
    """results.md: title, model and workload, the table, headline numbers, notes and plots."""
    params = _params(result.model)
    lines = [
        f"# {result.title}",
        "",
        f"- model: {result.model.get('source', '')}" + (f" ({params})" if params else ""),
        "- workload: " + ", ".join(f"{k} {_value(v)}" for k, v in result.workload.items()),
        f"- command: `{' '.join(['python -m granite_jax.experiment', *sys.argv[1:]])}`",
        "",
        markdown_table(result.rows, result.columns),
    ]
    if result.summary:
        lines += ["", markdown_table([dict(measure=k, value=v) for k, v in result.summary.items()])]
    lines += [f"- {note}" for note in result.notes]
    lines += ["", *(f"![{name}]({name})" for name in plots)]
    return "\n".join(lines).rstrip() + "\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return ", ".join(map(str, v)).join("()") if isinstance(v, list | tuple) else str(v)


def _params(model: dict[str, Any]) -> str:
    n = model.get("num_params")
    return "" if n is None else f"{n / 1e6:.1f}M parameters, {model.get('num_layers')} layers"


# ---------------------------------------------------------------------------------------------- command line


def _fail(message: str) -> NoReturn:
    fail(PROG, message)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    if config is None:
        _fail("--config is required, e.g. --config configs/experiments/scaling.py")
    try:
        if config.experiment not in MEASURES_COMPILATION:
            use_compilation_cache(None)
        out = run(config)
    except InputError as e:  # ExperimentError, ConfigError, CheckpointError, GenerationError
        _fail(str(e))
    with open(os.path.join(out, "results.md")) as f:
        print(f.read())
    print(f"wrote {out}/results.json, results.md and plots")


# Bad flags and config files: one line, exit code 2.
parse_flags = flags_parser(PROG, _CONFIG, "an experiment", "experiment", config_schema)


def cli() -> None:
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
