"""Command-line plumbing shared by the commands and benchmark scripts: bad input ends with one line on stderr and
exit code 2, never a usage block or a traceback.

- `ArgumentParser`: argparse with one-line errors (generate, compare, convert, the benchmark scripts), and the
  argument types and checks they share (`positive_int`, `output_file_problem`, `add_shape_argument`, ...).
- `flags_parser`: absl flag parsing for commands driven by an ml_collections config file (`--config FILE
  --config.x=y`: the experiment command and `rewriter.report`), naming a missing or broken config file and an
  override that names no field or does not fit its type.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from absl import flags

HELP_FLAGS = ("--help", "-h", "--helpshort", "--helpfull", "-?")
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # absl's handler would print backend probing


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit code 2 (argparse's default prints the usage too)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_shape_argument(parser: argparse.ArgumentParser, what: str, default: str = "granite-4.0-h-350m") -> None:
    """--shape NAME, one of the released architectures (`presets.RELEASED`); `what` says what a script takes from it."""
    from granite_jax.presets import RELEASED

    names = sorted(RELEASED)
    parser.add_argument(
        "--shape",
        default=default,
        choices=names,
        metavar="NAME",
        help=f"{what} of this released architecture: " + ", ".join(names),
    )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, refused when the arguments are read (before any work)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 ("1,8")."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def output_file_problem(flag: str, path: str | None, *, make_dir: bool = False) -> str | None:
    """Why the file `path` (given as `flag`) could not be written at the end of a run, or None; checked first, so a
    long run is not lost to a late failure. make_dir: create its missing directory now."""
    if path in (None, "", "-"):
        return None
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory; give a file name"
    parent = os.path.dirname(os.path.abspath(path))
    if make_dir:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            return f"{flag} {path}: cannot create its directory ({e.strerror})"
    if not os.path.isdir(parent):
        return f"{flag} {path}: the directory does not exist"
    if not os.access(parent, os.W_OK):
        return f"{flag} {path}: the directory is not writable"
    return None


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def load_config(path: str, arg: str | None = None):
    """`get_config()` (or `get_config(arg)`) of the config file at `path`; ValueError if it is not a Python file
    with a `get_config`. Whatever get_config raises (a bad argument, say) passes through."""
    spec = importlib.util.spec_from_file_location("_granite_jax_config_file", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python config file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"{path} has no get_config()")
    return module.get_config(arg) if arg is not None else module.get_config()


def flags_parser(prog: str, config: flags.FlagHolder, required: Sequence[str], kind: str) -> Callable:
    """An `app.run(..., flags_parser=)` that reports bad flags and config overrides in one line (exit code 2), and
    a config file without the `required` fields as not being a `kind` config. `--help` exits with 0."""

    def parse(argv: list[str]) -> list[str]:
        try:
            rest = flags.FLAGS(argv)
            fields = list(config.value.keys()) if config.value is not None else None  # a broken file raises here
        except SystemExit as e:  # absl's --help prints the usage and exits with 1
            sys.exit(0 if any(a in HELP_FLAGS for a in argv[1:]) else e.code)
        except flags.Error as e:  # the flag's first line, and the cause a config file's traceback ends with
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            fail(prog, lines[0] + (f" {lines[-1]}" if len(lines) > 1 else ""))
        except Exception as e:  # config_flags raises whatever the config file or the override raised
            fail(prog, override_error(argv, e))
        missing = [f for f in required if fields is not None and f not in fields]
        if missing:
            path = (_config_file_arg(argv) or "").partition(":")[0]
            fail(prog, f"--config: {path} is not {kind} config (no field {missing[0]!r}; it has: {', '.join(fields)})")
        return rest

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
    except ValueError as e:  # not a config file, or get_config refused its argument
        return f"--config: {e}" if path in str(e) else f"--config: {path}: {e}"
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
