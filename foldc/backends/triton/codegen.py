"""Generate the Triton source of a fused split-KV decode kernel from a plan's graph.

The generator walks the folded graph in order and lowers each node by its kind and the
register-tile form of its operands (layout.py); it never looks at which cache layout the plan
came from. Key-side nodes (ancestors of the online softmax) are emitted inside the token loop
before the softmax, value-side nodes after it, and nodes that read only the query are hoisted
before the loop. The online softmax, the accumulator and the split state follow eq. 9 and 14.

Register-tile forms (R = query rows, T = the tile's tokens, C = one channel chunk, G = one
channel group): "RT", "R", "T", "RC", "TC", "C", "TG", "RTG", "RG".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import PlanError
from ...precision import product_precision
from ...plan import check_plan
from ...ir import (TOKEN, Accumulate, Add, Codes, Contract, Correction, Dequantize, Divide, GroupedAxis,
                   GroupParam, Input, MulScalar, OnlineSoftmax, Prescale, ScaleGroups, param_axes)
from .layout import TileGeometry

# Masks of the tail tile; the full tiles before it are emitted without them (see `generate`).
MASK_2D_F = ", mask=valid[:, None], other=0.0"
MASK_2D_I = ", mask=valid[:, None], other=0"
MASK_1D_F = ", mask=valid, other=0.0"
TOKEN_AND = " & valid[:, None]"   # a padded chunk's channel mask joined with the tail tile's token mask
TAIL_ONLY = "  # tail tile only"

MAGIC = {"fp16": (0x6400, 1024), "bf16": (0x4300, 128)}  # code | bits  ->  bias + code (eq. 7)
MANTISSA_BITS = {"fp16": 10, "bf16": 7}


def magic_or_asm(raw: str, shift: int, bits: int, magic: int, tl_dtype: str) -> str:
    """Triton expression turning a uint8 tensor ``raw`` into ``magic_value + ((raw >> shift) & mask)``
    as fp16/bf16, four bytes per 32-bit register: one shift to bring the field down, one LOP3
    ((t & mask) | magic) per two codes, one byte-pair shift, and two PRMTs that restore the
    element order (bytes 0,1 -> first register, bytes 2,3 -> second)."""
    mask = ((1 << bits) - 1) * 0x00010001
    magic2 = magic * 0x00010001
    first = f"shr.b32 t, $2, {shift};" if shift else "mov.b32 t, $2;"
    asm = (f"{{ .reg .b32 t, lo, hi; {first} lop3.b32 lo, t, {mask}, {magic2}, 0xea; shr.b32 t, t, 8; "
           f"lop3.b32 hi, t, {mask}, {magic2}, 0xea; prmt.b32 $0, lo, hi, 0x5410; prmt.b32 $1, lo, hi, 0x7632; }}")
    return (f'tl.inline_asm_elementwise("{asm}", "=r,=r,r", [{raw}], dtype={tl_dtype}, is_pure=True, '
            "pack=4)")


def magic_ok(bits: int, dtype: str) -> bool:
    """The OR trick is exact only while every code fits in the mantissa."""
    return bits <= MANTISSA_BITS[dtype]


@dataclass
class Val:
    form: str
    vars: dict                # key (None, chunk index or group index) -> Triton expression / name
    mma: bool = False         # held in the MMA input dtype (else fp32)
    hoisted: bool = False     # depends on the query only
    product: str = ""
    lo: dict | None = None    # low parts of a pre-scaled operand split into two MMA terms (hi + lo)
    unit: dict | None = None  # a pre-scaled operand held times 2^e (fp16): key -> 2^-e, which its products take


@dataclass
class KernelSource:
    name: str
    source: str
    args: list[str]                       # runtime argument names in order
    constexprs: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)  # input name -> "values" | "encoded"


class _Emitter:
    def __init__(self, plan, geo: TileGeometry, dtype: str, fast: bool, split: dict[str, bool]):
        self.plan, self.graph, self.geo, self.dtype, self.fast = plan, plan.graph, geo, dtype, fast
        self.split = split          # product -> feed its pre-scaled operand as hi + lo (eq. 6a)
        self.tl_dtype = {"fp16": "tl.float16", "bf16": "tl.bfloat16"}[dtype]
        self.pre: list[str] = []    # before the token loop
        self.key: list[str] = []    # loop body, before the softmax
        self.value: list[str] = []  # loop body, after the softmax
        self.vals: dict[str, Val] = {}
        self.args: list[str] = []
        self.product_of: dict[str, str] = {}
        self.loaded: set = set()
        self._n = 0
        sm = self.graph.nodes_of(OnlineSoftmax)
        self.softmax = sm[0]
        self.key_side = self.graph.ancestors(self.softmax.name)

    # -- helpers --------------------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def phase(self, node) -> list[str]:
        return self.key if node.name in self.key_side else self.value

    def product(self, node) -> str:
        return getattr(node, "product", "") or ("qk" if node.name in self.key_side else "pv")

    def width(self, product: str) -> int:
        return self.geo.width(product)

    def group_of_chunk(self, product: str, chunk: int, group_size: int) -> int:
        return self.geo.first(product)[chunk] // group_size

    def channel_mask(self, product: str, chunk: int) -> str:
        """The channel mask of a padded chunk (its real channels), '' for a whole one."""
        if not self.geo.padded(product, chunk):
            return ""
        return f"(tl.arange(0, {self.width(product)}) < {self.geo.valid(product)[chunk]})"

    def chan_group_size(self, source: str) -> int:
        return self.graph[source].encoding.group_size

    def arg(self, *names: str) -> None:
        for n in names:
            if n not in self.args:
                self.args.append(n)

    # -- the walk -------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.graph:
            if isinstance(node, (Accumulate, Divide)):
                if isinstance(node, Accumulate):
                    self.emit_accumulate(node)
                continue
            if isinstance(node, OnlineSoftmax):
                self.emit_softmax(node)
                continue
            method = getattr(self, f"emit_{type(node).__name__.lower()}", None)
            if method is None:
                raise PlanError("backend", f"the Triton backend cannot lower %{node.name} ({node.kind})")
            result = method(node)
            if result is not None:
                self.vals[node.name] = result

    # -- sources --------------------------------------------------------------------------
    def emit_input(self, node: Input):
        name = node.name.upper()
        if node.role == "query":
            self.arg("Q", "stride_qb", "stride_qh")
            w = self.width("qk")
            out = {}
            for c in range(self.geo.chunks("qk")):
                v = f"q_c{c}"
                cm = self.channel_mask("qk", c)
                self.pre.append(f"{v} = tl.load(Q + q_row_off[:, None] + ({self.geo.first_qk[c]} + tl.arange(0, {w}))"
                                f"[None, :], mask=row_ok[:, None]{' & ' + cm + '[None, :]' if cm else ''}, other=0.0)")
                out[c] = v
            return Val("RC", out, mma=True, hoisted=True, product="qk")
        if node.encoding is not None:
            return None  # read through codes / params
        self.arg(f"{name}_VALUES", f"stride_{node.name}b", f"stride_{node.name}h", f"stride_{node.name}n")
        return Val("TC", {}, mma=True, product=f"lazy:{node.name}")

    def _lazy_values(self, node_name: str, product: str, val: Val, lines: list[str]) -> Val:
        if not val.product.startswith("lazy:"):
            return val
        src = val.product.split(":", 1)[1]
        name, w = src.upper(), self.width(product)
        out = {}
        for c in range(self.geo.chunks(product)):
            v = f"{src}_val_c{c}"
            lines.append(f"{v} = tl.load({name}_VALUES + {src}_base + offs_n[:, None] * stride_{src}n + "
                         f"({self.geo.first(product)[c]} + tl.arange(0, {w}))[None, :]{MASK_2D_F})")
            out[c] = v
        return Val("TC", out, mma=True, product=product)

    def emit_codes(self, node: Codes):
        src = self.graph[node.source]
        enc, name = src.encoding, node.source.upper()
        product = "qk" if src.role == "key" else "pv"
        self.arg(f"{name}_CODES", f"stride_{node.source}b", f"stride_{node.source}h", f"stride_{node.source}n")
        lines = self.key if src.role == "key" else self.value
        w, k = self.width(product), enc.codes_per_byte
        field_w = self.geo.head_dim // k
        mask = (1 << enc.bits) - 1
        magic, bias_value = MAGIC[self.dtype]
        out = {}
        for c in range(self.geo.chunks(product)):
            first = self.geo.first(product)[c]
            fld, col = first // field_w, first % field_w
            raw = f"{node.source}_bytes_{col}"
            if (node.source, col) not in self.loaded:  # one load serves every bit field of these bytes
                self.loaded.add((node.source, col))
                cm = self.channel_mask(product, c)   # a padded chunk: bytes past the field's read as 0
                load_mask = f", mask={cm}[None, :]{TOKEN_AND}, other=0" if cm else MASK_2D_I
                lines.append(f"{raw} = tl.load({name}_CODES + {node.source}_base + offs_n[:, None] * "
                             f"stride_{node.source}n + ({col} + tl.arange(0, {w}))[None, :]{load_mask})")
            code = f"(({raw} >> {fld * enc.bits}) & {mask})" if k > 1 else raw
            v = f"{node.source}_code_c{c}"
            if not magic_ok(enc.bits, self.dtype):
                if node.bias:
                    raise PlanError("backend", f"%{node.name}: {enc.bits}-bit codes do not fit the {self.dtype} "
                                    "mantissa, so they carry no bias; plan with bias 0")
                lines.append(f"{v} = {code}.to({self.tl_dtype})  # codes < 256 are exact")
                out[c] = v
                continue
            # eq. 7: OR the code into the mantissa of a constant: bias + code, exact in fp16/bf16
            if self.fast:  # two codes per LOP3 on 32-bit words (GPU only: no inline asm in the interpreter)
                lines.append(f"{v} = {magic_or_asm(raw, fld * enc.bits, enc.bits, magic, self.tl_dtype)}")
            else:
                lines.append(f"{v} = ({code}.to(tl.uint16) | {magic}).to({self.tl_dtype}, bitcast=True)")
            if node.bias == 0:
                lines.append(f"{v} = {v} - {bias_value}.0  # bias subtracted per value (exact)")
            elif node.bias != bias_value:
                raise PlanError("backend", f"%{node.name} has bias={node.bias}, but {self.dtype} codes built "
                                f"with the OR trick carry bias {bias_value}")
            out[c] = v
        return Val("TC", out, mma=True, product=product)

    def emit_groupparam(self, node: GroupParam):
        src = self.graph[node.source]
        enc, name = src.encoding, node.source.upper()
        product = "qk" if src.role == "key" else "pv"
        self.arg(f"{name}_SCALE", f"{name}_ZERO", f"stride_{node.source}sb", f"stride_{node.source}sh",
                 f"stride_{node.source}sn")
        lines = self.key if src.role == "key" else self.value
        ptr = f"{name}_{node.param.upper()}"
        base = f"{node.source}_sbase"
        grouped = next(a for a in param_axes(src) if isinstance(a, GroupedAxis))
        out = {}
        if grouped.base == TOKEN:   # one row per token group; the tile lies in one group
            w = self.width(product)
            row = f"(tile_start // {enc.group_size}) * stride_{node.source}sn"
            for c in range(self.geo.chunks(product)):
                v = f"{node.name.replace('.', '_')}_c{c}"
                cm = self.channel_mask(product, c)
                load = (f"tl.load({ptr} + {base} + {row} + {self.geo.first(product)[c]} + tl.arange(0, {w})"
                        f"{', mask=' + cm + ', other=0.0' if cm else ''}).to(tl.float32)")
                if node.bias:  # eq. 7: z - bias * s, from the scale already loaded
                    load = f"({load} - {node.bias}.0 * {self.vals[f'{node.source}.scale'].vars[c]})"
                lines.append(f"{v} = {load}")
                out[c] = v
            return Val("C", out, product=product)
        for gi in range(self.geo.head_dim // enc.group_size):  # one column per channel group
            v = f"{node.name.replace('.', '_')}_g{gi}"
            load = f"tl.load({ptr} + {base} + offs_n * stride_{node.source}sn + {gi}{MASK_1D_F}).to(tl.float32)"
            if node.bias:  # eq. 7: z - bias * s, from the scale already loaded
                load = f"({load} - {node.bias}.0 * {self.vals[f'{node.source}.scale'].vars[gi]})"
            lines.append(f"{v} = {load}")
            out[gi] = v
        return Val("TG", out, product=product)

    def emit_dequantize(self, node: Dequantize):
        src = self.graph[node.source]
        product = "qk" if src.role == "key" else "pv"
        lines = self.key if src.role == "key" else self.value
        codes = self.emit_codes(Codes(f"{node.source}.codes", src.axes, source=node.source))
        scale = self.emit_groupparam(GroupParam(f"{node.source}.scale", (), source=node.source, param="scale"))
        zero = self.emit_groupparam(GroupParam(f"{node.source}.zero", (), source=node.source, param="zero"))
        g = src.encoding.group_size
        out = {}
        for c, cv in codes.vars.items():
            s = self._bcast(scale, c, "TC", product, g)
            z = self._bcast(zero, c, "TC", product, g)
            v = f"{node.source}_deq_c{c}"
            lines.append(f"{v} = ({cv}.to(tl.float32) * {s} + {z}).to({self.tl_dtype})")
            out[c] = v
        return Val("TC", out, mma=True, product=product)

    # -- broadcasting -----------------------------------------------------------------------
    def _bcast(self, val: Val, key, target: str, product: str, group_size: int | None = None) -> str:
        """Expression of ``val`` at ``key`` (chunk or group of the target) broadcast to ``target``."""
        f = val.form
        if f.endswith("G") and target.endswith("C"):
            key = self.group_of_chunk(product, key, group_size)
        var = val.vars[key if (f.endswith("C") or f.endswith("G")) else None]
        expand = {
            ("R", "RT"): "[:, None]", ("T", "RT"): "[None, :]", ("RT", "RT"): "",
            ("R", "RC"): "[:, None]", ("RG", "RC"): "[:, None]", ("RC", "RC"): "", ("C", "RC"): "[None, :]",
            ("C", "TC"): "[None, :]", ("TG", "TC"): "[:, None]", ("TC", "TC"): "",
            ("TG", "RTG"): "[None, :]", ("TG", "RT"): "[None, :]", ("RTG", "RT"): "", ("RT", "RTG"): "",
        }.get((f, target))
        if expand is None:
            raise PlanError("backend", f"cannot broadcast a {f} value to {target}")
        return f"{var}{expand}"

    # -- products ---------------------------------------------------------------------------
    def _operand(self, name: str, product: str, lines) -> Val:
        val = self.vals[name]
        return self._lazy_values(name, product, val, lines)

    def emit_contract(self, node: Contract):
        lines = self.phase(node)
        product = node.product
        lhs, rhs = self._operand(node.lhs, product, lines), self._operand(node.rhs, product, lines)
        if lhs.form == "TC":
            lhs, rhs = rhs, lhs
        out_name = node.name.replace(".", "_")
        if node.reduce == "channel":   # rows x tokens, sum over chunks
            if lhs.form != "RC" or rhs.form != "TC":
                raise PlanError("backend", f"%{node.name}: cannot contract {lhs.form} with {rhs.form} over channel")
            if isinstance(node.split, GroupedAxis):
                g = node.split.group_size
                out = {}
                for c in sorted(rhs.vars):
                    gi = self.group_of_chunk(product, c, g)
                    v = f"{out_name}_g{gi}"
                    dot = f"tl.dot({lhs.vars[c]}, tl.trans({rhs.vars[c]}))"
                    lines.append(f"{v} = {dot}" if gi not in out else f"{v} += {dot}")
                    out[gi] = v
                if lhs.unit is not None:
                    raise PlanError("backend", f"%{node.name}: a pre-scaled query summed per channel group")
                return Val("RTG", out, product=product)
            v = out_name
            for i, c in enumerate(sorted(rhs.vars)):
                dot = f"tl.dot({lhs.vars[c]}, tl.trans({rhs.vars[c]}))"
                lines.append(f"{v} = {dot}" if i == 0 else f"{v} += {dot}")
                if lhs.lo is not None:
                    lines.append(f"{v} += tl.dot({lhs.lo[c]}, tl.trans({rhs.vars[c]}))")
            if lhs.unit is not None:   # one 2^e for every chunk (emit_prescale): back to the scores' own unit
                lines.append(f"{v} = {v} * {lhs.unit[min(rhs.vars)]}")
            return Val("RT", {None: v}, product=product)
        # reduce over tokens: rows x chunk
        if rhs.form != "TC" or lhs.form not in ("RT", "RTG"):
            raise PlanError("backend", f"%{node.name}: cannot contract {lhs.form} with {rhs.form} over token")
        out = {}
        for c in sorted(rhs.vars):
            a_lo, unit = None, None
            if lhs.form == "RTG":
                g = self.graph[self._scale_of_prescale(node.lhs)].source
                gi = self.group_of_chunk(product, c, self.chan_group_size(g))
                a = lhs.vars[gi]
                a_lo = lhs.lo[gi] if lhs.lo is not None else None
                unit = lhs.unit[gi] if lhs.unit is not None else None
            else:
                a = self._mma_p(lhs)
            v = f"{out_name}_c{c}"
            lines.append(f"{v} = tl.dot({a}, {rhs.vars[c]})")
            if a_lo is not None:
                lines.append(f"{v} += tl.dot({a_lo}, {rhs.vars[c]})")
            if unit is not None:   # the group's 2^e (emit_prescale) taken out
                lines.append(f"{v} = {v} * {unit}")
            out[c] = v
        return Val("RC", out, product=product)

    def _scale_of_prescale(self, name: str) -> str:
        return self.graph[name].scale

    def _mma_p(self, val: Val) -> str:
        if val.mma:
            return val.vars[None]
        key = f"__mma_{val.vars[None]}"
        if key not in self.vals:
            self.value.append(f"{val.vars[None]}_mma = {val.vars[None]}.to({self.tl_dtype})")
            self.vals[key] = Val("RT", {None: f"{val.vars[None]}_mma"}, mma=True)
        return self.vals[key].vars[None]

    def emit_prescale(self, node: Prescale):
        lines = self.phase(node)
        operand, scale = self.vals[node.operand], self.vals[node.scale]
        name = node.name.replace(".", "_")
        out = {}
        lo = {} if self.split.get(node.product, False) else None
        if operand.form == "RC" and scale.form == "C":      # prescale the query per chunk
            # max |q x s| x 2^e in [2^14, 2^15): no fp16 overflow (it was inf, NaN scores), and the products sit at
            # the top of fp16's range whatever q's size (2^e from the scale alone, |q x s x 2^e| < |q|, put a
            # query ~1e-4 among fp16 subnormals: 7x the error it had). One 2^e for the chunks the dot sums.
            bounds = []
            if self.dtype == "fp16":
                for c in sorted(operand.vars):   # max over rows of |q| per channel: once, before the loop
                    qmax = f"{name}_qmax_c{c}"
                    (self.pre if operand.hoisted else lines).append(
                        f"{qmax} = tl.max(tl.abs({operand.vars[c]}.to(tl.float32)), 0)")
                    bounds.append(f"({qmax} * {scale.vars[c]})")
            unit = self._power_of_two(lines, f"{name}_e", bounds, 14)
            for c in sorted(operand.vars):
                v = f"{name}_c{c}"
                # (q x s) x 2^e, not q x (s x 2^e): a channel whose q is 0 in every row bounds no 2^e, and its
                # s x 2^e may pass float32's range (0 x inf: NaN)
                e = "" if unit is None else f" * {name}_e"
                self._rounded(lines, v, f"{operand.vars[c]}.to(tl.float32) * {scale.vars[c]}[None, :]{e}", lo, c)
                out[c] = v
            units = None if unit is None else {c: unit for c in out}
            return Val("RC", out, mma=True, product=node.product, lo=lo, unit=units)
        if operand.form == "RT" and scale.form == "TG":     # prescale the weights per channel group
            units = None if self.dtype != "fp16" else {}
            for gi in sorted(scale.vars):
                v = f"{name}_g{gi}"
                # P <= 1: P x s x 2^e < 2^15, no fp16 subnormal down to P x s / max s ~ 2^-28 (P x s underflowed)
                unit = self._power_of_two(lines, f"{name}_e{gi}", [scale.vars[gi]], 14)
                s = scale.vars[gi] if unit is None else f"({scale.vars[gi]} * {name}_e{gi})"
                self._rounded(lines, v, f"{operand.vars[None]} * {s}[None, :]", lo, gi)
                out[gi] = v
                if unit is not None:
                    units[gi] = unit
            return Val("RTG", out, mma=True, product=node.product, lo=lo, unit=units)
        raise PlanError("backend", f"%{node.name}: cannot prescale a {operand.form} operand by a {scale.form} scale")

    def _power_of_two(self, lines, name: str, scales: list[str], top: int) -> str | None:
        """fp16 only (bf16 has float32's exponents): ``name = 2^e`` with ``max |scales| x 2^e`` in
        ``[2^top, 2^(top+1))``, from the largest scale's exponent bits, and the name of ``2^-e`` (None for bf16).
        Powers of two scale exactly: where ``x x s`` was a normal fp16 the operand, its products and the result
        are the same bits; they differ where ``x x s`` overflowed fp16 (inf) or fell among its subnormals (2^-24
        steps: P x s of small values lost most of its digits). 2^e and 2^-e stay normal float32s (a zero scale:
        2^126), an inf or NaN scale still gives inf or NaN."""
        if self.dtype != "fp16":
            return None
        largest = f"tl.max(tl.abs({scales[0]}), 0)"
        for s in scales[1:]:
            largest = f"tl.maximum({largest}, tl.max(tl.abs({s}), 0))"
        lines.append(f"{name}_x = tl.minimum(tl.maximum({127 + 127 + top} - ((({largest}).to(tl.int32, "
                     "bitcast=True) >> 23) & 255), 1), 253)   # the biased exponent of 2^e")
        lines.append(f"{name} = ({name}_x << 23).to(tl.float32, bitcast=True)")
        lines.append(f"{name}_inv = ((254 - {name}_x) << 23).to(tl.float32, bitcast=True)")
        return f"{name}_inv"

    def _rounded(self, lines, v: str, expr: str, lo: dict | None, key) -> None:
        """v = expr rounded to the MMA dtype; with ``lo``, also the rounding remainder as a second
        MMA operand, so hi + lo carries the pre-scaled operand to ~16 bits (bf16 has 8)."""
        if lo is None:
            lines.append(f"{v} = ({expr}).to({self.tl_dtype})")
            return
        lines.append(f"{v}_f = {expr}")
        lines.append(f"{v} = {v}_f.to({self.tl_dtype})")
        lines.append(f"{v}_lo = ({v}_f - {v}.to(tl.float32)).to({self.tl_dtype})")
        lo[key] = f"{v}_lo"

    def emit_scalegroups(self, node: ScaleGroups):
        lines = self.phase(node)
        partial, scale = self.vals[node.partial], self.vals[node.scale]
        name = node.name.replace(".", "_")
        if partial.form == "RTG" and scale.form == "TG":
            terms = [f"{partial.vars[gi]} * {scale.vars[gi]}[None, :]" for gi in sorted(partial.vars)]
            lines.append(f"{name} = " + " + ".join(terms))
            return Val("RT", {None: name}, product=node.product)
        if partial.form == "RC" and scale.form == "C":
            out = {}
            for c in sorted(partial.vars):
                v = f"{name}_c{c}"
                lines.append(f"{v} = {partial.vars[c]} * {scale.vars[c]}[None, :]")
                out[c] = v
            return Val("RC", out, product=node.product)
        raise PlanError("backend", f"%{node.name}: cannot scale {partial.form} partials by a {scale.form} scale")

    def emit_correction(self, node: Correction):
        lines = self.phase(node)
        zero, other = self.vals[node.zero], self.vals[node.other]
        zero_node = self.graph[node.zero]
        name = node.name.replace(".", "_")
        product = node.product
        if node.reduce == "channel" and other.form == "RC":
            if zero.form == "TG":   # eq. 6, acc-fold: zero x sum of q over each channel group
                g = self.chan_group_size(zero_node.source)
                sums = {}
                for c in sorted(other.vars):
                    gi = self.group_of_chunk(product, c, g)
                    term = f"tl.sum({other.vars[c]}.to(tl.float32), 1)"
                    sums.setdefault(gi, []).append(term)
                for gi, terms in sums.items():
                    self.pre.append(f"{name}_qsum_g{gi} = " + " + ".join(terms))
                lines.append(f"{name} = " + " + ".join(f"{name}_qsum_g{gi}[:, None] * {zero.vars[gi]}[None, :]"
                                                       for gi in sorted(sums)))
                return Val("RT", {None: name}, product=product)
            if zero.form == "C":    # eq. 6, operand-fold: sum over channels of q x zero
                raw_zero = zero_node.bias
                terms = []
                for c in sorted(other.vars):
                    zv = zero.vars[c]
                    if raw_zero:  # bias folded: correct with the pre-scaled q exactly as the MMA reads it
                        pre = self._prescaled_for(product)
                        zv = f"({zv} + {raw_zero}.0 * {self.vals[self.graph[node.zero].name.replace('zero', 'scale')].vars[c]})"
                        terms.append(f"tl.sum({other.vars[c]}.to(tl.float32) * {zv}[None, :], 1)")
                        unit = "" if pre.unit is None else f" * {pre.unit[c]}"   # its 2^e taken out
                        terms.append(f"- {raw_zero}.0 * tl.sum({pre.vars[c]}.to(tl.float32), 1){unit}")
                        if pre.lo is not None:  # the MMA consumed hi + lo
                            terms.append(f"- {raw_zero}.0 * tl.sum({pre.lo[c]}.to(tl.float32), 1){unit}")
                    else:
                        terms.append(f"tl.sum({other.vars[c]}.to(tl.float32) * {zv}[None, :], 1)")
                lines.append(f"{name} = " + " ".join(t if i == 0 or t.startswith("-") else f"+ {t}"
                                                     for i, t in enumerate(terms)))
                return Val("R", {None: name}, product=product)
        if node.reduce == "token" and other.form == "RT":
            p = other.vars[None]
            if zero.form == "C":    # eq. 6, acc-fold: zero x sum of p over the tile's token group
                # eq. 6a: the sum of P as the MMA reads it (rounded), so its rounding meets z + s*c = v
                # as in plain attention, not s*c alone (which cancels against z)
                lines.append(f"{name}_psum = tl.sum({self._mma_p(other)}.to(tl.float32), 1)")
                out = {}
                for c in sorted(zero.vars):
                    v = f"{name}_c{c}"
                    lines.append(f"{v} = {name}_psum[:, None] * {zero.vars[c]}[None, :]")
                    out[c] = v
                return Val("RC", out, product=product)
            if zero.form == "TG":   # eq. 6, operand-fold: sum over tokens of p x zero, per channel group
                out = {}
                for gi in sorted(zero.vars):
                    v = f"{name}_g{gi}"
                    lines.append(f"{v} = tl.sum({p} * {zero.vars[gi]}[None, :], 1)")
                    out[gi] = v
                return Val("RG", out, product=product)
        raise PlanError("backend", f"%{node.name}: cannot lower a {node.form} correction of a {other.form} "
                        f"operand with a {zero.form} zero")

    def _prescaled_for(self, product: str) -> Val:
        for n in self.graph.nodes_of(Prescale):
            if n.product == product:
                return self.vals[n.name]
        raise PlanError("backend", f"{product}: a folded bias needs the pre-scaled operand")

    def emit_add(self, node: Add):
        lines = self.phase(node)
        a, b = self.vals[node.lhs], self.vals[node.rhs]
        name = node.name.replace(".", "_")
        target = "RT" if "T" in a.form + b.form and "C" not in a.form + b.form else "RC"
        product = self.product(node)
        if target == "RT":
            lines.append(f"{name} = {self._bcast(a, None, 'RT', product)} + {self._bcast(b, None, 'RT', product)}")
            return Val("RT", {None: name}, product=product)
        chunks = sorted(next(v for v in (a, b) if v.form.endswith("C")).vars)
        gsize = self._group_size_for(product)
        out = {}
        for c in chunks:
            v = f"{name}_c{c}"
            lines.append(f"{v} = {self._bcast(a, c, 'RC', product, gsize)} + {self._bcast(b, c, 'RC', product, gsize)}")
            out[c] = v
        return Val("RC", out, product=product)

    def _group_size_for(self, product: str) -> int | None:
        role = "key" if product == "qk" else "value"
        inp = next(n for n in self.graph.nodes_of(Input) if n.role == role)
        return inp.encoding.group_size if inp.encoding is not None else None

    def emit_mulscalar(self, node: MulScalar):
        lines = self.phase(node)
        a = self.vals[node.input]
        name = node.name.replace(".", "_")
        lines.append(f"{name} = {self._bcast(a, None, 'RT', 'qk')} * qk_scale")
        return Val("RT", {None: name}, product="qk")

    # -- softmax and accumulator ------------------------------------------------------------
    def emit_softmax(self, node: OnlineSoftmax):
        logits = self.vals[node.logits].vars[None]
        self.key += [
            f"{logits} = tl.where(valid[None, :], {logits}, float('-inf')){TAIL_ONLY}",
            f"m_new = tl.maximum(m_i, tl.max({logits}, 1))",
            "alpha = tl.exp2(m_i - m_new)",
            f"p = tl.exp2({logits} - m_new[:, None])",
            "l_i = l_i * alpha + tl.sum(p, 1)",
            "m_i = m_new",
        ]
        self.vals[node.name] = Val("RT", {None: "p"}, product="pv")

    def emit_accumulate(self, node: Accumulate):
        contrib = self._operand(node.input, "pv", self.value)
        if contrib.form != "RC":
            raise PlanError("backend", f"%{node.name}: the accumulator needs a per-chunk value, got {contrib.form}")
        for c in range(self.geo.chunks("pv")):
            self.value.append(f"acc_c{c} = acc_c{c} * alpha[:, None] + {contrib.vars[c]}")


def _unmasked(lines: list[str]) -> list[str]:
    """The tile body for a full tile: no load masks, no softmax mask."""
    out = []
    for line in lines:
        if line.endswith(TAIL_ONLY):
            continue
        out.append(line.replace(MASK_2D_F, "").replace(MASK_2D_I, "").replace(MASK_1D_F, "").replace(TOKEN_AND, ""))
    return out


def split_operands(plan, dtype: str, split_prescaled: bool | None = None) -> dict[str, bool]:
    """Product -> whether its pre-scaled operand goes to the MMA as hi + lo. By default the plan's
    precision decision (eq. 6a; decided here for ``dtype`` if the plan was made without one); an
    explicit ``split_prescaled`` overrides it for every operand-fold."""
    out = {}
    for name, p in plan.products.items():
        if p.fold != "operand-fold":
            out[name] = False
        elif split_prescaled is not None:
            out[name] = bool(split_prescaled)
        else:
            decision = p.precision if p.precision is not None and plan.dtype == dtype else product_precision(p, dtype)
            out[name] = decision.split_operand
    return out


def generate(plan, geo: TileGeometry, dtype: str, fast: bool = False,
             split_prescaled: bool | None = None, paged: bool = False) -> KernelSource:
    """Triton source of the decode kernel for ``plan`` with MMA inputs in ``dtype``. ``fast``
    selects GPU-only instruction sequences (inline PTX); without it the same plan is lowered
    with plain Triton ops that the interpreter runs. ``split_prescaled`` (default: the plan's
    operand precision, eq. 6a) feeds each operand-fold's pre-scaled operand to the MMA as hi + lo,
    so rounding it costs no accuracy against attention in ``dtype``; True or False overrides the
    plan. ``paged`` reads K/V through a page table (paging.py): the same tile body, with per-tile
    bases from the page that holds the tile."""
    check_plan(plan)   # a wrong plan (a key correction after the softmax, ...) never reaches code generation
    em = _Emitter(plan, geo, dtype, fast, split_operands(plan, dtype, split_prescaled))
    em.run()
    pv_chunks, w_pv = geo.chunks("pv"), geo.width("pv")
    inputs = {n.name: ("encoded" if n.encoding is not None else "values")
              for n in plan.graph.nodes_of(Input) if n.role != "query"}
    # 64-bit addressing outside the loop: (batch, head)'s offset in a cache over 2**31 elements passes
    # 2**31 - 1, so each pointer moves there once in int64; the tile's offsets (token x stride) stay int32
    # from there (the launcher refuses a (batch, head) slice past them, `check_offsets`)
    bases = ["b64 = b.to(tl.int64)", "kvh64 = kvh.to(tl.int64)"]
    for name, kind in inputs.items():
        up = name.upper()
        for ptr in ((f"{up}_CODES",) if kind == "encoded" else (f"{up}_VALUES",)):
            bases.append(f"{ptr} += b64 * stride_{name}b + kvh64 * stride_{name}h")
        bases.append(f"{name}_base = 0")
        if kind == "encoded":
            for ptr in (f"{up}_SCALE", f"{up}_ZERO"):
                bases.append(f"{ptr} += b64 * stride_{name}sb + kvh64 * stride_{name}sh")
            bases.append(f"{name}_sbase = 0")
    args = ["SEQ_LENS", "WS_M", "WS_L", "WS_ACC"] + em.args + ["qk_scale", "tokens_per_split", "num_splits",
                                                               "cache_tokens"]
    tile_bases: list[str] = []
    if paged:  # the bases move into the tile loop, computed from the page table
        from .paging import PAGED_ARGS, hoisted_lines, tile_base_lines

        encs = {n.name: n.encoding for n in plan.graph.nodes_of(Input)}
        tile_bases = tile_base_lines({name: (kind, encs[name]) for name, kind in inputs.items()})
        bases, args = hoisted_lines(), args + list(PAGED_ARGS)
    # the tensors first (upper-case names), then the integers and strides: a bound launch passes the tensors
    # as addresses (foldc/backends/runtime/fast_launch.py)
    args = [a for a in args if a.isupper()] + [a for a in args if not a.isupper()]
    ind = " " * 4
    tile = [
        *em.key,
        *[f"acc_c{c} = acc_c{c} * alpha[:, None]" for c in range(pv_chunks)],
        *[ln for ln in em.value if not ln.startswith("acc_c")],
        *[ln.replace(" * alpha[:, None]", "") for ln in em.value if ln.startswith("acc_c")],
    ]
    body = [
        "b = tl.program_id(0)",
        "kvh = tl.program_id(1)",
        "split = tl.program_id(2)",
        "seq_len = tl.minimum(tl.load(SEQ_LENS + b), cache_tokens)  # never read past the cache",
        "start = split * tokens_per_split",
        "end = tl.minimum(start + tokens_per_split, seq_len)",
        "rows = tl.arange(0, ROWS)",
        "row_ok = rows < Q_PER_KV",
        "q_row_off = b.to(tl.int64) * stride_qb + (kvh * Q_PER_KV + rows) * stride_qh",
        *bases,
        *em.pre,
        "m_i = tl.full([ROWS], float('-inf'), tl.float32)",
        "l_i = tl.zeros([ROWS], tl.float32)",
        *[f"acc_c{c} = tl.zeros([ROWS, {w_pv}], tl.float32)" for c in range(pv_chunks)],
        # full tiles without masks, then one masked tail tile
        "full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N",
        "for tile_start in range(start, full_end, BLOCK_N):",
        *[ind + line for line in ["offs_n = tile_start + tl.arange(0, BLOCK_N)", *tile_bases, *_unmasked(tile)]],
        "if full_end < end:",
        *[ind + line for line in ["tile_start = full_end", "offs_n = tile_start + tl.arange(0, BLOCK_N)",
                                  "valid = offs_n < end", *tile_bases, *tile]],
        "ws_row = ((b.to(tl.int64) * NUM_KV_HEADS + kvh) * num_splits + split) * ROWS + rows  # 64-bit: a "
        "workspace may pass 2**31 elements",
        "tl.store(WS_M + ws_row, m_i)",
        "tl.store(WS_L + ws_row, l_i)",
        *[f"tl.store(WS_ACC + ws_row[:, None] * HEAD_DIM + {geo.first_pv[c]} + tl.arange(0, {w_pv})[None, :], acc_c{c}"
          f"{', mask=' + em.channel_mask('pv', c) + '[None, :]' if geo.padded('pv', c) else ''})"
          for c in range(pv_chunks)],
    ]
    name = "foldc_decode"
    constexprs = ["Q_PER_KV", "ROWS", "BLOCK_N", "HEAD_DIM", "NUM_KV_HEADS"] + (["PAGE_SIZE"] if paged else [])
    src = kernel_module(plan, name, args, constexprs, body,
                        f"MMA inputs {dtype}; tiles: {geo.rows} rows x {geo.block_n} tokens, channel chunks of "
                        f"{geo.width_qk} (qk) / {geo.width_pv} (pv){'; paged K/V' if paged else ''}.")
    return KernelSource(name, src, args, {}, inputs)


def kernel_module(plan, name: str, args: list[str], constexprs: list[str], body: list[str], detail: str) -> str:
    """Source of a module holding one generated @triton.jit kernel: the docstring names the plan it
    came from (``detail`` adds the tiling), then the signature (runtime args, then constexprs)."""
    sig = ",\n    ".join(args + [f"{c}: tl.constexpr" for c in constexprs])
    folds = ", ".join(f"{k}={v}" for k, v in plan.folds.items())
    return "\n".join([
        f'"""Generated by foldc from the plan for {plan.spec.describe()} ({folds}).',
        f"{detail} Do not edit: regenerate with foldc.\"\"\"",
        "import triton",
        "import triton.language as tl",
        "",
        "",
        "@triton.jit",
        f"def {name}(\n    {sig},\n):",
        *[" " * 4 + line for line in body],
        "",
    ])
