"""``tandem quantize`` on mixture-of-experts checkpoints: round-to-nearest, GPTQ and
AWQ int4 of Mixtral's, Qwen2-MoE's and Qwen3-MoE's Hugging Face checkpoints, and GGUF
requantization (Q4_0, Q4_K) of a Mixtral GGUF file and (Q8_0) of a Qwen3-MoE one,
every expert included. Each
result loads in the engine with its experts kept quantized and gives the greedy ids
of a dense model of the same dequantized weights, with prompt log-probabilities
within 2e-4 (the bound of the dense quantize tests: only the kernels' float32
summation order differs)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tandem.engine.llm import LLM
from tandem.engine.model.registry import UnsupportedModelError
from tandem.kernels.cpu.gguf_linear import gguf_kernels_available
from tandem.router.cli import main
from tests.models.conftest import save_tiny_checkpoint
from tests.models.gguf_files import write_gguf
from tests.models.test_architectures import CASES
from tests.models.test_quantized_experts import (GGUF_CASES, MIXTRAL_256, _expert_linears,
                                                 assert_same_greedy)
from tests.test_quantize import _dense_copy

pytestmark = pytest.mark.skipif(not gguf_kernels_available(),
                                reason="compiled CPU kernels unavailable")


@pytest.mark.parametrize("case, projs", [("mixtral", ("w1", "w3", "w2")),
                                         ("qwen2-moe", ("gate_proj", "up_proj", "down_proj")),
                                         ("qwen3-moe", ("gate_proj", "up_proj", "down_proj"))])
def test_rtn_int4_quantizes_every_expert(case, projs, tmp_path):
    from safetensors.torch import load_file

    from tandem.quantize.rtn import quantize_rtn

    config_class, overrides, arch = CASES[case]
    if case == "qwen2-moe":          # a shared expert of whole groups of 32 (not 48 wide)
        overrides = overrides | {"shared_expert_intermediate_size": 64}
    src = tmp_path / "hf"
    save_tiny_checkpoint(src, config_class, **overrides)
    out = tmp_path / "rtn"
    assert main(["quantize", "--method", "rtn", "--model", str(src), "--output", str(out),
                 "--group-size", "32"]) == 0

    source = load_file(str(src / "model.safetensors"))
    state = load_file(str(out / "model.safetensors"))
    # routed experts, and Qwen2-MoE's shared expert
    expert_weights = [n for n in source if ".experts." in n or ".shared_expert." in n]
    assert expert_weights
    for name in expert_weights:       # every expert projection packed, as RTN computes it
        module = name.removesuffix(".weight")
        assert name not in state and module.rsplit(".", 1)[1] in projs
        want = quantize_rtn(source[name], 4, 32).pack()
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            assert torch.equal(state[f"{module}.{leaf}"], want[leaf]), f"{module}.{leaf}"
    routers = [n for n in source if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                                                "mlp.shared_expert_gate.weight"))]
    assert routers and all(state[n].dtype == torch.float16 for n in routers)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert config["quantization_config"]["quant_method"] == "gptq"

    int4 = LLM(str(out), dtype="float32", num_blocks=64)
    assert int4.engine.model_config.architecture == arch
    layers = _expert_linears(int4)
    moe = int4.engine.model_config.moe
    assert len(layers) == 2 * moe.num_experts * sum(moe.sparse_layers)
    assert {m.quant_method.name for m in layers} == {"gptq"}
    assert all(m.int4_blocks is not None for m in layers)
    if moe.shared_expert_intermediate_size:
        shared = [layer.mlp.shared_expert for layer in int4.engine.model.model.layers
                  if hasattr(layer.mlp, "shared_expert")]
        assert shared and all(p.int4_blocks is not None for s in shared
                              for p in (s.gate_up_proj, s.down_proj))
    dense = LLM(_dense_copy(str(out), tmp_path / "dense", torch.float32), dtype="float32",
                num_blocks=64)
    assert not _expert_linears(dense)
    assert_same_greedy(int4, dense)


@pytest.mark.parametrize("method, qtype, case", [
    ("q4_0", QT.Q4_0, CASES["mixtral"]), ("q4_k", QT.Q4_K, MIXTRAL_256),
    ("q8_0", QT.Q8_0, GGUF_CASES["qwen3-moe-q8_0"][0])])
def test_gguf_requantization_quantizes_the_experts(method, qtype, case, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize, quantize

    from tandem.quantize.kquants import quantize_q4_k

    config_class, overrides, arch = case
    save_tiny_checkpoint(tmp_path / "hf", config_class, **overrides)
    src = write_gguf(tmp_path / "hf", tmp_path / "f32.gguf")
    dst = tmp_path / f"{method}.gguf"
    assert main(["quantize", "--method", method, "--model", str(src), "--output", str(dst)]) == 0

    before = {t.name: t for t in GGUFReader(src).tensors}
    after = {t.name: t for t in GGUFReader(dst).tensors}
    experts = [n for n in after if "_exps." in n]
    assert experts
    for name in experts:      # each expert's rows quantized in place
        assert QT(after[name].tensor_type) == qtype
        w = np.asarray(before[name].data, dtype=np.float32)
        want = quantize_q4_k(w) if qtype == QT.Q4_K else quantize(w, qtype)
        assert np.array_equal(np.asarray(after[name].data), want), name
        assert dequantize(after[name].data, qtype).shape == w.shape
    routers = [n for n in after if ".ffn_gate_inp." in n]
    assert routers and {QT(after[n].tensor_type) for n in routers} == {QT.F32}

    packed = LLM(str(dst), dtype="float32", num_blocks=64, quantization="gguf")
    assert packed.engine.model_config.architecture == arch
    layers = _expert_linears(packed)
    assert layers and {m.qtype for m in layers} == {int(qtype)}
    assert sum(m.qweight.numel() for m in layers) == sum(int(after[n].n_bytes) for n in experts)
    assert_same_greedy(packed, LLM(str(dst), dtype="float32", num_blocks=64))


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_awq_scales_experts_and_keeps_the_routing(case, tmp_path):
    """AWQ on a tiny Mixtral, Qwen2-MoE (shared expert, q/k/v biases) and Qwen3-MoE
    (Q/K norms, a dense layer 0), groups of 32: one scale for the MoE block's input
    over every expert's gate and up, folded into the norm and, exactly, into the
    router's and the shared expert gate's columns (the searched scales folded alone
    leave the float model's logits unchanged: the routing did not move); a down
    scale per expert reached; every expert projection packed in the gemm layout and
    served as INT4 blocks with the greedy ids of the same checkpoint dequantized; and
    on the calibration tokens its logits are closer to the float model's than plain
    round-to-nearest's (the same quantizer with the search and clipping off). AWQ
    was refused for mixture-of-experts models before."""
    from safetensors.torch import load_file

    from tandem.engine.text.tokenizer import Tokenizer
    from tandem.quantize.awq import awq_quantize, fold_scales
    from tandem.quantize.dense import calibration_segments, load_dense, model_logits

    config_class, overrides, arch = CASES[case]
    if case == "qwen2-moe":          # a shared expert of whole groups of 32 (not 48 wide)
        overrides = overrides | {"shared_expert_intermediate_size": 64}
    save_tiny_checkpoint(tmp_path / "hf", config_class, **overrides)
    rng = random.Random(0)         # the tiny tokenizer's words, w3 .. w511
    text = " ".join(f"w{rng.randrange(3, 512)}" for _ in range(1024))
    runs = {"awq": {}, "rtn": {"grid": 1, "clip": False}}
    stats = {m: awq_quantize(str(tmp_path / "hf"), str(tmp_path / m), text, group_size=32,
                             num_calibration_tokens=1024, calibration_seq_len=256, **kw)
             for m, kw in runs.items()}
    dense = load_dense(str(tmp_path / "hf"), moe=True)
    moe = dense.cfg.moe
    sparse = [i for i, s in enumerate(moe.sparse_layers) if s]
    for i in sparse:
        layer = stats["awq"]["layers"][i]
        assert layer["gate_up"]["mse_awq"] <= layer["gate_up"]["mse_rtn"]
        assert layer["down"] is None and len(layer["experts_down"]) == \
            moe.num_experts + (case == "qwen2-moe")
        assert all(v is not None for v in layer["experts_down"].values())   # all reached

    tokenizer = Tokenizer(dense.files)
    ids = calibration_segments(tokenizer, text, 256, 256)[0][None]
    want = model_logits(dense.cfg, dense.weights, ids)
    folded = {k: v.clone() for k, v in dense.weights.items()}
    fold_scales(folded, dense.cfg, stats["awq"]["scales"])
    routers = [n for n in folded if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]
    assert routers and not all(torch.equal(folded[n], dense.weights[n]) for n in routers)
    torch.testing.assert_close(model_logits(dense.cfg, folded, ids), want, rtol=1e-4, atol=1e-4)

    state = load_file(str(tmp_path / "awq" / "model.safetensors"))
    experts = [n.removesuffix(".weight") for n in dense.weights
               if ".experts." in n or ".shared_expert." in n]
    assert experts and all(f"{m}.qweight" in state and f"{m}.weight" not in state for m in experts)
    assert all(state[n].dtype == torch.float16 for n in routers)
    packed = LLM(str(tmp_path / "awq"), dtype="float32", num_blocks=64)
    assert packed.engine.model_config.architecture == arch
    layers = _expert_linears(packed)
    assert layers and {m.quant_method.name for m in layers} == {"awq"}
    assert all(m.int4_blocks is not None for m in layers)
    assert_same_greedy(packed, LLM(_dense_copy(str(tmp_path / "awq"), tmp_path / "dense",
                                               torch.float32), dtype="float32", num_blocks=64))

    errors = {}
    for m in runs:
        sd = load_file(str(_dense_copy(str(tmp_path / m), tmp_path / f"{m}-dense", torch.float32))
                       + "/model.safetensors")
        weights = {n: sd[n].float() if n in sd else w for n, w in dense.weights.items()}
        errors[m] = float((model_logits(dense.cfg, weights, ids) - want).pow(2).mean())
    print(f"\nlogit mean squared error against the float model: {errors}")
    assert errors["awq"] < errors["rtn"], errors


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_gptq_quantizes_experts_from_their_routed_tokens(case, tmp_path):
    """GPTQ on a tiny Mixtral, Qwen2-MoE (q/k/v biases, a shared expert behind its
    sigmoid gate) and Qwen3-MoE (Q/K norms, a dense layer 0; groups of
    32): every expert projection packed, each
    from the Hessian of the calibration tokens routed to it (an expert none reached
    rounded to nearest; the shared expert from every token); the checkpoint serves its experts as INT4 blocks with the
    greedy ids of the same checkpoint dequantized; and on the
    calibration tokens its logits are closer to the float model's than those of
    round-to-nearest, which GPTQ's error feedback is for. The calibration forward's
    logits are transformers' (routing, biases, shared expert, Q/K norms)."""
    from tandem.quantize.autogptq import quantize_model
    from tandem.quantize.dense import calibration_segments, load_dense, model_logits

    config_class, overrides, _ = CASES[case]
    if case == "qwen2-moe":          # a shared expert of whole groups of 32 (not 48 wide)
        overrides = overrides | {"shared_expert_intermediate_size": 64}
    hf_model = save_tiny_checkpoint(tmp_path / "hf", config_class, **overrides)
    # Text in the tiny tokenizer's words (w3 .. w511): any other text is all <unk>.
    rng = random.Random(0)
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(" ".join(f"w{rng.randrange(3, 512)}" for _ in range(1024)))
    results = {m: quantize_model(str(tmp_path / "hf"), str(tmp_path / m), m, group_size=32,
                                 calibration_file=str(calibration) if m == "gptq" else None)
               for m in ("gptq", "rtn")}
    gptq = results["gptq"]
    dense = load_dense(str(tmp_path / "hf"), moe=True)
    experts = [n.removesuffix(".weight") for n in dense.weights
               if ".experts." in n or ".shared_expert." in n]
    assert experts and set(experts) <= set(gptq.quantized)
    assert any(".shared_expert." in n for n in experts) == (case == "qwen2-moe")
    assert set(gptq.losses) | set(gptq.rtn_experts) >= set(experts)
    assert not gptq.rtn_experts                 # 1,024 varied tokens reach every expert
    assert gptq.quantization_config["meta"]["method"] == "gptq"

    packed = LLM(str(tmp_path / "gptq"), dtype="float32", num_blocks=64)
    layers = _expert_linears(packed)
    assert layers and all(m.int4_blocks is not None for m in layers)
    assert_same_greedy(packed, LLM(_dense_copy(str(tmp_path / "gptq"), tmp_path / "dense",
                                               torch.float32), dtype="float32", num_blocks=64))

    tokens = calibration_segments(packed.tokenizer, calibration.read_text(), 256, 256)[0][None]
    want = model_logits(dense.cfg, dense.weights, tokens)
    with torch.no_grad():          # the calibration forward is the model transformers runs
        torch.testing.assert_close(want, hf_model(tokens).logits, rtol=1e-4, atol=1e-4)
    errors = {}
    for m, result in results.items():
        weights = {n: (result.quantized[n.removesuffix(".weight")].dequantize()
                       if n.removesuffix(".weight") in result.quantized else w)
                   for n, w in dense.weights.items()}
        errors[m] = float((model_logits(dense.cfg, weights, tokens) - want).pow(2).mean())
    print(f"\nlogit mean squared error against the float model, calibration tokens: {errors}")
    assert errors["gptq"] < errors["rtn"], errors


def test_stacked_experts_load_as_their_per_expert_tensors(tmp_path):
    """transformers 5's stacked ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows,
    then up rows) and ``experts.down_proj`` ``[E, H, I]`` load as the per-expert
    tensors they stack."""
    from safetensors.torch import load_file, save_file

    from tandem.quantize.dense import load_dense

    config_class, overrides, _ = CASES["qwen3-moe"]
    src = tmp_path / "hf"
    save_tiny_checkpoint(src, config_class, **overrides)
    state = load_file(str(src / "model.safetensors"))
    stacked_dir = tmp_path / "stacked"
    stacked_dir.mkdir()
    stacked = {n: t for n, t in state.items() if ".experts." not in n}
    p = "model.layers.1.mlp.experts"      # layer 0 is dense (mlp_only_layers)
    stacked[f"{p}.gate_up_proj"] = torch.stack([torch.cat(
        [state[f"{p}.{e}.gate_proj.weight"], state[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
    stacked[f"{p}.down_proj"] = torch.stack([state[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    save_file(stacked, str(stacked_dir / "model.safetensors"))
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (stacked_dir / f.name).write_bytes(f.read_bytes())
    a, b = load_dense(str(src), forward=False), load_dense(str(stacked_dir), forward=False)
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)
