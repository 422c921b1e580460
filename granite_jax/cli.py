"""Commands driven by an ml_collections config file (`--config FILE --config.x=y`): absl's flag parsing, with one
line and exit code 2 for a missing or broken config file and for an override that names no field or does not fit its
type, instead of absl's traceback. Used by `granite_jax.experiment` and `rewriter.report`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from absl import flags


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def load_config(path: str, arg: str | None = None):
    """`get_config()` (or `get_config(arg)`) of the config file at `path`."""
    spec = importlib.util.spec_from_file_location("_granite_jax_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg is not None else module.get_config()


def flags_parser(prog: str, config: flags.FlagHolder) -> Callable[[list[str]], list[str]]:
    """An `app.run(..., flags_parser=)` that reports bad flags and config overrides in one line (exit code 2)."""

    def parse(argv: list[str]) -> list[str]:
        try:
            rest = flags.FLAGS(argv)
            if config.value is not None:
                list(config.value.keys())  # a config file that failed to load raises only when read
            return rest
        except flags.Error as e:
            fail(prog, str(e).splitlines()[0])
        except Exception as e:  # config_flags raises whatever the config file or the override raised
            fail(prog, override_error(argv, e))

    return parse


def _config_file_arg(argv: list[str]) -> str | None:
    """The config file named last (absl keeps the last value of a repeated flag)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--config="):
            found = arg.split("=", 1)[1]
    return found


def override_error(argv: list[str], error: Exception) -> str:
    """Name the config file that cannot be loaded, or the override that does not fit the config and the fields that
    exist where it points."""
    spec = _config_file_arg(argv)
    path, _, arg = (spec or "").partition(":")
    if spec is None or not os.path.isfile(path):
        return f"--config: config file {path or '(none)'!r} not found"
    try:
        config = load_config(path, arg or None)
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
