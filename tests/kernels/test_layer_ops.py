"""The layer ops (``spectoolkit::attn_in`` / ``layer_tail``, csrc/layer.inc) give the bits of the ops they
compose called one by one — the body as it ran before they existed, kept here as the reference."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from spectoolkit.kernels import cpu_ops
from spectoolkit.kernels.cpu_linear import to_int8_activations, widen
from spectoolkit.kernels.rtn_format import RtnConfig
from spectoolkit.kernels.static_decoder import StaticDecoder
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.quant.packing import pack_model
from spectoolkit.quant.rtn import quantize_model_rtn
from spectoolkit.runtime.attention import flat_key_slots, kernel_attention, pool_stores
from spectoolkit.runtime.decoder_rows import decoder_rows, layer_stores
from spectoolkit.runtime.paged_kv import make_pool

ops = torch.ops.spectoolkit


def _rms(dec, norm, x):
    out = ops.rms_norm(x.float().contiguous(), dec.norm_weights[id(norm)], norm.variance_epsilon, dec.isa)
    return out.to(x.dtype)


def _reference_rows(dec, pool, ids, cos, sin, write, key_slots, starts):
    """decoder_rows op by op: norms, each linear, rotary, attention, SwiGLU as separate calls -> (final hidden, the
    hidden entering each layer)."""
    hidden, entering = dec.embed(ids), []
    for index, layer in enumerate(dec.layers):
        entering.append(hidden)
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms(dec, layer.input_layernorm, hidden)
        fused = getattr(attn, "qkv_fused", None)
        if fused is not None:
            q, k, v = fused(x).float().split(fused.splits, dim=-1)
        else:
            q, k, v = attn.q_proj(x).float(), attn.k_proj(x).float(), attn.v_proj(x).float()
        rows = x.shape[0]
        q, k = q.reshape(rows, dec.num_heads, dec.head_dim), k.reshape(rows, dec.kv_heads, dec.head_dim)
        v = v.reshape(rows, dec.kv_heads, dec.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = _rms(dec, attn.q_norm, q), _rms(dec, attn.k_norm, k)
        q, k = ops.rotary(q.contiguous(), cos, sin, dec.isa), ops.rotary(k.contiguous(), cos, sin, dec.isa)
        stores = pool_stores(pool, index)
        out = kernel_attention(stores, q, k, v, write, key_slots, starts, dec.scale, dec.isa)
        hidden = hidden + attn.o_proj(out.to(hidden.dtype).reshape(out.shape[0], -1))
        x = _rms(dec, layer.post_attention_layernorm, hidden)
        fused = getattr(mlp, "gate_up_fused", None)
        if fused is not None:
            gate, up = (part.contiguous() for part in fused(x).float().split(fused.splits, dim=-1))
        else:
            gate, up = mlp.gate_proj(x).float().contiguous(), mlp.up_proj(x).float().contiguous()
        hidden = hidden + mlp.down_proj(ops.silu_mul(gate, up, dec.isa).to(x.dtype))
    return _rms(dec, dec.norm, hidden), entering


def _qwen(kind):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(3)
    if kind == "qwen3":  # per-head q/k norms
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()  # q/k/v biases


def _model(case):
    if case.startswith("qwen"):
        model = _qwen(case)
        with torch.no_grad():
            for layer in model.model.layers:  # norms away from 1, biases away from 0
                for module in layer.modules():
                    if hasattr(module, "variance_epsilon"):
                        module.weight.add_(torch.randn_like(module.weight) * 0.3)
                    if getattr(module, "bias", None) is not None:
                        module.bias.add_(torch.randn_like(module.bias))
        return model
    model = tiny_llama(vocab_size=96, seed=4)
    if case == "bf16":
        model = model.to(torch.bfloat16)
    if case.startswith("rtn-int4"):
        quantize_model_rtn(model, RtnConfig(4, 32))
    return model


@torch.inference_mode()
@pytest.mark.parametrize("kv", ["auto", "int8", "fp8", "bf16"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", ["fp32", "bf16", "rtn-int4", "rtn-int4+a8", "rtn-int4+a8-mixed", "qwen2", "qwen3"])
def test_the_layer_ops_give_the_bits_of_their_ops_one_by_one(case, fused, kv):
    model = _model(case)
    report = pack_model(model, "int8" if "+a8" in case else "float")
    if "+a8" in case:  # integer dot products in every decoder linear
        assert all(v == "packed, int8 activations" for k, v in report.items() if "rtn" in k), report
    if case.endswith("mixed"):  # v wide, q and k in their own format: one pass over two formats (a GGUF's q/k/v)
        if fused:
            pytest.skip("a fused call holds one format")
        for layer in model.model.layers:
            v_proj = layer.self_attn.v_proj
            v_proj.set_packed(to_int8_activations(widen(v_proj.packed)))
            assert v_proj.fmt != layer.self_attn.q_proj.fmt and v_proj.activations == "int8"
    if not fused:
        for layer in model.model.layers:
            object.__delattr__(layer.self_attn, "qkv_fused")
            object.__delattr__(layer.mlp, "gate_up_fused")
    dec = StaticDecoder(model, isa=-1)
    ids = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(1))
    cos, sin = dec.rope.rows(torch.arange(6))
    write = torch.tensor([0, 1, 2, 3, 4, -1])  # the last row attends without being stored
    key_slots, starts = flat_key_slots([torch.arange(r + 1) for r in range(5)] + [torch.tensor([0, 2, 4])])
    capture = (1, 0, 1)  # every layer's entering state, one of them twice
    results = []
    for body in (decoder_rows, None):
        pool = make_pool(model, kv, 16)
        if body is None:
            hidden, entering = _reference_rows(dec, pool, ids, cos, sin, write, key_slots, starts)
            states = torch.cat([entering[layer] for layer in capture], dim=-1)
        else:
            hidden, states = body(dec, layer_stores(pool), ids, cos, sin, write, key_slots, starts, capture)
        results.append((hidden, states, [pool.stored(1, "value", torch.arange(5))[f] for f in pool.fields]))
    (got, got_states, got_kv), (want, want_states, want_kv) = results
    assert got.dtype == model.dtype and torch.equal(got, want)
    assert got_states.shape == (6, 3 * model.config.hidden_size) and torch.equal(got_states, want_states)
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv, strict=True))
    assert not torch.equal(got[0], got[1])  # the rows computed something


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16", "fp16", "fp32"])
def test_kv_encode_gives_the_pools_bits(kv):
    """The layer op's KV encoding (``spectoolkit::kv_encode``) equals the pool's own (kvcache/formats.py) bit for
    bit, on rows with ties at .5 after scaling, an all-zero row, huge and tiny values."""
    cpu_ops.load()
    model = tiny_llama(vocab_size=96, seed=4)
    pool = make_pool(model, kv, 16)
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(7, 2, 16, generator=generator) * torch.logspace(-30, 30, 7)[:, None, None]  # [W, H, D]
    rows[0, 0] = 0.0
    rows[1, 0] = torch.arange(16) - 7.5  # ties for int8: max |x| 127 makes the scale 1, x / 1 = k + 0.5
    rows[1, 0, 0] = 127.0
    rows[1, 1] = (torch.arange(16) - 8) * 28.0  # ties for fp8: max 448 -> scale 1; 28·k sits between e4m3 values
    rows[1, 1, 0] = 448.0
    want = pool._encode(rows)
    store = pool.layers[0]["key"]["data"]
    data, scale = ops.kv_encode(rows, store, "scale" in want)
    assert data.dtype == want["data"].dtype and torch.equal(_bits(data), _bits(want["data"]))
    if "scale" in want:
        assert torch.equal(scale, want["scale"])


def test_the_layer_ops_refuse_a_wrong_linear_list():
    model = tiny_llama(vocab_size=96, seed=4)
    pack_model(model)
    dec = StaticDecoder(model, isa=-1)
    args = dec.layer_args[0]
    cos, sin = dec.rope.rows(torch.arange(1))
    with pytest.raises(RuntimeError, match="4 tensors and 3 ints"):
        ops.attn_in(dec.embed(torch.tensor([1])), args.norm_in, args.eps_in, args.qkv[:3], args.qkv_meta, cos, sin,
                    dec.num_heads, dec.kv_heads, dec.head_dim, args.q_norm, args.k_norm, args.qk_eps)  # fmt: skip


def test_decoder_layers_refuses_a_wrong_argument_list():
    model = tiny_llama(vocab_size=96, seed=4)
    pack_model(model)
    dec = StaticDecoder(model, isa=-1)
    pool = make_pool(model, "auto", 16)
    stores = layer_stores(pool)
    hidden = dec.embed(torch.tensor([1]))
    cos, sin = dec.rope.rows(torch.arange(1))
    write, (key_slots, starts) = torch.tensor([0]), flat_key_slots([torch.arange(1)])
    layers = len(dec.layers)

    def call(weights=dec.weights, meta=dec.meta, stores=stores, capture=()):
        return ops.decoder_layers(hidden, cos, sin, weights, meta, dec.eps, stores, write, key_slots, starts,
                                  dec.num_heads, dec.kv_heads, dec.head_dim, dec.scale, list(capture))  # fmt: skip

    with pytest.raises(RuntimeError, match=f"no layer {layers} to capture"):
        call(capture=(layers,))
    with pytest.raises(RuntimeError, match="4 pool tensors and 3 epsilons per layer"):
        call(stores=stores[:-4])
    with pytest.raises(RuntimeError, match="left over"):
        call(meta=dec.meta + [0, 0])
    with pytest.raises(RuntimeError, match="end inside layer 1"):
        call(weights=dec.weights[:-1])
