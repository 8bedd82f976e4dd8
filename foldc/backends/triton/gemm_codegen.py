"""Generate the Triton source of a GEMM/GEMV kernel from a GEMM plan's graph.

The generator walks the folded graph in order and lowers each node by its kind and by the
register-tile form of its operands; it never looks at which encoding the plan came from.
The kernel computes one ``BLOCK_M x BLOCK_N`` tile of ``y = x @ w.T`` and loops over the
k groups of the plan (``GROUP`` = the group size along k of the plan's grouped axes, K if
none), each group in chunks of ``BLOCK_K``:

    [pre]            running totals (sums over groups) = 0
    for t:           [group start] load this group's scales and zeros; per-group sums = 0
        for chunk:   [chunk] load / unpack codes, tl.dot or row/column sums into the per-group
                     partials (split contractions) or into totals (unsplit ones)
        [group end]  scale the group's partials (eq. 3), add its offset corrections (eq. 6, 15);
                     kept-group values stay per group, the others add into their totals
    [final]          add the totals, store y

Bit-field lanes. Codes use the planar packing of foldc/encoding.py along k: bit field ``i`` of
the bytes of a row holds the contiguous k range ``[i*K/F, (i+1)*K/F)`` (F codes per byte). So
one tile of bytes is loaded once and shifted into F lanes, lane ``i`` covering
``k0 = i*K/F + j``. Values that depend on k (chunk values, and the per-group values when a
group fits inside one bit field) are emitted once per lane: the generator writes them with the
placeholder ``@`` (lane suffix) and ``$L`` (lane index) and `_lanes` expands them. With one
group spanning k (per-channel encodings) all lanes feed the same group values.

Register-tile forms: "MK" (x-like, [BLOCK_M, BLOCK_K]), "KN" (w-like, transposed,
[BLOCK_K, BLOCK_N]), "K" (the ones input), "MN", "M", "N" and "" (a scalar).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import PlanError
from ...gemm.plan import check_gemm_plan
from .codegen import kernel_module
from ...ir import (Add, Codes, Contract, Correction, Dequantize, GroupedAxis, GroupParam, Input, K, M,
                   ScaleGroups)

TL_DTYPES = {"fp16": "tl.float16", "bf16": "tl.bfloat16"}
SHAPES = {"MN": "[BLOCK_M, BLOCK_N]", "M": "[BLOCK_M]", "N": "[BLOCK_N]"}


@dataclass
class Val:
    expr: str
    form: str            # register-tile form, see the module docstring
    level: str           # "chunk", "group" (per k group), "total" (summed over groups), "final"
    integer: bool = False  # an int8 codes tile or an int32 accumulator


@dataclass
class GemmKernelSource:
    name: str
    source: str
    args: list[str]
    group: int
    inputs: dict = field(default_factory=dict)   # input name -> "values" | "encoded"
    int8_dot: bool = False


def _union(a: str, b: str) -> str:
    return "".join(c for c in "MN" if c in a + b)


def _bcast(v: Val, to: str) -> str:
    if v.form in ("", to):
        return v.expr
    if (v.form, to) == ("M", "MN"):
        return f"{v.expr}[:, None]"
    if (v.form, to) == ("N", "MN"):
        return f"{v.expr}[None, :]"
    raise PlanError("backend", f"cannot broadcast a {v.form} tile to {to}")


def _lanes(lines: list[str], lanes: int) -> list[str]:
    """Expand each line holding the lane placeholders once per lane (others stay as they are)."""
    out = []
    for line in lines:
        if "@" not in line and "$L" not in line:
            out.append(line)
            continue
        out += [line.replace("@", f"_{i}").replace("$L", str(i)) for i in range(lanes)]
    return out


def plan_group(graph, k: int) -> int:
    """The one group size along k of the plan (k when nothing is grouped)."""
    sizes = {a.group_size for n in graph for a in n.axes if isinstance(a, GroupedAxis) and a.base == K}
    sizes |= {getattr(n, f).group_size for n in graph for f in ("split", "groups")
              if isinstance(getattr(n, f, None), GroupedAxis)}
    sizes |= {n.encoding.group_size for n in graph.nodes_of(Input) if n.encoding is not None}
    if len(sizes) > 1:
        raise PlanError("backend", f"the GEMM kernel handles one group size along k; the plan has {sorted(sizes)}")
    return sizes.pop() if sizes else k


class _GemmEmitter:
    def __init__(self, plan, dtype: str):
        self.plan, self.graph, self.spec = plan, plan.graph, plan.spec
        self.dtype, self.tl_dtype = dtype, TL_DTYPES[dtype]
        self.group = plan_group(self.graph, self.spec.k)
        self.pre: list[str] = []
        self.group_start: list[str] = []
        self.chunk: list[str] = []
        self.group_end: list[str] = []
        self.final: list[str] = []
        self.vals: dict[str, Val] = {}
        self.args: list[str] = []
        self.bases: list[str] = []   # the per-program int64 pointer advances (`_advance`)
        packed = [n.encoding for n in self.graph.nodes_of(Input) if n.encoding is not None]
        self.lanes = max(8 // e.bits for e in packed) if packed else 1
        self.lane_len = self.spec.k // self.lanes
        if self.group > self.lane_len and self.group != self.spec.k:
            # a group spans several bit fields but not all of k: one lane, each chunk loads its own
            # bytes (a byte is read once per bit field)
            self.lanes, self.lane_len = 1, self.spec.k
        if self.lane_len % self.group and self.group != self.spec.k:
            raise PlanError("backend", f"group_size={self.group} does not divide the bit field of "
                            f"{self.lane_len} channels; use a divisor of {self.lane_len}")
        if self.group == self.spec.k:        # one group spans k: all lanes share it
            self.lane_groups, self.outer = False, 1
        else:                                # groups inside bit fields: lane i, step t -> group i*outer + t
            self.lane_groups, self.outer = self.lanes > 1, self.lane_len // self.group
        # a contraction of two 8-bit code tiles runs on the integer tensor cores (int8 x int8 -> int32)
        self.int8_dot = any(all(isinstance(self.graph[o], Codes) and self.graph[self.graph[o].source].encoding.bits == 8
                                for o in c.operands()) for c in self.graph.nodes_of(Contract))

    def arg(self, *names: str) -> None:
        for n in names:
            if n not in self.args:
                self.args.append(n)

    @staticmethod
    def var(node) -> str:
        return node.name.replace(".", "_")

    def cvar(self, node) -> str:
        """Name of a chunk value: one per lane."""
        return self.var(node) + "@"

    def gvar(self, node) -> str:
        """Name of a per-group value: one per lane when groups lie inside bit fields."""
        return self.var(node) + ("@" if self.lane_groups else "")

    def run(self) -> None:
        for node in self.graph:
            emit = getattr(self, f"emit_{type(node).__name__.lower()}", None)
            if emit is None:
                raise PlanError("backend", f"%{node.name}: the GEMM kernel cannot lower a {node.kind} node "
                                "(it lowers acc-fold and dequant plans)")
            val = emit(node)
            if val is not None:
                self.vals[node.name] = val

    # -- sources ---------------------------------------------------------------------------
    def _rows(self, name: str) -> tuple[str, str, str]:
        """(row offsets in the program's tile, row mask, tile form) of input ``name``: x rows are m, w rows
        are n. The offsets count from the tile's first row: `_advance` moves the input's pointers there."""
        return ("rows_in", "row_ok", "MK") if self.graph[name].axes[0] == M else ("cols_in", "col_ok", "KN")

    def _advance(self, name: str, pointer: str, stride: str) -> None:
        """Move ``pointer`` (an argument of input ``name``) to the program's first row, in int64: the
        tile's offsets from there stay 32-bit (see `generate_gemm`)."""
        first = "row0" if self.graph[name].axes[0] == M else "col0"
        line = f"{pointer} += {first} * {stride}  # 64-bit: rows x stride may pass 2**31 - 1"
        if line not in self.bases:
            self.bases.append(line)

    def emit_input(self, node: Input):
        if node.role == "ones":
            return Val("1.0", "K", "chunk")
        if node.encoding is not None:
            return None  # read through its codes, params or dequantized values
        up = node.name.upper()
        self.arg(up, f"stride_{node.name}")
        rows, ok, form = self._rows(node.name)
        self._advance(node.name, up, f"stride_{node.name}")
        v = self.cvar(node)
        if form == "MK":
            ptr = f"{up} + {rows}[:, None] * stride_{node.name} + (k0@ + kk)[None, :]"
            self.chunk.append(f"{v} = tl.load({ptr}, mask={ok}[:, None], other=0.0).to({self.tl_dtype})")
        else:
            ptr = f"{up} + {rows}[None, :] * stride_{node.name} + (k0@ + kk)[:, None]"
            self.chunk.append(f"{v} = tl.load({ptr}, mask={ok}[None, :], other=0.0).to({self.tl_dtype})")
        return Val(v, form, "chunk")

    def _raw_codes(self, source: str) -> tuple[str, str]:
        """Emit the unpacked integer codes (int32) of a chunk of ``source``; return (var, form)."""
        v = f"{source}_code@"
        if v in self.vals:
            return v, self.vals[v].form
        enc = self.graph[source].encoding
        up = source.upper()
        self.arg(f"{up}_CODES", f"stride_{source}")
        rows, ok, form = self._rows(source)
        self._advance(source, f"{up}_CODES", f"stride_{source}")
        field_len = self.spec.k // (8 // enc.bits)
        if field_len == self.lane_len:  # the same bytes for every lane: load once, shift per lane
            raw, byte, shift = f"{source}_bytes", "(j + kk)", f"$L * {enc.bits}"
        else:                           # fewer codes per byte than lanes: each lane loads its bytes
            raw, byte, shift = f"{source}_bytes@", f"(k0@ % {field_len} + kk)", f"(k0@ // {field_len}) * {enc.bits}"
        if form == "MK":
            ptr = f"{up}_CODES + {rows}[:, None] * stride_{source} + {byte}[None, :]"
            mask = f"{ok}[:, None]"
        else:
            ptr = f"{up}_CODES + {rows}[None, :] * stride_{source} + {byte}[:, None]"
            mask = f"{ok}[None, :]"
        self.chunk.append(f"{raw} = tl.load({ptr}, mask={mask}, other=0).to(tl.int32)")
        self.chunk.append(f"{v} = ({raw} >> {shift}) & {enc.max_code}" if enc.bits < 8 else f"{v} = {raw}")
        self.vals[v] = Val(v, form, "chunk", integer=True)
        return v, form

    def emit_codes(self, node: Codes):
        raw, form = self._raw_codes(node.source)
        v = self.cvar(node)
        biased = f"{raw} + {node.bias}" if node.bias else raw
        if self.int8_dot and self.graph[node.source].encoding.bits == 8:
            if node.bias != -128:
                raise PlanError("backend", f"%{node.name}: the int8 tensor-core path needs code bias -128 (eq. 7), "
                                f"got {node.bias}")
            self.chunk.append(f"{v} = ({biased}).to(tl.int8)")
            return Val(v, form, "chunk", integer=True)
        self.chunk.append(f"{v} = ({biased}).to({self.tl_dtype})")
        return Val(v, form, "chunk")

    def emit_groupparam(self, node: GroupParam):
        src = node.source
        up = src.upper()
        self.arg(f"{up}_SCALE", f"{up}_ZERO", f"stride_{src}s")
        rows, ok, form = self._rows(src)
        for p in ("SCALE", "ZERO"):
            self._advance(src, f"{up}_{p}", f"stride_{src}s")
        v = self.gvar(node)
        part = "SCALE" if node.param == "scale" else "ZERO"
        grp = "grp@" if self.lane_groups else "grp"
        def load(p: str) -> str:
            return f"tl.load({up}_{p} + {rows} * stride_{src}s + {grp}, mask={ok}, other=0.0).to(tl.float32)"
        self.group_start.append(f"{v} = {load(part)}")
        if node.param == "zero" and node.bias:
            sign = "-" if node.bias > 0 else "+"
            self.group_start.append(f"{v} = {v} {sign} {abs(node.bias)} * {load('SCALE')}  # z - bias*s (eq. 7)")
        return Val(v, form[0] if form == "MK" else "N", "group")

    def emit_dequantize(self, node: Dequantize):
        raw, form = self._raw_codes(node.source)
        s = GroupParam(f"{node.source}.dq_scale", (), source=node.source, param="scale")
        z = GroupParam(f"{node.source}.dq_zero", (), source=node.source, param="zero")
        sv, zv = self.emit_groupparam(s), self.emit_groupparam(z)
        b = "[:, None]" if form == "MK" else "[None, :]"
        v = self.cvar(node)
        self.chunk.append(f"{v} = ({raw}.to(tl.float32) * {sv.expr}{b} + {zv.expr}{b}).to({self.tl_dtype})  # s*c + z")
        return Val(v, form, "chunk")

    # -- products --------------------------------------------------------------------------
    def _accumulator(self, v: str, form: str, level: str, integer: bool) -> None:
        zeros = f"tl.zeros({SHAPES[form]}, {'tl.int32' if integer else 'tl.float32'})"
        (self.group_start if level == "group" else self.pre).append(f"{v} = {zeros}")

    def emit_contract(self, node: Contract):
        a, b = self.vals[node.lhs], self.vals[node.rhs]
        if a.form == "KN" or b.form == "MK":
            a, b = b, a
        level = "group" if node.split is not None else "total"
        v = self.gvar(node) if level == "group" else self.var(node)
        if (a.form, b.form) == ("MK", "KN"):
            integer = a.integer and b.integer
            self._accumulator(v, "MN", level, integer)
            out = ", out_dtype=tl.int32" if integer else ""
            self.chunk.append(f"{v} = tl.dot({a.expr}, {b.expr}, {v}{out})" if integer else
                              f"{v} = tl.dot({a.expr}, {b.expr}, {v})")
            return Val(v, "MN", level, integer)
        summed = a if b.form == "K" else b
        if {a.form, b.form} == {"K"} or summed.form not in ("MK", "KN"):
            raise PlanError("backend", f"%{node.name}: cannot contract {a.form} with {b.form}")
        form, axis = ("M", 1) if summed.form == "MK" else ("N", 0)
        self._accumulator(v, form, level, summed.integer)
        acc_t = "tl.int32" if summed.integer else "tl.float32"
        self.chunk.append(f"{v} += tl.sum({summed.expr}.to({acc_t}), axis={axis})  # row/column sums")
        return Val(v, form, level, summed.integer)

    def _float(self, v: Val) -> str:
        return f"{v.expr}.to(tl.float32)" if v.integer else v.expr

    def _emit_term(self, node, expr: str, form: str, keep: bool) -> Val:
        """A group-end value: kept per group, or added into a running total over groups."""
        if keep:
            v = self.gvar(node)
            self.group_end.append(f"{v} = {expr}")
            return Val(v, form, "group")
        v = self.var(node)
        self._accumulator(v, form, "total", False)
        self.group_end.append(f"{v} += {expr}")
        return Val(v, form, "total")

    def emit_scalegroups(self, node: ScaleGroups):
        part, scale = self.vals[node.partial], self.vals[node.scale]
        form = _union(part.form, scale.form)
        p = Val(self._float(part), part.form, part.level)
        expr = f"{_bcast(p, form)} * {_bcast(scale, form)}  # scale each group's partial sum (eq. 3)"
        return self._emit_term(node, expr, form, node.keep_groups)

    def emit_correction(self, node: Correction):
        zero, other = self.vals[node.zero], self.vals[node.other]
        if node.form == "presummed":  # other: per-group sums (eq. 15)
            form = _union(zero.form, other.form)
            o = Val(self._float(other), other.form, other.level)
            return self._emit_term(node, f"{_bcast(o, form)} * {_bcast(zero, form)}  # zero x row sums (eq. 15)",
                                   form, False)
        if node.form != "group-sum":
            raise PlanError("backend", f"%{node.name}: the GEMM kernel lowers group-sum corrections, not {node.form}")
        if other.form == "K":  # the ones input: the sum is the number of k this program visits in the group
            s = f"{self.var(node)}_len" + ("@" if self.lane_groups else "")
            self.group_start.append(f"{s} = 0.0")
            # one line per lane when each lane has its own group; else all lanes count into the one group
            self.chunk.append(f"{s} += BLOCK_K" if self.lane_groups else f"{s} += BLOCK_K * {self.lanes}")
            sums = Val(s, "", "group")
        else:
            s = f"{self.var(node)}_sum" + ("@" if self.lane_groups else "")
            form, axis = ("M", 1) if other.form == "MK" else ("N", 0)
            acc_t = "tl.int32" if other.integer else "tl.float32"
            self.group_start.append(f"{s} = tl.zeros({SHAPES[form]}, {acc_t})")
            self.chunk.append(f"{s} += tl.sum({other.expr}.to({acc_t}), axis={axis})")
            sums = Val(f"{s}.to(tl.float32)" if other.integer else s, form, "group")
        form = _union(zero.form, sums.form)
        return self._emit_term(node, f"{_bcast(sums, form)} * {_bcast(zero, form)}  # zero x group sums (eq. 6)",
                               form, node.keep_groups)

    def emit_add(self, node: Add):
        a, b = self.vals[node.lhs], self.vals[node.rhs]
        form = _union(a.form, b.form)
        v = self.gvar(node) if a.level == b.level == "group" else self.var(node)
        terms = [_bcast(Val(self._float(v), v.form, v.level), form) for v in (a, b)]
        expr = f"{terms[0]} + {terms[1]}"
        if a.level == b.level == "group":
            self.group_end.append(f"{v} = {expr}")
            return Val(v, form, "group")
        if "group" in (a.level, b.level) or "chunk" in (a.level, b.level):
            raise PlanError("backend", f"%{node.name} adds a {a.level} value to a {b.level} value")
        self.final.append(f"{v} = {expr}")
        return Val(v, form, "final")


def generate_gemm(plan, dtype: str = "fp16") -> GemmKernelSource:
    """Triton source of ``y = x @ w.T`` for a GEMM plan, MMA inputs in ``dtype``."""
    check_gemm_plan(plan)   # a decision that is not the proved graph's never reaches code generation
    em = _GemmEmitter(plan, dtype)
    em.run()
    out = em.vals[plan.graph.output]
    if out.form != "MN":
        raise PlanError("backend", f"the output %{plan.graph.output} has form {out.form}, not an [m, n] tile")
    args = [*em.args, "Y", "stride_y", "M"]
    ind = " " * 4
    group_level = (lambda lines: _lanes(lines, em.lanes)) if em.lane_groups else (lambda lines: lines)
    if em.lane_groups:  # lane i works on group i * outer + t
        start = ["grp@ = $L * " + str(em.outer) + " + t"]
        chunk_len, j0 = em.group, f"t * {em.group} + kc"
    elif em.outer > 1:  # one lane, several groups along k
        start, chunk_len, j0 = ["grp = t"], em.group, f"t * {em.group} + kc"
    else:               # one group spans k: every lane adds into it
        start, chunk_len, j0 = ["grp = 0"], em.lane_len, "kc"
    # split-K (eq. 3 and 6 are sums over k, so programs may take disjoint parts and add): program
    # pid_k takes every SPLIT_K-th group step, or with a single group every SPLIT_K-th chunk
    if em.outer > 1:
        outer_loop, chunk_loop = "range(pid_k, {0}, SPLIT_K)", "range(0, {1}, BLOCK_K)"
    else:
        outer_loop, chunk_loop = "range(0, {0})", "range(pid_k * BLOCK_K, {1}, SPLIT_K * BLOCK_K)"
    # 64-bit addressing at no cost in the loop: a row's offset (row x stride) can pass 2**31 - 1 (an
    # int8 weight over 2 GiB, an output over 2**31 elements), which int32 arithmetic wraps. So each
    # pointer moves once per program to the tile's first row in int64, and the loop's offsets count
    # from there in int32 (a tile spans less than 2**31 elements: the launcher checks, `check_tile_span`).
    store = "Y + rows_in[:, None] * stride_y + cols[None, :]"
    body = [
        "pid_m = tl.program_id(0)",
        "pid_n = tl.program_id(1)",
        "pid_k = tl.program_id(2)",
        "row0 = (pid_m * BLOCK_M).to(tl.int64)  # the tile's first row and column",
        "col0 = (pid_n * BLOCK_N).to(tl.int64)",
        "rows_in = tl.arange(0, BLOCK_M)  # rows and columns from the tile's first",
        "cols_in = tl.arange(0, BLOCK_N)",
        "rows = pid_m * BLOCK_M + rows_in",
        "cols = pid_n * BLOCK_N + cols_in",
        "row_ok = rows < M",
        "col_ok = cols < N",
        *em.bases,
        "Y += row0 * stride_y  # 64-bit: rows x stride may pass 2**31 - 1",
        "kk = tl.arange(0, BLOCK_K)",
        *em.pre,
        f"for t in {outer_loop.format(em.outer, chunk_len)}:  # k groups of {em.group}; {em.lanes} bit-field "
        f"lane(s) of {em.lane_len} k",
        *[ind + ln for ln in group_level(start + em.group_start)],
        ind + f"for kc in {chunk_loop.format(em.outer, chunk_len)}:",
        *[2 * ind + ln for ln in _lanes([f"j = {j0}", f"k0@ = $L * {em.lane_len} + j", *em.chunk], em.lanes)],
        *[ind + ln for ln in group_level(em.group_end)],
        *em.final,
        "if SPLIT_K == 1:",
        ind + f"tl.store({store}, {out.expr}.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])",
        "else:  # Y is a zeroed float32 buffer the launcher casts afterwards",
        ind + f"tl.atomic_add({store}, {out.expr}, mask=row_ok[:, None] & col_ok[None, :])",
    ]
    constexprs = ["N", "K", "GROUP", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"]
    name = "foldc_gemm"
    src = kernel_module(plan, name, args, constexprs, body,
                        f"MMA inputs {'int8' if em.int8_dot else dtype}; k groups of {em.group}.")
    inputs = {n.name: ("encoded" if n.encoding is not None else "values")
              for n in plan.graph.nodes_of(Input) if n.role != "ones"}
    return GemmKernelSource(name, src, args, em.group, inputs, em.int8_dot)
