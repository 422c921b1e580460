"""Run one config-driven experiment and write its results.

    python -m granite_jax.experiment --config configs/experiments/scaling.py --config.workload.seq_len=4096
    python -m granite_jax.experiment --config configs/experiments/parity.py --config.model.checkpoint=DIR

A config file (ml_collections, `get_config()`) names the experiment and has four sections: `model` (a checkpoint
directory, or random weights of a named architecture), `workload` (batch, prompt length, new tokens, dtype, SSD
implementation, rewriter on/off), `measure` (repeats and experiment-specific switches) and `output_dir`. Any field can
be overridden on the command line as `--config.SECTION.FIELD=VALUE`; values are type-checked and unknown fields are
refused. Experiments: rewrite, parity, throughput, scaling (`granite_jax/experiments/`, docs/experiments.md).

Writes into the output directory (default runs/<experiment>-<timestamp>): results.json (every number, the config
used, the environment), results.md (the table) and PNG plots.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
import time
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from granite_jax.config import ConfigError
from granite_jax.experiments.common import (
    ExperimentError,
    Result,
    check_measure,
    check_workload,
    environment,
    markdown_table,
    prepare_output_dir,
    torch_matmul_precision,
    write_json,
)
from granite_jax.params import CheckpointError

EXPERIMENTS = {
    "rewrite": "granite_jax.experiments.rewrite",
    "parity": "granite_jax.experiments.parity",
    "throughput": "granite_jax.experiments.throughput",
    "scaling": "granite_jax.experiments.scaling",
}
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Experiment config file, e.g. configs/experiments/scaling.py (text after ':' is passed to its get_config). "
    "Override any field with --config.SECTION.FIELD=VALUE: --config.model.checkpoint=DIR (HF or orbax), "
    "--config.model.name=granite-4.0-h-350m (random weights), --config.model.num_layers=N, --config.workload.batch=N, "
    "--config.workload.seq_len=N, --config.workload.seq_lens='(256,1024)', --config.workload.new_tokens=N, "
    "--config.workload.dtype=bfloat16, --config.workload.weight_dtype=bfloat16 (weights only, under dtype float32), "
    "--config.workload.ssd_impl=naive|xla|pallas, --config.workload.rewriter, "
    "--config.measure.repeats=N, --config.output_dir=DIR. See docs/experiments.md.",
    lock_config=True,
)
PROG = "granite_jax.experiment"


def run(config) -> str:
    """Run the experiment `config` describes; write results.json, results.md and plots. Returns the output dir."""
    if config.experiment not in EXPERIMENTS:
        raise ExperimentError(f"experiment: {config.experiment!r} is not one of {', '.join(EXPERIMENTS)}")
    check_workload(config.workload)
    check_measure(config.measure)
    out = config.output_dir or os.path.join("runs", f"{config.experiment}-{time.strftime('%Y%m%d-%H%M%S')}")
    prepare_output_dir(out, "output_dir")
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


def _record(config, result: Result, plots: list[str], elapsed: float) -> dict[str, Any]:
    return dict(
        experiment=config.experiment,
        title=result.title,
        command=" ".join(["python -m granite_jax.experiment", *sys.argv[1:]]),
        config=json.loads(config.to_json()),
        model=result.model,
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


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors (exit code 2) instead of tracebacks for bad config overrides."""
    try:
        rest = flags.FLAGS(argv)
        if _CONFIG.value is not None:
            _CONFIG.value.experiment  # noqa: B018  (a config file that failed to load raises only when read)
        return rest
    except flags.Error as e:
        _fail(str(e).splitlines()[0])
    except Exception as e:  # config_flags raises whatever the config file or the override raised)
        _fail(_override_error(argv, e))
    return []


def _config_file_arg(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _override_error(argv: list[str], error: Exception) -> str:
    """Name the config file that cannot be loaded, or the override that does not fit the config and the fields that
    exist where it points."""
    spec = _config_file_arg(argv)
    path, _, arg = (spec or "").partition(":")
    if spec is None or not os.path.isfile(path):
        return f"--config: config file {path or '(none)'!r} not found"
    try:
        config = _load_config(path, arg or None)
    except Exception as e:  # the config file itself is broken
        return f"--config: {path}: get_config() failed ({type(e).__name__}: {e})"
    for item in argv[1:]:
        m = re.fullmatch(r"--(?:no)?config\.([\w.]+)(=.*)?", item)
        if not m:
            continue
        node, fields_path = config, m.group(1).split(".")
        for depth, key in enumerate(fields_path):
            fields = list(node.keys()) if hasattr(node, "keys") else []
            if key not in fields:
                where = ".".join(["config", *fields_path[:depth]])
                known = f"fields: {', '.join(sorted(fields))}" if fields else "it is a value, not a section"
                return f"--config.{m.group(1)}: unknown field {key!r} in {where} ({known})"
            node = node[key]
    return f"bad config override ({type(error).__name__}: {str(error).strip()})"


def _load_config(path: str, arg: str | None):
    spec = importlib.util.spec_from_file_location("_granite_experiment_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg is not None else module.get_config()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    config = _CONFIG.value
    if config is None:
        _fail("--config is required, e.g. --config configs/experiments/scaling.py")
    try:
        out = run(config)
    except (ExperimentError, CheckpointError, ConfigError) as e:
        _fail(str(e))
    with open(os.path.join(out, "results.md")) as f:
        print(f.read())
    print(f"wrote {out}/results.json, results.md and plots")


def cli() -> None:
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
