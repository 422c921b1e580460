"""The per-site report: what was found where, what it costs, and what the rewriter did with it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

REWRITTEN, SKIPPED, FUSED = "rewritten", "skipped", "fused"


@dataclasses.dataclass
class Site:
    """One reduce_sum of a broadcast product.

    path: nesting of higher-order primitives above the site ("" at top level), e.g. "jit(_pad)/scan".
    source: file:line (function) of the sum.
    spec: einsum spec of the contraction (after dropping broadcast dims), operands in `operand_shapes` order.
    intermediate_*: the broadcast product the original materialises (or XLA loops over) and the rewrite removes.
    flops: FLOPs of the emitted contraction; naive_flops: the multiplies and adds of the original.
    status: "rewritten", "skipped" (see `reason`) or "fused" (composed into site `fused_into`).
    """

    id: int
    path: str
    source: str
    spec: str
    operand_shapes: list[tuple[int, ...]]
    operand_dtypes: list[str]
    out_shape: tuple[int, ...]
    out_dtype: str
    intermediate_shape: tuple[int, ...]
    intermediate_dtype: str
    intermediate_elements: int
    intermediate_bytes: int
    flops: int
    naive_flops: int
    contraction_path: list[tuple[int, ...]]
    hidden_broadcasts: int  # operand dims found constant by the invariance analysis and dropped
    status: str = SKIPPED
    reason: str | None = None
    fused_into: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, index: int | None = None) -> Site:
        where = "site" if index is None else f"site #{index}"
        if not isinstance(d, dict):
            raise ValueError(f"not a rewriter report: {where} must be an object, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        unknown = sorted(set(d) - set(fields))
        if missing or unknown:
            raise ValueError(f"not a rewriter report: {where} has missing key(s) {missing}, unknown key(s) {unknown}")
        d = dict(d)
        try:
            for key in ("out_shape", "intermediate_shape"):
                d[key] = tuple(d[key])
            d["operand_shapes"] = [tuple(s) for s in d["operand_shapes"]]
            d["contraction_path"] = [tuple(p) for p in d["contraction_path"]]
        except TypeError as e:
            raise ValueError(f"not a rewriter report: {where} has a malformed shape or contraction path ({e})") from e
        return cls(**d)


@dataclasses.dataclass
class Report:
    """All sites of one traced function, in program order. `str()` is a table; `to_json()` saves it."""

    function: str
    sites: list[Site]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if s.status == REWRITTEN]

    @property
    def skipped(self) -> list[Site]:
        return [s for s in self.sites if s.status == SKIPPED]

    @property
    def fused(self) -> list[Site]:
        return [s for s in self.sites if s.status == FUSED]

    def site(self, site_id: int) -> Site:
        for s in self.sites:
            if s.id == site_id:
                return s
        raise KeyError(f"no site #{site_id}")

    def to_dict(self) -> dict[str, Any]:
        return {"function": self.function, "options": self.options, "sites": [s.to_dict() for s in self.sites]}

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent, default=str)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> Report:
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            with open(text_or_path) as f:
                text = f.read()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a rewriter report: invalid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ValueError(f"not a rewriter report: expected a JSON object, got {type(d).__name__}")
        missing = [key for key in ("function", "sites") if key not in d]
        if missing:
            raise ValueError(f"not a rewriter report: missing key(s) {missing} (found {sorted(d)})")
        if not isinstance(d["sites"], list):
            raise ValueError(f"not a rewriter report: 'sites' must be a list, got {type(d['sites']).__name__}")
        options = d.get("options", {})
        if not isinstance(options, dict):
            raise ValueError(f"not a rewriter report: 'options' must be an object, got {type(options).__name__}")
        return cls(d["function"], [Site.from_dict(s, index=i) for i, s in enumerate(d["sites"])], options)

    def __str__(self) -> str:
        return format_table(self)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _flops(n: int) -> str:
    return f"{n / 1e9:.3g} G" if n >= 1e7 else f"{n:,}"


def _operands(site: Site) -> str:
    return " x ".join(
        f"{_short_dtype(d)}[{','.join(map(str, s))}]" for s, d in zip(site.operand_shapes, site.operand_dtypes)
    )


def _short_dtype(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}.get(dtype, dtype)


def format_table(report: Report) -> str:
    header = ("#", "status", "where", "spec", "operands", "intermediate removed", "FLOPs naive -> dot", "note")
    rows = []
    for s in report.sites:
        where = f"{s.path}: {s.source}" if s.path else s.source
        inter = f"{s.intermediate_elements:,} ({human_bytes(s.intermediate_bytes)})"
        flops = f"{_flops(s.naive_flops)} -> {_flops(s.flops)}"
        note = "; ".join(filter(None, [f"into #{s.fused_into}" if s.fused_into else "", s.reason]))
        if s.hidden_broadcasts:
            note = (note + "; " if note else "") + f"{s.hidden_broadcasts} broadcast dim(s) dropped"
        rows.append((str(s.id), s.status, where, s.spec, _operands(s), inter, flops, note))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    n_rw, n_fu = len(report.rewritten), len(report.fused)
    removed = sum(s.intermediate_bytes for s in report.sites if s.status != SKIPPED)
    title = (
        f"{report.function}: {len(report.sites)} broadcast-multiply-sum site(s), {n_rw} rewritten, {n_fu} fused, "
        f"{len(report.skipped)} skipped; intermediates removed: {human_bytes(removed)}"
    )
    return "\n".join([title, line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])
