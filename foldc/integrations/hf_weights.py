"""A transformers model's linear layers as `foldc.nn.FoldLinear`: quantized here (`quantize_model`) or loaded from a
GPTQ or AWQ checkpoint's tensors (`load_quantized`). Both are re-exported by `foldc.integrations.hf`.

::

    model = quantize_model(model, weight="k-group:4:128")        # every nn.Linear but lm_head, quantized by foldc

    model = AutoModelForCausalLM.from_config(config)             # the checkpoint's architecture, random weights
    tensors = {}
    for shard in shards:                                         # the checkpoint's *.safetensors files
        tensors.update(safetensors.torch.load_file(shard))
    load_quantized(model, tensors, checkpoint="gptq", bits=4, group_size=128)   # as its quantize_config.json says

A checkpoint's packed tensors are converted by `foldc.gemm.convert` (`from_gptq`, `from_gptq_act_order` where
``g_idx`` reorders the input channels, `from_awq`), each checked to dequantize to exactly the format's own values.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from ..errors import InputError, InputTypeError, SpecError

CHECKPOINTS = ("gptq", "gptq_v2", "awq")   # GPTQ v1 (zeros stored minus one), GPTQ v2, AutoAWQ's GEMM format
PACKED = (".qweight", ".qzeros", ".scales", ".g_idx")
# modules whose forward reads their linears' weights as tensors: MultiheadAttention's out_proj
# (F.multi_head_attention_forward), TransformerEncoderLayer's linear1 and linear2 (its fused inference path)
_READ_AS_TENSORS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)


def _stand_in(model: torch.nn.Module, name: str, linear: torch.nn.Linear, names: list[str], then: str) -> None:
    """Refuse a linear that a FoldLinear (``x @ W.T + b``) in its place would not reproduce: one whose forward is its
    subclass's or its own (accelerate's hooks replace an instance's), one with hooks, which the FoldLinear would not
    run, and a linear of a module that reads its weight as a tensor instead of calling it (``_READ_AS_TENSORS``).
    ``names``: every name of the linear in ``model``; ``then`` ends the error's message."""
    short = name.rsplit(".", 1)[-1]
    if type(linear).forward is not torch.nn.Linear.forward or "forward" in vars(linear):
        raise SpecError(f"{name} ({type(linear).__name__}) runs a forward of its own, not nn.Linear's x @ W.T + b, "
                        f"which a FoldLinear in its place would drop; add {short!r} to skip{then}")
    hooks = [*linear._forward_pre_hooks.values(), *linear._forward_hooks.values(),
             *linear._backward_pre_hooks.values(), *linear._backward_hooks.values()]
    if hooks:
        what = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks)
        raise SpecError(f"{name} has {len(hooks)} forward or backward hook(s) ({what}), which a FoldLinear in its "
                        "place would not run: remove them first (torch.nn.utils.prune.remove(module, 'weight') for "
                        f"pruning) or add {short!r} to skip{then}")
    for where in names:
        parent = where.rpartition(".")[0]
        parent = model.get_submodule(parent) if parent else model
        if isinstance(parent, _READ_AS_TENSORS):
            raise SpecError(f"{where} is a linear of an nn.{type(parent).__name__}, which reads its weight and bias as "
                            "tensors (a fused forward) instead of calling it: the model's forward would fail on a "
                            f"FoldLinear there; add {short!r} to skip{then}")


def quantize_model(model: torch.nn.Module, weight="k-group:4:128", skip=("lm_head",)) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place; returned) by a `foldc.nn.FoldLinear` with its
    weight quantized as ``weight`` (e.g. ``"k-group:4:128"``), except those whose name ends with one of
    ``skip`` (the output projection by default). Every layer's plan is proved when it is built; a layer
    whose shape the encoding cannot take (a group that does not divide its input features) is refused
    with its name before any layer is replaced. With a `FoldcCache` for the KV cache, the model's weight
    folds and KV folds are all planned and proved by foldc."""
    from ..gemm.spec import WEIGHT_KINDS, GemmEncoding, GemmSpec, parse_gemm_encoding
    from ..nn import FoldLinear, _linear_weight

    if isinstance(model, torch.nn.Linear):   # it has no parent to hold its replacement
        raise InputTypeError(f"model is itself an nn.Linear ({model.in_features} -> {model.out_features}): "
                             "quantize_model replaces the linears inside a model; quantize this one with "
                             "foldc.nn.FoldLinear.from_linear(model, weight)")
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    enc = parse_gemm_encoding(weight, "weight") if not hasattr(weight, "kind") else weight
    if enc is None:
        raise SpecError("weight=None: quantize_model quantizes the linear layers; give e.g. 'k-group:4:128'")
    if not isinstance(enc, GemmEncoding) or enc.kind not in WEIGHT_KINDS:   # once, not per layer with a group's advice
        shown = enc.short() if isinstance(enc, GemmEncoding) else enc
        raise SpecError(f"weight={shown!r}: a FoldLinear weight is 'k-group:bits:group' or 'per-channel:bits'")
    if skip is None:
        skip = ()
    elif isinstance(skip, str):
        skip = (skip,)
    try:
        skip = tuple(skip)   # read once: a generator would be used up by the first module checked against it
    except TypeError:
        raise InputTypeError(f"skip={skip!r} must be a module name or an iterable of names (e.g. ('lm_head',))") \
            from None
    for s in skip:
        if not isinstance(s, str):
            raise InputTypeError(f"skip holds {s!r} ({type(s).__name__}): its entries are names of modules, like "
                                 "'lm_head' or 'model.layers.0.mlp.down_proj'")
    names: dict[int, list[str]] = {}   # every name of each module (one registered twice is given once below)
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    chosen = []
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        skipped = [n for n in names[id(m)] if any(n == s or n.endswith("." + s) for s in skip)]
        if skipped and len(skipped) < len(names[id(m)]):
            raise SpecError(f"{name} is also registered as {', '.join(names[id(m)][1:])} (one module) but skip="
                            f"{tuple(skip)} names only {', '.join(skipped)}: skip all its names or none; the model "
                            "is unchanged")
        if not skipped:
            chosen.append((name, m))
    if not chosen:
        others = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ == "Conv1D"})
        raise SpecError("quantize_model found no torch.nn.Linear to quantize" + (
            f" (this model's projections are {', '.join(others)} modules, which it does not convert)" if others
            else f" outside skip={tuple(skip)}") + "; the model is unchanged")
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    for name, m in chosen:   # every layer's shape first: nothing is replaced if one is refused
        tied = [other for other in owners.get(id(m.weight), []) if other != name]
        if tied:
            raise SpecError(f"{name}'s weight is tied to {tied[0]}'s (one parameter): quantizing it would untie them; "
                            f"add {name.rsplit('.', 1)[-1]!r} to skip")
        if m.weight.is_meta:
            raise InputError(f"{name} ({m.in_features} -> {m.out_features}): its weight is on the meta device (no "
                             "values to quantize): load the model's weights first; the model is unchanged")
        _linear_weight(m, name, "; the model is unchanged")   # the float [out, in] weight (not another quantizer's)
        _stand_in(model, name, m, names[id(m)], "; the model is unchanged")
        try:
            GemmSpec(m.out_features, m.in_features, weight=enc)
        except SpecError as e:
            raise SpecError(f"{name} ({m.in_features} -> {m.out_features}): {e}; pick a group that divides "
                            f"{m.in_features} or add {name.rsplit('.', 1)[-1]!r} to skip") from None
    for name, m in chosen:
        layer = FoldLinear.from_linear(m, enc).to(m.weight.device)
        for where in names[id(m)]:   # one FoldLinear wherever the linear is registered (a shared layer stays shared)
            parent_name, _, child = where.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    _warn_unconverted(model, len(chosen))
    return model


#: the share of a model's parameters left in float, outside linears and embeddings, that `quantize_model` reports
UNCONVERTED_SHARE = 0.05


def _warn_unconverted(model: torch.nn.Module, converted: int) -> None:
    """Warn when weights `quantize_model` does not convert hold a large share of the model: matrices of modules
    that are not nn.Linear (a mixture of experts stored as 3-D parameters, transformers' MixtralExperts; GPT-2's
    Conv1D) stay in float, which a caller counting on a quantized model would not see otherwise."""
    from ..nn import FoldLinear

    total, left = 0, []
    for mod_name, m in model.named_modules():
        for p_name, p in m.named_parameters(recurse=False):
            total += p.numel()
            if p.is_floating_point() and p.dim() >= 2 and not isinstance(m, (torch.nn.Linear, torch.nn.Embedding,
                                                                              FoldLinear)):
                left.append((f"{mod_name}.{p_name}" if mod_name else p_name, type(m).__name__, p))
    share = sum(p.numel() for _, _, p in left) / max(total, 1)
    if left and share >= UNCONVERTED_SHARE:
        shown = ", ".join(f"{n} {list(p.shape)} ({kind})" for n, kind, p in left[:3])
        warnings.warn(f"quantize_model converted {converted} nn.Linear layers, but {share:.0%} of the model's "
                      f"parameters stay in float in modules it does not convert ({len(left)} matrices, e.g. {shown}): "
                      "foldc converts nn.Linear only, so those weights are not quantized", stacklevel=3)


def load_quantized(model: torch.nn.Module, state_dict: Mapping, *, checkpoint: str = "gptq", bits: int = 4,
                   group_size: int = 128) -> list[str]:
    """Load a GPTQ or AWQ checkpoint's tensors (``state_dict``: name -> tensor, every shard's) into ``model``, built
    from the checkpoint's config (its ``nn.Linear`` layers are replaced, its other parameters overwritten): each
    ``nn.Linear`` whose ``<name>.qweight`` the checkpoint holds becomes a `foldc.nn.FoldLinear` of the converted
    weight (and the checkpoint's ``<name>.bias``; act-order layers gather x by their input order), on the layer's
    device; every other tensor of the checkpoint is copied into the model as ``load_state_dict`` does.
    ``checkpoint``: ``"gptq"`` (v1, the zeros stored minus one), ``"gptq_v2"`` or ``"awq"`` (AutoAWQ's GEMM format);
    ``bits`` and ``group_size``: the checkpoint's quantization config (``group_size=-1``: one group per row, each
    layer's k). Refused by name before the model changes: a packed layer the model has no ``nn.Linear`` for (a prefix
    that does not match), a tensor the model has no place for or of another shape than the model's, a parameter of
    the model the checkpoint does not hold (it would keep its random value), a layer whose tensors do not convert.
    Returns the names of the replaced layers."""
    from ..gemm.convert import from_awq, from_gptq, from_gptq_act_order
    from ..nn import FoldLinear

    if checkpoint not in CHECKPOINTS:
        raise SpecError(f"checkpoint={checkpoint!r} must be one of {CHECKPOINTS}")
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise InputTypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    own = model.state_dict(keep_vars=True)
    if any(t.is_meta for t in own.values()):
        raise InputError("the model's tensors are on the meta device (built without memory): build it on the CPU or "
                         "a GPU, whose values the checkpoint's then overwrite")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names: dict[int, list[str]] = {}   # every name of each module
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    packed = sorted(key[:-len(".qweight")] for key in state_dict if key.endswith(".qweight"))
    if not packed:
        raise InputError(f"state_dict holds no '<layer>.qweight' tensor: not a {checkpoint} checkpoint's tensors")
    strangers = [name for name in packed if name not in linears]
    if strangers:
        raise InputError(f"the checkpoint packs {strangers[0]!r} but the model has no nn.Linear of that name (its "
                         f"first is {next(iter(linears), None)!r}): build the model from the checkpoint's config, and "
                         "give the tensors under the names its state_dict uses")
    layers = {}
    for name in packed:   # every layer converted and checked before anything changes
        get = lambda suffix: state_dict.get(name + suffix)  # noqa: E731
        for suffix in (".qzeros", ".scales"):
            if name + suffix not in state_dict:
                raise InputError(f"the checkpoint holds {name + '.qweight'!r} but does not hold {name + suffix!r}: "
                                 "pass every shard's tensors")
        try:
            order = None
            if checkpoint == "awq":
                weight, enc = from_awq(get(".qweight"), get(".qzeros"), get(".scales"), bits=bits,
                                       group_size=group_size)
            else:
                offset = 1 if checkpoint == "gptq" else 0
                weight, enc, order = from_gptq_act_order(get(".qweight"), get(".qzeros"), get(".scales"), get(".g_idx"),
                                                         bits=bits, group_size=group_size, zero_offset=offset) \
                    if get(".g_idx") is not None else (*from_gptq(get(".qweight"), get(".qzeros"), get(".scales"),
                                                                  bits=bits, group_size=group_size,
                                                                  zero_offset=offset), None)
                if order is not None and torch.equal(order, torch.arange(order.numel(), device=order.device)):
                    order = None   # g_idx in order: no gather
        except (InputError, InputTypeError, SpecError) as e:
            raise type(e)(f"{name}: {e}") from None
        linear = linears[name]
        _stand_in(model, name, linear, names[id(linear)], "; the model is unchanged")
        if tuple(weight.shape[2:]) != (linear.out_features, linear.in_features):
            raise InputError(f"{name}: the checkpoint's weight is {weight.shape[2]} x {weight.shape[3]} (out x in) but "
                             f"the model's nn.Linear is {linear.out_features} x {linear.in_features}")
        layers[name] = FoldLinear(weight, enc, get(".bias"), input_order=order).to(linear.weight.device)
    # the rest of the checkpoint, as load_state_dict would take it: every name the model has, nothing it lacks
    consumed = {name + suffix for name in packed for suffix in (*PACKED, ".bias")}
    rest = {k: v for k, v in state_dict.items() if k not in consumed}
    # a packed layer's own weight is replaced; its bias only where the checkpoint holds one (else it is missing)
    replaced = {name + ".weight" for name in packed} | {name + ".bias" for name in packed
                                                        if name + ".bias" in state_dict}
    unknown = sorted(k for k in rest if k not in own)
    if unknown:
        raise InputError(f"the checkpoint holds {unknown[0]!r} (and {len(unknown) - 1} more) that the model has no "
                         "place for: build the model from the checkpoint's config")
    for k, t in rest.items():   # load_state_dict copies the tensors that fit before it raises on one that does not
        if k.rpartition(".")[2] == "_extra_state" or not isinstance(own[k], torch.Tensor):
            continue   # a module's extra state is its own to check (set_extra_state), whatever its shape
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(own[k].shape):
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            raise InputError(f"the checkpoint's {k!r} is {got} but the model's is {tuple(own[k].shape)}: build the "
                             "model from the checkpoint's config; the model is unchanged")
    loaded = {id(own[k]) for k in rest}   # a tied parameter (lm_head and the embedding) is one object under two names
    missing = sorted(k for k, t in own.items() if k not in rest and k not in replaced and id(t) not in loaded)
    if missing:
        raise InputError(f"the checkpoint does not hold {missing[0]!r} (and {len(missing) - 1} more): the model would "
                         "keep its random value there; pass every shard's tensors")
    model.load_state_dict(rest, strict=False)
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return packed
