"""Where training text comes from: files named by globs, or the running interpreter's standard library.

The standard library is the corpus every machine has offline: its `.py` sources (not site-packages, not compiled
files), split into a training and a held-out set by file, so no held-out line was seen in training.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import sysconfig

from granite_jax.errors import InputError

STDLIB = "stdlib"  # the `data.train` value naming the Python standard library's sources
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources() -> list[str]:
    """The running interpreter's standard-library `.py` files, sorted by path relative to the library root."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _NOT_STDLIB)
        found += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def matched_files(patterns: str, field: str, exclude: str = "") -> list[str]:
    """The files matched by comma-separated globs (`**` recurses), or `stdlib_sources()` for "stdlib", but those
    `exclude` names (`is_excluded`); InputError naming the config field when nothing is left."""
    if patterns.strip() == STDLIB:
        files = stdlib_sources()
    else:
        names = _patterns(patterns)
        files = sorted(
            {f for p in names for f in glob.glob(os.path.expanduser(p), recursive=True) if os.path.isfile(f)}
        )
    files = [f for f in files if not is_excluded(f, exclude)]
    if not files:
        but = f" but data.exclude={exclude!r}" if exclude else ""
        raise InputError(f"{field}: no files matched {patterns!r}{but}")
    return files


def is_excluded(path: str, exclude: str) -> bool:
    """Whether one of the comma-separated shell patterns `exclude` matches the file's name (`name`: "test/*" is the
    standard library's test suite; `*` spans folders)."""
    return any(fnmatch.fnmatchcase(name(path), p) for p in _patterns(exclude))


def is_held_out(path: str, fraction: float) -> bool:
    """Whether `path` belongs to the held-out split, by a hash of its name (`name`): the same split on every machine,
    and one that does not move as files are added."""
    digest = hashlib.sha256(name(path).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def name(path: str) -> str:
    """A file's name in the corpus: a standard-library file's path within the library, another's as globbed."""
    root = sysconfig.get_paths()["stdlib"]
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def _patterns(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def split_files(files: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(training files, held-out files): about `fraction` of the files held out, by `is_held_out`."""
    held = [f for f in files if is_held_out(f, fraction)]
    train = [f for f in files if not is_held_out(f, fraction)]
    if not train or not held:
        raise InputError(
            f"data.held_out_fraction: {fraction} of {len(files)} files leaves "
            f"{'no training' if not train else 'no held-out'} file; name held-out files with data.held_out"
        )
    return train, held


def read_text(path: str) -> str:
    """A file's text (UTF-8, undecodable bytes replaced: the standard library holds a few Latin-1 test files)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
