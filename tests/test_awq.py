"""AWQ int4 (Lin et al. 2023, Section 3): the AutoAWQ gemm packing, the linear method
that serves it, and the quantizer on the real default model (float32).

The real-model tests share one small quantization run (128 calibration tokens from
tests/data/awq_calibration.txt, group size 64: 128 does not divide the model's
width 576) and one dense float32 engine, whose weights are swapped in place.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from tandem.engine.model.linear import Linear
from tandem.engine.model.weights import WeightLoadError, load_weights
from tandem.engine.quantization.awq_linear import (AWQLinearMethod, dequantize_awq,
                                                   pack_int4, unpack_int4)
from tandem.quantize import awq
from tandem.quantize.dense import (LINEAR_NAMES, NORM_NAMES, attention_block, decoder_layer,
                                   layer_weights, load_dense, mlp_block, model_logits)

CALIBRATION = os.path.join(os.path.dirname(__file__), "data", "awq_calibration.txt")
GROUP = 64
# The packing order as the AutoAWQ gemm layout defines it: nibble i of a word holds
# column ORDER[i] of its eight; written out here, independently of the module.
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def reference_dequantize(qweight, qzeros, scales):
    """``W [N, K]`` from gemm-layout tensors, straight from the layout's definition."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    shifts = torch.tensor([4 * ORDER.index(j) for j in range(8)])     # column j -> its nibble
    q = ((qweight[:, :, None].long() >> shifts) & 15).reshape(k, n)
    z = ((qzeros[:, :, None].long() >> shifts) & 15).reshape(groups, n)
    row_group = torch.arange(k) // (k // groups)
    return ((q - z[row_group]).float() * scales.float()[row_group]).t()


# -- packing ---------------------------------------------------------------------------------
def test_pack_interleaves_columns_and_round_trips_exactly():
    word = pack_int4(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    # nibbles low to high: columns 0, 2, 4, 6, 1, 3, 5, 7 -> values 1, 3, 5, 7, 2, 4, 6, 8
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert int(word) == 0x86427531 - 2 ** 32
    assert int(pack_int4(torch.full((1, 8), 15))) == -1
    assert int(pack_int4(torch.zeros(1, 8, dtype=torch.int64))) == 0
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 96), generator=g, dtype=torch.int32)
    packed = pack_int4(codes)
    assert packed.shape == (37, 12) and torch.equal(unpack_int4(packed), codes)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        pack_int4(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((1, 8), 16))


def test_packed_weight_dequantizes_to_the_rounded_weight_exactly():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g) * torch.rand(1, 256, generator=g) * 3
    t = awq.pack_awq_weight(w, 4, GROUP)
    assert (t["qweight"].dtype, tuple(t["qweight"].shape)) == (torch.int32, (256, 6))
    assert (t["qzeros"].dtype, tuple(t["qzeros"].shape)) == (torch.int32, (4, 6))
    assert (t["scales"].dtype, tuple(t["scales"].shape)) == (torch.float16, (4, 48))
    rounded = awq.fake_quantize(w, 4, GROUP)
    assert torch.equal(reference_dequantize(**t), rounded)
    assert torch.equal(dequantize_awq(**t), rounded)
    # Asymmetric RTN: each group has 16 levels spanning [min, max]; the error is at
    # most half a step (the step is rounded to float16: allow its relative error).
    steps = t["scales"].float().t().repeat_interleave(GROUP, dim=1)
    assert ((rounded - w).abs() <= steps * (0.5 + 1e-3)).all()
    codes, zeros, _ = awq.quantize_groups(w, 4, GROUP)
    assert int(codes.min()) == 0 and int(codes.max()) == 15 and int(zeros.max()) <= 15
    with pytest.raises(ValueError, match="group_size 128 does not divide the input width 576"):
        awq.fake_quantize(torch.zeros(8, 576), 4, 128)
    with pytest.raises(ValueError, match="4-bit"):
        awq.pack_awq_weight(w, 3, GROUP)


# -- the linear method -----------------------------------------------------------------------
def _fused_layer(dtype=torch.float32, group_size=None):
    from tandem.engine.model.linear import Linear

    return Linear(128, [64, 32, 32], AWQLinearMethod(group_size), params_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_loads_shards_at_their_column_offsets(dtype):
    g = torch.Generator().manual_seed(2)
    shards = [torch.randn(n, 128, generator=g) for n in (64, 32, 32)]
    packed = [awq.pack_awq_weight(w, 4, GROUP) for w in shards]
    layer = _fused_layer(dtype)
    for shard_id in (2, 0, 1):                           # checkpoint order does not matter
        for leaf in ("qzeros", "scales", "qweight"):
            layer.load_weight(leaf, packed[shard_id][leaf], shard_id)
    assert layer.qweight.shape == (128, 16) and layer.scales.shape == (2, 128)
    assert layer.awq_group_size == GROUP
    assert torch.equal(layer.qweight[:, 8:12], packed[1]["qweight"])
    assert torch.equal(layer.scales[:, 96:], packed[2]["scales"].float())
    layer.process_weights_after_loading()
    layer.process_weights_after_loading()                # idempotent
    want = torch.cat([reference_dequantize(**p) for p in packed])        # float32
    x = torch.randn(5, 128, generator=g).to(dtype)
    # Kept packed (INT4_ZP blocks): exactly the dequantized weights, multiplied in
    # float32 (one rounding of the result for bfloat16).
    assert layer.int4_blocks is not None and not hasattr(layer, "weight")
    assert torch.equal(layer.quant_method.dequantized_weight(layer), want)
    ref = x.double() @ want.double().t()
    scale = x.abs().double() @ want.abs().double().t()
    y = layer(x)
    assert y.dtype == dtype
    rel = 0.0 if dtype == torch.float32 else 2 ** -8
    assert ((y.double() - ref).abs() <= rel * ref.abs() + 2e-6 * scale).all()
    assert not hasattr(layer, "qweight")


def test_groups_of_16_columns_are_served_dense_exactly():
    """Groups that do not fill whole 32-column blocks cannot be INT4_ZP rows: the
    layer is dequantized to a dense weight, bit for bit the reference."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 128, generator=g)
    packed = awq.pack_awq_weight(w, 4, 16)
    layer = Linear(128, 32, AWQLinearMethod(16), params_dtype=torch.float32)
    for leaf in ("qzeros", "scales", "qweight"):
        layer.load_weight(leaf, packed[leaf], None)
    layer.process_weights_after_loading()
    want = reference_dequantize(**packed)
    assert layer.int4_blocks is None and torch.equal(layer.weight, want)
    dense = Linear(128, 32, params_dtype=torch.float32)
    dense.load_weight("weight", want, None)
    dense.process_weights_after_loading()
    x = torch.randn(3, 128, generator=g)
    assert torch.equal(layer(x), dense(x))


def test_misshapen_and_foreign_tensors_raise_weight_load_error():
    from tandem.engine.model.linear import Linear

    w = torch.randn(64, 128)
    good = awq.pack_awq_weight(w, 4, GROUP)
    layer = _fused_layer()
    with pytest.raises(WeightLoadError, match=r"checkpoint shape \(128, 8\) != model shape "
                                              r"\(128, 4\)"):
        layer.load_weight("qweight", good["qweight"], 1)
    with pytest.raises(WeightLoadError, match="qweight must be int32"):
        layer.load_weight("qweight", good["qweight"].float(), 0)
    with pytest.raises(WeightLoadError, match="stores no 'weight'"):
        layer.load_weight("weight", w, 0)
    layer.load_weight("scales", good["scales"], 0)      # fixes the group size: 64
    with pytest.raises(WeightLoadError, match=r"checkpoint shape \(4, 4\) != model shape "
                                              r"\(2, 4\)"):
        layer.load_weight("qzeros", torch.zeros(4, 4, dtype=torch.int32), 1)
    with pytest.raises(WeightLoadError, match="3 group rows do not divide the input width 128"):
        _fused_layer().load_weight("scales", torch.zeros(3, 64, dtype=torch.float16), 0)
    with pytest.raises(WeightLoadError, match="not a multiple of group_size 48"):
        _fused_layer(group_size=48)
    with pytest.raises(WeightLoadError, match="output width 12 of sub-matrix 1 is not a multiple"):
        Linear(128, [64, 12], AWQLinearMethod())
    fixed = _fused_layer(group_size=32)                  # fixed by the config: no inference
    with pytest.raises(WeightLoadError, match=r"\(2, 64\) != model shape \(4, 64\)"):
        fixed.load_weight("scales", good["scales"], 0)


def test_method_from_quantization_config():
    qc = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
          "version": "GEMM"}
    assert AWQLinearMethod.from_config(qc).group_size == 64
    with pytest.raises(ValueError, match=r"^quantization_config.version: expected 'gemm', "
                                         r"got 'gemv'$"):
        AWQLinearMethod.from_config(qc | {"version": "gemv"})
    with pytest.raises(ValueError, match=r"^quantization_config.bits: expected 4, got 8$"):
        AWQLinearMethod.from_config(qc | {"bits": 8})


def test_registry_and_config_know_awq():
    from tandem.engine.config import EngineConfig
    from tandem.engine.quantization.registry import get_linear_method

    assert isinstance(get_linear_method("awq"), AWQLinearMethod)
    assert EngineConfig(quantization="awq").quantization == "awq"


# -- the real model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense():
    """The default model's config and float32 tensors (Hugging Face names)."""
    _, cfg, weights = load_dense(None)
    return cfg, weights


@pytest.fixture(scope="module")
def calibration_text():
    with open(CALIBRATION) as f:
        return f.read()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, calibration_text, tokenizer):
    """One AWQ run on the default model: 128 calibration tokens, coarse grids."""
    out = str(tmp_path_factory.mktemp("awq") / "ckpt")
    stats = awq.awq_quantize(None, out, calibration_text, group_size=GROUP,
                             num_calibration_tokens=128, calibration_seq_len=128, grid=2,
                             clip_grid=4, tokenizer=tokenizer)
    return out, stats


@pytest.fixture(scope="module", autouse=True)
def plain_float32_weights():
    """These tests load other weights into live float32 layers in place and read them
    back, which needs the layers' plain ``weight``: keep float32 dense layers on
    ``F.linear`` (not packed for oneDNN, whose packed copy would not follow an
    in-place load). bfloat16 packing is unchanged."""
    import tandem.engine.model.linear as linear_module

    real = linear_module.packing_available
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_module, "packing_available",
                   lambda dtype=torch.bfloat16: dtype != torch.float32 and real(dtype))
        yield


@pytest.fixture(scope="module")
def dense_llm():
    """A float32 engine of the default model without prefix caching: the tests load
    other weights into it in place."""
    from tandem.engine.llm import LLM

    return LLM(dtype="float32", num_blocks=16, enable_prefix_caching=False)


_rid = itertools.count()


def _logits(llm, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 logits of one sequence through the engine's model."""
    from tandem.engine.runtime.model_runner import pack_chunks

    engine = llm.engine
    kv = engine.kv_cache_manager
    rid = f"awq-test-{next(_rid)}"
    assert kv.allocate_slots(rid, 0, len(ids))
    try:
        t, pos, meta = pack_chunks([(ids, 0, kv.get_block_ids(rid))], kv.block_size,
                                   engine.device)
        with torch.inference_mode():
            hidden = engine.model(t, pos, engine.kv_cache.tensor, meta, engine.backend, None)
            return engine.model.compute_logits(hidden).float()
    finally:
        kv.free(rid)


PROMPT = "The old bridge over the river was repaired last spring, and now the"


def test_awq_search_beats_rtn_on_a_real_layer(dense, tokenizer, calibration_text):
    """Layer 14's blocks on the real calibration activations, computed as the folded
    model computes them (input divided by s, weight Q(W s)): AWQ's error <= RTN's in
    every group (alpha = 0 is RTN), and strictly smaller in at least one."""
    from tandem.kernels.reference import rope_cos_sin_cache

    cfg, weights = dense
    ids = awq.calibration_ids(tokenizer, calibration_text, 256, 256)
    cos_sin = rope_cos_sin_cache(cfg.head_dim, ids.shape[1], cfg.rope_theta)
    layer = 14
    with torch.no_grad():
        h = weights["model.embed_tokens.weight"][ids]
        for i in range(layer):
            h = decoder_layer(cfg, layer_weights(weights, i), h, cos_sin).out
        lw = {k: v.clone() for k, v in layer_weights(weights, layer).items()}
        acts = decoder_layer(cfg, lw, h, cos_sin)
        found = awq.awq_layer(cfg, {k: v.clone() for k, v in lw.items()}, acts, cos_sin, 4,
                              GROUP, grid=20, clip=False)
        assert found["o"] is None                       # GQA: v_proj -> o_proj not folded

        def q(w, s):
            return awq.fake_quantize(w * s, 4, GROUP)

        def errors(s_qkv, s_gu, s_down):
            x = acts.attn_in / s_qkv
            attn = attention_block(cfg, x, q(lw["q"], s_qkv), q(lw["k"], s_qkv),
                                   q(lw["v"], s_qkv), lw["o"], cos_sin)[1]
            x = acts.mlp_in / s_gu
            mlp = mlp_block(x, q(lw["gate"], s_gu), q(lw["up"], s_gu), lw["down"])[1]
            down = (acts.down_in / s_down) @ q(lw["down"], s_down).t()
            return [float((a - b).pow(2).mean()) for a, b in
                    [(attn, acts.attn_out), (mlp, acts.mlp_out), (down, acts.mlp_out)]]

        ones = torch.ones(1)
        rtn = errors(ones, ones, ones)
        got = errors(found["qkv"].scales, found["gate_up"].scales, found["down"].scales)
    for name, r, a in zip(("qkv", "gate_up", "down"), rtn, got):
        assert a <= r, (name, a, r)
        assert found[name].mse_awq <= found[name].mse_rtn
        assert found[name].mse_rtn == pytest.approx(r, rel=1e-5)
    assert any(a < 0.9 * r for a, r in zip(got, rtn)), (got, rtn)


def test_clip_search_never_increases_a_groups_error():
    """The Gram-matrix error equals the token-by-token partial-sum error, and the
    chosen bounds do at least as well as no clipping in every group."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 128, generator=g) * torch.rand(128, generator=g) * 4
    w = torch.randn(24, 128, generator=g)
    w[:, 5] *= 8                                          # an outlier channel to clip
    bound = awq.search_clip(w, x, 4, GROUP)
    m = w.reshape(24, 2, GROUP).abs().amax(-1)
    assert (bound <= m).all() and (bound >= 0.55 * m - 1e-6).all()
    assert (bound < m).any()

    def group_err(weight):
        d = (awq.fake_quantize(weight, 4, GROUP) - w).reshape(24, 2, GROUP)
        part = torch.einsum("ngk,tgk->ngt", d, x.reshape(300, 2, GROUP))
        return part.pow(2).mean(-1)

    clipped = w.clone()
    awq.apply_clip(clipped, bound, GROUP)
    assert (group_err(clipped) <= group_err(w) * (1 + 1e-5)).all()


def test_without_gqa_o_proj_scales_fold_into_v_proj_and_nothing_changes():
    """A small random Llama with as many KV heads as query heads: the searched
    scales of all four groups (o_proj's into v_proj's rows) fold without changing
    the float model's logits."""
    from tandem.engine.config import ModelConfig

    cfg = ModelConfig(hidden_size=128, intermediate_size=192, num_layers=2, num_heads=4,
                      num_kv_heads=4, head_dim=32, vocab_size=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_model_len=64, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(4)
    weights = {"model.embed_tokens.weight": torch.randn(64, 128, generator=g),
               "model.norm.weight": 1 + 0.1 * torch.randn(128, generator=g)}
    shapes = {"q": (128, 128), "k": (128, 128), "v": (128, 128), "o": (128, 128),
              "gate": (192, 128), "up": (192, 128), "down": (128, 192)}
    for i in range(2):
        for short, name in LINEAR_NAMES.items():
            w = torch.randn(shapes[short], generator=g) / shapes[short][1] ** 0.5
            weights[f"model.layers.{i}.{name}.weight"] = w
        for name in NORM_NAMES.values():
            weights[f"model.layers.{i}.{name}.weight"] = 1 + 0.1 * torch.randn(128, generator=g)
    ids = torch.randint(0, 64, (2, 48), generator=g)
    want = model_logits(cfg, weights, ids)
    folded = {k: v.clone() for k, v in weights.items()}
    found = awq.awq_transform(cfg, folded, ids, group_size=32, grid=4, clip=False)
    assert all(r["o"] is not None for r in found)
    assert any(r[k].alpha > 0 for r in found for k in ("qkv", "o", "gate_up", "down"))
    s = found[1]["o"].scales
    torch.testing.assert_close(folded["model.layers.1.self_attn.v_proj.weight"],
                               weights["model.layers.1.self_attn.v_proj.weight"] / s[:, None]
                               / (1 / found[1]["qkv"].scales))
    torch.testing.assert_close(model_logits(cfg, folded, ids), want, atol=1e-4, rtol=1e-4)


def test_folding_the_searched_scales_preserves_the_dense_model(dense, quantized, dense_llm,
                                                               tokenizer):
    cfg, weights = dense
    _, stats = quantized
    scales = stats["scales"]
    assert all(s["o"] is None for s in scales)
    assert any(float((s["qkv"] - 1).abs().max()) > 0.1 for s in scales)     # not trivial
    ids = tokenizer.encode(PROMPT)
    want = _logits(dense_llm, ids)
    folded = {k: v.clone() for k, v in weights.items()}
    awq.fold_scales(folded, cfg, scales)
    assert not torch.equal(folded["model.layers.3.input_layernorm.weight"],
                           weights["model.layers.3.input_layernorm.weight"])
    load_weights(dense_llm.engine.model, iter(folded.items()))
    got = _logits(dense_llm, ids)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The search's own float model agrees with the served one.
    torch.testing.assert_close(model_logits(cfg, weights, torch.tensor([ids]))[0], want,
                               atol=2e-3, rtol=1e-4)


def test_checkpoint_serves_as_its_dequantized_dense_model(quantized, dense_llm):
    from safetensors import safe_open

    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    path, stats = quantized
    assert (stats["calibration_tokens"], stats["calibration_sequences"]) == (128, 1)
    assert stats["skipped"] == ["v_proj -> o_proj: num_heads 9 != num_kv_heads 3 (GQA)"]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4,
                                             "group_size": GROUP, "zero_point": True,
                                             "version": "gemm"}
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    p = "model.layers.7"
    want = {f"{p}.self_attn.q_proj.qweight": (torch.int32, (576, 72)),
            f"{p}.self_attn.k_proj.qzeros": (torch.int32, (9, 24)),
            f"{p}.self_attn.o_proj.scales": (torch.float16, (9, 576)),
            f"{p}.mlp.up_proj.qweight": (torch.int32, (576, 192)),
            f"{p}.mlp.down_proj.qweight": (torch.int32, (1536, 72)),
            f"{p}.mlp.down_proj.scales": (torch.float16, (24, 576)),
            f"{p}.post_attention_layernorm.weight": (torch.float16, (576,)),
            "model.embed_tokens.weight": (torch.float16, (49152, 576))}
    assert {n: (tensors[n].dtype, tuple(tensors[n].shape)) for n in want} == want
    assert len(tensors) == 30 * (7 * 3 + 2) + 2          # no lm_head: tied
    assert not any(n.endswith("_proj.weight") for n in tensors)

    # The dense reference: every linear dequantized straight from the layout.
    dequantized = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            dequantized[f"{prefix}.weight"] = reference_dequantize(
                t, tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"])
        elif not name.endswith((".qzeros", ".scales")):
            dequantized[name] = t.float()
    load_weights(dense_llm.engine.model, iter(dequantized.items()))
    llm = LLM(path, quantization="awq", dtype="float32", num_blocks=16,
              enable_prefix_caching=False)
    ids = llm.tokenizer.encode(PROMPT)
    want_logits = _logits(dense_llm, ids)
    torch.testing.assert_close(_logits(llm, ids), want_logits, atol=1e-4, rtol=1e-5)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = llm.generate([ids], params)[0].outputs[0].token_ids
    assert got == dense_llm.generate([ids], params)[0].outputs[0].token_ids
    assert len(got) == 4


def test_a_misshapen_checkpoint_tensor_is_refused(quantized, dense):
    from safetensors import safe_open

    from tandem.engine.model.llama import LlamaForCausalLM

    path, _ = quantized
    cfg, _ = dense
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    name = "model.layers.2.self_attn.v_proj.qweight"
    tensors[name] = tensors[name][:, :16].contiguous()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, AWQLinearMethod())
    model = model.to_empty(device=torch.device("cpu"))
    with pytest.raises(WeightLoadError, match=r"^model.layers.2.self_attn.v_proj.qweight: "
                                              r"checkpoint shape \(576, 16\) != model shape "
                                              r"\(576, 24\) \(model.layers.2.self_attn"
                                              r".qkv_proj.qweight\)$"):
        load_weights(model, iter(tensors.items()))


def test_quantize_refuses_bad_arguments(tmp_path, calibration_text):
    with pytest.raises(ValueError, match=r"group_size: 128 does not divide the input "
                                         r"width\(s\) \[576\]"):
        awq.awq_quantize(None, str(tmp_path), calibration_text, group_size=128)
    with pytest.raises(ValueError, match="bits: the AWQ gemm layout packs 4-bit codes"):
        awq.awq_quantize(None, str(tmp_path), calibration_text, bits=3, group_size=GROUP)
