"""What a program compiled for a GPU will launch, read from XLA's dump of a deviceless compile (`pallas_kernels.aot`).

`launches(lowered)` compiles a lowered program with XLA's dump on and returns one `Launch` per kernel launch or device
copy of one run: its name (the HLO instruction's, or the Triton kernel's for a Pallas call), what it is, whether it
runs inside a CUDA graph (an XLA command buffer), how many times a run launches it, and its bytes and FLOPs.

- The launches come from the thunk sequence after XLA's thunk passes, the program the GPU runtime executes: kernels
  inside a `kCommandBuffer` are recorded into a CUDA graph and replayed as one launch.
- Loops: a `kWhile` body runs its known trip count (XLA's `known_trip_count`), its condition once more; a loop whose
  trip count XLA does not know is counted once, and its launches say so (`trips_known=False`).
- Conditionals: the branch moving the fewest bytes is counted (the Generator's steps branch between greedy and sampled
  decoding; the greedy branch reads the logits least), and the other branches are left out. Bytes, not predicted
  time: a branch's launch costs depend on which of its kernels XLA put in a graph, which can change with the program
  around it.
- Bytes and FLOPs are XLA's `HloCostAnalysis` of each fusion alone (a module holding just that fusion, so that a
  fusion reading a slice of a parameter is charged for the slice); a parameter the fusion only gathers from is
  charged for the rows gathered, not the whole operand as the cost analysis does. A cuBLAS GEMM is charged 2·M·N·K
  FLOPs and its operands and result; a device copy twice its size; a Pallas (Triton) call its operands and results
  (of an operand it reads by index, `INDEXED_OPERANDS`, the rows' share), and no FLOPs: XLA cannot see into it
  (`flops_known=False`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax

H200_BYTES_PER_S = 4.8e12  # HBM3e
H200_FLOPS_PER_S = 989e12  # dense bfloat16 tensor-core peak (SXM)
LAUNCH_S = 4e-6  # host cost of one kernel launch outside a CUDA graph (cudaLaunchKernel and the gap it leaves)
NVLINK_BYTES_PER_S = 900e9  # H200 SXM: NVLink 4, 18 links
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_ITEM_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # fmt: skip


@dataclasses.dataclass
class Launch:
    name: str  # the HLO instruction (fusion, custom call, copy), or the Triton kernel of a Pallas call
    kind: str  # "fusion", "gemm" (a fusion on tensor cores or a cuBLAS call), "pallas", "copy", "kernel"
    graphed: bool  # recorded into a CUDA graph (inside an XLA command buffer)
    count: int  # launches per run of the program
    bytes: float  # per launch
    flops: float  # per launch
    trips_known: bool = True  # False: inside a loop whose trip count XLA does not know (counted once)
    flops_known: bool = True  # False: a Pallas call, whose FLOPs XLA cannot see
    source: str = ""  # the JAX operation it came from (XLA's op_name: the jitted function's path to it)
    devices: int = 1  # a collective's group: the devices each of its groups spans

    def seconds(self, bytes_per_s: float = H200_BYTES_PER_S, flops_per_s: float = H200_FLOPS_PER_S) -> float:
        """Predicted time of all its launches: each bound by bytes or FLOPs, plus a launch cost outside a graph; a
        collective by the bytes it sends over NVLink (`link_bytes`)."""
        if self.kind == "collective":
            one = self.link_bytes() / NVLINK_BYTES_PER_S
        else:
            one = max(self.bytes / bytes_per_s, self.flops / flops_per_s)
        return self.count * (one + (0.0 if self.graphed else LAUNCH_S))

    def link_bytes(self) -> float:
        """Bytes a collective sends through each device's links: a ring all-reduce of S bytes over n devices sends
        2 (n-1)/n S (reduce-scatter, then all-gather); an all-gather, reduce-scatter or all-to-all (n-1)/n of its
        whole; a permute its payload."""
        n = self.devices
        if self.kind != "collective" or n <= 1:
            return 0.0
        if self.name.startswith("all-reduce"):
            return 2.0 * (n - 1) / n * self.bytes
        return self.bytes if self.name.startswith("collective-permute") else (n - 1) / n * self.bytes


# Pallas kernels that read an operand by index: kernel name -> (the stacked operand, the index operand). The routed
# experts' kernels take the whole stack (E, in, out) and read the rows' experts in place.
INDEXED_OPERANDS = {"experts_up": (1, 2), "experts_down": (1, 2)}


def launches(lowered, compiler_options: dict[str, Any] | None = None) -> list[Launch]:
    """Compile `lowered` (a `jax.stages.Lowered` for a GPU, see `pallas_kernels.aot`) and list its launches."""
    with tempfile.TemporaryDirectory() as dump:
        lowered.compile(compiler_options={**(compiler_options or {}), "xla_dump_to": dump})
        files = os.listdir(dump)
        read = lambda suffix: open(os.path.join(dump, _one(files, suffix))).read()  # noqa: E731
        hlo = _Hlo(read("gpu_after_optimizations.txt"))
        annotations = _annotations(read("thunk_metadata.txt"))
        passes = any(f.endswith("thunk_sequence_after_thunk_passes.txt") for f in files)  # absent: no pass applied
        sequence = read("thunk_sequence_after_thunk_passes.txt" if passes else "thunk_sequence.txt")
    return _Walk(hlo, annotations).run(_thunk_tree(sequence))


def summary(items: list[Launch]) -> dict[str, Any]:
    """Totals of a run: kernels launched (copies apart), how many outside graphs, bytes, FLOPs, predicted seconds."""
    kernels = [k for k in items if k.kind not in ("copy", "wait")]
    return dict(
        kernels=sum(k.count for k in kernels),
        kernels_outside_graphs=sum(k.count for k in kernels if not k.graphed),
        copies=sum(k.count for k in items if k.kind == "copy"),
        bytes=sum(k.count * k.bytes for k in items),
        flops=sum(k.count * k.flops for k in items),
        predicted_s=sum(k.seconds() for k in items),
        collectives=sum(k.count for k in items if k.kind == "collective"),
        collective_bytes=sum(k.count * k.link_bytes() for k in items),
        collective_s=sum(k.seconds() for k in items if k.kind == "collective"),
        unknown_trip_counts=sum(not k.trips_known for k in items),
        pallas_calls=sum(k.count for k in items if k.kind == "pallas"),
    )


def layer_split(cfg: Any, totals: Callable[[Any], dict[str, float]]) -> dict[str, dict[str, float]]:
    """A step's totals split into one layer of each kind the model config `cfg` has and the rest ({"mamba layer": ...,
    "rest": ...}), from `totals` of models of two layers of the first kind and of those and one layer of each kind:
    their difference is that layer, what two layers leave is the embedding, head and sampler. Two, not one: what a
    program does once from its second layer on (a copy of the cache's index, read by the later layers) is the rest's."""
    kinds = tuple(sorted(set(cfg.layer_types), key=cfg.layer_types.index))
    base = totals(cfg.replace(layer_types=kinds[:1] * 2))
    parts = {}
    for kind in kinds:
        more = totals(cfg.replace(layer_types=(kinds[0], kinds[0], kind)))
        parts[f"{kind} layer"] = {k: more[k] - base[k] for k in base}
    parts["rest"] = {k: base[k] - 2 * parts[f"{kinds[0]} layer"][k] for k in base}
    return parts


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (`bf16[4,128]{1,0}`, or a tuple of them)."""
    return sum(_ITEM_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in
               re.findall(r"\b(pred|bf16|[subfc]\d+)\[([\d,]*)\]", shape))  # fmt: skip


def _one(files: list[str], suffix: str) -> str:
    found = sorted(f for f in files if f.endswith(suffix))
    if not found:
        raise RuntimeError(f"XLA's dump has no *{suffix}: this jax's GPU compiler writes another layout")
    return found[-1]


# ---------------------------------------------------------------------------------------------- the HLO module


class _Hlo:
    """The optimized HLO module's text: computations by name, instructions by name, and each fusion's cost."""

    INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(?:, (.*))?$")

    def __init__(self, text: str) -> None:
        self.sources = dict(re.findall(r'^\s*(?:ROOT )?%(\S+) = .*?metadata=\{op_name="([^"]*)"', text, re.M))
        text = re.sub(r", metadata=\{[^}]*\}", "", text)  # stack frame ids refer to a table the parts would lack
        self.computations = {
            m.group(2): m.group(0)
            for m in re.finditer(r"^(ENTRY )?%(\S+) \((.*?)\) -> (.*?) \{\n(.*?)^\}", text, re.M | re.S)
        }
        self.instructions: dict[str, tuple[str, str, list[str], str]] = {}  # name -> (shape, opcode, operands, attrs)
        for line in text.splitlines():
            if m := self.INSTRUCTION.match(line):
                name, shape, opcode, operands, attrs = m.groups()
                self.instructions[name] = (shape, opcode, re.findall(r"%([\w.\-]+)", operands), attrs or "")
        self._client = jax.devices("cpu")[0].client  # cost analysis needs a client; it reads shapes, not devices

    def trip_count(self, name: str) -> int | None:
        attrs = self.instructions.get(name, ("", "", [], ""))[3]
        found = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
        return int(found.group(1)) if found else None

    def cost(self, name: str) -> tuple[str, float, float, bool]:
        """(kind, bytes, FLOPs, FLOPs known) of the instruction `name` launched as one kernel."""
        shape, opcode, operands, attrs = self.instructions[name]
        io_bytes = shape_bytes(shape) + sum(shape_bytes(self.instructions[o][0]) for o in operands)
        if opcode == "fusion":
            calls = re.search(r"calls=%([\w.\-]+)", attrs).group(1)
            cost = self._fusion_cost(shape, re.search(r"kind=(k\w+)", attrs).group(1), calls)
            gemm = "gemm" in attrs or " dot(" in self.computations[calls]
            nbytes = cost.get("bytes accessed", io_bytes) - self._gathered_unread(calls)
            return ("gemm" if gemm else "fusion"), nbytes, cost.get("flops", 0.0), True
        if opcode == "custom-call" and "cublas" in attrs:  # result (or (result, workspace)): 2 FLOPs per product term
            out_type, out_dims = re.search(r"(\w+)\[([\d,]*)\]", shape).groups()
            lhs_dims = re.search(r"\[([\d,]*)\]", self.instructions[operands[0]][0]).group(1).split(",")
            contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attrs).group(1)
            k = math.prod(int(lhs_dims[int(i.strip('" '))]) for i in contracting.split(",") if i.strip('" '))
            result = f"{out_type}[{out_dims}]"
            nbytes = shape_bytes(result) + sum(shape_bytes(self.instructions[o][0]) for o in operands)
            return "gemm", nbytes, 2.0 * math.prod(int(d) for d in out_dims.split(",") if d) * k, True
        if opcode == "custom-call" and "triton" in attrs:
            return "pallas", io_bytes - self._indexed_unread(operands, self.sources.get(name, "")), 0.0, False
        if opcode == "copy":
            return "copy", 2.0 * shape_bytes(shape), 0.0, True
        if opcode.removesuffix("-start") in COLLECTIVES:  # its payload: what it reduces, gathers or sends
            payload = sum(shape_bytes(self.instructions[o][0]) for o in operands)
            return "collective", payload, 0.0, True
        if opcode.endswith("-done"):  # waits for its start: no kernel of its own
            return "wait", 0.0, 0.0, True
        return "kernel", io_bytes, 0.0, False

    def _indexed_unread(self, operands: list[str], source: str) -> float:
        """Bytes of a Pallas call's operands that it reads only where an index operand points (`INDEXED_OPERANDS`):
        of stacked matrices (E, ...), all but the rows' experts (at most min(rows, E) of them). source: its op_name."""
        found = re.search(r"(\w+)/pallas_call$", source)
        if not found or found.group(1) not in INDEXED_OPERANDS:
            return 0.0
        stacked, index = (self.instructions[operands[i]][0] for i in INDEXED_OPERANDS[found.group(1)])
        experts = int(re.search(r"\[(\d+)", stacked).group(1))
        rows = math.prod(int(d) for d in re.search(r"\[([\d,]*)\]", index).group(1).split(",") if d)
        return shape_bytes(stacked) * (1 - min(rows, experts) / experts)

    def group_size(self, name: str) -> int:
        """The devices each group of collective `name` spans: `{{0,1},{2,3}}`, `[groups,size]<=[...]`, or
        `mesh[...] {axes}` (the named axes' sizes multiplied)."""
        attrs = self.instructions[name][3]
        if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attrs):
            return len(m.group(1).split(","))
        if m := re.search(r"replica_groups=\[\d+,(\d+)\]", attrs):
            return int(m.group(1))
        if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs):
            sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
            return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
        if m := re.search(r"source_target_pairs=\{(.*?)\}\}", attrs):
            return 2
        return 1

    def _fusion_cost(self, shape: str, kind: str, calls: str) -> dict[str, float]:
        """XLA's cost analysis of a module holding only this fusion, its parameters as the module's."""
        from jax._src.lib import xla_client
        from jaxlib import _hlo

        params = sorted((int(i), s) for s, i in re.findall(r"= (.+?) parameter\((\d+)\)", self.computations[calls]))
        signature = ", ".join(f"p{i}: {s}" for i, s in params)
        body = [f"  %p{i} = {s} parameter({i})" for i, s in params]
        body.append(f"  ROOT %kernel = {shape} fusion({', '.join(f'%p{i}' for i, _ in params)}), kind={kind}, "
                    f"calls=%{calls}")  # fmt: skip
        parts = [self.computations[c].replace("ENTRY ", "") for c in reversed(self._called(calls, []))]
        text = "HloModule kernel\n\n" + "\n\n".join(parts) + f"\n\nENTRY %main ({signature}) -> {shape} {{\n"
        module = _hlo.hlo_module_from_text(text + "\n".join(body) + "\n}\n")
        return xla_client._xla.hlo_module_cost_analysis(self._client, module)

    def _gathered_unread(self, calls: str) -> float:
        """Bytes XLA's cost analysis charges a fusion for the parts of a parameter it only gathers from: it charges
        the whole operand of a gather (a MoE decode reads the chosen experts of a [experts, ...] weight, not all)."""
        body = self.computations[calls]
        unread = 0.0
        for name, shape in re.findall(r"%(\S+) = (\S+) parameter\(\d+\)", body):
            users = re.findall(rf"= (\S+) ([a-z][\w\-]*)\(%{re.escape(name)}[,)]", body)
            mentions = len(re.findall(rf"%{re.escape(name)}\b(?! =)", body))
            if users and len(users) == mentions and all(op == "gather" for _, op in users):
                unread += max(0.0, shape_bytes(shape) - sum(shape_bytes(out) for out, _ in users))
        return unread

    def _called(self, name: str, seen: list[str]) -> list[str]:
        if name not in seen:
            seen.append(name)
            for called in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", self.computations[name].split("\n", 1)[1]):
                self._called(called, seen)
        return seen


def _annotations(metadata: str) -> dict[int, str]:
    """Thunk id -> the HLO instruction it runs (XLA's thunk metadata)."""
    found = re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', metadata)
    return {int(i): name for name, i in found}


# ---------------------------------------------------------------------------------------------- the thunk sequence


@dataclasses.dataclass
class _Thunk:
    id: int
    kind: str
    text: str
    sections: dict[str, list[_Thunk]] = dataclasses.field(default_factory=dict)  # "" for a plain container


def _thunk_tree(sequence: str) -> list[_Thunk]:
    """The thunk sequence as a tree: a container's thunks are the deeper-indented lines after it; a loop's and a
    conditional's are split by their section labels (`condition:`, `body:`, `true_branch:`, ...), which XLA does not
    always indent."""
    lines: list[tuple[int, Any]] = []
    for line in sequence.splitlines():
        if m := re.match(r"^(\s*)(\d+): (k\w+)\s*(.*)$", line):
            lines.append((len(m.group(1)), _Thunk(int(m.group(2)), m.group(3), m.group(4))))
        elif m := re.match(r"^(\s*)(\w+):\s*$", line):
            lines.append((-1 - len(m.group(1)), m.group(2)))  # a label: its indent, negated
    root: list[_Thunk] = []
    stack: list[tuple[int, _Thunk]] = []  # open containers and their indents
    for indent, item in lines:
        if indent < 0:  # a section label: of the loop just opened (`condition:`, at any indent), else by indent
            while item != "condition" and stack and stack[-1][0] >= -1 - indent:
                stack.pop()
            stack[-1][1].sections[item] = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else None
        if parent is None:
            root.append(item)
        else:
            parent.sections.setdefault(next(reversed(parent.sections)) if parent.sections else "", []).append(item)
        if item.kind in ("kCommandBuffer", "kWhile", "kConditional", "kSequential"):
            stack.append((indent, item))
    return root


class _Walk:
    """The launches of one run through a thunk tree."""

    def __init__(self, hlo: _Hlo, annotations: dict[int, str]) -> None:
        self.hlo, self.annotations = hlo, annotations

    def run(self, thunks: list[_Thunk], graphed: bool = False, count: int = 1, known: bool = True) -> list[Launch]:
        out: list[Launch] = []
        for t in thunks:
            if t.kind in ("kCommandBuffer", "kSequential"):
                out += self.run(t.sections.get("", []), graphed or t.kind == "kCommandBuffer", count, known)
            elif t.kind == "kWhile":
                trips = self.hlo.trip_count(self.annotations.get(t.id, ""))
                n = trips if trips is not None else 1
                out += self.run(t.sections.get("condition", []), graphed, count * (n + 1), known and trips is not None)
                out += self.run(t.sections.get("body", []), graphed, count * n, known and trips is not None)
            elif t.kind == "kConditional":
                branches = [self.run(b, graphed, count, known) for b in t.sections.values()]
                out += min(branches, key=lambda b: sum(k.bytes * k.count for k in b), default=[])
            else:  # a kernel, a copy, a library call, a memset: one launch each
                out.append(self._launch(t, graphed, count, known))
        return out

    def _launch(self, t: _Thunk, graphed: bool, count: int, known: bool) -> Launch:
        name = self.annotations.get(t.id, "")
        if name not in self.hlo.instructions:  # no cost to read: counted as a launch of unknown size
            return Launch(name or t.kind, "kernel", graphed, count, 0.0, 0.0, known, False)
        kind, nbytes, flops, flops_known = self.hlo.cost(name)
        if t.kind.endswith("Done"):  # a collective's wait, annotated with its start's instruction
            kind, nbytes, flops = "wait", 0.0, 0.0
        devices = self.hlo.group_size(name) if kind == "collective" else 1
        if kind == "pallas" and (kernel := re.search(r"\]\s*(\S+)", t.text)):
            name = kernel.group(1)  # the Triton kernel's name, which a profiler shows
        source = self.hlo.sources.get(self.annotations.get(t.id, ""), "")
        return Launch(name, kind, graphed, count, float(nbytes), float(flops), known, flops_known, source, devices)
