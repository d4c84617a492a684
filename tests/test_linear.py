"""Linear methods: the registry keyed by ``quantization``, the dense method, and the
strict loading that targets it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import EngineConfig, ModelConfig
from tandem.engine.model.linear import (Linear, UnquantizedLinearMethod,
                                        process_weights_after_loading)
from tandem.engine.quantization.registry import LINEAR_METHODS, get_linear_method
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.weights import WeightLoadError, load_weights
from tandem.kernels.cpu.linear import (invariant_linear, invariant_linear_available,
                                       pack_invariant_weight, packing_available)

CFG = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
           head_dim=16, vocab_size=50, rms_norm_eps=1e-5, rope_theta=10000.0, max_model_len=64)


def _checkpoint(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under Hugging Face Llama names (unfused q/k/v, gate/up)."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                   f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h),
                   f"{p}.mlp.down_proj.weight": (h, f)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _meta_model(cfg: ModelConfig) -> LlamaForCausalLM:
    """Built as load_model builds it: on ``meta``, then materialised uninitialised."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, get_linear_method("none"))
    return model.to_empty(device=torch.device("cpu"))


def test_unknown_quantization_names_the_field_and_the_known_names():
    from tandem.router.cli import build_parser

    assert list(LINEAR_METHODS)[0] == "none" and "gguf" in LINEAR_METHODS
    assert isinstance(get_linear_method("none"), UnquantizedLinearMethod)
    known = ", ".join(LINEAR_METHODS)
    with pytest.raises(ValueError, match=rf"^quantization: unknown 'int3', expected one of {known}$"):
        get_linear_method("int3")
    with pytest.raises(ValueError, match=rf"^quantization: unknown 'q4_0', expected one of {known}$"):
        EngineConfig(quantization="q4_0")
    assert EngineConfig().quantization == "none"
    # The CLI offers exactly the registered methods.
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    action = next(a for a in sub.choices["serve"]._actions if a.dest == "quantization")
    assert sorted(action.choices) == sorted(LINEAR_METHODS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_dense_fused_layer_round_trip_equals_f_linear(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    shards = [torch.randn(n, 48, generator=g) for n in (32, 16, 16)]
    layer = Linear(48, [32, 16, 16], get_linear_method("none"), params_dtype=dtype)
    assert (layer.in_features, layer.out_features, layer.shard_ids) == (48, 64, (0, 1, 2))
    for shard_id in (2, 0, 1):                      # checkpoint order does not matter
        layer.load_weight("weight", shards[shard_id], shard_id)
    want_weight = torch.cat(shards).to(dtype)
    assert torch.equal(layer.weight, want_weight)
    process_weights_after_loading(layer)
    process_weights_after_loading(layer)            # idempotent
    onednn = packing_available(dtype)
    fma = dtype == torch.bfloat16 and not onednn and invariant_linear_available()
    assert (layer.packed_weight is not None) == onednn
    assert (layer.invariant_weight is not None) == fma
    assert ("weight" in dict(layer.named_parameters())) == (not (onednn or fma))
    x = torch.randn(tokens, 48, generator=g).to(dtype)
    if fma:     # no oneDNN bfloat16 path: the compiled kernel, exactly
        assert torch.equal(layer(x), invariant_linear(x, pack_invariant_weight(want_weight), 64))
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), want_weight.float()),
                                   atol=0.05, rtol=0.02)
    elif dtype == torch.float32 and onednn:     # oneDNN's float32 matmul: another summation order
        torch.testing.assert_close(layer(x), F.linear(x, want_weight), atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(layer(x), F.linear(x, want_weight))


def test_dense_layer_refuses_misshapen_shards_and_foreign_tensors():
    layer = Linear(8, [4, 2], get_linear_method("none"))
    with pytest.raises(WeightLoadError, match=r"checkpoint shape \(4, 8\) != model shape \(2, 8\)"):
        layer.load_weight("weight", torch.zeros(4, 8), 1)
    with pytest.raises(WeightLoadError, match="stores no 'qweight'"):
        layer.load_weight("qweight", torch.zeros(4, 8, dtype=torch.int32), 0)


def test_checkpoint_loads_into_fused_layers_row_for_row():
    cfg = ModelConfig(**CFG, tie_word_embeddings=False)
    ckpt = _checkpoint(cfg)
    model = _meta_model(cfg)
    load_weights(model, iter(ckpt.items()))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1"
    assert torch.equal(attn.qkv_proj.weight, torch.cat(
        [ckpt[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat(
        [ckpt[f"{p}.mlp.gate_proj.weight"], ckpt[f"{p}.mlp.up_proj.weight"]]))
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    hidden = torch.randn(3, cfg.hidden_size)
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, ckpt["lm_head.weight"]))


def test_tied_output_projection_is_the_loaded_embedding():
    cfg = ModelConfig(**CFG, tie_word_embeddings=True)
    ckpt = _checkpoint(cfg)
    model = _meta_model(cfg)
    assert model.lm_head.weight is not model.model.embed_tokens.weight   # to_empty() untied it
    load_weights(model, iter([*ckpt.items(), ("lm_head.weight", torch.zeros(1))]))  # ignored
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(3, cfg.hidden_size)
    want = F.linear(hidden, ckpt["model.embed_tokens.weight"])
    assert torch.equal(model.compute_logits(hidden), want)
    model.to(torch.bfloat16)
    process_weights_after_loading(model)
    assert torch.equal(model.compute_logits(hidden.bfloat16()),
                       F.linear(hidden.bfloat16(), ckpt["model.embed_tokens.weight"].bfloat16()).float())
    assert model.model.embed_tokens.weight.shape == (cfg.vocab_size, cfg.hidden_size)


def test_strict_loading_still_raises_on_missing_extra_and_repeated_tensors():
    cfg = ModelConfig(**CFG, tie_word_embeddings=False)
    ckpt = _checkpoint(cfg)
    missing_v = {k: v for k, v in ckpt.items() if k != "model.layers.0.self_attn.v_proj.weight"}
    with pytest.raises(WeightLoadError, match=r"not \(fully\) filled.*'model.layers.0.self_attn"
                                              r".qkv_proj.weight'\]$"):
        load_weights(_meta_model(cfg), iter(missing_v.items()))
    no_norm = {k: v for k, v in ckpt.items() if k != "model.norm.weight"}
    with pytest.raises(WeightLoadError, match=r"filled by the checkpoint: \['model.norm.weight'\]$"):
        load_weights(_meta_model(cfg), iter(no_norm.items()))
    extra = [*ckpt.items(), ("model.layers.0.self_attn.q_proj.qweight", torch.zeros(4, 4))]
    with pytest.raises(WeightLoadError, match="'model.layers.0.self_attn.q_proj.qweight' has no "
                                              "place in the model"):
        load_weights(_meta_model(cfg), iter(extra))
    twice = [*ckpt.items(), ("model.layers.1.mlp.up_proj.weight",
                             ckpt["model.layers.1.mlp.up_proj.weight"])]
    with pytest.raises(WeightLoadError, match="'model.layers.1.mlp.up_proj.weight' loaded twice "
                                              "into model.layers.1.mlp.gate_up_proj.weight"):
        load_weights(_meta_model(cfg), iter(twice))
    bad = dict(ckpt, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})
    with pytest.raises(WeightLoadError, match=r"^model.layers.0.self_attn.k_proj.weight: checkpoint "
                                              r"shape \(16, 64\) != model shape \(32, 64\) "
                                              r"\(model.layers.0.self_attn.qkv_proj.weight\)$"):
        load_weights(_meta_model(cfg), iter(bad.items()))
