"""`FoldLinear`: an ``nn.Linear`` whose weight is affine-quantized, computed by foldc's GEMM plan.

    layer = foldc.nn.FoldLinear.from_linear(linear, weight="k-group:4:128")   # quantize an nn.Linear
    layer = foldc.nn.FoldLinear(weight, encoding, bias)                        # already quantized, e.g.
                                                                              # foldc.gemm.convert.from_gptq(...)
    layer = foldc.nn.FoldLinear(weight, encoding, bias, input_order=order)     # act-order GPTQ:
                                                                              # from_gptq_act_order(...)
    y = layer(x)                                                               # x [..., in_features]

The layer's plan (``GemmSpec(out_features, in_features, weight=encoding)``) is planned and proved
when the layer is built (`foldc.prove`: a plan that is not exact is refused there). The forward runs
``torch.ops.foldc.linear``, a custom op with a fake implementation, so torch.compile and CUDA graphs
see one op: on a GPU the generated GEMM kernel, on the CPU Triton's interpreter (fp16 inputs) or the
float64 plan executor (other dtypes), cast to the input's dtype. An eager GPU call that the
register-operand GEMV takes (up to 16 rows of fp16/bf16, no autograd, nothing tracing) launches the
kernel from the layer instead: the same kernel and launch, without the custom op's dispatch and the
per-call checks of the weight (about 200 of an eager call's 230 µs of host time on the H200,
benchmarks/linear_host.py). Gradients flow to x (and to a bias given to the op that requires one):
``grad @ W`` with W dequantized in float32, so adapters (LoRA) beside a quantized layer train; the weight
itself is a constant.
"""
from __future__ import annotations

import functools

import torch

from . import linear_state
from .backends.runtime.launch import RAW_STREAM, STREAM_CAPTURING
from .encoding import AffineTensor
from .errors import InputError, InputTypeError, SpecError
from .gemm.reference import quantize_2d
from .gemm.spec import GemmEncoding, GemmSpec, parse_gemm_encoding


@functools.lru_cache(maxsize=None)
def _proved(spec: GemmSpec):
    """The spec's plan, proved exact once per spec (a model's layers share a few)."""
    from .plan import plan
    from .proof import prove

    the_plan = plan(spec)
    prove(the_plan)
    return the_plan


@functools.lru_cache(maxsize=None)
def _gemm(out_features: int, in_features: int, encoding: str, target: str):
    from .compile import compile as compile_gemm

    return compile_gemm(GemmSpec(out_features, in_features, weight=parse_gemm_encoding(encoding, "weight")), target)


EAGER_ENTRIES = 64   # a layer's eager launches kept at once, per (rows, dtype, device)


_TENSOR = torch.Tensor
_DEVICE = torch.Tensor.get_device   # a CUDA tensor's device index
_DISPATCH_DEPTH = torch._C._len_torch_dispatch_stack
_STREAM = RAW_STREAM
_CAPTURING = STREAM_CAPTURING
# (device index, stream) -> the float32 split-k workspace and the int32 split-k counters (zero between calls) every
# layer's eager calls on that stream share: calls on one stream run in order, so each may overwrite the partials
# of the one before and finds the counters at zero; calls on two streams, which may run at once, never share them
# (a layer's own `gemv_counters` serve its traced and captured calls)
_STREAM_BUFFERS: dict = {}


def _capturing(device: int) -> bool:
    return device >= 0 and _CAPTURING is not None and _CAPTURING()


def _stream_of(device: int) -> int:
    return _STREAM(device) if device >= 0 else 0


def _stream_buffers(device: torch.device, index: int, floats: int, blocks: int) -> tuple:
    """(workspace, counters) of ``device``'s current stream, grown to ``floats`` float32 partials and ``blocks``
    counters (a grown pair is a new tuple: fast paths holding the old one see that and take the whole path once)."""
    key = (index, _stream_of(index))
    held = _STREAM_BUFFERS.get(key)
    if held is None or held[0].numel() < floats or held[1].numel() < blocks:
        part = held[0] if held is not None and held[0].numel() >= floats else \
            torch.empty(floats, dtype=torch.float32, device=device)
        counters = held[1] if held is not None and held[1].numel() >= blocks else \
            torch.zeros(blocks, dtype=torch.int32, device=device)
        held = _STREAM_BUFFERS[key] = (part, counters)
    return held


def _traced() -> bool:
    """Whether torch is tracing the call (torch.compile, export, make_fx, a fake or functional tensor
    mode): then it must go through the custom op, whose fake implementation the tracer sees."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


@functools.lru_cache(maxsize=None)
def _parsed_weight(encoding: str):
    """The GemmEncoding of an encoding's text, parsed once per text, not at every call of the op (a model makes
    about a hundred a token)."""
    enc = parse_gemm_encoding(encoding, "weight")
    if enc is None:   # ('none', '': a plain weight, which the op's codes, scale and zero cannot be)
        raise SpecError(f"encoding={encoding!r} names a plain weight; the op multiplies by a quantized one: pass its "
                        "encoding, e.g. 'k-group:4:128' (FoldLinear.encoding.short())")
    return enc


@functools.lru_cache(maxsize=None)
def _weight_encoding(encoding: str, k: int):
    """(GemmEncoding, its Affine over k) for an encoding's text, once per text and k."""
    enc = _parsed_weight(encoding)
    return enc, enc.affine(k)


_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_floating(x: torch.Tensor) -> None:
    """Refuse an x of another dtype than ``_X_DTYPES`` (an integer or bool x: the op's float result cast back to x's
    dtype would be truncated; an fp8 one: torch adds no bias in fp8 on the CPU, and the GPU kernels take none) or a
    sparse one."""
    if x.dtype not in _X_DTYPES:
        raise InputError(f"x dtype={x.dtype}: FoldLinear takes floating-point activations (float16, bfloat16, float32 "
                         "or float64), as nn.Linear does; cast x")
    _check_dense(x)


def _check_dense(x: torch.Tensor) -> None:
    if x.layout != torch.strided:
        raise InputError(f"x is a {x.layout} tensor: FoldLinear takes dense activations; pass x.to_dense()")


def _check_op_bias(bias: torch.Tensor | None, out_features: int, x: torch.Tensor) -> None:
    """Refuse a bias of the op that is not a floating-point [out_features] tensor on x's device: added to the
    [m, out_features] output, it would broadcast (a [2, m, out_features] bias made a 3-D output where the fake says
    [m, out_features]), and cast to x's dtype (a complex bias lost its imaginary part; a meta one added uninitialised
    memory)."""
    if bias is None:
        return
    if tuple(bias.shape) != (out_features,):
        raise InputError(f"bias shape={tuple(bias.shape)} but the op adds one bias per output channel: pass a "
                         f"[{out_features}] tensor (out_features={out_features}) or None")
    _check_bias_dtype(bias, "bias")
    if bias.device != x.device:
        raise InputError(f"bias is on {bias.device} but x is on {x.device}; move it there (a bias on the meta device "
                         "holds no values: load it first)")


def _op_weight(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, encoding: str,
               out_features: int) -> AffineTensor | None:
    """The op's weight, checked against x [m, in_features] and out_features at any m (the real op and its fake
    alike: a call of no rows returned [0, out_features] for any weight)."""
    enc = _parsed_weight(encoding)
    if x.dim() != 2:
        raise InputError(f"x shape={tuple(x.shape)}: the op takes x [m, in_features]; reshape it (FoldLinear does)")
    per_byte = 8 // enc.bits
    if codes.dim() != 4 or tuple(codes.shape[:2]) != (1, 1):
        raise InputError(f"codes shape={tuple(codes.shape)}: the op takes the weight's codes as [1, 1, out_features, "
                         f"in_features / {per_byte}] ({enc.short()}; FoldLinear.codes)")
    if codes.device != x.device:   # (scale and zero are checked against the codes by AffineTensor)
        raise InputError(f"the weight (codes) is on {codes.device} but x is on {x.device}; move the weight's codes, "
                         "scale and zero to x's device (a weight on the meta device holds no values: load it first)")
    n, k = codes.shape[2], codes.shape[3] * per_byte
    if (n, k) != (out_features, x.shape[1]):
        raise InputError(f"codes shape={tuple(codes.shape)} hold a [{n}, {k}] weight ({enc.short()}) but the call has "
                         f"out_features={out_features} and x [m, {x.shape[1]}]: pass out_features={n} and x [m, {k}]")
    if not isinstance(k, int):   # a trace with the weight's shapes symbolic (the fake): nothing more to check here
        return None              # that the real op will not (its encoding memo is keyed by plain integers)
    _, affine = _weight_encoding(encoding, k)
    return AffineTensor(codes, scale, zero, affine, k)


@torch.library.custom_op("foldc::linear", mutates_args=())
def linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
           bias: torch.Tensor | None, encoding: str, out_features: int,
           counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x [m, k] @ W.T (+ bias)`` with W the ``[out_features, k]`` weight encoded as ``encoding``
    (`GemmEncoding.short`), stored as ``codes``/``scale``/``zero`` of its AffineTensor [1, 1, n, k].
    ``counters``: int32 zeros for the GPU GEMV's split-k (left at zero; `FoldLinear` owns them), so that
    the kernel holds no memory between calls (CUDA-graph trees refuse memory a step keeps)."""
    _check_floating(x)
    _check_op_bias(bias, out_features, x)
    w = _op_weight(x, codes, scale, zero, encoding, out_features)
    if x.shape[0] == 0:
        y = x.new_zeros(0, out_features)
    else:
        target = "auto" if x.is_cuda else "interpret" if x.dtype == torch.float16 else "reference"
        kernel = _gemm(out_features, w.head_dim, encoding, target)
        extra = {"counters": counters} if counters is not None and x.is_cuda else {}
        y = kernel(x.contiguous(), w, **extra).to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


@linear.register_fake
def _(x, codes, scale, zero, bias, encoding, out_features, counters=None):
    _check_floating(x)   # a bad encoding or weight fails at trace time too, as does an integer x
    _check_op_bias(bias, out_features, x)
    _op_weight(x, codes, scale, zero, encoding, out_features)
    return x.new_empty(x.shape[0], out_features)


_GRAD_ROWS_VALUES = 1 << 24   # the backward dequantizes the weight this many values at a time


def _setup_backward(ctx, inputs, output):
    x, codes, scale, zero, bias, encoding, _out_features, _counters = inputs
    ctx.save_for_backward(codes, scale, zero)
    ctx.encoding, ctx.k, ctx.x_dtype = encoding, x.shape[-1], x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    """The gradient of ``x @ W.T + bias`` for x (``grad @ W``, W dequantized in row blocks in float32, or
    float64 for a float64 gradient, and the product cast to x's dtype) and for a bias that requires one. The
    weight's codes, scales and zeros are the quantized model's constants: they get none (a LoRA adapter beside
    the layer trains; the layer does not)."""
    codes, scale, zero = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        # (a trace with symbolic shapes: the weight's in and out features are a layer's constants, taken as such)
        k, n = int(ctx.k), int(codes.shape[2])
        _, affine = _weight_encoding(ctx.encoding, k)
        dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
        g = grad.to(dtype)
        step = max(1, _GRAD_ROWS_VALUES // k)
        for r in range(0, n, step):
            rows = slice(r, min(n, r + step))
            w = AffineTensor(codes[:, :, rows], scale[:, :, rows], zero[:, :, rows], affine, k)
            part = g[:, rows] @ w.dequantize(dtype)[0, 0]
            grad_x = part if grad_x is None else grad_x + part
        grad_x = grad_x.to(ctx.x_dtype)
    if ctx.needs_input_grad[4]:
        grad_bias = grad.sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, grad_bias, None, None, None


linear.register_autograd(_backward, setup_context=_setup_backward)


class FoldLinear(torch.nn.Module):
    """``y = x @ W.T + bias`` with ``W`` an affine-quantized ``[out_features, in_features]`` weight
    (module doc). ``weight``: an `AffineTensor` [1, 1, out_features, in_features] encoded as
    ``encoding`` (a `GemmEncoding` or its text, e.g. ``"k-group:4:128"``); ``bias``: [out_features] or
    None; ``input_order``: None, or a permutation of the input channels (int [in_features]) the layer gathers x by
    first, ``y = x[..., input_order] @ W.T + bias`` (act-order checkpoints, `foldc.gemm.convert.from_gptq_act_order`).
    The weight's tensors are buffers (they move with ``.to()`` and are saved in the state dict).

    The state dict also records the weight's encoding, shape and whether the layer has an input order, under
    ``_extra_state`` (`foldc.linear_state`: JSON text in a uint8 tensor, so a state dict stays all tensors). A load
    whose record names another encoding is refused, naming both (tensors of two encodings can have the same shapes:
    4-bit in groups of 128 over 256 inputs, 8-bit in groups of 64 over 128), as is a codes, scale or zero tensor of
    another dtype than the encoding's (the load's copy would convert it). `from_state_dict` builds the layer a state
    dict records. A state dict without the record (saved before foldc wrote one) loads as before, with
    ``strict=True`` too: its tensors' shapes and dtypes are checked, not their encoding; save it again to record it."""

    def __init__(self, weight: AffineTensor, encoding, bias: torch.Tensor | None = None,
                 input_order: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(weight, AffineTensor):
            raise InputTypeError(f"weight must be a foldc.AffineTensor [1, 1, out_features, in_features], got "
                                 f"{type(weight).__name__}; quantize an nn.Linear with FoldLinear.from_linear")
        enc = encoding if isinstance(encoding, GemmEncoding) else parse_gemm_encoding(encoding, "weight")
        if enc is None or enc.kind == "per-token":
            raise SpecError(f"encoding={encoding!r}: a FoldLinear weight is 'k-group:bits:group' or 'per-channel:bits'")
        b, h, n, k = weight.shape
        if (b, h) != (1, 1):
            raise InputError(f"weight shape={weight.shape}: expected [1, 1, out_features, in_features]")
        if weight.encoding != enc.affine(k):
            raise InputError(f"weight is encoded as {weight.encoding.short()} but encoding={enc.short()!r} needs "
                             f"{enc.affine(k).short()} over in_features={k}")
        self.spec = GemmSpec(n, k, weight=enc)
        self.plan = _proved(self.spec)      # planned and proved exact before the layer exists
        self.in_features, self.out_features, self.encoding = k, n, enc
        self._encoding_text = enc.short()   # the op's argument, made once
        # row-major copies, the layout the kernels read (a weight built from another tool's tensors may be a view),
        # the layer's own: layers built from one placeholder weight shared the memory each load_state_dict copied into;
        # detached, the layer's constants (scales computed under autograd kept its graph, and deepcopy refused them)
        self.register_buffer("codes", weight.codes.detach().clone(memory_format=torch.contiguous_format))
        self.register_buffer("scale", weight.scale.detach().clone(memory_format=torch.contiguous_format))
        self.register_buffer("zero", weight.zero.detach().clone(memory_format=torch.contiguous_format))
        self.register_buffer("bias", _bias(bias, n, weight.codes.device))
        self.register_buffer("input_order", _input_order(input_order, k, weight.codes.device))
        # the GPU GEMV's split-k counters (one per 16 output channels, zero between calls): held here, not
        # by the shared kernel object, so a compiled step's CUDA graph sees every buffer it uses
        self.register_buffer("gemv_counters", torch.zeros(-(-n // 16), dtype=torch.int32, device=weight.codes.device),
                             persistent=False)
        self._eager: dict = {}   # (rows, dtype, device) -> (the buffers it was made for, GEMV launch or None)
        self._fast = None   # the last eager call whose GEMV launch was bound (`forward`'s fast path)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_eager"] = {}   # launchers and compiled kernels: made again after a copy or a load
        state["_fast"] = None
        return state

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .half(), ...: the eager entries hold the old buffers (and would keep a moved layer's
        # GPU memory alive); they are made again for the new ones
        self._eager, self._fast = {}, None
        # a dtype cast of the model (.half(), .float(), .to(torch.bfloat16)) moves the scale and zero with it but
        # keeps their dtype: they are the encoding's (a cast would round them, and the layer refuse them); so does
        # nn.Module.type(dtype), which casts integer tensors too, for the codes, the input order and the counters
        # (made floats, the layer was refused at its next call). fn itself runs on them (``to_empty`` from the meta
        # device makes new tensors, which no copy can)
        buffers = self._buffers
        fixed = {id(buffers.get(name)) for name in ("codes", "scale", "zero", "input_order", "gemv_counters")
                 if buffers.get(name) is not None}
        counters = buffers.get("gemv_counters")

        def keep_dtype(t):
            out = fn(t)
            if id(t) in fixed and out.dtype != t.dtype:
                return t.to(device=out.device)
            if t is counters and out is not t:   # zeros between calls, whatever fn made (to_empty: uninitialised)
                return out.zero_()
            return out
        return super()._apply(keep_dtype, recurse)

    def _record(self) -> dict:
        """The layer's `foldc.linear_state` record: its encoding, shape and whether it has an input order."""
        return linear_state.layer_record(self.encoding, self.in_features, self.out_features,
                                         self._buffers.get("input_order") is not None)

    def get_extra_state(self) -> torch.Tensor:
        """The state dict's ``_extra_state``: the layer's record as JSON text in a uint8 tensor (`foldc.linear_state`),
        made when the state dict is (the forward never reads it)."""
        return linear_state.record_tensor(self._record())

    def set_extra_state(self, state) -> None:
        """Check a loaded ``_extra_state`` against the layer (its encoding is fixed when it is built): refused,
        naming both encodings, where the state dict's tensors would mean another weight here."""
        saved = linear_state.read_record(state, linear_state.KEY)
        if saved is not None:
            linear_state.check_same_meaning(saved, self._record(), linear_state.KEY)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # the record first (the clearest message: both encodings), then each tensor's dtype, before any change
        float_weight = state_dict.get(prefix + "weight")
        if isinstance(float_weight, torch.Tensor):
            # an nn.Linear's checkpoint (the model's float weights loaded after quantize_model): with strict=False the
            # weight was dropped as an unexpected key, and the layer kept the codes of the weights it was built from
            raise InputError(f"{prefix}weight: the state dict holds an nn.Linear's float weight "
                             f"{list(float_weight.shape)}, which a FoldLinear (codes, scale and zero) does not load; "
                             "load the float weights into the model before quantize_model (or FoldLinear.from_linear), "
                             "or load a FoldLinear's state dict")
        key = prefix + linear_state.KEY
        if key in state_dict:
            saved = linear_state.read_record(state_dict[key], key)
            if saved is not None:
                linear_state.check_same_meaning(saved, self._record(), key)
        elif isinstance(state_dict.get(prefix + "input_order"), torch.Tensor) and self._buffers["input_order"] is None:
            # a state dict without a record (an older one) of an act-order layer: with strict=False the order was
            # dropped as an unexpected key, and x multiplied by columns in another order
            raise InputError(f"{prefix}input_order: the state dict is an act-order layer's (x gathered by an input "
                             "order) but this FoldLinear has none; build it with FoldLinear(weight, encoding, bias, "
                             "input_order=...) before the load")
        # load_state_dict copies into the buffers with a cast (or, with assign=True, puts the tensors in as they
        # are): a state dict of another encoding's scale dtype would be rounded into this one's, codes of another
        # dtype wrapped, an input order that is no permutation gathered as it came. Refused, before any change.
        want = {"codes": torch.uint8, "scale": self.encoding.scale_dtype, "zero": self.encoding.scale_dtype}
        for name, dtype in want.items():
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.dtype != dtype:
                raise InputError(f"{prefix + name} dtype={t.dtype} but this layer ({self.encoding.short()}) stores "
                                 f"{dtype}: the state dict is another encoding's; build the layer with that one")
        bias = state_dict.get(prefix + "bias")
        if isinstance(bias, torch.Tensor):
            _check_bias_dtype(bias, prefix + "bias")
        order = state_dict.get(prefix + "input_order")
        if isinstance(order, torch.Tensor) and self._buffers.get("input_order") is not None:
            try:
                _input_order(order, self.in_features, order.device)
            except InputError as e:
                raise InputError(f"{prefix}input_order of the state dict: {e}") from None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key in missing_keys:   # a state dict saved before the record: loaded, as it was then (class doc)
            missing_keys.remove(key)
        if local_metadata.get("assign_to_params_buffers", False):
            # assign=True put the state dict's tensors in as they are: row-major copies (the layout the kernels
            # read), and the split-k counters (outside the state dict) beside the codes, e.g. off the meta device
            buffers = self._buffers
            for name in ("codes", "scale", "zero"):
                buffers[name] = buffers[name].contiguous()
            if buffers["gemv_counters"].device != buffers["codes"].device:
                buffers["gemv_counters"] = torch.zeros_like(buffers["gemv_counters"], device=buffers["codes"].device)
            self._eager, self._fast = {}, None

    @classmethod
    def from_state_dict(cls, state_dict, prefix: str = "") -> "FoldLinear":
        """The layer a FoldLinear's state dict records (its ``<prefix>_extra_state``: encoding, shape, input order),
        holding that state dict's tensors (copies, on their device). Refused by name: a state dict without the record
        (saved before foldc wrote one: build ``FoldLinear(weight, encoding)`` and load it) or without a tensor the
        record needs."""
        key = prefix + linear_state.KEY
        if key not in state_dict:
            raise InputError(f"the state dict has no {key!r} (a FoldLinear's record of its encoding; one saved before "
                             "foldc wrote it has none): build the layer with FoldLinear(weight, encoding) or "
                             "FoldLinear.from_linear(linear, weight=...) and load the state dict into it")
        record = linear_state.read_record(state_dict[key], key)
        if record is None:
            raise InputError(f"{key} is on the meta device (a state dict of placeholders): load the saved one")
        enc, k = linear_state.record_encoding(record), record["in_features"]
        names = ["codes", "scale", "zero"] + (["input_order"] if record["input_order"] else [])
        missing = [prefix + name for name in names if not isinstance(state_dict.get(prefix + name), torch.Tensor)]
        if missing:
            raise InputError(f"the state dict records a {linear_state.describe(record)} layer but does not hold "
                             f"{missing[0]!r}: pass the layer's whole state dict")
        get = lambda name: state_dict[prefix + name]  # noqa: E731
        try:
            weight = AffineTensor(get("codes"), get("scale"), get("zero"), enc.affine(k), k)
        except InputError as e:
            raise InputError(f"{prefix}codes, scale and zero: the state dict's tensors do not fit its record "
                             f"({linear_state.describe(record)}): {e}") from None
        layer = cls(weight, enc, state_dict.get(prefix + "bias"),
                    input_order=get("input_order") if record["input_order"] else None)
        if layer.out_features != record["out_features"]:
            raise InputError(f"{key} records out_features={record['out_features']} but {prefix}codes holds "
                             f"{layer.out_features} rows: the record is another layer's; pass the layer's state dict")
        return layer

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, weight="k-group:4:128") -> "FoldLinear":
        """``linear`` with its weight quantized as ``weight`` (`foldc.gemm.reference.quantize_2d`:
        min-max per group, the scale and zero in the encoding's dtype)."""
        if not isinstance(linear, torch.nn.Linear):
            raise InputTypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        enc = weight if isinstance(weight, GemmEncoding) else parse_gemm_encoding(weight, "weight")
        if enc is None:
            raise SpecError("weight=None: from_linear quantizes the weight; give an encoding like 'k-group:4:128'")
        w = _linear_weight(linear, "linear")
        GemmSpec(w.shape[0], w.shape[1], weight=enc)   # a layout the plan takes, before the work of quantizing
        return cls(quantize_2d(w.float(), enc), enc, linear.bias)

    @property
    def weight(self) -> AffineTensor:
        return AffineTensor(self.codes, self.scale, self.zero, self.encoding.affine(self.in_features), self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self._buffers["input_order"]
        if order is not None:   # act-order: x's channels in the weight's order first (a new, contiguous x)
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
                got = getattr(x, "shape", type(x).__name__)
                raise InputError(f"x must be a tensor [..., {self.in_features}]; got {got}")
            _check_dense(x)
            x = x.index_select(-1, order)
        fast = self._fast
        if (fast is not None and type(x) is _TENSOR and x.shape == fast[0] and x.stride() == fast[1]
                and x.dtype == fast[2] and not x.requires_grad and _DEVICE(x) == fast[3] and self._holds(fast[4])
                and not _DISPATCH_DEPTH() and (fast[10] is None or (
                    _STREAM_BUFFERS.get((fast[3], _stream_of(fast[3]))) is fast[10] and not _capturing(fast[3])))):
            # shaped as the last eager call, whose GEMV launch was bound (`_eager_gemv`): x's rows as they lie
            # (no reshape), the output made in its final shape, the launch given the addresses alone (a tracer's
            # fake tensors and torch.compile's are not torch.Tensor itself; a dispatch mode takes the whole path)
            out = torch.empty(fast[5], dtype=fast[2], device=fast[6])
            if fast[7]((x.data_ptr(), *fast[8], out.data_ptr(), *fast[9])):
                return out
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            got = getattr(x, "shape", type(x).__name__)
            raise InputError(f"x must be a tensor [..., {self.in_features}]; got {got}")
        _check_dense(x)   # (reshape raised on a sparse x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = None
        if type(x) is torch.Tensor and x.is_cuda and not x.requires_grad and not _traced():
            y = self._eager_gemv(x2, x)
        if y is None:
            y = torch.ops.foldc.linear(x2, self.codes, self.scale, self.zero, self.bias, self._encoding_text,
                                       self.out_features, self.gemv_counters)
        return y.reshape(*lead, self.out_features)

    def _held(self) -> tuple:
        """The buffers an eager launch reads (replaced by ``.to()``, ``.half()``, a load)."""
        buffers = self._buffers
        return buffers["codes"], buffers["scale"], buffers["zero"], buffers["gemv_counters"], buffers["bias"]

    def _holds(self, held: tuple) -> bool:
        """Whether the layer still holds these very buffer objects (by identity: tensors' == compares values)."""
        buffers = self._buffers
        return (buffers["codes"] is held[0] and buffers["scale"] is held[1] and buffers["zero"] is held[2]
                and buffers["gemv_counters"] is held[3] and buffers["bias"] is held[4])

    def _eager_gemv(self, x2: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """An eager GPU call the GEMV takes, launched from here: the op's result without the custom op's
        dispatch and without checking the weight again (it was checked when the layer was built; its
        2-D rows are made once per row count, dtype and device, and again when a buffer is replaced).
        None where the call is not the GEMV's: the op then runs it, or says why it cannot. ``x``: the call's
        input before its reshape to ``x2``; where its launch was bound and the layer has no bias, the layer keeps
        what `forward`'s fast path needs for the next call of its shape (`_fast`)."""
        key = (x2.shape[0], x2.dtype, x2.device)
        buffers = self._buffers
        codes, scale, zero = buffers["codes"], buffers["scale"], buffers["zero"]
        entry = self._eager.get(key)
        if entry is None or entry[0] is not codes or entry[1] is not scale or entry[2] is not zero:
            kernel = _gemm(self.out_features, self.in_features, self._encoding_text, "auto")
            # the buffers as the op sees them (a buffer of another dtype or shape since, e.g. after .half(), is
            # refused there, naming it)
            _, affine = _weight_encoding(self._encoding_text, self.in_features)
            w = AffineTensor(codes, scale, zero, affine, self.in_features)
            found = kernel.gemv_for(key[0], key[1], key[2], w) if hasattr(kernel, "gemv_for") else None
            if len(self._eager) >= EAGER_ENTRIES:   # prompts of many lengths: their entries are all None
                self._eager.clear()
            entry = self._eager[key] = (codes, scale, zero, found)
        if entry[3] is None:
            return None
        gemv, launch, rows = entry[3]
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], self.out_features, device=x2.device, dtype=x2.dtype)
        split, index = launch.grid[1], _DEVICE(x2)
        if _capturing(index):   # the graph keeps the layer's own counters' address, and a workspace of its own
            held, counters, part = None, buffers["gemv_counters"], None
        else:   # the stream's (one split reads neither)
            held = _stream_buffers(x2.device, index, split * launch.m * self.out_features if split > 1 else 1,
                                   launch.grid[0])
            part, counters = held
        bound = gemv.run_rows(launch, x2, *rows, out, counters, part)
        bias = buffers["bias"]
        if (bound is not None and bias is None and x is not None and x2.data_ptr() == x.data_ptr() and x.is_contiguous()
                and (split == 1 or held is not None)):
            # the rows', workspace's and counters' addresses stand for the next calls of x's shape (on this stream
            # where there are several splits: ``held`` is checked there): (x's shape, strides, dtype, device index;
            # the buffers; the output's shape and device; the bound launch; the rows' addresses; the workspace's
            # and counters'; the stream's buffers)
            self._fast = (x.shape, x.stride(), x.dtype, index, self._held(), (*x.shape[:-1], self.out_features),
                          x.device, bound, tuple(t.data_ptr() for t in rows), (part.data_ptr(), counters.data_ptr())
                          if held is not None else (counters.data_ptr(), counters.data_ptr()),
                          held if split > 1 else None)
        return out if bias is None else out.add_(bias.to(out.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight={self.encoding.short()}, "
                f"bias={self.bias is not None}, input_order={self.input_order is not None}, folds={self.plan.folds}")


def _linear_weight(linear: torch.nn.Linear, name: str, then: str = "") -> torch.Tensor:
    """``linear``'s weight detached, refused unless it holds the layer's values: an initialized floating-point
    [out_features, in_features] tensor off the meta device (another quantizer's storage, e.g. bitsandbytes' int8
    codes or packed uint8, would be quantized as if its codes were the weights). ``then`` ends the error's message."""
    if isinstance(linear.weight, torch.nn.parameter.UninitializedParameter):
        raise InputError(f"{name}'s weight is uninitialized (an nn.LazyLinear before its first forward, in_features="
                         f"{linear.in_features}): run the model on an input first, which makes it an nn.Linear{then}")
    w = linear.weight.detach()
    if w.is_meta:
        raise InputError(f"{name}'s weight {tuple(w.shape)} is on the meta device (no values to quantize): load "
                         "its weights first, or build the FoldLinear on the meta device and load a FoldLinear's "
                         "state dict into it")
    if not w.is_floating_point():
        raise InputError(f"{name}'s weight dtype={w.dtype}: foldc quantizes floating-point weights (an integer weight "
                         "is another quantizer's codes, whose scales it does not see); load the float weights, or "
                         f"convert the quantized ones with foldc.gemm.convert{then}")
    if w.element_size() == 1:   # float8 (and float4 pairs): codes whose scales the quantizer keeps apart
        raise InputError(f"{name}'s weight dtype={w.dtype}: an 8-bit float weight is another quantizer's codes (FP8 "
                         "linears keep their scales apart, e.g. weight_scale or weight_scale_inv), which foldc would "
                         f"quantize without them; load the float weights (bf16, fp16 or fp32){then}")
    if tuple(w.shape) != (linear.out_features, linear.in_features):
        raise InputError(f"{name}'s weight shape={tuple(w.shape)} but the linear is {linear.out_features} x "
                         f"{linear.in_features} (out_features x in_features): its weight is stored in another "
                         f"tool's layout; load the float weights{then}")
    return w


def _bias(bias, n: int, device) -> torch.Tensor | None:
    """``bias`` detached and copied (None stays None), refused unless it is a floating-point [n] tensor on the weight's
    device: the output adds it cast to x's dtype (a complex bias lost its imaginary part there, a bool one added 1.0),
    and a bias on the meta device added uninitialised memory to a CPU output."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
        got = getattr(bias, "shape", type(bias).__name__)
        raise InputError(f"bias must be a [{n}] tensor or None; got {got}")
    _check_bias_dtype(bias, "bias")
    if bias.device != device:
        raise InputError(f"bias is on {bias.device} but the weight is on {device}; move it there (a bias on the meta "
                         "device holds no values: load it first)")
    return bias.detach().clone()   # the layer's own (from_linear's linear keeps its bias; a load copies into it)


def _check_bias_dtype(bias: torch.Tensor, name: str) -> None:
    """A bias is floating point, as nn.Linear's: the output adds it cast to x's dtype (a complex bias lost its
    imaginary part there, a bool one added 1.0 where True)."""
    if not bias.is_floating_point():
        raise InputError(f"{name} dtype={bias.dtype} must be floating point, as nn.Linear's; pass bias.float() (or, "
                         "for a complex bias, the real part meant)")


def _input_order(order, k: int, device) -> torch.Tensor | None:
    """``order`` as an int64 permutation of range(k) on ``device`` (a copy), refused unless it is one (None stays
    None)."""
    if order is None:
        return None
    if not isinstance(order, torch.Tensor):
        raise InputTypeError(f"input_order must be a torch.Tensor [{k}] (a permutation of the input channels) or "
                             f"None, got {type(order).__name__}")
    if order.dtype == torch.bool or order.is_floating_point() or order.is_complex() or tuple(order.shape) != (k,):
        raise InputError(f"input_order must be an integer tensor [{k}]; got {order.dtype} {tuple(order.shape)}")
    values = None if order.is_meta else order.to(torch.int64)   # checked where it holds values (not on meta)
    order = order.to(device=device, dtype=torch.int64, copy=True)   # the layer's own (a load copies into it)
    # a layer built on the meta device (a serving engine's model before its weights load) takes a placeholder order:
    # torch.equal has no meta kernel (NotImplementedError from inside torch); its load is checked
    if values is not None and not torch.equal(torch.sort(values).values, torch.arange(k, device=values.device)):
        raise InputError(f"input_order is not a permutation of range({k}): each input channel must appear once")
    return order
