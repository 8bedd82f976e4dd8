"""Memory side of the register-operand kernel (kernel.py): the code words' cp.async copies and the
last partial tile, token-wise scale and zero loads (and their L2 prefetch), where a tile's words and
parameters live (contiguous or paged cache), and the tile draws of dynamic tiles.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

#: a plain side's tiles in shared memory: 16-byte chunks of a row XOR-swizzled over 8 rows, so that
#: ldmatrix's eight rows fall in different banks; PLAIN_WORDS as the copies write it (32-bit words),
#: PLAIN_VIEW as the operand loads read it (bf16), the same bytes
PLAIN_WORDS: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
PLAIN_VIEW: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
CODE_WORDS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])


@constexpr_function
def words_per_token(head_dim, fields):
    """32-bit words per token: head_dim x bits / 32, or head_dim / 2 for a plain bf16 side."""
    return int(head_dim) // int(fields) // 4 if int(fields) else int(head_dim) // 2


@constexpr_function
def copy_layout(BN, W, WARPS=1):
    """cp.async of a [BN, W] word tile: 16 bytes per lane, WARPS warps on consecutive rows."""
    BN, W, WARPS = int(BN), int(W), int(WARPS)
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // (W // 4), W // 4],
                            warps_per_cta=[WARPS, 1], order=[1, 0])


@constexpr_function
def lane_order_smem(BN, W):
    """A [BN tokens, W words] value tile (W a multiple of 8) placed so that one value read
    (`tile_operands.value_words_layout`: lanes on words 0-7 of tokens t, t + 8, t + 16, t + 24) meets
    32 consecutive words, one shared wavefront: the offset's lowest bits are words 1, 2, 4 and tokens
    8, 16, then the words from 8, then tokens 1, 2, 4, 32, ... Stored token by token instead, those four
    tokens' words share a bank: four wavefronts a read."""
    BN, W = int(BN), int(W)
    bases = [[0, 1], [0, 2], [0, 4], [8, 0], [16, 0]] + [[0, 8 << i] for i in range((W // 8).bit_length() - 1)] + \
        [[1, 0], [2, 0], [4, 0]] + [[32 << i, 0] for i in range((BN // 32).bit_length() - 1)]
    return gl.SharedLinearLayout(offset_bases=bases)


@constexpr_function
def lane_order_copy_layout(BN, W):
    """cp.async of a [BN, W] tile into `lane_order_smem`: four words (16 bytes) a lane, lanes 0-7 the
    word half and tokens 8 and 16 (32 consecutive words of the tile), then the words from 8 and tokens
    1, 2, 4, 32, ..."""
    BN, W = int(BN), int(W)
    rest = [[0, 8 << i] for i in range((W // 8).bit_length() - 1)] + [[1, 0], [2, 0], [4, 0]] + \
        [[32 << i, 0] for i in range((BN // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]] + rest[2:],
                                      lane_bases=[[0, 4], [8, 0], [16, 0]] + rest[:2],
                                      warp_bases=[], block_bases=[], shape=[BN, W])


@gluon.jit
def issue_copies(stage, n0, k_smem, v_smem, k_base, v_base, stride_kh, stride_vh, lanes, KW: gl.constexpr,
                 VW: gl.constexpr, H: gl.constexpr, PAD: gl.constexpr = False):
    """Start copying the code words of tile n0, every packed head, into pipeline stage ``stage``.
    ``lanes``: the (token, word) index vectors of each side's copy layout, ``(tck, wck, tcv, wcv)``;
    KW, VW: words per token of K and V in the cache (they differ when K and V have different widths).
    PAD: the tiles hold more words per token than the cache (a padded head_dim); the rest are zeros."""
    tck, wck, tcv, wcv = lanes
    k_rows = (n0 + tck)[:, None] * KW + wck[None, :]
    v_rows = (n0 + tcv)[:, None] * VW + wcv[None, :]
    k_mask = None
    v_mask = None
    if PAD:
        k_mask = (wck < KW)[None, :]
        v_mask = (wcv < VW)[None, :]
    for i in gl.static_range(H):
        async_copy.async_copy_global_to_shared(k_smem.index(stage * H + i), k_base + i * stride_kh + k_rows,
                                               mask=k_mask)
        async_copy.async_copy_global_to_shared(v_smem.index(stage * H + i), v_base + i * stride_vh + v_rows,
                                               mask=v_mask)
    async_copy.commit_group()


@gluon.jit
def prefetch_scales(n0, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh, KEY_G: gl.constexpr, VAL_G: gl.constexpr,
                    H: gl.constexpr, BN: gl.constexpr):
    """Bring tile n0's token-wise scales and zeros into L2 (``prefetch.global.L2``, no registers
    held): lane l takes parameter l % 4 of head (l // 4) % H, one BN x 2-byte row each (at most
    128 bytes, one line). The loads at the tile's start then wait on L2, not on DRAM (long-scoreboard
    stalls on them were 17% of the samples, docs/perf.md)."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    p = lane % 4
    head = (lane // 4) % H
    byte: gl.constexpr = gl.pointer_type(gl.int8)   # K and V scales may differ in dtype: byte addresses
    ks = (KSp + head * stride_ksh + n0).to(byte)
    kz = (KZp + head * stride_ksh + n0).to(byte)
    vs = (VSp + head * stride_vsh + n0).to(byte)
    vz = (VZp + head * stride_vsh + n0).to(byte)
    if KEY_G == 0:
        ptr = gl.where(p == 0, ks, kz)
    else:
        ptr = vs
    if VAL_G == 0:
        ptr = gl.where(p == 2, vs, gl.where(p == 3, vz, ptr))
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [ptr], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _param(P, n0, tm, head_c, stride_h, live, H: gl.constexpr, MASKED: gl.constexpr, NG: gl.constexpr = 1,
           g: gl.constexpr = 0):
    """One token-wise parameter (scale or zero) per token of tile n0: [BN] with one head per program,
    else [BN, ROWS] with each query row's own head (head_c: the packed head of each row).
    A lane's tokens are tm = g + 8j: the address is one base per lane (row g) plus 8j elements, so
    every load takes an immediate offset from that base instead of its own 64-bit address (the
    address registers of 32 loads per tile had warps waiting on them, docs/perf.md). With NG channel
    groups per token, a token's NG parameters are consecutive: this loads group ``g``'s."""
    lo = tm & 7          # the lane's row g, the same in every register
    hi = tm & -8         # 8j: a constant per register
    if NG == 1:
        if H == 1:
            ptr = (P + n0 + lo) + hi
        else:
            ptr = (P + n0 + head_c[None, :] * stride_h + lo[:, None]) + hi[:, None]
    else:
        if H == 1:
            ptr = (P + (n0 + lo) * NG + g) + hi * NG
        else:
            ptr = (P + head_c[None, :] * stride_h + ((n0 + lo) * NG + g)[:, None]) + (hi * NG)[:, None]
    if H == 1:
        ok = live
    else:
        ok = live[:, None]
    if MASKED:
        x = gl.load(ptr, mask=ok, other=0)
    else:
        x = gl.load(ptr)
    return x


@gluon.jit
def _params(P, n0, tm, head_c, stride_h, live, H: gl.constexpr, MASKED: gl.constexpr, NG: gl.constexpr):
    """A token-wise parameter of one tile: one tensor (_param) for one group per token, else a tuple
    of NG, group g's at index g. 16-bit parameters: a token's NG in one 32- or 64-bit load, split into
    its halves by one mov (3-10% faster than NG 16-bit loads at INT2, H200, docs/perf.md); fp32 ones
    one load per group."""
    if NG == 1:
        x = _param(P, n0, tm, head_c, stride_h, live, H, MASKED)
    elif P.dtype.element_ty.primitive_bitwidth == 16 and (NG == 2 or NG == 4 or NG == 8):
        if NG == 2:
            word = _param(P.to(gl.pointer_type(gl.int32)), n0, tm, head_c, stride_h // 2, live, H, MASKED)
            x = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [word],
                                          dtype=(P.dtype.element_ty,) * 2, is_pure=True, pack=1)
        elif NG == 4:
            word = _param(P.to(gl.pointer_type(gl.int64)), n0, tm, head_c, stride_h // 4, live, H, MASKED)
            x = gl.inline_asm_elementwise("mov.b64 {$0, $1, $2, $3}, $4;", "=h,=h,=h,=h,l", [word],
                                          dtype=(P.dtype.element_ty,) * 4, is_pure=True, pack=1)
        else:   # eight groups: two 64-bit words per token
            P64 = P.to(gl.pointer_type(gl.int64))
            lo = _param(P64, n0, tm, head_c, stride_h // 4, live, H, MASKED, 2, 0)
            hi = _param(P64, n0, tm, head_c, stride_h // 4, live, H, MASKED, 2, 1)
            a = gl.inline_asm_elementwise("mov.b64 {$0, $1, $2, $3}, $4;", "=h,=h,=h,=h,l", [lo],
                                          dtype=(P.dtype.element_ty,) * 4, is_pure=True, pack=1)
            b = gl.inline_asm_elementwise("mov.b64 {$0, $1, $2, $3}, $4;", "=h,=h,=h,=h,l", [hi],
                                          dtype=(P.dtype.element_ty,) * 4, is_pure=True, pack=1)
            x = (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])
    else:   # fp32 parameters, or a group count no word holds (3, 5-7: head_dim 96, 160, 192 in groups of 32)
        x = ()
        for g in gl.static_range(NG):
            x = x + (_param(P, n0, tm, head_c, stride_h, live, H, MASKED, NG, g),)
    return x


@gluon.jit
def tile_scales(n0, end, tm, head_c, KSp, KZp, VSp, VZp, stride_ksh, stride_vsh, KEY_G: gl.constexpr,
                VAL_G: gl.constexpr, H: gl.constexpr, MASKED: gl.constexpr, KEY_NG: gl.constexpr = 1,
                VAL_NG: gl.constexpr = 1):
    """Per-token scale and zero of the token-wise sides (placeholders for channel-wise ones); tuples
    of KEY_NG / VAL_NG with several channel groups per token (_params)."""
    tok = n0 + tm
    live = tok < end
    if KEY_G == 0:
        ks = _params(KSp, n0, tm, head_c, stride_ksh, live, H, MASKED, KEY_NG)
        kz = _params(KZp, n0, tm, head_c, stride_ksh, live, H, MASKED, KEY_NG)
    else:
        ks = tm
        kz = tm
    if VAL_G == 0:
        vs = _params(VSp, n0, tm, head_c, stride_vsh, live, H, MASKED, VAL_NG)
        vz = _params(VZp, n0, tm, head_c, stride_vsh, live, H, MASKED, VAL_NG)
    else:
        vs = tm
        vz = tm
    return ks, kz, vs, vz


@gluon.jit
def stage_tail(n0, end, k_smem, v_smem, k_base, v_base, stride_kh, stride_vh, lanes, KW: gl.constexpr,
               VW: gl.constexpr, H: gl.constexpr, PAD: gl.constexpr = False):
    """The last, partial tile into stage 0 of the pipeline's shared memory, zeros past the end
    (``lanes``, KW, VW as in issue_copies)."""
    tck, wck, tcv, wcv = lanes
    k_tok = n0 + tck
    v_tok = n0 + tcv
    k_rows = k_tok[:, None] * KW + wck[None, :]
    v_rows = v_tok[:, None] * VW + wcv[None, :]
    k_live = (k_tok < end)[:, None]
    v_live = (v_tok < end)[:, None]
    if PAD:   # the padding words: zeros
        k_live = k_live & (wck < KW)[None, :]
        v_live = v_live & (wcv < VW)[None, :]
    gl.thread_barrier()   # every lane is done reading the stages
    for i in gl.static_range(H):
        k_smem.index(i).store(gl.load(k_base + i * stride_kh + k_rows, mask=k_live, other=0))
        v_smem.index(i).store(gl.load(v_base + i * stride_vh + v_rows, mask=v_live, other=0))
    gl.thread_barrier()   # the words are visible to every lane


@gluon.jit
def draw_chunk(counter, first, live, previous, DYNAMIC: gl.constexpr):
    """The next chunk for this program from its (batch, head group)'s counter where ``live``, else
    ``previous``: chunks 0 .. splits-1 are the programs' first ones, so a draw returns splits + the
    counter's old value. One lane draws (a scalar atomic); a program draws again only after its last
    draw succeeded, so every chunk drawn is processed."""
    if DYNAMIC:
        got = first + gl.atomic_add(counter, 1, mask=live, sem="relaxed")
        drawn = gl.where(live, got, previous)
    else:
        drawn = previous
    return drawn


@gluon.jit
def next_tile(t, drawn, t_stop, counter, first, CHUNK: gl.constexpr, DYNAMIC: gl.constexpr):
    """(tile after tile t, the chunk drawn ahead). Static: t + 1. Dynamic: the next tile of t's chunk,
    or the first of the chunk drawn ahead, and then the next draw (its latency hides under a tile).
    Past the sequence's t_stop full tiles the program stops."""
    if DYNAMIC:
        last = (t + 1) % CHUNK == 0
        t_next = gl.where(last, drawn * CHUNK, t + 1)
        drawn = draw_chunk(counter, first, last & (drawn * CHUNK < t_stop), drawn, DYNAMIC)
    else:
        t_next = t + 1
    return t_next, drawn


@gluon.jit
def tile_bases(n0, b, h, cache, table, strides, KW: gl.constexpr, VW: gl.constexpr, KEY_G: gl.constexpr,
               VAL_G: gl.constexpr, PAGE: gl.constexpr, KEY_NG: gl.constexpr = 1, VAL_NG: gl.constexpr = 1):
    """Base pointers of the code words and the scales/zeros for the tile holding token n0.
    Contiguous cache (PAGE == 0): batch b's. Paged (PAGE tokens a page, FlashInfer's table): the page
    that holds n0, *rebased* by that page's first token tok0, so that ``base + token * row_stride``
    addresses row token - tok0 of the page for every token of the tile (a tile lies in one page).
    ``first``/``n_pages``: the sequence's entries in KV_INDICES; a slot past them (an empty split)
    reads no entry and takes page 0, whose rows no load then touches. ``cache``: the six tensors'
    pointers, ``table``: (first, n_pages, KV_INDICES), ``strides``: theirs, as the kernel's arguments."""
    KC, KS, KZ, VC, VS, VZ = cache
    first, n_pages, KV_INDICES = table
    stride_kb, stride_kh, stride_ksb, stride_ksh, stride_ksn, stride_vb, stride_vh, stride_vsb, stride_vsh, \
        stride_vsn = strides
    if PAGE > 0:
        slot = n0 // PAGE
        unit = gl.load(KV_INDICES + first + slot, mask=slot < n_pages, other=0).to(gl.int64)
        tok0 = slot * PAGE
    else:
        unit = b
        tok0 = 0
    k_base = KC + unit * stride_kb + h * stride_kh - tok0 * KW   # KW, VW: words per token of K and V
    v_base = VC + unit * stride_vb + h * stride_vh - tok0 * VW
    if KEY_G == 0:      # scale/zero rows: tokens (KEY_NG groups each) or token groups (stride_ksn)
        k_row = tok0 * KEY_NG
    else:
        k_row = (tok0 // KEY_G) * stride_ksn
    if VAL_G == 0:
        v_row = tok0 * VAL_NG
    else:
        v_row = (tok0 // VAL_G) * stride_vsn
    KSp = KS + unit * stride_ksb + h * stride_ksh - k_row
    KZp = KZ + unit * stride_ksb + h * stride_ksh - k_row
    VSp = VS + unit * stride_vsb + h * stride_vsh - v_row
    VZp = VZ + unit * stride_vsb + h * stride_vsh - v_row
    return k_base, v_base, KSp, KZp, VSp, VZp
