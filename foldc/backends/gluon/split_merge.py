"""The decode kernel's splits merged inside the kernel (eq. 14): one launch a call instead of the decode and the
merge kernel's two, for eager calls, whose host time is bound by the driver's launches (docs/perf.md).

After a program writes its split's (max, denominator, accumulator) rows, it waits at a barrier of the whole grid;
then every program merges a share of the outputs: program p takes items p, p + G, ... of the call's G programs,
an item being one query row's 8 channels of one sequence, its splits 128 at a step, as the merge kernel
(foldc/backends/runtime/merge.py) does for its own programs. The launch is cooperative (every program resident at
once, or the driver refuses it), so the wait cannot deadlock; the launcher takes this path only where the grid fits
one wave of resident programs, and never under CUDA-graph capture, where the merge kernel's programmatic dependent
launch costs no host time.

The barrier's int64 counters ``COUNTERS``: [0] groups arrived, [1] a generation, [2 + g] the splits of group g
(a sequence's head program) arrived. Each program counts itself on its group's counter; the group's last counts the
group on [0]; the last group bumps the generation, which every program waits on (it read the generation before it
arrived). Each last arriver sets the count it finished back to zero, so one zeroed buffer of ``2 + groups`` serves
every later call on its stream, whatever its grid.

Import this module only where Triton runs natively (not under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from foldc.backends.gluon import launch_defaults

SPLIT_BLOCK = gl.constexpr(128)   # splits per step of an item's loop
D_BLOCK = gl.constexpr(8)         # channels per item
BARRIER_FIXED = gl.constexpr(launch_defaults.BARRIER_FIXED)   # the counters before the groups' (two)


@gluon.jit
def merge_splits(OUT, LSE, COUNTERS, WS_M, WS_L, WS_ACC, b, s, ROWS: gl.constexpr, DR: gl.constexpr,
                 REAL_ROWS: gl.constexpr):
    """Program (b, head program, s) of a decode grid, after writing its rows of the workspace [batch, head programs,
    splits, ROWS(, DR)]: wait for the whole grid, then merge its share into OUT [batch, head programs x REAL_ROWS,
    DR] (contiguous, the queries' dtype) and LSE [batch, head programs x REAL_ROWS] (natural log)."""
    heads = gl.num_programs(1)
    splits = gl.num_programs(2)
    groups = gl.num_programs(0) * heads
    # every lane's rows are written before the count says so (the release of the atomic orders them through the
    # warp's barrier)
    gl.thread_barrier()
    # the generation, read before arriving (it moves only after every arrival): lane 0's read, ordered before its
    # arrival by the arrival's release and handed to every lane (a scalar atomic's value), so all wait for one value
    gen0 = gl.atomic_add(COUNTERS + 1, 0, sem="relaxed", scope="gpu")
    group = COUNTERS + BARRIER_FIXED + b * heads + gl.program_id(1)
    old = gl.atomic_add(group, 1, sem="acq_rel", scope="gpu")
    if old == splits - 1:   # the group's last split
        gl.store(group, 0)
        arrived = gl.atomic_add(COUNTERS, 1, sem="acq_rel", scope="gpu")
        if arrived == groups - 1:   # the last group: every program has written its rows
            gl.store(COUNTERS, 0)
            gl.atomic_add(COUNTERS + 1, 1, sem="release", scope="gpu")
    # wait with acquire loads (triton makes an atomic add of 0 a load, no read-modify-write traffic on the counter,
    # and drops one whose value is unused: an acquire after a wait on volatile loads was compiled away): the load
    # that sees the new generation synchronises with the last group's release, and the barrier hands that to every
    # lane before the merge reads the other programs' rows
    gen = gl.atomic_add(COUNTERS + 1, 0, sem="acquire", scope="gpu")
    while gen == gen0:
        gen = gl.atomic_add(COUNTERS + 1, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()

    blk: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [gl.num_warps(), 1], [1, 0])
    sl: gl.constexpr = gl.SliceLayout(1, blk)
    cl: gl.constexpr = gl.SliceLayout(0, blk)
    NDB: gl.constexpr = DR // D_BLOCK
    sb = gl.arange(0, SPLIT_BLOCK, layout=sl)
    cols = gl.arange(0, D_BLOCK, layout=cl)
    programs = groups * splits
    items = groups * REAL_ROWS * NDB
    for item in range((b * heads + gl.program_id(1)) * splits + s, items, programs):
        dblk = item % NDB
        row = (item // NDB) % REAL_ROWS
        head = item // (NDB * REAL_ROWS)   # the group: (sequence, head program)
        base = head.to(gl.int64) * splits * ROWS + row
        c = dblk * D_BLOCK + cols
        m = gl.max(gl.full([SPLIT_BLOCK], float("-inf"), gl.float32, layout=sl), axis=0)
        den = gl.sum(gl.zeros([SPLIT_BLOCK], gl.float32, layout=sl), axis=0)
        acc = gl.zeros([D_BLOCK], gl.float32, layout=cl)
        for s0 in range(0, splits, SPLIT_BLOCK):
            live = (s0 + sb) < splits
            idx = base + (s0 + sb) * ROWS
            m_s = gl.load(WS_M + idx, mask=live, other=float("-inf"))
            l_s = gl.load(WS_L + idx, mask=live, other=0.0)
            acc_s = gl.load(WS_ACC + idx[:, None] * DR + c[None, :], mask=live[:, None], other=0.0)
            m_new = gl.maximum(m, gl.max(m_s, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)   # nothing yet: every weight is 0
            alpha = gl.exp2(m - m_safe)
            w = gl.exp2(m_s - m_safe)
            den = den * alpha + gl.sum(l_s * w, axis=0)
            acc = acc * alpha + gl.sum(acc_s * w[:, None], axis=0)
            m = m_new
        q_head = head.to(gl.int64) * REAL_ROWS + row
        gl.store(OUT + q_head * DR + c, (acc / den).to(OUT.dtype.element_ty))
        if dblk == 0:   # m is in log2 units
            gl.store(LSE + q_head, (m + gl.log2(den)) * 0.6931471805599453)
