"""Which plans take the warpgroup template (warpgroup.py) and how a call launches it: splits that fill one
wave of resident programs, the workspace the merge kernel reads (the same layout as the one-warp
program's, one head of 32 rows per KV head).

The template lowers token-wise INT2 keys and values in one group per token (fp16 scales and zeros, no
code bias) at head_dim 128 with 17 to 32 query rows per KV head (fewer than 32: the rest padding, read as
zeros and not merged), on sm_90 (wgmma; B200 keeps the one-warp
mma.sync program), contiguous caches whose token capacity is a multiple of 8 (the scales travel in
16-byte rows). Every other plan and call, paged ones included, runs the one-warp program.
"""
from __future__ import annotations

import torch

from ...errors import SpecError
from ...plan import Plan, plan
from ..runtime.fast_launch import Bindings, FastLaunch
from ..runtime.launch import Launch, capturing, split_partition
from ..runtime.merge import merge_arguments, run_bound
from ..runtime.modules import num_sms
from ..runtime.offsets import DECODE_FIX, check_offsets, decode_offsets
from .lower import KEY_BIAS, VALUE_BIAS, NotLowerable, lower

ROWS = 32          # the template's query rows: one wgmma N; 17..32 query rows per KV head take it
FEWEST_ROWS = 17   # below: the one-warp program (16 rows measured as fast there, one program of 16 rows)
KERNEL_ROWS = (16, 32)   # what the kernel builds (16: measured as fast as the one-warp program, not taken)
BLOCK_N = 128      # tokens per tile: two wgmma M of 64 (H200: 133.1 against 163.4 µs with 64 at 128/4, 8 x 64K)
STAGES = 4         # tiles in flight by cp.async (134.1 against 149.5 µs with 2 at 128/4 8 x 64K)
_DATA_PTR = torch.Tensor.data_ptr
RESIDENT = 2       # programs per SM: 254 registers x 128 threads (tests/backends/test_gluon_warpgroup.py)
SCALE_ROW = 8      # tokens per 16-byte copy of a scale row


def key_channel(k: int) -> tuple[int, int]:
    """(channel, bit field) of k index ``k`` of the template's key operand at INT2, head_dim 128: lane t of a
    quad holds words 2t + u, and result 2i+p of the key unpack (field i of bytes p, p+2 of the word) sits at
    k = e + 2t + 8p + 16i + 64u (warpgroup.py's prologue computes the same inline)."""
    field, word = (k >> 4) & 3, 2 * ((k >> 1) & 3) + (k >> 6)
    return field * 32 + 4 * word + ((k >> 3) & 1) + 2 * (k & 1), field


def value_channel(m: int) -> tuple[int, int]:
    """(channel, bit field) of row ``m`` of the template's value operand: lane row g of warp w unpacks byte
    b = g + 8w, and its four rows g + 8a + 16w + 64c are that byte's fields a + 2c (the kernel's epilogue
    computes the same inline)."""
    field = ((m >> 3) & 1) + 2 * (m >> 6)
    return field * 32 + (m & 7) + 8 * ((m >> 4) & 3), field


def warpgroup_plan(spec) -> Plan:
    """The plan the template runs: the one-warp program's (no code bias, fp16 operands, bf16 queries), with
    the break-even (eq. 12) weighed against all of a KV head's query rows, which one program takes."""
    return plan(spec, code_bias={"key": KEY_BIAS, "value": VALUE_BIAS}, dtype="bf16", operand_dtype="fp16")


def warpgroup_applies(spec, target: str) -> bool:
    """The template lowers ``spec``'s plan on ``target``: every field read from the checked plan's lowering."""
    if target != "sm_90" or not FEWEST_ROWS <= spec.q_per_kv <= ROWS or spec.k is None or spec.v is None:
        return False
    try:
        cfg = lower(warpgroup_plan(spec))   # check_plan first: a wrong plan never reaches the template
    except NotLowerable:
        return False
    return (cfg.key_bits == cfg.value_bits == 2 and cfg.head_dim == 128 and not cfg.padded_dim
            and cfg.key_tokens == 0 and cfg.value_tokens == 0 and cfg.key_groups == cfg.value_groups == 1
            and not (cfg.key_dequant or cfg.value_dequant or cfg.key_masked_groups or cfg.value_masked_groups)
            and spec.k.scale_dtype == spec.v.scale_dtype == torch.float16)


class WarpgroupLaunch:
    """Launch the warpgroup decode kernel and the shared merge kernel for one call (no checks: the
    caller, `GluonAttention`, validated the call)."""

    def __init__(self, spec):
        if spec.q_per_kv not in KERNEL_ROWS and not FEWEST_ROWS <= spec.q_per_kv <= ROWS:
            raise SpecError(f"the warpgroup kernel takes 16 or {FEWEST_ROWS}..{ROWS} query rows per KV head, not "
                            f"{spec.q_per_kv}")
        self.spec = spec
        self.rows = ROWS if spec.q_per_kv > KERNEL_ROWS[0] else spec.q_per_kv   # the kernel's rows (workspace's)
        self.head_rows = spec.q_per_kv   # the real ones: the merge writes these
        self.plan = warpgroup_plan(spec)
        self.resident = RESIDENT   # programs per SM the splits fill one wave of
        self._kernel = None
        self._kwargs: dict = {}
        self._bindings = Bindings()

    @staticmethod
    def takes(k, v) -> bool:
        """A contiguous cache whose scale rows start 16-byte aligned (capacity a multiple of 8 tokens)."""
        return k.codes.shape[2] % SCALE_ROW == 0 and all(
            t.data_ptr() % 16 == 0 for x in (k, v) for t in (x.codes, x.scale, x.zero))

    def split_plan(self, batch: int, tokens: int, device) -> tuple[int, int]:
        """(splits, tokens per split): one wave of ``resident`` programs per SM, whole tiles per split."""
        want = max(1, min(-(-tokens // BLOCK_N), num_sms(device) * self.resident // (batch * self.spec.num_kv_heads)))
        return split_partition(tokens, want, BLOCK_N)

    def plan_launch(self, dtype: torch.dtype, batch: int, tokens: int, device, has_lens: bool = False) -> Launch:
        """The `Launch` of a call over a contiguous cache of ``tokens`` tokens (kernel "gluon-warpgroup")."""
        splits, per_split = self.split_plan(batch, tokens, device)
        return Launch("gluon-warpgroup", dtype, batch, self.spec.num_kv_heads, splits, per_split, BLOCK_N, tokens,
                      self.rows, 128, 0, has_lens)

    def run(self, launch: Launch, q, k, v, lens, sm_scale: float, out, lse, workspace, merge,
            tokens: int | None = None) -> None:
        """Launch the template and the merge for ``launch`` (``lens``: int32 device lengths or None; ``merge``:
        the merge kernel behind `FastLaunch`; ``tokens``: the tokens every sequence holds, by default the
        launch's ``cache_tokens``). From the second eager call with one launch's integers, strides and dtypes
        both go as bound launches (`Bindings`), the token count given per call."""
        tokens = launch.cache_tokens if tokens is None else tokens
        if self._kernel is None:
            from .warpgroup import foldc_decode_warpgroup

            self._kernel = FastLaunch(foldc_decode_warpgroup)
        bindable = not capturing(q)
        if bindable:
            key = (id(launch), q.stride(), k.codes.stride(), k.scale.stride(), v.codes.stride(), v.scale.stride(),
                   out.stride(), out.dtype, None if lens is None else lens.dtype, sm_scale)
            state = self._bindings.get(key, launch)
            if type(state) is tuple and run_bound(state, (
                    q.data_ptr(), k.codes.data_ptr(), k.scale.data_ptr(), k.zero.data_ptr(), v.codes.data_ptr(),
                    v.scale.data_ptr(), v.zero.data_ptr(), (q if lens is None else lens).data_ptr(),
                    *map(_DATA_PTR, workspace)), merge, workspace, out, lse, self.head_rows, (tokens,)):
                return
        check_offsets("warpgroup decode kernel", decode_offsets(q, k, v, workspace), DECODE_FIX)
        kc, vc = k.codes.view(torch.int32), v.codes.view(torch.int32)
        args = (q, kc, k.scale, k.zero, vc, v.scale, v.zero, q if lens is None else lens, *workspace, q.stride(0),
                q.stride(1), kc.stride(0), kc.stride(1), k.scale.stride(0) // SCALE_ROW,
                k.scale.stride(1) // SCALE_ROW, sm_scale * 1.4426950408889634, launch.per_split, tokens)
        kwargs = self._keywords(lens is not None)
        self._kernel[launch.grid](*args, **kwargs)
        merge_grid, merge_args, merge_kwargs = merge_arguments(*workspace, out, lse, self.head_rows)
        merge[merge_grid](*merge_args, **merge_kwargs)
        if bindable:
            self._bindings.note(key, launch, state, lambda: (self._kernel.bind(launch.grid, args, kwargs,
                                                                               dynamic=(len(args) - 1,)),
                                                              merge.bind(merge_grid, merge_args, merge_kwargs)))

    def _keywords(self, has_lens: bool) -> dict:
        """The template's constexprs and options, one dict object per value of HAS_LENS (`FastLaunch` reads a
        dict it saw before once only)."""
        kwargs = self._kwargs.get(has_lens)
        if kwargs is None:
            kwargs = self._kwargs[has_lens] = dict(HAS_LENS=has_lens, ROWS=self.rows, BN=BLOCK_N, STAGES=STAGES,
                                                   num_warps=4, **({"QH": self.head_rows}
                                                                   if self.head_rows != self.rows else {}))
        return kwargs
