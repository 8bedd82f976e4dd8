"""`PreparedRun`: `GluonAttention.prepare`'s repeated run of one launch over tensors that stay where they are (a
serving cache's decode steps), handing the launch's bound kernels addresses made once."""
from __future__ import annotations

import torch

from ...errors import InputError
from ..runtime.launch import Launch, capturing, stream_handle
from ..runtime.merge import launch_merge
from .decode_args import binding_key

_DATA_PTR = torch.Tensor.data_ptr


class PreparedRun:
    """`GluonAttention.prepare`'s repeated run of one launch over k, v, a workspace and an lse buffer that stay
    where they are (a serving cache's own storage; a paged launch's lengths and page table too):
    ``prepared(q, out, tokens)`` does what ``run(launch, q, k, v, out, lse, sm_scale, workspace=workspace,
    tokens=tokens)`` does (``seq_lens=..., paged=...`` for a paged launch, which takes no ``tokens``); once that
    run's launches are bound it hands them k's, v's and the buffers' addresses made once, with q's and out's, and
    rebuilds no key. Calls whose q or out differ from the bound one in batch, strides or dtype, calls on another
    device and calls inside a CUDA-graph capture take ``run``. The caller validates q, out and tokens (0 .. the
    launch's tokens)."""

    __slots__ = ("attn", "launch", "k", "v", "workspace", "lse", "sm_scale", "seq_lens", "paged", "_fixed", "_bound")

    def __init__(self, attn, launch: Launch, k, v, workspace, lse, sm_scale: float, seq_lens=None,
                 paged: tuple | None = None):
        if (paged is not None) != bool(launch.page) or (seq_lens is not None) != launch.has_lens:
            raise InputError(f"a prepared run of a launch planned with page={launch.page} and has_lens="
                             f"{launch.has_lens} takes {'a page table' if launch.page else 'no page table'} and "
                             f"{'lengths' if launch.has_lens else 'no lengths'}")
        self.attn, self.launch, self.k, self.v = attn, launch, k, v
        self.workspace, self.lse, self.sm_scale, self.seq_lens, self.paged = workspace, lse, sm_scale, seq_lens, paged
        # the addresses a bound call repeats: both sides encoded (a plain side's stand-ins are q's address)
        fixed = None
        if not isinstance(k, torch.Tensor) and not isinstance(v, torch.Tensor) and launch.kernel == "gluon":
            fixed = ((k.codes.data_ptr(), k.scale.data_ptr(), k.zero.data_ptr(), v.codes.data_ptr(),
                      v.scale.data_ptr(), v.zero.data_ptr()), tuple(map(_DATA_PTR, workspace)), lse.data_ptr(),
                     None if seq_lens is None else seq_lens.data_ptr(),
                     None if paged is None else (paged[0].data_ptr(), paged[1].data_ptr()))
        self._fixed = fixed
        # (q's batch, strides and dtype, out's strides and dtype, the two Bound launches: the second None where the
        # decode merges its splits itself, then with its barrier's address and the stream whose barrier it is)
        self._bound = None

    def __call__(self, q, out, tokens: int | None = None) -> None:
        bound, fixed = self._bound, self._fixed
        if bound is not None and bound[6] is None and not self.attn.merge_in_decode:   # told since not to merge
            bound = self._bound = None   # inside: bound again to the two launches
        if (bound is not None and q.stride() == bound[1] and out.stride() == bound[3] and q.shape[0] == bound[0]
                and q.dtype == bound[2] and out.dtype == bound[4] and not capturing(q)):
            qa = q.data_ptr()
            lens = qa if fixed[3] is None else fixed[3]
            table = (qa, qa) if fixed[4] is None else fixed[4]
            count = self.launch.cache_tokens if tokens is None else tokens
            if bound[6] is None:   # the decode merges its splits itself (split_merge.py): one launch, with the
                # current stream's barrier (a launch on another stream at once must not count on the same counters)
                stream = stream_handle(q.device)
                if stream != bound[8]:
                    groups = q.shape[0] * self.attn.head_programs(self.launch.options)
                    bound = self._bound = (*bound[:7], self.attn.barrier(q, groups).data_ptr(), stream)
                if bound[5]((qa, *fixed[0], lens, *fixed[1], out.data_ptr(), fixed[2], bound[7]), (count,)):
                    return
            else:
                launched = bound[5].then((qa, *fixed[0], lens, *fixed[1], *table, qa), (count,), bound[6],
                                         (*fixed[1], out.data_ptr(), fixed[2]))
                if launched:
                    if launched == 1:   # the merge's bound launch declined
                        launch_merge(self.attn._launchers()[1], *self.workspace, out, self.lse,
                                     self.attn.config.q_per_kv * self.launch.options["heads"],
                                     head_rows=self.attn.config.head_rows)
                    return
        launch = self.launch
        self.attn.run(launch, q, self.k, self.v, out, self.lse, self.sm_scale, workspace=self.workspace, tokens=tokens,
                      seq_lens=self.seq_lens, paged=self.paged)
        if bound is None and fixed is not None and not capturing(q):   # bound by now (from the second run)?
            paged = None if self.paged is None else (*self.paged, launch.page)
            merging = self.attn.merges_inside(launch.options, q, launch.splits, out.is_contiguous(), self.paged,
                                              self.seq_lens is not None)
            key = binding_key(launch.options, q, self.k, self.v, self.seq_lens, out, self.sm_scale, launch.per_split,
                              launch.splits, paged, merging)
            state = self.attn._bindings.get(key, launch.options)
            if type(state) is tuple and len(state) == (1 if merging else 2):
                barrier = self.attn.barrier(q, q.shape[0] * self.attn.head_programs(launch.options)).data_ptr() \
                    if merging else None
                self._bound = (q.shape[0], q.stride(), q.dtype, out.stride(), out.dtype, state[0],
                               None if merging else state[1], barrier, stream_handle(q.device))
