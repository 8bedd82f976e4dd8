"""A FlashInfer-style paged decode wrapper: ``plan`` once per batch layout, ``run`` per layer.

Page table (FlashInfer's conventions, int32 tensors):

- ``kv_indptr [batch + 1]``: sequence ``b`` owns page-table entries ``kv_indptr[b]:kv_indptr[b + 1]``;
- ``kv_indices [kv_indptr[-1]]``: page numbers in the pool, in token order;
- ``kv_last_page_len [batch]``: tokens in each sequence's last page, in ``[1, page_size]``. A sequence
  may also end with an empty page (``0``: the page is reserved for appends) or own no page at all
  (``0``, length 0: e.g. a body still empty while its tokens sit in a plain window).

Sequence ``b`` holds ``(pages_b - 1) * page_size + kv_last_page_len[b]`` tokens; token ``t`` sits at row
``t % page_size`` of page ``kv_indices[kv_indptr[b] + t // page_size]``. Pools are laid out as in
foldc/backends/triton/paging.py (an `AffineTensor` whose batch axis is the page).

``plan`` validates the table on the host (the only place that may synchronise) and copies it into
device buffers that ``run`` reads. ``run`` does no host synchronisation and no data-dependent Python
branching, so it can be captured in a CUDA graph; a later ``plan`` with the same batch size and no
more page-table entries rewrites the same buffers, so the graph replays the new layout.
"""
from __future__ import annotations

import dataclasses

import torch

from ..backends.runtime.launch import Launch, allocate_workspace, workspace_fits
from ..backends.triton.paging import check_page_size, paged_block_n
from ..compile import TARGETS, ReferenceAttention, detect_target
from ..encoding import AffineTensor
from ..errors import InputError, InputTypeError, SpecError
from ..plan import plan as make_plan
from ..registry import attention_backend
from ..spec import AttentionSpec
from ..validate import ATTENTION_FIX, check_no_overlap, check_sm_scale, last_byte, output_buffer, without_backward
from .inputs import resolve_device
from .page_table import PageTable, check_page_table, gather_pages, page_pool  # noqa: F401 - public names

_WORKSPACE = {torch.float16: "workspace_float16", torch.bfloat16: "workspace_bfloat16"}   # buffer names per q dtype
MOST_PREPARED = 512   # prepared runs a wrapper keeps: a model's layers x query dtypes x scales


def check_wrapper_page_size(spec: AttentionSpec, page_size) -> int:
    """``page_size`` as a `PagedDecodeWrapper` of its default tiles takes it (a positive integer of whole channel-wise
    groups, with a power-of-two divisor of at least 16 for the token tiles), checked before any cache is built."""
    paged_block_n(spec, page_size, None)
    return page_size


def register_operand_kernel(spec: AttentionSpec, page_size: int, target: str, kernel: str = "auto",
                            block_n: int | None = None, splits: int | None = None, dynamic_tiles: bool = False):
    """The register-operand kernel (foldc/backends/gluon) for a paged decode, or None for the
    generated Triton kernel. Its tile is pinned (an explicit ``block_n``) to one that lies in a page,
    so no tuned launch can pick a tile spanning two pages. ``kernel="gluon"`` raises with the reason
    where it cannot run, and so does ``dynamic_tiles=True`` (an option of that kernel only)."""
    if not isinstance(dynamic_tiles, bool):
        raise SpecError(f"dynamic_tiles={dynamic_tiles!r} must be True or False (the default)")
    if kernel not in ("auto", "triton", "gluon"):
        raise SpecError(f"kernel={kernel!r}: use 'auto', 'triton' or 'gluon'")
    if kernel == "triton":
        if dynamic_tiles:
            raise SpecError("dynamic_tiles=True is an option of the register-operand kernel, and kernel='triton' "
                            "runs the generated Triton kernel; use kernel='auto' or 'gluon', or dynamic_tiles=False")
        return None
    reason = None
    if target not in ("sm_90", "sm_100"):
        reason = f"it runs on sm_90 and sm_100 and this wrapper's target is {target!r}"
    elif page_size % 32:
        reason = f"its tiles are 32 or 64 tokens and page_size={page_size} is not a multiple of 32"
    elif block_n is not None and block_n not in (32, 64):
        reason = f"block_n={block_n} is not 32 or 64"
    else:
        ok, why = attention_backend("gluon").lowerable(spec, "bf16")
        reason = None if ok else why
    if reason is None:
        make = attention_backend("gluon").kernel
        try:
            tile = block_n or make(spec, target).default_block_n
            if page_size % tile:   # the kernel's default tile would span two pages
                tile = 32
            return make(spec, target, block_n=tile, splits=splits, dynamic_tiles=dynamic_tiles)
        except SpecError as err:   # e.g. a 64-token tile over 32-token channel groups
            reason = str(err)
    if kernel == "gluon":
        raise SpecError(f"kernel='gluon' cannot run this paged decode: {reason}; use kernel='auto' or 'triton'")
    if dynamic_tiles:
        raise SpecError(f"dynamic_tiles=True needs the register-operand kernel, which cannot run this paged "
                        f"decode: {reason}; use dynamic_tiles=False")
    return None


class PagedDecodeWrapper:
    """Decode attention over a paged, quantized KV cache (FlashInfer-style ``plan`` / ``run``).

    A wrapper's page table, lengths, split-k workspace and lse buffer serve one CUDA stream at a time (``plan``
    rewrites them, ``run`` writes the workspace): streams that decode at once take a wrapper each.

    Parameters
    ----------
    spec : AttentionSpec
        The attention and its K/V encodings (None keeps that operand plain).
    page_size : int
        Tokens per page, P. Channel-wise encodings need ``P % group_size == 0``.
    max_seq_len : int
        Most tokens any sequence will hold while a plan is in use (appends included). Fixes the
        split-KV partition, so runs (and captured graphs) do not depend on lengths.
    device : str or torch.device
        Where the page table lives (the pools' device).
    target : str
        "auto" (generated kernel on CUDA, interpreter on the CPU), "sm_90", "sm_100", "interpret"
        (CPU, float16 queries) or "reference" (float64 executor over the gathered pages: slow, exact).
    block_n : int, optional
        Tokens per tile; must divide P (None: the largest power of two <= 64 that does).
    num_warps, num_stages, splits : int
        Launch options (``splits``: split-KV count per sequence; None: enough to fill the GPU).
        ``num_warps``/``num_stages`` apply to the generated Triton kernel only.
    dynamic_tiles : bool
        The register-operand kernel's ``dynamic_tiles`` (`GluonAttention`): programs draw tiles from
        a counter; the output's last bits then vary between runs. Refused where that kernel does not run.
    kernel : str
        "auto" (the register-operand kernel on sm_90 and sm_100 when it lowers the plan and the page holds
        whole 32-token tiles, else the generated Triton kernel), "triton" or "gluon" (refused
        with the reason where it does not apply).

    Attributes
    ----------
    attention
        The compiled attention that runs the pages (`GluonAttention` or `TritonAttention`; absent for
        target "reference"): ``plan`` holds its `Launch` per query dtype and ``run`` calls its ``run``.
    register_operand : bool
        Whether that is the register-operand kernel (fp16 and bf16 queries).
    """

    def __init__(self, spec: AttentionSpec, page_size: int, *, max_seq_len: int, device="cpu",
                 target: str = "auto", block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                 splits: int | None = None, kernel: str = "auto", dynamic_tiles: bool = False):
        if not isinstance(spec, AttentionSpec):
            raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
        self.spec = spec
        self.page_size = check_page_size(spec, page_size)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise SpecError(f"max_seq_len={max_seq_len!r} must be a positive integer (most tokens per sequence)")
        self.max_seq_len = max_seq_len
        self.device = resolve_device(device)
        if target not in TARGETS:
            raise SpecError(f"target={target!r} is not available; use one of {TARGETS}")
        if target == "auto":
            target = "interpret" if self.device.type == "cpu" else detect_target()
        if target == "interpret" and self.device.type != "cpu":
            raise SpecError(f"target='interpret' runs Triton's interpreter on the CPU, but device={self.device}; "
                            "use target='auto'")
        if target in ("sm_90", "sm_100") and self.device.type != "cuda":
            raise SpecError(f"target={target!r} runs on a CUDA GPU, but device={self.device}; use device='cuda', "
                            "or target='interpret' (CPU, float16) or 'reference'")
        self.target = target
        self.block_n = paged_block_n(spec, page_size, block_n)
        self.table: PageTable | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._out_apart: tuple | None = None   # the last out found apart from the pools (`_check_out`)
        self._repeat: tuple | None = None   # the last checked call `run` may repeat without its checks (`_repeat_run`)
        if target == "reference" and dynamic_tiles:
            raise SpecError("dynamic_tiles=True is an option of the register-operand kernel (sm_90); "
                            "target='reference' runs the float64 executor: use dynamic_tiles=False")
        self.register_operand = False
        if target == "reference":
            self._reference = ReferenceAttention(make_plan(spec))
            return
        self.interpret = target == "interpret"
        gluon = register_operand_kernel(spec, page_size, target, kernel, block_n, splits, dynamic_tiles)
        self.register_operand = gluon is not None
        if gluon is not None:
            self.block_n = gluon.default_block_n
            self.attention = gluon
        else:
            self.attention = attention_backend("triton").kernel(spec, target, block_n=self.block_n,
                                                               num_warps=num_warps, num_stages=num_stages,
                                                               splits=splits)
        # the query dtypes run() takes: the interpreter's fp16, else fp16 and bf16
        self._dtypes = (torch.float16,) if self.interpret else (torch.float16, torch.bfloat16)
        self._launches: dict[torch.dtype, Launch] = {}
        self._prepared: dict = {}   # (query dtype, scale, pools' ids) -> the register-operand kernel's PreparedRun

    # ---- plan ---------------------------------------------------------------------------------

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor | None, *,
             num_pages: int, seq_lens=None) -> PageTable:
        """Validate a batch layout on the host and copy it to the device (may synchronise).

        Parameters
        ----------
        kv_indptr : torch.Tensor, int32 ``[batch + 1]``
            Non-decreasing from 0: sequence b owns entries ``kv_indptr[b]:kv_indptr[b + 1]``.
        kv_indices : torch.Tensor, int32 ``[kv_indptr[-1]]``
            Page numbers in ``[0, num_pages)``, in token order; a page listed more than once (a prefix several
            sequences share, read-only) must be a full page before the last token of each sequence listing it.
        kv_last_page_len : torch.Tensor, int32 ``[batch]``, or None
            Tokens in each sequence's last page, in ``[0, page_size]`` (module doc).
        num_pages : int
            Pages in the pools that ``run`` will read.
        seq_lens : list of int or torch.Tensor ``[batch]``, optional
            Instead of ``kv_last_page_len`` (pass None there): tokens per sequence; sequences may then
            own pages past their last token, reserved for appends.

        Returns
        -------
        PageTable
            Host facts: lengths, pages per sequence, headroom for appends (within max_seq_len too).
        """
        table = check_page_table(kv_indptr, kv_indices, kv_last_page_len, num_pages, self.page_size, seq_lens,
                                 shared=True)
        most = max(table.seq_lens)
        if most > self.max_seq_len:
            b = table.seq_lens.index(most)
            raise InputError(f"sequence {b} holds {most} tokens but max_seq_len={self.max_seq_len}; build the "
                             "wrapper with a larger max_seq_len")
        table = dataclasses.replace(table, max_seq_len=self.max_seq_len)   # (its headroom stops there)
        lens = torch.tensor(table.seq_lens, dtype=torch.int32)
        self._repeat = None   # the launches and buffers a repeated call holds may change below
        self._store("kv_indptr", kv_indptr.to(torch.int32))
        # room for every table of this batch, so re-plans never move it: pages listed once are distinct (at most the
        # pool's), and a sequence lists shared pages for whole pages of its tokens only (at most max_seq_len's)
        self._store("kv_indices", kv_indices.to(torch.int32),
                    capacity=num_pages + table.batch * (self.max_seq_len // self.page_size))
        self._store("seq_lens", lens)
        self.table = table
        if self.target != "reference":
            self._plan_launch(table.batch)
        return table

    def _store(self, name: str, value: torch.Tensor, capacity: int | None = None) -> None:
        """Copy into the existing buffer when it fits (same address: captured graphs stay valid)."""
        buf = self._buffers.get(name)
        n = value.numel()
        size = n if capacity is None else max(n, capacity)
        if buf is None or buf.numel() < n or (capacity is None and buf.numel() != n):
            buf = torch.zeros(max(size, 1), dtype=torch.int32, device=self.device)
            self._buffers[name] = buf
        buf[:n].copy_(value.to(self.device), non_blocking=True)

    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 ``[batch]`` device lengths that ``run`` reads (appends advance them in place)."""
        return self._buffers["seq_lens"]

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self._buffers["kv_indptr"]

    @property
    def kv_indices(self) -> torch.Tensor:
        return self._buffers["kv_indices"]

    def _plan_launch(self, batch: int) -> None:
        """The kernel's `Launch` per query dtype for this batch over ``max_seq_len`` tokens (the split
        partition does not depend on the lengths), and a workspace that fits it: the same buffers
        while the shapes hold, so captured graphs stay valid across plans."""
        for dtype in self._dtypes:
            launch = self.attention.plan_launch(dtype, batch, self.max_seq_len, self.device, has_lens=True,
                                              page=self.page_size)
            self._launches[dtype] = launch
            name = _WORKSPACE[dtype]
            if not workspace_fits(self._buffers.get(name), launch):
                self._buffers[name] = allocate_workspace(launch, self.device)

    # ---- run ----------------------------------------------------------------------------------

    def _check_pool(self, name: str, pool, q: torch.Tensor) -> None:
        enc, t = getattr(self.spec, name), self.table
        want = (t.num_pages, self.spec.num_kv_heads, self.page_size, self.spec.head_dim)
        if enc is not None:
            if not isinstance(pool, AffineTensor):
                raise InputTypeError(f"{name}_pages must be a foldc.AffineTensor pool encoded as {enc.short()}, "
                                     f"got {type(pool).__name__}")
            if pool.encoding is not enc and pool.encoding != enc:
                raise InputError(f"{name}_pages is encoded as {pool.encoding.short()} but the spec says "
                                 f"{enc.short()}; allocate the pool with foldc.serving.page_pool(spec, ...)")
            shape, dev = pool.shape, pool.device
        else:
            if not isinstance(pool, torch.Tensor) or isinstance(pool, AffineTensor):
                raise InputTypeError(f"{name}_pages must be a plain tensor pool (spec.{name} is None), got "
                                     f"{type(pool).__name__}")
            if pool.dtype != q.dtype:
                raise InputError(f"{name}_pages dtype={pool.dtype} must match q dtype={q.dtype} for a plain operand")
            shape, dev = tuple(pool.shape), pool.device
        if shape != want:
            raise InputError(f"{name}_pages shape={tuple(shape)} but the plan needs {want} (num_pages, kv_heads, "
                             "page_size, head_dim): plan against this pool, with num_pages=its page count")
        contiguous = (pool.codes.is_contiguous() and pool.scale.is_contiguous() and pool.zero.is_contiguous()
                      if enc is not None else pool.is_contiguous())
        if not contiguous:
            raise InputError(f"{name}_pages must be contiguous (allocate it with foldc.serving.page_pool); call "
                             ".contiguous() on its tensors")
        if dev != q.device:
            raise InputError(f"{name}_pages is on {dev} but q is on {q.device}; move both to one device")

    def _check_out(self, out: torch.Tensor, q: torch.Tensor, k_pages, v_pages) -> None:
        """Refuse an ``out`` that shares memory with q or the pools (`check_no_overlap`). The pools are checked once
        for each span of memory an out covers (a serving loop hands the same buffer, or one of the same address from
        torch's allocator, every step) while they stay the same objects; q, new each step, every call."""
        if not isinstance(out, torch.Tensor):   # (its address was read first: an AttributeError)
            raise InputTypeError(f"out must be a torch.Tensor {tuple(q.shape)} or None, got {type(out).__name__}")
        if out.layout != torch.strided:
            check_no_overlap(out, "out")   # (raises, naming the layout: a sparse out has no address)
        span = (out.data_ptr(), out.shape, out.stride(), out.dtype)
        held = self._out_apart
        if held is not None and held[0] == span and held[1] is k_pages and held[2] is v_pages:
            check_no_overlap(out, "out", q=q)
            return
        check_no_overlap(out, "out", q=q, k_pages=k_pages, v_pages=v_pages)
        self._out_apart = (span, k_pages, v_pages)

    def run(self, q: torch.Tensor, k_pages, v_pages, *, sm_scale: float | None = None,
            out: torch.Tensor | None = None, return_lse: bool = False, seq_lens: torch.Tensor | None = None):
        """Decode attention of one query token per sequence over its paged K/V.

        No host synchronisation: shapes and dtypes are checked from metadata only.

        Parameters
        ----------
        q : torch.Tensor ``[batch, num_q_heads, head_dim]``
            float16 or bfloat16 (float16 under the interpreter), unit stride along head_dim.
        k_pages, v_pages : AffineTensor or torch.Tensor
            The pools (module doc): an `AffineTensor` ``[num_pages, kv_heads, page_size, head_dim]``
            (uint8 codes, scale/zero in the encoding's dtype) for an encoded operand, else a tensor
            ``[num_pages, kv_heads, page_size, head_dim]`` in q's dtype. Contiguous.
        sm_scale : float, optional
            Softmax scale (default ``head_dim ** -0.5``).
        out : torch.Tensor ``[batch, num_q_heads, head_dim]``, optional
            Preallocated output in q's dtype, or float32 (unrounded, for a later `foldc.merge_attention`).
        return_lse : bool
            Also return the log-sum-exp of the scaled logits.
        seq_lens : torch.Tensor, int32 ``[batch]``, optional
            Device lengths to read instead of the plan's (e.g. advanced on the device by appends).
            Not checked (that needs a sync): a length past the pages its sequence owns reads only those pages,
            and one past ``max_seq_len`` is cut where the split partition planned for ``max_seq_len`` ends
            (keep lengths <= max_seq_len). Any strides (copied to a contiguous tensor when needed).

        Returns
        -------
        out : torch.Tensor ``[batch, num_q_heads, head_dim]``, q's dtype (float64 with ``target="reference"``)
        lse : torch.Tensor ``[batch, num_q_heads]``, float32 (with ``return_lse``; float64 with the reference)
            Natural-log sum of exp of the scaled logits; -inf for a sequence with no tokens (whose
            output is then 0/0: merge it away with `foldc.merge_attention`).
        """
        repeat = self._repeat
        if (repeat is not None and out is not None and not return_lse and k_pages is repeat[0] and v_pages is repeat[1]
                and seq_lens is repeat[2] and (sm_scale is None or type(sm_scale) is float) and sm_scale == repeat[3]
                and self._repeat_run(repeat, q, out)):
            return out
        if self.table is None:
            raise InputError("run() before plan(): call plan(kv_indptr, kv_indices, kv_last_page_len, "
                             "num_pages=...) first")
        if not isinstance(q, torch.Tensor):
            raise InputTypeError(f"q must be a torch.Tensor [batch, num_q_heads, head_dim], got {type(q).__name__}")
        if q.layout != torch.strided:   # (torch raised from inside data_ptr, or its strides (0, 0, 0) were named)
            raise InputError(f"q is a tensor of layout {q.layout}; attention takes dense queries: pass q.to_dense()")
        want = (self.table.batch, self.spec.num_q_heads, self.spec.head_dim)
        if q.shape != want:
            raise InputError(f"q shape={tuple(q.shape)} but the plan and spec need {want} (batch, num_q_heads, "
                             "head_dim)")
        if q.device != self.device:
            raise InputError(f"q is on {q.device} but the wrapper's page table is on {self.device}; build the "
                             f"wrapper with device={str(q.device)!r}")
        self._check_pool("k", k_pages, q)
        self._check_pool("v", v_pages, q)
        if out is not None:   # (every call runs this path: a call without an out pays nothing)
            self._check_out(out, q, k_pages, v_pages)
        scale = check_sm_scale(sm_scale, self.spec.head_dim)
        if self.target == "reference":
            return self._run_reference(q, k_pages, v_pages, scale, out, return_lse, seq_lens)
        dtypes = self._dtypes
        if q.dtype not in dtypes:
            raise InputError(f"q dtype={q.dtype} is not supported by target={self.target!r}; use one of "
                             f"{list(dtypes)}")
        if q.stride(-1) != 1:
            raise InputError(f"q must have unit stride along head_dim; got strides {q.stride()}")
        given_out = out
        out = output_buffer(out, want, q)
        lse = self._buffers.get("lse")   # the merge's lse, unless it goes to the caller: one buffer per plan
        if return_lse or lse is None or lse.shape != want[:2]:
            lse = torch.empty(want[:2], device=q.device, dtype=torch.float32)
            if not return_lse:
                self._buffers["lse"] = lse
        seq_lens = self._check_lens(seq_lens, want)
        buf = self._buffers
        launch, workspace = self._launches[q.dtype], buf[_WORKSPACE[q.dtype]]
        table = (buf["kv_indptr"], buf["kv_indices"])
        lens = buf["seq_lens"] if seq_lens is None else seq_lens
        if not return_lse and self.register_operand:
            # the lengths (the plan's, or the caller's tensor, e.g. a paged cache's per-layer offsets that its appends
            # move on), table and buffers: a prepared run per pair of pools and lengths (a model's layers), its bound
            # launches given their addresses made once (made again when the plan changed a launch or a buffer). The
            # entry holds the pools and the lengths, so their ids are not reused while it lives
            key = (q.dtype, scale, id(k_pages), id(v_pages), id(lens))
            prepared = self._prepared.get(key)
            if (prepared is None or prepared.k is not k_pages or prepared.v is not v_pages
                    or prepared.launch is not launch or prepared.workspace is not workspace or prepared.lse is not lse
                    or prepared.seq_lens is not lens or prepared.paged[0] is not table[0]
                    or prepared.paged[1] is not table[1]):
                if len(self._prepared) >= MOST_PREPARED:
                    self._prepared.clear()
                prepared = self._prepared[key] = self.attention.prepare(
                    launch, k_pages, v_pages, workspace, lse, scale, seq_lens=lens, paged=table)
            prepared(q, out)
            result = out
            if given_out is not None and (sm_scale is None or type(sm_scale) is float) and lens is not None and (
                    seq_lens is None or lens is seq_lens):
                self._note_repeat(q, out, k_pages, v_pages, seq_lens, sm_scale, prepared)
        else:
            self.attention.run(launch, q, k_pages, v_pages, out, lse, scale, seq_lens=lens, workspace=workspace,
                               paged=table)
            result = (out, lse) if return_lse else out
        if q.requires_grad or (isinstance(k_pages, torch.Tensor) and k_pages.requires_grad) or (
                isinstance(v_pages, torch.Tensor) and v_pages.requires_grad):   # no backward: one through it raises
            return without_backward(result, (q, k_pages, v_pages), "PagedDecodeWrapper.run", ATTENTION_FIX)
        return result

    def _note_repeat(self, q, out, k_pages, v_pages, seq_lens, sm_scale, prepared) -> None:
        """Remember a call that passed every check of ``run`` into a caller's ``out`` (a serving loop's call, each
        layer's pools in turn): a later call with the same pools, lengths object, scale and out, and a q of the same
        shape, dtype, strides and device, is that call again but for q's values and address (`_repeat_run`)."""
        plain = tuple(p for p in (k_pages, v_pages) if isinstance(p, torch.Tensor))
        q_bytes = last_byte(q, 0) + 1   # q's span from its first byte: the same for every q of its shape and strides
        o_lo = out.data_ptr()
        o_hi = last_byte(out, o_lo)
        self._repeat = (k_pages, v_pages, seq_lens, sm_scale, q.shape, q.stride(), q.dtype, q.get_device(),
                        (o_lo, out.shape, out.stride(), out.dtype), o_lo, o_hi, q_bytes, plain, prepared)

    def _repeat_run(self, repeat: tuple, q, out) -> bool:
        """Launch a call `_note_repeat` remembered (the pools, lengths, scale and out already matched): whether q
        matches it in shape, strides, dtype and device, records no gradient, lies apart from out, and no plain pool
        records gradients now; False sends the call through ``run``'s checks."""
        if (type(q) is not torch.Tensor or q.shape != repeat[4] or q.dtype != repeat[6] or q.requires_grad
                or q.stride() != repeat[5] or q.get_device() != repeat[7]
                or (out.data_ptr(), out.shape, out.stride(), out.dtype) != repeat[8]
                or any(p.requires_grad for p in repeat[12])):
            return False
        qa = q.data_ptr()
        if qa <= repeat[10] and qa + repeat[11] > repeat[9]:   # q's bytes meet out's: run() names it
            return False
        repeat[13](q, out)
        return True

    def prepared_run(self, dtype: torch.dtype, sm_scale: float, k_pages, v_pages, seq_lens: torch.Tensor | None = None):
        """The prepared run (`GluonAttention.prepare`) that ``run`` keeps for queries of ``dtype``, this softmax
        scale, these pools and lengths (None: the plan's), or None where it keeps none: a caller that checked a
        call as ``run`` does may call it as ``prepared(q, out)`` for later calls of q's batch, strides and dtype,
        with the same pools and lengths, until the next ``plan``."""
        lens = self._buffers.get("seq_lens") if seq_lens is None else seq_lens
        return self._prepared.get((dtype, sm_scale, id(k_pages), id(v_pages), id(lens)))

    def _check_lens(self, seq_lens, want) -> torch.Tensor | None:
        """``seq_lens`` (or None) as the kernel reads it: int32 ``[batch]`` on the wrapper's device,
        contiguous (the kernel reads length b at ``SEQ_LENS + b``; a strided view, e.g. a column of a
        [batch, 2] tensor, would give it other values, no error)."""
        if seq_lens is not None and (not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32
                                     or tuple(seq_lens.shape) != want[:1] or seq_lens.device != self.device):
            raise InputError(f"seq_lens must be an int32 tensor of shape ({want[0]},) on {self.device}; got "
                             f"{getattr(seq_lens, 'dtype', type(seq_lens).__name__)} "
                             f"{tuple(getattr(seq_lens, 'shape', ()))}")
        return None if seq_lens is None else seq_lens.contiguous()

    def _run_reference(self, q, k_pages, v_pages, scale, out, return_lse, seq_lens):
        seq_lens = self._check_lens(seq_lens, (self.table.batch,))
        lens = self.table.seq_lens if seq_lens is None else tuple(int(n) for n in seq_lens.tolist())
        if min(lens) < 1:
            raise InputError(f"target='reference' needs every sequence to hold a token; lengths are {list(lens)}")
        for b, (n, pages) in enumerate(zip(lens, self.table.pages)):
            # the gathered cache pads a sequence with its last page: a length past its own pages would
            # read those copies here (the kernels read its own pages only), and one past max_seq_len is
            # outside what the kernels' split partition covers
            if n > min(pages * self.page_size, self.max_seq_len):
                raise InputError(f"seq_lens[{b}]={n} but sequence {b} owns {pages} pages of page_size="
                                 f"{self.page_size} tokens and max_seq_len={self.max_seq_len}; pass lengths "
                                 "within both, or plan() a table with more pages")
        used = self.kv_indices[:sum(self.table.pages)]
        k, _ = gather_pages(k_pages, self.kv_indptr, used, lens, self.page_size)
        v, _ = gather_pages(v_pages, self.kv_indptr, used, lens, self.page_size)
        seq = torch.tensor(lens, device=q.device)
        return self._reference(q, k, v, sm_scale=scale, seq_lens=seq, out=out, return_lse=return_lse)


def launch_plain(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, sm_scale: float,
                 out: torch.Tensor, lse: torch.Tensor) -> None:
    """Run a compiled attention over contiguous ``k, v [batch, kv_heads, C, head_dim]`` with device
    lengths ``lens`` (int32 [batch], 0 allowed) into ``out``/``lse`` through its ``plan_launch`` and
    ``run``, skipping the host-side checks of its ``__call__`` (which read the lengths): no host
    synchronisation."""
    launch = attn.plan_launch(q.dtype, q.shape[0], k.shape[2], q.device, has_lens=True)
    attn.run(launch, q, k, v, out, lse, sm_scale, seq_lens=lens)
