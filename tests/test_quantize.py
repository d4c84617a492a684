"""Quantization (``tandem quantize``): the GPTQ checkpoint layout, RTN and GPTQ on the
real model's layers and activations, and serving the checkpoints they write.

Exact where exact values exist: packing, the ``g_idx`` of act-order, the weights a
loaded checkpoint dequantizes to, and the served model against a dense model of
the same dequantized weights (token ids and log-probabilities, bit for bit).
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from tandem.engine.model.linear import Linear, UnquantizedLinearMethod, process_weights_after_loading
from tandem.engine.model.model_files import ModelFiles, resolve_model
from tandem.engine.model.weights import WeightLoadError
from tandem.engine.quantization.gptq_linear import GPTQLinearMethod
from tandem.engine.quantization.checkpoint import linear_method_for
from tandem.engine.quantization.packing import (dequantize_packed, pack_qweight, pack_zeros,
                                                unpack_qweight, unpack_zeros)
from tandem.quantize.autogptq import LINEAR_GROUPS, capture_inputs
from tandem.quantize.dense import calibration_segments, data_path, load_dense
from tandem.quantize.gptq import HessianAccumulator, gptq_quantize
from tandem.quantize.rtn import quantize_rtn

ROOT = Path(__file__).resolve().parents[1]
LAYER = 1           # the decoder layer whose real activations the layer tests use


@pytest.fixture(scope="module")
def dense():
    """``(files, config, float32 tensors)`` of the default model."""
    return load_dense(None)


@pytest.fixture(scope="module")
def activations(dense, tokenizer):
    """Layer ``LAYER``'s real inputs per linear group, on calibration and held-out
    text (dense model): ``{"calibration": {group: [T, K]}, "heldout": {...}}``."""
    _, cfg, tensors = dense
    out = {}
    for split, n in (("calibration", 1024), ("heldout", 512)):
        with open(data_path(f"{split}.txt"), encoding="utf-8") as f:
            segments = calibration_segments(tokenizer, f.read(), 256, n)
        out[split] = capture_inputs(cfg, tensors, segments, LAYER)
    return out


@pytest.fixture(scope="module")
def gptq_layer(dense, activations):
    """GPTQ with act-order of every linear of layer ``LAYER`` on its real calibration
    inputs, each group's linears stacked under their shared Hessian (the paper's
    ``2 X X^T``): ``({module name: QuantizedWeight}, {group: H})``."""
    tensors = dense[2]
    quantized, hessians = {}, {}
    for group, names in LINEAR_GROUPS.items():
        acc = HessianAccumulator(activations["calibration"][group].shape[1])
        acc.add(activations["calibration"][group])
        hessians[group] = acc.result()
        weights = [tensors[f"model.layers.{LAYER}.{n}.weight"] for n in names]
        q, _ = gptq_quantize(torch.cat(weights), hessians[group], 4, 128, desc_act=True)
        for name, part in zip(names, q.split_rows([w.shape[0] for w in weights])):
            quantized[f"model.layers.{LAYER}.{name}"] = part
    return quantized, hessians


# -- the layout ---------------------------------------------------------------------------------
def test_packing_round_trips_exactly_and_follows_the_autogptq_layout():
    # Eight 4-bit codes along K fill one int32, low nibble first: 0x87654321.
    codes = torch.arange(1, 9, dtype=torch.uint8).reshape(1, 8)          # [N=1, K=8]
    qweight = pack_qweight(codes, 4)
    assert qweight.dtype == torch.int32 and qweight.shape == (1, 1)
    assert int(qweight) == 0x87654321 - (1 << 32)
    # Zero points pack along N, stored as zero - 1 (mod 16): 0 -> 0xF.
    zeros = torch.arange(8, dtype=torch.uint8).reshape(1, 8)             # [G=1, N=8]
    qzeros = pack_zeros(zeros, 4)
    assert int(qzeros) == 0x6543210F
    assert torch.equal(unpack_zeros(qzeros, 4).long(), zeros.long())

    g = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        pf = 32 // bits
        c = torch.randint(0, 1 << bits, (3 * pf, 5 * pf), generator=g)      # [N, K]
        q = pack_qweight(c, bits)
        assert q.shape == (5, 3 * pf) and q.dtype == torch.int32
        assert torch.equal(unpack_qweight(q, bits).long(), c)
        z = torch.randint(0, 1 << bits, (4, 3 * pf), generator=g)          # [G, N]
        assert torch.equal(unpack_zeros(pack_zeros(z, bits), bits).long(), z)
        assert torch.equal(unpack_zeros(pack_zeros(z, bits, 0), bits, 0).long(), z)
    with pytest.raises(ValueError, match="cannot be packed in 4 bits"):
        pack_qweight(torch.full((1, 8), 16), 4)


def test_rtn_is_round_to_nearest_per_group(dense):
    w = dense[2]["model.layers.0.self_attn.o_proj.weight"]                 # [576, 576]
    q = quantize_rtn(w, 4, 128)
    assert q.scales.shape == (5, 576) and q.zeros.shape == (5, 576)        # ceil(576 / 128)
    assert torch.equal(q.g_idx, (torch.arange(576) // 128).int())
    # Row 7, group 2, by the formula: scale = (max - min) / 15 in float16,
    # zero = round(-min / scale), code = clamp(round(w / scale) + zero, 0, 15).
    x = w[7, 256:384]
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = torch.tensor((hi - lo) / 15).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    assert float(q.scales[2, 7]) == float(scale) and int(q.zeros[2, 7]) == int(zero)
    assert torch.equal(q.codes[7, 256:384].long(),
                       torch.clamp(torch.round(x / scale) + zero, 0, 15).long())
    # Nearest level: half a step, plus what rounding the scale to float16 (a
    # relative 2**-11) can move the top of a 15-step range.
    err = (q.dequantize() - w).abs() / q.scales.float()[q.g_idx.long()].t()
    assert float(err.max()) <= 0.5 + 15 * 2 ** -11


# -- GPTQ on the real model -----------------------------------------------------------------------
def test_gptq_has_lower_output_error_than_rtn_on_real_activations(dense, activations, gptq_layer):
    tensors = dense[2]
    quantized, _ = gptq_layer
    for group, names in LINEAR_GROUPS.items():
        for name in names:
            module = f"model.layers.{LAYER}.{name}"
            w = tensors[module + ".weight"]
            gptq, rtn = quantized[module], quantize_rtn(w, 4, 128)
            assert gptq.scales.shape == rtn.scales.shape and gptq.codes.dtype == torch.uint8
            # On the calibration inputs (what GPTQ minimises) for every linear, and
            # on held-out text for those of the 576-wide inputs.
            splits = ("calibration", "heldout") if w.shape[1] == 576 else ("calibration",)
            for split in splits:
                x = activations[split][group]
                ref = x @ w.t()
                err_gptq = float(torch.linalg.norm(ref - x @ gptq.dequantize().t()))
                err_rtn = float(torch.linalg.norm(ref - x @ rtn.dequantize().t()))
                assert err_gptq < err_rtn, (name, split, err_gptq, err_rtn)


def test_act_order_records_g_idx_of_its_permutation(gptq_layer):
    quantized, hessians = gptq_layer
    h = hessians["gate_up"]
    perm = torch.argsort(torch.diag(h), descending=True, stable=True)
    for name in LINEAR_GROUPS["gate_up"]:
        q = quantized[f"model.layers.{LAYER}.{name}"]                      # [1536, 576]
        assert q.desc_act and q.codes.shape == (1536, 576)
        # The p-th column visited belongs to group p // 128.
        assert torch.equal(q.g_idx[perm].long(), torch.arange(576) // 128)
        assert not torch.equal(q.g_idx, (torch.arange(576) // 128).int())    # really permuted
        assert torch.bincount(q.g_idx.long()).tolist() == [128, 128, 128, 128, 64]
        packed = q.pack()
        assert torch.equal(dequantize_packed(packed["qweight"], packed["qzeros"],
                                             packed["scales"], packed["g_idx"], 4),
                           q.dequantize())


# -- serving --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory):
    """``tandem quantize --method rtn`` of the default model, through the CLI."""
    from tandem.router.cli import main

    out = tmp_path_factory.mktemp("quantized") / "rtn"
    assert main(["quantize", "--method", "rtn", "--output", str(out),
                 "--num-calibration-tokens", "64"]) == 0
    return str(out)


def _dense_copy(quantized_dir: str, out: Path, dtype: torch.dtype) -> str:
    """A dense checkpoint of a quantized one's dequantized weights (rounded to
    ``dtype`` once, as the served model rounds them), its config without
    ``quantization_config``, the same tokenizer files. GPTQ layout (``g_idx``) or
    AutoAWQ's gemm layout."""
    from safetensors.torch import load_file, save_file

    from tandem.engine.quantization.awq_linear import dequantize_awq

    sd = load_file(os.path.join(quantized_dir, "model.safetensors"))
    dense = {}
    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "qweight" and f"{module}.g_idx" not in sd:
            dense[f"{module}.weight"] = dequantize_awq(t, sd[f"{module}.qzeros"],
                                                       sd[f"{module}.scales"]).to(dtype)
        elif leaf == "qweight":
            dense[f"{module}.weight"] = dequantize_packed(
                t, sd[f"{module}.qzeros"], sd[f"{module}.scales"], sd[f"{module}.g_idx"],
                4).to(dtype)
        elif leaf not in ("qzeros", "scales", "g_idx"):
            dense[name] = t.to(dtype)
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"))
    config = json.loads(Path(quantized_dir, "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(quantized_dir, name)):   # tiny checkpoints: no template
            shutil.copy(os.path.join(quantized_dir, name), out / name)
    return str(out)


def test_quantize_cli_writes_a_checkpoint_served_as_gptq_like_its_dense_dequantization(
        rtn_checkpoint, dense, tmp_path):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    files = sorted(os.listdir(rtn_checkpoint))
    assert {"config.json", "quantize_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    config = json.loads(Path(rtn_checkpoint, "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"],
            qc["checkpoint_format"], qc["meta"]["method"]) == ("gptq", 4, 128, False, False,
                                                               "gptq", "rtn")
    assert json.loads(Path(rtn_checkpoint, "quantize_config.json").read_text())["bits"] == 4

    llm = LLM(rtn_checkpoint, num_blocks=16, dtype="float32")      # quantization "none"
    model = llm.engine.model
    layer = model.model.layers[2].self_attn.qkv_proj
    assert isinstance(layer.quant_method, GPTQLinearMethod)
    # Kept packed: 960 rows of 576 / 32 blocks of 19 bytes; the checkpoint's int32
    # tensors are dropped once repacked.
    assert layer.int4_blocks.shape == (960, 18 * 19) and layer.int4_blocks.dtype == torch.uint8
    assert layer.int4_perm is None and not hasattr(layer, "qweight")
    assert not hasattr(layer, "weight")
    # The loaded tensors dequantize to exactly the RTN of the source's weights.
    tensors = dense[2]
    want = torch.cat([quantize_rtn(tensors[f"model.layers.2.self_attn.{p}_proj.weight"]).dequantize()
                      for p in "qkv"])
    assert torch.equal(layer.quant_method.dequantized_weight(layer), want)
    down = model.model.layers[29].mlp.down_proj
    assert torch.equal(down.quant_method.dequantized_weight(down),
                       quantize_rtn(tensors["model.layers.29.mlp.down_proj.weight"]).dequantize())

    # A dense model of the same dequantized weights: the same tokens, and prompt
    # logprobs equal up to the float32 summation order of the packed kernels.
    reference = LLM(_dense_copy(rtn_checkpoint, tmp_path / "dense", torch.float32),
                    num_blocks=16, dtype="float32")
    assert isinstance(reference.engine.model.model.layers[2].self_attn.qkv_proj.quant_method,
                      UnquantizedLinearMethod)
    prompt = llm.tokenizer.encode("The history of the printing press")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    got, want = llm.generate([prompt], params)[0], reference.generate([prompt], params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 2e-4


def test_a_gptq_checkpoint_loads_to_exactly_the_quantizer_weights(rtn_checkpoint, gptq_layer):
    """The RTN checkpoint with layer ``LAYER``'s tensors replaced by GPTQ's (act-order),
    loaded by the model loader into the ``gptq`` method."""
    from tandem.engine.config import ModelConfig
    from tandem.engine.model.llama import LlamaForCausalLM
    from tandem.engine.model.weights import iter_safetensors, load_weights

    quantized, _ = gptq_layer
    tensors = dict(iter_safetensors(rtn_checkpoint))
    for module, q in quantized.items():
        for leaf, t in q.pack().items():
            assert tensors[f"{module}.{leaf}"].shape == t.shape
            tensors[f"{module}.{leaf}"] = t
    method = GPTQLinearMethod.from_config({"bits": 4, "group_size": 128, "desc_act": True})
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf_config(rtn_checkpoint), method)
    model = model.to_empty(device=torch.device("cpu"))
    load_weights(model, iter(tensors.items()))
    process_weights_after_loading(model)

    layer = model.model.layers[LAYER]
    for fused, names in ((layer.self_attn.qkv_proj, LINEAR_GROUPS["qkv"]),
                         (layer.self_attn.o_proj, LINEAR_GROUPS["o"]),
                         (layer.mlp.gate_up_proj, LINEAR_GROUPS["gate_up"]),
                         (layer.mlp.down_proj, LINEAR_GROUPS["down"])):
        parts = [quantized[f"model.layers.{LAYER}.{n}"] for n in names]
        assert torch.equal(fused.g_idx, parts[0].g_idx)
        want = torch.cat([p.dequantize() for p in parts])                 # float32
        # Kept packed, columns sorted by act-order group: exactly those weights.
        assert fused.int4_blocks is not None and fused.int4_perm is not None
        assert torch.equal(fused.quant_method.dequantized_weight(fused), want)
        x = torch.randn(3, fused.in_features, generator=torch.Generator().manual_seed(0))
        ref = x.double() @ want.double().T
        scale = x.abs().double() @ want.abs().double().T
        assert ((fused(x).double() - ref).abs() <= 1e-5 * scale).all()


def test_bad_gptq_tensors_raise_weight_load_errors_naming_them(rtn_checkpoint):
    from tandem.engine.model.llama import LlamaForCausalLM
    from tandem.engine.model.weights import iter_safetensors, load_weights
    from tandem.engine.config import ModelConfig

    files = resolve_model(rtn_checkpoint)
    cfg = ModelConfig.from_hf_config(rtn_checkpoint)
    method = linear_method_for(files, "gptq")

    def build():
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, method)
        return model.to_empty(device=torch.device("cpu"))

    tensors = dict(iter_safetensors(rtn_checkpoint))
    name = "model.layers.3.self_attn.k_proj.qweight"
    bad = dict(tensors, **{name: tensors[name][:-1]})
    with pytest.raises(WeightLoadError, match=r"^model\.layers\.3\.self_attn\.k_proj\.qweight: "
                                              r"checkpoint shape \(71, 192\) != model shape "
                                              r"\(72, 192\)"):
        load_weights(build(), iter(bad.items()))
    g_idx = "model.layers.0.mlp.up_proj.g_idx"
    bad = dict(tensors, **{g_idx: torch.flip(tensors[g_idx], [0]).contiguous()})
    with pytest.raises(WeightLoadError, match=r"^model\.layers\.0\.mlp\.up_proj\.g_idx: g_idx of "
                                              r"sub-matrix 1 differs from that of sub-matrix 0"):
        load_weights(build(), iter(bad.items()))
    qzeros = "model.layers.0.mlp.down_proj.qzeros"
    bad = dict(tensors, **{qzeros: tensors[qzeros].float()})
    with pytest.raises(WeightLoadError, match="qzeros: expected int32, got torch.float32"):
        load_weights(build(), iter(bad.items()))

    # qzeros packs 8 outputs per int32: a fused sub-matrix of 12 outputs cannot be
    # placed at its column offset.
    with pytest.raises(WeightLoadError, match=r"output sizes \[16, 12\] are not all multiples of 8"):
        Linear(64, [16, 12], GPTQLinearMethod())


def test_quantization_follows_the_checkpoint_or_names_the_conflict(tmp_path, rtn_checkpoint):
    assert isinstance(linear_method_for(resolve_model(rtn_checkpoint), "none"), GPTQLinearMethod)
    with pytest.raises(ValueError, match=r"^quantization: 'gptq' loads checkpoints quantized "
                                         r"with it .* has no quantization_config"):
        linear_method_for(resolve_model(None), "gptq")
    exl2 = tmp_path / "exl2"
    exl2.mkdir()
    (exl2 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl2"}}))
    with pytest.raises(ValueError, match=r"^quantization: .* quantized with quant_method 'exl2', "
                                         r"which is not served"):
        linear_method_for(ModelFiles(str(exl2), "hf", "exl2"), "none")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "gptq_v2"}}))
    method = linear_method_for(ModelFiles(str(v2), "hf", "v2"), "gptq")
    assert (method.bits, method.group_size, method.zero_offset) == (4, 64, 0)


def _gptq_layer(q, group_size: int, dtype: torch.dtype) -> Linear:
    layer = Linear(64, 48, GPTQLinearMethod(group_size=group_size), params_dtype=dtype)
    for name, t in q.pack().items():
        layer.load_weight(name, t, None)
    process_weights_after_loading(layer)
    process_weights_after_loading(layer)                 # idempotent
    return layer


def test_gptq_layer_in_bfloat16_packed_and_dense():
    """Groups of 32 columns: kept packed, bfloat16 activations multiplied by the exact
    float32 weights (one rounding of the result). Groups of 16 (not whole 32-column
    blocks): the dequantized weight goes through the dense method's bfloat16 kernels,
    bit for bit a dense layer."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(5, 64, generator=g).bfloat16()
    q = quantize_rtn(w, 4, 32)
    layer = _gptq_layer(q, 32, torch.bfloat16)
    assert layer.int4_blocks is not None and not hasattr(layer, "weight")
    assert torch.equal(layer.quant_method.dequantized_weight(layer), q.dequantize())
    y = layer(x)
    ref = x.double() @ q.dequantize().double().T
    scale = x.abs().double() @ q.dequantize().abs().double().T
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6 * scale).all()

    q16 = quantize_rtn(w, 4, 16)
    layer = _gptq_layer(q16, 16, torch.bfloat16)
    assert layer.int4_blocks is None and layer.gptq_dequantized
    dense = Linear(64, 48, params_dtype=torch.bfloat16)
    dense.load_weight("weight", q16.dequantize(), None)
    process_weights_after_loading(dense)
    assert torch.equal(layer(x), dense(x))
    assert torch.equal(layer.quant_method.dequantized_weight(layer), q16.dequantize())


def test_calibration_and_heldout_texts_ship_with_the_package():
    texts = {}
    for name in ("calibration", "heldout"):
        with open(data_path(f"{name}.txt"), encoding="utf-8") as f:
            texts[name] = f.read()
    assert 11_000 <= len(texts["calibration"]) <= 14_000
    assert 7_000 <= len(texts["heldout"]) <= 9_000
    sentences = {s.strip() for s in texts["calibration"].split(".") if len(s.strip()) > 30}
    assert not any(s.strip() in sentences for s in texts["heldout"].split("."))
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "tandem.quantize" in setup["packages"]
    assert setup["package-data"]["tandem.quantize"] == ["data/*.txt"]


def test_gptq_checkpoint_with_int8_activations(rtn_checkpoint, monkeypatch):
    """``activation_quantization="int8"`` on a GPTQ checkpoint: every packed layer's
    decode-sized product multiplies the INT4_ZP blocks by int8 activation blocks, as
    the torch reference computes it on the same activations (act-order gathers come
    first: the reference sees the gathered columns)."""
    from tandem.engine.llm import LLM
    from tandem.engine.model.linear import Linear
    from tandem.engine.quantization import int4_packed
    from tandem.engine.sampling.sampling_params import SamplingParams
    from tandem.kernels.cpu.gguf_linear import MAX_INT8_ROWS
    from tandem.kernels.reference import gguf_linear_int8_reference

    llm = LLM(rtn_checkpoint, num_blocks=16, dtype="float32", activation_quantization="int8")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    packed = [m for m in layers if getattr(m, "int4_blocks", None) is not None]
    assert len(packed) == 4 * llm.engine.model_config.num_layers
    assert all(m.int8_activations for m in packed)
    assert not llm.engine.model.lm_head.int8_activations       # the checkpoint's dense head
    kernel, calls = int4_packed.gguf_linear, []

    def checked(x, blocks, qtype, in_features, fused_only=False, activations="float"):
        y = kernel(x, blocks, qtype, in_features, fused_only, activations)
        if activations == "int8" and len(x) <= MAX_INT8_ROWS:
            ref = gguf_linear_int8_reference(x, blocks, qtype, in_features)
            calls.append(float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
        return y

    monkeypatch.setattr(int4_packed, "gguf_linear", checked)
    prompt = llm.tokenizer.encode("The history of the printing press")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert len(calls) >= 3 * len(packed) and max(calls) < 1e-5
