"""Page tables and page pools (FlashInfer's conventions: foldc/serving/paged.py's docstring): the host checks of a
table (`check_page_table`), its contiguous gather for checks and the float64 target (`gather_pages`), and a pool's
storage (`page_pool`)."""
from __future__ import annotations

import reprlib
from dataclasses import dataclass

import torch

from ..backends.triton.paging import check_page_size
from ..encoding import AffineTensor
from ..errors import InputError, InputTypeError, SpecError
from ..spec import AttentionSpec
from .inputs import check_readable


@dataclass(frozen=True)
class PageTable:
    """What ``plan`` learned about a batch layout (host values)."""

    batch: int
    num_pages: int            # pages in the pool the table points into
    page_size: int
    seq_lens: tuple[int, ...]  # tokens per sequence
    pages: tuple[int, ...]     # page-table entries per sequence
    max_seq_len: int | None = None   # most tokens a run reads per sequence (the wrapper's), None: no such bound

    @property
    def headroom(self) -> int:
        """Tokens every sequence can still append into the pages it owns and a run still reads: within
        ``max_seq_len`` too, where the split partition ends (a run cut a longer sequence there, silently)."""
        most = [p * self.page_size if self.max_seq_len is None else min(p * self.page_size, self.max_seq_len)
                for p in self.pages]
        return min(m - n for m, n in zip(most, self.seq_lens))


def _int_tensor(name: str, x, shape_text: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{name} must be an int32 torch.Tensor {shape_text}, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64) or x.dim() != 1:
        raise InputError(f"{name} must be a 1-D int32 tensor {shape_text}; got dtype={x.dtype}, "
                         f"shape={tuple(x.shape)}")
    return check_readable(name, x, f"int32 tensor {shape_text}")


def _host_lengths(seq_lens) -> list[int]:
    """``seq_lens`` of `check_page_table` as host ints: a list or 1-D tensor of integers (a float such
    as 16.5 would be truncated to a length nobody asked for, so it is refused)."""
    if seq_lens is None or isinstance(seq_lens, (str, bytes)):
        raise InputTypeError(f"seq_lens={seq_lens!r}: with kv_last_page_len=None, pass seq_lens, one integer "
                             "token count per sequence (a list of ints or an integer tensor [batch])")
    try:
        lens = torch.as_tensor(seq_lens)
    except (TypeError, ValueError, RuntimeError):
        raise InputTypeError(f"seq_lens={seq_lens!r} must be a list of ints or an integer tensor [batch]") from None
    check_readable("seq_lens", lens, "integer tensor [batch] (or a list of ints)")
    if lens.dtype.is_floating_point or lens.dtype.is_complex or lens.dtype == torch.bool or lens.dim() != 1:
        raise InputError(f"seq_lens dtype={lens.dtype} shape={tuple(lens.shape)} must be one integer token count "
                         "per sequence, shape [batch]; pass ints (e.g. [int(n) for n in lengths])")
    return [int(n) for n in lens.tolist()]


def check_page_table(kv_indptr, kv_indices, kv_last_page_len, num_pages: int, page_size: int,
                     seq_lens=None, shared: bool = False) -> PageTable:
    """Validate a page table on the host; every error names the value and the fix. With
    ``kv_last_page_len=None``, ``seq_lens`` gives the lengths instead, and a sequence may own
    pages past its last token (reserved for appends). ``shared``: a page may be listed more than once (a prefix
    several sequences read) where every entry naming it is a full page before its sequence's last token, which no
    append at the sequence's end writes; otherwise every entry names a page of its own."""
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise SpecError(f"num_pages={num_pages!r} must be a positive integer (pages in the pool)")
    if kv_last_page_len is not None and seq_lens is not None:   # (one would be ignored)
        raise InputError(f"kv_last_page_len and seq_lens={reprlib.repr(seq_lens)} both give the lengths; pass one: "
                         "kv_last_page_len (tokens in each last page), or seq_lens with kv_last_page_len=None "
                         "(sequences may then own pages reserved for appends)")
    indptr = _int_tensor("kv_indptr", kv_indptr, "[batch + 1]").cpu().tolist()
    indices = _int_tensor("kv_indices", kv_indices, "[kv_indptr[-1]]").cpu()
    if kv_last_page_len is None:
        last, last_name = _host_lengths(seq_lens), "seq_lens"
    else:
        last = _int_tensor("kv_last_page_len", kv_last_page_len, "[batch]").cpu().tolist()
        last_name = "kv_last_page_len"
    batch = len(indptr) - 1
    if batch < 1:
        raise InputError(f"kv_indptr has {len(indptr)} entries; it needs batch + 1 >= 2 (starting at 0)")
    if len(last) != batch:
        raise InputError(f"{last_name} has {len(last)} entries but kv_indptr describes batch={batch} "
                         f"sequences; pass one {'length' if kv_last_page_len is None else 'last-page length'} "
                         "per sequence")
    if indptr[0] != 0:
        raise InputError(f"kv_indptr[0]={indptr[0]}; it must start at 0")
    pages = [indptr[b + 1] - indptr[b] for b in range(batch)]
    if any(p < 0 for p in pages):
        b = next(b for b, p in enumerate(pages) if p < 0)
        raise InputError(f"kv_indptr decreases at sequence {b} ({indptr[b]} -> {indptr[b + 1]}); it must be "
                         "non-decreasing (a prefix sum of pages per sequence)")
    if indptr[-1] != indices.numel():
        raise InputError(f"kv_indptr[-1]={indptr[-1]} but kv_indices holds {indices.numel()} entries; they must "
                         "match")
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_pages:
            bad = lo if lo < 0 else hi
            where = int(((indices < 0) | (indices >= num_pages)).nonzero()[0])
            raise InputError(f"kv_indices[{where}]={bad} points outside the pool of num_pages={num_pages}; every "
                             f"page index must lie in [0, {num_pages - 1}]")
    if kv_last_page_len is None:
        for b in range(batch):
            if not 0 <= last[b] <= pages[b] * page_size:
                raise InputError(f"seq_lens[{b}]={last[b]} but sequence {b} owns {pages[b]} pages of "
                                 f"page_size={page_size} tokens; give it more pages in kv_indices")
        lens = list(last)
    else:
        lens = []
        for b in range(batch):
            n = last[b]
            if pages[b] == 0 and n != 0:
                raise InputError(f"sequence {b} owns no page but kv_last_page_len[{b}]={n}; it must be 0")
            if not 0 <= n <= page_size:
                raise InputError(f"kv_last_page_len[{b}]={n} must lie in [0, page_size={page_size}]")
            lens.append((pages[b] - 1) * page_size + n if pages[b] else 0)
    if indices.numel():
        _check_shared_pages(indices, pages, lens, page_size, shared)
    return PageTable(batch, num_pages, page_size, tuple(lens), tuple(pages))


def _check_shared_pages(indices: torch.Tensor, pages: list[int], lens: list[int], page_size: int,
                        shared: bool) -> None:
    """Refuse a page listed more than once, unless ``shared`` and every entry naming it is a full page before its
    sequence's last token (read by each, written by none: an append at a sequence's end lands past it)."""
    values, counts = torch.unique(indices, return_counts=True)
    if bool((counts == 1).all()):
        return
    twice = values[counts > 1]
    listed = torch.isin(indices, twice)
    if not shared:
        where = int(listed.nonzero()[0])
        raise InputError(f"kv_indices lists page {int(indices[where])} more than once; every page-table entry of "
                         "this cache must name a page of its own (its appends write them); a PagedDecodeWrapper "
                         "takes a prefix of full pages shared by several sequences")
    seq = torch.repeat_interleave(torch.arange(len(pages)), torch.tensor(pages))
    starts = torch.tensor([0] + pages[:-1]).cumsum(0)
    page_end = (torch.arange(indices.numel()) - starts[seq] + 1) * page_size   # tokens up to each entry's end
    bad = listed & (page_end > torch.tensor(lens)[seq])
    if bool(bad.any()):
        where = int(bad.nonzero()[0])
        b, page = int(seq[where]), int(indices[where])
        raise InputError(f"kv_indices[{where}] lists page {page} again, as entry {where - int(starts[b])} of "
                         f"sequence {b}, which holds {lens[b]} tokens: a page listed more than once must be full "
                         f"before each of its sequences' last tokens ({page_size} tokens each), a prefix they only "
                         "read; give the partly filled page of each sequence a page of its own")


def gather_pages(pool, kv_indptr, kv_indices, seq_lens, page_size: int):
    """The paged cache as contiguous storage: ``[batch, kv_heads, max_tokens, ...]`` with sequence b's
    pages in order (padded with its last page's rows, or page 0 when it has none). For checks and
    the reference target (host loop: not for the hot path). Returns (contiguous operand, lengths).
    The table is checked as `PagedDecodeWrapper.plan` checks it (a page index of -1 read the pool's last page)."""
    if not isinstance(pool, (AffineTensor, torch.Tensor)) or len(pool.shape) != 4:
        raise InputTypeError(f"pool must be a page pool [num_pages, kv_heads, page_size, head_dim] (an AffineTensor "
                             f"or a tensor), got {type(pool).__name__} {tuple(getattr(pool, 'shape', ()))}")
    if pool.shape[2] != page_size:
        raise InputError(f"pool holds pages of {pool.shape[2]} tokens but page_size={page_size}; pass the pool's "
                         "page size")
    check_page_table(kv_indptr, kv_indices, None, pool.shape[0], page_size, seq_lens, shared=True)
    indptr = kv_indptr.cpu().tolist()
    indices = kv_indices.cpu().tolist()
    batch = len(indptr) - 1
    most = max(1, max(indptr[b + 1] - indptr[b] for b in range(batch)))
    table = []
    for b in range(batch):
        own = indices[indptr[b]:indptr[b + 1]] or [0]
        table.append(own + [own[-1]] * (most - len(own)))
    rows = torch.tensor(table, dtype=torch.long, device=_device(pool))

    def flat(t):  # [pages, H, R, X] -> [batch, H, most * R, X]
        g = t[rows.reshape(-1)].reshape(batch, most, *t.shape[1:])
        return g.permute(0, 2, 1, 3, 4).reshape(batch, t.shape[1], most * t.shape[2], t.shape[3]).contiguous()

    if isinstance(pool, AffineTensor):
        out = AffineTensor(flat(pool.codes), flat(pool.scale), flat(pool.zero), pool.encoding, pool.head_dim)
    else:
        out = flat(pool)
    return out, torch.as_tensor(seq_lens)


def page_pool(spec: AttentionSpec, name: str, num_pages: int, page_size: int, *, dtype: torch.dtype = torch.float16,
              device="cpu"):
    """Zeroed storage for one operand (``name`` "k" or "v"): an `AffineTensor` of ``num_pages`` pages
    encoded as ``spec.<name>`` (scale/zero in the encoding's scale dtype), or a plain
    ``[num_pages, kv_heads, page_size, head_dim]`` tensor of ``dtype`` when that encoding is None."""
    from ..encoding import scale_shape

    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"spec must be a foldc.AttentionSpec, got {type(spec).__name__}")
    if name not in ("k", "v"):
        raise SpecError(f"name={name!r} must be 'k' or 'v' (the operand whose encoding the pool holds)")
    check_page_size(spec, page_size)
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise SpecError(f"num_pages={num_pages!r} must be a positive integer")
    enc, h, d = getattr(spec, name), spec.num_kv_heads, spec.head_dim
    if enc is None:
        return torch.zeros(num_pages, h, page_size, d, dtype=dtype, device=device)
    shape = scale_shape(enc, num_pages, h, page_size, d)
    return AffineTensor(torch.zeros(num_pages, h, page_size, d // enc.codes_per_byte, dtype=torch.uint8,
                                    device=device),
                        torch.zeros(shape, dtype=enc.scale_dtype, device=device),
                        torch.zeros(shape, dtype=enc.scale_dtype, device=device), enc, d)


def _device(x) -> torch.device:
    return x.codes.device if isinstance(x, AffineTensor) else x.device
