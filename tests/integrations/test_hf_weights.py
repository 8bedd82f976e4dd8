"""A GPTQ or AWQ checkpoint's tensors loaded into a transformers model as `FoldLinear` layers
(`foldc.integrations.hf.load_quantized`). Each checkpoint is built here the way the tools write one (the packers of
tests/_formats.py, written from the formats' definitions; act-order GPTQ layers quantized in a permuted channel order
as AutoGPTQ does with desc_act) from a source model; loaded into a model of another seed, its logits must equal,
to float32 rounding, the source's with each linear holding the format's own float64 dequantization (float32
models: the float64 plan executor)."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
fhf = pytest.importorskip("foldc.integrations.hf")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from _formats import asymmetric_codes, pack_along  # noqa: E402  (tests/_formats.py)
from foldc.errors import InputError, SpecError  # noqa: E402
from foldc.gemm.convert import AWQ_ORDER  # noqa: E402
from foldc.nn import FoldLinear  # noqa: E402


def model(kind: str, seed: int):
    torch.manual_seed(seed)
    if kind == "llama":   # hidden 64, MLP 128: k of 64 and 128
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64,
                          initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)
        return LlamaForCausalLM(cfg).eval()
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,   # q/k/v bias
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, initializer_range=0.1,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return Qwen2ForCausalLM(cfg).eval()


def checkpoint(source, fmt: str, bits: int, group_size: int, gen: torch.Generator):
    """(the tensors a ``fmt`` checkpoint of ``source`` holds, the source with each quantized linear holding the
    format's float64 dequantization, the names of the act-order layers). GPTQ layers take act-order at random;
    ``group_size=-1``: one group per row (each layer's k), as the tools' configs say it."""
    tensors, twin, act_order = {}, copy.deepcopy(source), []
    quantized = [name for name, m in source.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    for name in quantized:
        m = source.get_submodule(name)
        w = m.weight.detach()
        n, k = w.shape
        group = k if group_size == -1 else group_size
        if fmt == "awq":
            codes, scale, zero = asymmetric_codes(w, bits, group)
            g_idx = torch.arange(k) // group
            tensors[name + ".qweight"] = pack_along(codes.T, bits, 1, AWQ_ORDER)     # [k, n / 8], interleaved
            tensors[name + ".qzeros"] = pack_along(zero.T, bits, 1, AWQ_ORDER)
            effective = zero
        else:
            shuffled = bool(torch.randint(0, 2, (), generator=gen))
            perm = torch.randperm(k, generator=gen) if shuffled else torch.arange(k)
            codes_p, scale, zero = asymmetric_codes(w[:, perm], bits, group)            # groups of permuted columns
            inverse = torch.argsort(perm)
            codes, g_idx = codes_p[:, inverse], (torch.arange(k) // group)[inverse]
            stored = zero - 1 if fmt == "gptq" else zero                                 # v1 stores zero - 1
            # v1 reads (field + 1) mod 2**bits, as AutoGPTQ's kernels do: a zero of 0, stored as -1, is 0 again
            effective = (stored % 2**bits + (1 if fmt == "gptq" else 0)) % 2**bits
            tensors[name + ".qweight"] = pack_along(codes.T, bits, 0)                   # [k * bits / 32, n]
            tensors[name + ".qzeros"] = pack_along(stored.T % 2**bits, bits, 1)
            tensors[name + ".g_idx"] = g_idx.to(torch.int32)
            if not torch.equal(g_idx, torch.arange(k) // group):   # (one group per row: any order is in order)
                act_order.append(name)
        tensors[name + ".scales"] = scale.T.contiguous()                                 # [groups, n]
        if m.bias is not None:
            tensors[name + ".bias"] = m.bias.detach().half()
            twin.get_submodule(name).bias.data = m.bias.detach().half().float()
        want = scale.double()[:, g_idx] * (codes.double() - effective.double()[:, g_idx])
        twin.get_submodule(name).weight.data = want.float()
    held = {name + suffix for name in quantized for suffix in (".weight", ".bias")}
    tensors.update({k: v.clone() for k, v in source.state_dict().items() if k not in held})
    return tensors, twin, act_order


@pytest.mark.parametrize("kind, fmt, bits, group", [("llama", "gptq", 4, 32), ("llama", "gptq_v2", 8, 32),
                                                    ("llama", "gptq", 2, 16), ("qwen2", "awq", 4, 32),
                                                    ("qwen2", "gptq_v2", 4, 64), ("llama", "awq", 4, -1),
                                                    ("qwen2", "gptq", 4, -1)])
def test_a_checkpoint_loads_as_fold_linears_equal_to_the_formats_dequantization(kind, fmt, bits, group):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    source = model(kind, 1)
    tensors, twin, act_order = checkpoint(source, fmt, bits, group, gen)
    target = model(kind, 2)
    names = fhf.load_quantized(target, tensors, checkpoint=fmt, bits=bits, group_size=group)
    swapped = {n: m for n, m in target.named_modules() if isinstance(m, FoldLinear)}
    assert set(names) == set(swapped) and "lm_head" not in swapped and len(swapped) == 14
    assert {n for n, m in swapped.items() if m.input_order is not None} == set(act_order)
    ids = torch.randint(3, 96, (2, 9), generator=gen)
    with torch.no_grad():
        got, want = target(ids).logits, twin(ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), seed


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_it_changes():
    gen = torch.Generator().manual_seed(5)
    tensors, _, _ = checkpoint(model("llama", 1), "gptq", 4, 32, gen)
    target = model("llama", 2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    cases = [
        ({k.removeprefix("model."): v for k, v in tensors.items()}, {}, InputError, "no nn.Linear of that name"),
        ({k: v for k, v in tensors.items() if k != "model.norm.weight"}, {}, InputError, "does not hold 'model.norm"),
        ({**tensors, "model.extra.weight": torch.ones(3)}, {}, InputError, "no place for"),
        ({k: v for k, v in tensors.items() if not k.endswith(".qweight")}, {}, InputError, "no '<layer>.qweight'"),
        (tensors, {"group_size": 64}, InputError, r"model\.layers\.0\..*: "),
        (tensors, {"checkpoint": "exl2"}, SpecError, "must be one of"),
    ]
    for given, options, error, match in cases:
        with pytest.raises(error, match=match):
            fhf.load_quantized(target, given, **{"checkpoint": "gptq", "bits": 4, "group_size": 32, **options})
        assert not any(isinstance(m, FoldLinear) for m in target.modules())
        assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_a_checkpoint_tensor_of_another_shape_is_refused_before_the_model_changes():
    """A checkpoint of another config (a vocabulary of 100 where the model has 96): load_state_dict copied every
    tensor that fit (lm_head's weight among them) and then raised a RuntimeError about the embedding, leaving the model
    half loaded, its linears unreplaced. Refused by name now, before any change."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tensors, _, _ = checkpoint(model("llama", 1), "gptq", 4, 32, gen)
    tensors["model.embed_tokens.weight"] = torch.randn(100, 64, generator=gen)
    target = model("llama", 2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(InputError, match=r"the checkpoint's 'model\.embed_tokens\.weight' is shape \(100, 64\) but "
                                         r"the model's is \(96, 64\): .*the model is unchanged"):
        fhf.load_quantized(target, tensors, checkpoint="gptq", bits=4, group_size=32)
    assert not any(isinstance(m, FoldLinear) for m in target.modules())
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_a_checkpoint_without_the_bias_of_a_biased_linear_is_refused():
    """Qwen2's q/k/v projections have biases: a checkpoint that lacks one (a shard not passed) made a FoldLinear
    without it, silently, where every other parameter the checkpoint lacks is refused by name."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    source = model("qwen2", 1)
    with torch.no_grad():
        for m in source.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(generator=gen)
    tensors, _, _ = checkpoint(source, "gptq_v2", 4, 32, gen)
    target = model("qwen2", 2)
    given = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(InputError, match=r"does not hold 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        fhf.load_quantized(target, given, checkpoint="gptq_v2", bits=4, group_size=32)
    assert not any(isinstance(m, FoldLinear) for m in target.modules())


@pytest.mark.parametrize("fmt, suffix", [("gptq", ".qzeros"), ("gptq", ".scales"), ("awq", ".qzeros"),
                                         ("awq", ".scales")])
def test_a_packed_layer_missing_one_of_its_tensors_is_refused_naming_it(fmt, suffix):
    """A layer's qweight without its qzeros (another shard) raised "qzeros must be a torch.Tensor, got NoneType",
    naming neither the layer nor the tensor."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tensors, _, _ = checkpoint(model("qwen2", 1), fmt, 4, 32, gen)
    missing = "model.layers.0.mlp.up_proj" + suffix
    given = {k: v for k, v in tensors.items() if k != missing}
    with pytest.raises(InputError, match=f"does not hold {missing!r}"):
        fhf.load_quantized(model("qwen2", 2), given, checkpoint=fmt, bits=4, group_size=32)


def test_quantize_model_with_skip_none_skips_nothing():
    """skip=None (nothing to skip) raised "TypeError: 'NoneType' object is not iterable"."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    for p in net.parameters():
        torch.nn.init.normal_(p, generator=gen)
    twins = [FoldLinear.from_linear(net[i], "k-group:4:32") for i in (0, 2)]
    fhf.quantize_model(net, weight="k-group:4:32", skip=None)
    assert isinstance(net[0], FoldLinear) and isinstance(net[2], FoldLinear)
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(net(x), twins[1](torch.relu(twins[0](x))))


class _ScaledLinear(torch.nn.Linear):
    """An nn.Linear subclass whose forward does more than x @ W.T + b."""

    def forward(self, x):
        return super().forward(x) * 0.5


def _offloaded(linear: torch.nn.Linear) -> None:
    """accelerate's add_hook_to_module: the instance's own forward wraps the class's."""
    inner = linear.forward
    linear.forward = lambda x: inner(x.flip(-1))


@pytest.mark.parametrize("change, where, match", [
    (lambda m: m[0].register_forward_hook(lambda mod, i, out: out * 2), "0", r"forward or backward hook"),
    (lambda m: m[0].register_forward_pre_hook(lambda mod, i: (i[0].flip(-1),)), "0", r"forward or backward hook"),
    (lambda m: torch.nn.utils.prune.random_unstructured(m[2], "weight", 0.5), "2", r"prune\.remove"),
    (lambda m: m.__setitem__(0, _ScaledLinear(64, 64)), "0", r"\(_ScaledLinear\) runs a forward of its own"),
    (lambda m: _offloaded(m[2]), "2", r"\(Linear\) runs a forward of its own"),
])
def test_quantize_model_refuses_a_linear_a_fold_linear_cannot_stand_in_for(change, where, match):
    """A FoldLinear computes x @ W.T + b: in place of a linear with hooks, a subclass's or an instance's own forward
    (accelerate's offload hooks), it dropped what they did, silently (a forward hook doubling the output: the model's
    output halved). Refused by name, the model unchanged; with the layer in skip the rest is quantized."""
    import torch.nn.utils.prune  # noqa: F401  (torch.nn.utils.prune is not imported by torch)

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    change(net)
    for p in net.parameters():
        torch.nn.init.normal_(p, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        before = net(x)
    with pytest.raises(SpecError, match=rf"^{where} .*{match}.*add '{where}' to skip; the model is unchanged"):
        fhf.quantize_model(net, weight="k-group:8:32")
    assert not any(isinstance(m, FoldLinear) for m in net.modules())
    with torch.no_grad():
        assert torch.equal(net(x), before)
    fhf.quantize_model(net, weight="k-group:8:32", skip=(where,))
    assert sum(isinstance(m, FoldLinear) for m in net.modules()) == 1
    with torch.no_grad():
        assert float((net(x) - before).norm() / before.norm()) < 0.05   # 8-bit weights


class _AttentionBlock(torch.nn.Module):
    """An nn.MultiheadAttention (its out_proj read as tensors) and a projection after it."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(64, 4, batch_first=True)
        self.proj = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.proj(self.attn(x, x, x, need_weights=False)[0])


def test_quantize_model_refuses_linears_their_module_reads_as_tensors():
    """nn.MultiheadAttention reads its out_proj's weight and bias as tensors (F.multi_head_attention_forward), and
    nn.TransformerEncoderLayer its linear1's and linear2's (its fused inference path), instead of calling them:
    quantize_model replaced them and every later forward of the model raised "linear(): argument 'weight' must be
    Tensor, not AffineTensor". Refused by name, the model unchanged; skipped, the rest converts."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    block = _AttentionBlock().eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=gen)
    x = torch.randn(2, 5, 64, generator=gen)
    with torch.no_grad():
        before = block(x)
    with pytest.raises(SpecError, match=r"^attn\.out_proj is a linear of an nn\.MultiheadAttention.*"
                                        r"add 'out_proj' to skip; the model is unchanged"):
        fhf.quantize_model(block, weight="k-group:8:32")
    assert not any(isinstance(m, FoldLinear) for m in block.modules())
    fhf.quantize_model(block, weight="k-group:8:32", skip=("out_proj",))
    assert isinstance(block.proj, FoldLinear)
    with torch.no_grad():
        assert float((block(x) - before).norm() / before.norm()) < 0.05   # 8-bit weights
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).eval()
    with pytest.raises(SpecError, match=r"^linear1 is a linear of an nn\.TransformerEncoderLayer.*"
                                        r"add 'linear1' to skip"):
        fhf.quantize_model(layer, weight="k-group:8:32", skip=("out_proj",))
    assert not any(isinstance(m, FoldLinear) for m in layer.modules())


def test_a_lazy_linear_before_its_first_forward_is_refused_by_name():
    """An nn.LazyLinear not yet run has no weight (in_features=0): torch raised "Attempted to use an uninitialized
    parameter in <method 'detach'...>", naming no layer."""
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LazyLinear(32))
    with pytest.raises(InputError, match=r"^1's weight is uninitialized \(an nn\.LazyLinear.*the model is unchanged"):
        fhf.quantize_model(net, weight="k-group:4:32")
    assert not any(isinstance(m, FoldLinear) for m in net.modules())
    with pytest.raises(InputError, match=r"^linear's weight is uninitialized"):
        FoldLinear.from_linear(torch.nn.LazyLinear(32), "k-group:4:32")
    net(torch.randn(2, 64))   # its first forward makes it an nn.Linear of 64 input features
    fhf.quantize_model(net, weight="k-group:4:32")
    assert isinstance(net[1], FoldLinear)


def test_a_checkpoint_layer_a_fold_linear_cannot_stand_in_for_is_refused():
    """load_quantized replaces the checkpoint's linears as quantize_model does, so a forward hook on one of them was
    dropped silently there too."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    tensors, _, _ = checkpoint(model("llama", 1), "gptq_v2", 4, 32, gen)
    target = model("llama", 2)
    target.model.layers[1].mlp.up_proj.register_forward_hook(lambda mod, i, out: out * 2)
    with pytest.raises(SpecError, match=r"^model\.layers\.1\.mlp\.up_proj has 1 forward or backward hook"):
        fhf.load_quantized(target, tensors, checkpoint="gptq_v2", bits=4, group_size=32)
    assert not any(isinstance(m, FoldLinear) for m in target.modules())


def test_quantize_model_refuses_an_activation_encoding_as_the_weights_once():
    """A per-token GemmEncoding object (an activation's) given as weight was refused per layer with the advice of a
    group that does not divide: "0 (64 -> 64): weight='per-token:8': kind 'per-token' does not apply to the weight ...;
    pick a group that divides 64 or add '0' to skip". Refused as the encoding it is, naming no layer."""
    from foldc.gemm import GemmEncoding

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    with pytest.raises(SpecError, match=r"^weight='per-token:8': .*'k-group:bits:group' or 'per-channel:bits'$"):
        fhf.quantize_model(net, weight=GemmEncoding("per-token", 8))
    assert not any(isinstance(m, FoldLinear) for m in net.modules())


def _through_a_file(state: dict, how: str) -> dict:
    import io

    if how == "safetensors":   # (a state dict of tensors only: the layers' records are uint8 tensors)
        safetensors = pytest.importorskip("safetensors.torch")
        return safetensors.load(safetensors.save(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("how", ["torch", "safetensors"])
def test_a_quantized_models_state_dict_round_trips_and_one_of_another_encoding_is_refused_by_name(how):
    """quantize_model's model saved and loaded into the same model quantized alike: its logits bit for bit. Loaded
    into one quantized as another encoding, the first layer that differs is refused naming it and both encodings
    (a bf16-scale model's state dict was refused naming one encoding; another bit width raised torch's size
    mismatches, after the load had copied the rest)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    source = fhf.quantize_model(model("llama", 1), weight="k-group:4:32")
    state = _through_a_file(source.state_dict(), how)
    target = fhf.quantize_model(model("llama", 2), weight="k-group:4:32")
    assert target.load_state_dict(state).missing_keys == []
    ids = torch.randint(3, 96, (2, 7), generator=gen)
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)
    first = "model.layers.0.self_attn.q_proj"
    for other in ("k-group:4:32:bf16", "k-group:8:32", "per-channel:4"):
        built = fhf.quantize_model(model("llama", 2), weight=other)
        with pytest.raises(InputError, match=rf"^{first}\._extra_state: .*k-group:4:32 over .*FoldLinear's is "
                                             rf"{other} over .*quantize_model\(model, weight='k-group:4:32'\)"):
            built.load_state_dict(state)
    old = {k: v for k, v in state.items() if not k.endswith("._extra_state")}   # saved before the records
    target = fhf.quantize_model(model("llama", 3), weight="k-group:4:32")
    assert target.load_state_dict(old).missing_keys == []
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)


def test_a_loaded_checkpoints_state_dict_round_trips_with_its_act_order_layers():
    """load_quantized's model (act-order layers among its FoldLinears) saved and loaded into a model made from a
    checkpoint of the same layout: its logits bit for bit; a layer of another input order layout is refused."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(seed))
    made = []
    for source_seed in (1, 3):   # two sources, one generator seed: the same act-order layers and orders
        tensors, _, act_order = checkpoint(model("llama", source_seed), "gptq", 4, 32,
                                           torch.Generator().manual_seed(seed))
        target = model("llama", 2)
        fhf.load_quantized(target, tensors, checkpoint="gptq", bits=4, group_size=32)
        made.append((target, act_order))
    (source, act_order), (target, _) = made
    target.load_state_dict(_through_a_file(source.state_dict(), "safetensors"))
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)
    plain = fhf.quantize_model(model("llama", 2), weight="k-group:4:32:fp32")   # no input orders
    if act_order:
        with pytest.raises(InputError, match=rf"^{act_order[0]}\._extra_state: .*act-order"):
            plain.load_state_dict(source.state_dict(), strict=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_model_warns_when_weights_it_does_not_convert_stay_in_float(seed):
    """transformers stores Mixtral's experts as 3-D parameters (MixtralExperts), not nn.Linear: quantize_model
    converted the attention and left most of the model in float without a word. It warns, naming them; a model whose
    weights are all linears (Llama) quantizes without a warning."""
    import warnings

    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2)
    mixtral = transformers.MixtralForCausalLM(cfg).eval()
    with pytest.warns(UserWarning, match=r"stay in float .*experts\.gate_up_proj \[4, 128, 64\] \(MixtralExperts\)"):
        fhf.quantize_model(mixtral, "k-group:4:32")
    assert isinstance(mixtral.model.layers[0].self_attn.q_proj, FoldLinear)   # the linears are converted all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fhf.quantize_model(model("llama", seed), "k-group:4:32")
