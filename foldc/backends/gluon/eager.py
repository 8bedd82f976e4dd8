"""Eager calls of `GluonAttention` whose launches are bound: one memo lookup instead of the whole call path.

An eager call of the register-operand kernel validates q, k and v (`foldc.validate.check_call`, the layout checks
of `GluonAttention.__call__`), finds its memoised launch plan and its stream's buffers, builds the key of its bound
launches (`binding_key`: shapes, strides, dtypes) and reads every tensor's address. From the second call with one
launch the launches are bound, and on the H200 the rest of that path cost about as much host time as the two
launches themselves (docs/perf.md). `EagerCalls` keeps, per shape of call, what that path found once it was bound:
the launch, the stream's workspace and lse, the two bound launches and the buffers' addresses.

A call finds its entry by a key made of what the whole path checked and what fixes the launch: q's dtype, shape
and strides, k's and v's code shapes (contiguous sides: their strides and the scales' shapes follow; an
`AffineTensor` checks its scales' shape, dtype and device when it is built), the output's shape, strides and dtype
(or none), the softmax scale, the device and the current stream. What the key cannot hold is checked per call:
the objects' exact types, the spec's encodings (by identity), every side's contiguity and device, no CUDA-graph
capture. Anything else (lengths, a returned lse, plain sides, other encodings objects, the warpgroup template, an
`sm_scale` that is not a float, a misaligned tensor: the bound launch declines) takes the whole path, which
validates and refuses by name as before. Entries are made only from calls that path took and bound."""
from __future__ import annotations

import torch

from ...encoding import AffineTensor
from ..runtime.launch import RAW_STREAM, STREAM_CAPTURING
from ..runtime.merge import launch_merge

_DATA_PTR = torch.Tensor.data_ptr
_TENSOR = torch.Tensor
_DEVICE = torch.Tensor.get_device   # a CUDA device's index, -1 off the GPU
_CAPTURING = STREAM_CAPTURING
_STREAM = RAW_STREAM
MOST = 16   # entries per callable (each holds a workspace): a serving loop uses one or two shapes at a time


def _key(q, k, v, sm_scale, out):
    """The memo key of a call, or None where the call cannot take the memo (see the module doc)."""
    if type(q) is not _TENSOR or type(k) is not AffineTensor or type(v) is not AffineTensor:
        return None
    if sm_scale is not None and type(sm_scale) is not float:
        return None
    device = _DEVICE(q)
    if device < 0 or _STREAM is None or _CAPTURING is None:
        return None
    if out is None:
        held = None
    elif type(out) is _TENSOR and _DEVICE(out) == device:
        held = (out.shape, out.stride(), out.dtype)
    else:
        return None
    return (q.dtype, q.shape, q.stride(), k.codes.shape, v.codes.shape, held, sm_scale, device, _STREAM(device))


class EagerCalls:
    """`GluonAttention`'s memo of bound eager calls (module doc)."""

    __slots__ = ("_held",)

    def __init__(self):
        self._held: dict = {}

    def run(self, attn, q, k, v, sm_scale, out):
        """The call's output where its entry is held and its bound launches took it, else None (nothing launched:
        the caller takes the whole path)."""
        key = _key(q, k, v, sm_scale, out)
        entry = self._held.get(key) if key is not None else None
        if entry is None:
            return None
        spec = attn.spec
        kc, ks, kz, vc, vs, vz = k.codes, k.scale, k.zero, v.codes, v.scale, v.zero
        if (k.encoding is not spec.k or v.encoding is not spec.v or not kc.is_contiguous() or not ks.is_contiguous()
                or not kz.is_contiguous() or not vc.is_contiguous() or not vs.is_contiguous()
                or not vz.is_contiguous() or _DEVICE(kc) != key[7] or _DEVICE(vc) != key[7] or _CAPTURING()):
            return None
        decode, merge, tokens, fixed, workspace, lse, rows, modules = entry
        if attn._modules is not modules:   # its kernels were swapped since
            return None
        if out is None:   # contiguous as the whole path's (torch.empty_like of a contiguous q: half the host time)
            out = torch.empty_like(q) if q.is_contiguous() else torch.empty(q.shape, device=q.device, dtype=q.dtype)
        qa = q.data_ptr()
        if merge is None:   # the decode merges its splits itself (split_merge.py): one launch
            if not decode((qa, kc.data_ptr(), ks.data_ptr(), kz.data_ptr(), vc.data_ptr(), vs.data_ptr(),
                           vz.data_ptr(), qa, *fixed[0], out.data_ptr(), fixed[1], fixed[2]), tokens):
                return None
            return out
        launched = decode.then((qa, kc.data_ptr(), ks.data_ptr(), kz.data_ptr(), vc.data_ptr(), vs.data_ptr(),
                                vz.data_ptr(), qa, *fixed[0], qa, qa, qa), tokens, merge,
                               (*fixed[0], out.data_ptr(), fixed[1]))
        if not launched:
            return None
        if launched == 1:   # the merge's bound launch declined
            launch_merge(attn._launchers()[1], *workspace, out, lse, rows, head_rows=attn.config.head_rows)
        return out

    def note(self, attn, launch, q, k, v, sm_scale, out, workspace, lse, binding_key) -> None:
        """After the whole path ran ``launch`` for a call (``sm_scale`` and ``out`` as the caller gave them): hold
        its entry once its launches are bound (``binding_key(merging)``: their key in ``attn._bindings``, of a
        launch that merges its splits itself or not)."""
        key = _key(q, k, v, sm_scale, out)
        if key is None or key in self._held or launch.kernel != "gluon" or launch.page or launch.has_lens:
            return
        if k.encoding is not attn.spec.k or v.encoding is not attn.spec.v:
            return
        merging = attn.merges_inside(launch.options, q, launch.splits, out is None or out.is_contiguous())
        state = attn._bindings.get(binding_key(merging), launch.options)
        if type(state) is not tuple or len(state) != (1 if merging else 2):
            return
        if len(self._held) >= MOST:
            self._held.clear()
        rows = attn.config.q_per_kv * launch.options["heads"]
        fixed = (tuple(map(_DATA_PTR, workspace)), lse.data_ptr())
        if merging:   # the stream's barrier too (held by the launcher for as long as this entry)
            fixed += (attn.barrier(q, q.shape[0] * attn.head_programs(launch.options)).data_ptr(),)
        self._held[key] = (state[0], state[1] if not merging else None, (launch.cache_tokens,), fixed, workspace, lse,
                           rows, attn._modules)

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
