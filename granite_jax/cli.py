"""Command-line plumbing shared by the commands and benchmark scripts: bad input ends with one line on stderr and
exit code 2, never a usage block or a traceback.

- `ArgumentParser`: argparse with one-line errors (generate, compare, convert, the benchmark scripts), and the
  argument types and checks they share (`positive_int`, `output_file_problem`, `add_shape_argument`, ...).
- `flags_parser`: absl flag parsing for commands driven by an ml_collections config file (`--config FILE
  --config.x=y`: the experiment command and `rewriter.report`), naming a missing or broken config file, a field
  of the file that the command does not read or lacks or whose value does not fit its type, and an override
  that names no field or does not fit its type.
- `guarded`: a command's exit status, with bad input (`InputError`) one line and 2, Ctrl-C 130.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from absl import flags

if TYPE_CHECKING:
    from ml_collections.config_dict import ConfigDict

HELP_FLAGS = ("--help", "-h", "--helpshort", "--helpfull", "-?")
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # absl's handler would print backend probing


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `granite_jax.<command>: error: ...`, with exit code 2 (argparse's default
    prints the usage block too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{command_name(self.prog)}: error: {message} (see --help)\n")

    def fail(self, message: str) -> NoReturn:
        """Bad input found after parsing: the same one line and exit code."""
        fail(command_name(self.prog), message)


def command_name(prog: str) -> str:
    """The name errors start with: `granite_jax.generate` for `python -m granite_jax.generate`."""
    return prog.removeprefix("python -m ")


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


def model_dir(text: str) -> str:
    """argparse type: an existing checkpoint directory."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: model directory not found")
    return text


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


CACHE_ENV = "GRANITE_JAX_COMPILATION_CACHE"
_OFF = ("off", "0", "false", "no", "")


def add_cache_argument(parser: argparse.ArgumentParser) -> None:
    """--compilation-cache DIR|off: where the command keeps compiled programs between runs."""
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR|off",
        help=f"keep compiled programs in DIR so that later runs skip compilation (JAX's persistent cache); off: "
        f"compile on every run. Default: ${CACHE_ENV} if set (a directory or off), else {default_cache_dir()}",
    )


def default_cache_dir() -> str:
    """The user's cache directory for compiled programs (XDG's cache home)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "granite-jax", "xla")


def compilation_cache_dir(flag: str | None) -> str | None:
    """The cache directory a command uses: the flag, else $GRANITE_JAX_COMPILATION_CACHE, else the default; None
    when either says off."""
    setting = flag if flag is not None else os.environ.get(CACHE_ENV)
    if setting is None:
        return default_cache_dir()
    return None if setting.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(setting))


def use_compilation_cache(flag: str | None) -> str | None:
    """Turn JAX's persistent compilation cache on for this process (before its first compilation) and return its
    directory, or None. A cache that JAX was told about directly (JAX_COMPILATION_CACHE_DIR, or
    JAX_ENABLE_COMPILATION_CACHE=false) is left as it is. Raises InputError for a directory that cannot be made."""
    import jax

    from granite_jax.errors import InputError

    if not jax.config.jax_enable_compilation_cache:
        return None
    if jax.config.jax_compilation_cache_dir and flag is None and CACHE_ENV not in os.environ:
        return jax.config.jax_compilation_cache_dir
    path = compilation_cache_dir(flag)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        message = f"--compilation-cache {path}: cannot create it ({e.strerror}); give a writable directory or off"
        raise InputError(message) from None
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however quick to compile: a command's many small compilations add up to seconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


# C0 and C1 control characters but newline and tab, DEL, and the bidirectional formatting characters: sampled text
# could otherwise move the cursor, rewrite the screen or reorder what the terminal shows (CVE-2021-42574).
_CONTROL = [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _CONTROL}


def printable(text: str) -> str:
    """`text` for a terminal: control characters but newline and tab shown as Python escapes (`\\x1b`)."""
    return text.translate(_ESCAPES)


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def guarded(prog: str, run: Callable[[], int]) -> int:
    """A command's exit status: `run()`'s, or 2 with one line for bad input (an `InputError`), or 130 for Ctrl-C
    (the interrupt's message, if it has one, says what resumes)."""
    from granite_jax.errors import InputError

    try:
        return run()
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"{prog}: {e or 'interrupted'}", file=sys.stderr)
        return 130


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


def flags_parser(
    prog: str,
    config: flags.FlagHolder,
    kind: str,
    key: str,
    schema: Callable[[ConfigDict], ConfigDict],
    *,
    flag_values: flags.FlagValues = flags.FLAGS,
) -> Callable:
    """An `app.run(..., flags_parser=)` that reports bad flags, config files and config overrides in one line (exit
    code 2); `--help` exits with 0. A config file without the field `key` is named as not being a `kind` config;
    one whose fields differ from those of `schema(config)` (see `config_problem`) is refused naming the field.
    schema(config): a new config with exactly the fields the command reads for `config` (ValueError if none fits)."""

    def parse(argv: list[str]) -> list[str]:
        try:
            rest = flag_values(argv)
            loaded = config.value
            hasattr(loaded, "keys")  # config_flags raises a missing or broken file's error at the first use of it
        except SystemExit as e:  # absl's --help prints the usage and exits with 1
            sys.exit(0 if any(a in HELP_FLAGS for a in argv[1:]) else e.code)
        except flags.Error as e:  # the flag's first line, and the cause a config file's traceback ends with
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            fail(prog, lines[0] + (f" {lines[-1]}" if len(lines) > 1 else ""))
        except Exception as e:  # config_flags raises whatever the config file or the override raised
            fail(prog, override_error(argv, e))
        if loaded is not None:
            path = (_config_file_arg(argv) or "").partition(":")[0]
            if (problem := file_problem(path, loaded, kind, key, schema)) is not None:
                fail(prog, problem)
        return rest

    return parse


def file_problem(
    path: str, config: ConfigDict, kind: str, key: str, schema: Callable[[ConfigDict], ConfigDict]
) -> str | None:
    """Why the config file `path`, loaded as `config`, cannot drive the command, or None: it is not a `kind` config
    (no field `key`), `schema` cannot tell what it should hold (its ValueError), or `config_problem`."""
    fields = list(config.keys()) if hasattr(config, "keys") else []
    if key not in fields:
        return f"--config: {path} is not {kind} config (no field {key!r}; it has: {', '.join(fields) or 'nothing'})"
    try:
        problem = config_problem(config, schema(config))
    except ValueError as e:
        problem = str(e)
    return None if problem is None else f"--config: {path}: {problem}"


def config_problem(config: ConfigDict, schema: ConfigDict, where: str = "config") -> str | None:
    """The first way `config` differs from `schema`, a config with exactly the fields the command reads, or None: a
    field `schema` does not have, one it has that `config` lacks (at any depth), or a value that ml_collections would
    refuse as an override of the schema's field (`--config.x=y`'s type check: an int may stand for a float, a list
    for a tuple, None for anything). A field a command does not read is refused as a misspelt one would be: either
    way the value the user wrote would be silently ignored."""
    fields, expected = list(config.keys()), schema.keys()
    listing = ", ".join(expected)
    unknown = [name for name in fields if name not in expected]
    if unknown:
        return f"unknown field {unknown[0]!r} in {where} (fields: {listing})"
    missing = [name for name in expected if name not in fields]
    if missing:
        return f"missing field {missing[0]!r} in {where} (expected fields: {listing})"
    for name in expected:
        if (problem := _field_problem(config[name], schema, name, f"{where}.{name}")) is not None:
            return problem
    return None


def _field_problem(value: object, schema: ConfigDict, name: str, where: str) -> str | None:
    if hasattr(schema[name], "keys"):
        if not hasattr(value, "keys"):
            return f"{where} must be a section of fields ({', '.join(schema[name].keys())}), got {value!r}"
        return config_problem(value, schema[name], where)
    expected = schema.get_type(name)
    try:
        schema[name] = value  # the schema is built for this check alone: its own values are never read
    except TypeError:
        # A section's repr is a YAML block of many lines.
        got = "a section" if hasattr(value, "keys") else f"{value!r} ({type(value).__name__})"
        return f"{where} must be {_type_name(expected)}, got {got}"
    return None


def _type_name(t: type) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(t, f"a {t.__name__}")


def _config_file_arg(argv: Sequence[str]) -> str | None:
    """The config file named last (absl keeps the last value of a repeated flag)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--config="):
            found = arg.split("=", 1)[1]
    return found


def override_error(argv: Sequence[str], error: Exception) -> str:
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
