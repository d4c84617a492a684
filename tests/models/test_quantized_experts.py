"""Mixture-of-experts models whose expert weights stay quantized: a GGUF file's
``ffn_*_exps`` blocks kept packed per expert (``quantization="gguf"``), and GPTQ / AWQ
checkpoints' per-expert int4 tensors in INT4_ZP blocks. Each against the same weights
dequantized into a dense model: greedy ids equal, prompt logprobs equal up to the
kernels' float32 summation order (float32 activations); and the expert bytes held are
exactly the quantized format's."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tandem.engine.llm import LLM
from tandem.engine.model.linear import Linear
from tandem.engine.model.moe import QuantizedExpert
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.kernels.cpu.gguf_linear import gguf_kernels_available
from tests.models.conftest import save_tiny_checkpoint
from tests.models.gguf_files import write_gguf
from tests.models.test_architectures import CASES, _prompts

pytestmark = pytest.mark.skipif(not gguf_kernels_available(),
                                reason="compiled CPU kernels unavailable")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
# Q4_K needs rows of whole 256-weight super-blocks: a Mixtral 256 wide (8 heads of 32).
MIXTRAL_256 = ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                 "hidden_size": 256, "intermediate_size": 256,
                                 "num_attention_heads": 8, "head_dim": 32,
                                 "num_hidden_layers": 1}, "MixtralForCausalLM")


def _block_weights(qtype: QT) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][0]


def quantize_gguf(src: pathlib.Path, dst: pathlib.Path, qtype: QT) -> pathlib.Path:
    """A copy of the float32 GGUF file ``src`` with every matrix (2-D and the stacked
    3-D experts) in ``qtype`` where its rows are whole blocks of it, else in Q8_0 or,
    failing that too, F32; the routers (``ffn_gate_inp``) and the norms stay F32, as
    llama-quantize leaves them."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.quants import quantize

    from tandem.quantize.gguf_writer import field_value
    from tandem.quantize.kquants import quantize_q4_k, quantize_q6_k

    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            value, vtype, etype = field_value(field)
            writer.add_key_value(key, value, vtype, sub_type=etype)
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape(
            [int(x) for x in reversed(t.shape.tolist())])
        fits = [q for q in (qtype, QT.Q8_0) if data.shape[-1] % _block_weights(q) == 0]
        if data.ndim < 2 or ".ffn_gate_inp." in t.name or not fits:
            writer.add_tensor(t.name, data)
            continue
        out = fits[0]
        kquant = {QT.Q4_K: quantize_q4_k, QT.Q6_K: quantize_q6_k}.get(out)
        writer.add_tensor(t.name, quantize(data, out) if kquant is None else kquant(data),
                          raw_dtype=out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _expert_linears(llm: LLM) -> list[Linear]:
    return [m for e in llm.engine.model.modules() if isinstance(e, QuantizedExpert)
            for m in (e.gate_up_proj, e.down_proj)]


def assert_same_greedy(quantized: LLM, dense: LLM) -> None:
    for a, b in zip(quantized.generate(_prompts(), GREEDY), dense.generate(_prompts(), GREEDY)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert lp_a.token_id == lp_b.token_id
            assert math.isclose(lp_a.logprob, lp_b.logprob, abs_tol=2e-4)


GGUF_CASES = {
    "mixtral-q4_0": (CASES["mixtral"], QT.Q4_0),
    "mixtral-q4_k": (MIXTRAL_256, QT.Q4_K),
    # every layer sparse: the converter cannot write mlp_only_layers' dense layers
    "qwen3-moe-q8_0": (("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": 32,
                                           "norm_topk_prob": True}, "Qwen3MoeForCausalLM"),
                       QT.Q8_0),
    # a shared expert and Q/K/V biases (kept dense) beside the packed experts
    "qwen2-moe-q4_0": (CASES["qwen2-moe"], QT.Q4_0),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_experts_kept_packed_equal_the_dequantized_file(case, tmp_path):
    """``quantization="gguf"``: each expert's rows of the file's ``ffn_*_exps`` blocks
    are held as stored (bytes equal to the file's expert tensors) and multiplied by
    the GGUF kernel; the same file loaded dequantized gives the same greedy ids."""
    from gguf import GGUFReader

    (config_class, overrides, arch), qtype = GGUF_CASES[case]
    save_tiny_checkpoint(tmp_path / "hf", config_class, **overrides)
    path = quantize_gguf(write_gguf(tmp_path / "hf", tmp_path / "f32.gguf"),
                         tmp_path / f"{case}.gguf", qtype)
    packed = LLM(str(path), dtype="float32", num_blocks=64, quantization="gguf")
    dense = LLM(str(path), dtype="float32", num_blocks=64)
    assert packed.engine.model_config.architecture == arch

    expert_tensors = [t for t in GGUFReader(path).tensors if "_exps." in t.name]
    assert {QT(t.tensor_type) for t in expert_tensors} == {qtype}
    layers = _expert_linears(packed)
    moe = packed.engine.model_config.moe
    assert len(layers) == 2 * moe.num_experts * sum(moe.sparse_layers)
    assert {m.qtype for m in layers} == {int(qtype)}
    assert not any(hasattr(m, "weight") or m.dense_weight is not None for m in layers)
    assert sum(m.qweight.numel() for m in layers) == sum(int(t.n_bytes) for t in expert_tensors)
    assert not _expert_linears(dense)
    assert_same_greedy(packed, dense)


def _int4_checkpoints(path: pathlib.Path, case: str, method: str) -> tuple[str, str, int]:
    """A tiny checkpoint whose decoder linears (attention and every expert) are
    quantized to 4 bits in groups of 32 by Tandem's RTN quantizer and stored in
    ``method``'s layout (GPTQ v1 / AutoAWQ gemm), beside the dense checkpoint of the
    same int4 weights dequantized (float32). Returns ``(quantized dir, dense dir,
    int4 expert weights)``."""
    from safetensors.torch import load_file, save_file

    from tandem.engine.quantization.awq_linear import pack_int4
    from tandem.quantize.rtn import quantize_rtn

    config_class, overrides, _ = CASES[case]
    save_tiny_checkpoint(path / "hf", config_class, **overrides)
    state = load_file(str(path / "hf" / "model.safetensors"))
    quantized, dense, expert_weights = {}, {}, 0
    for name, w in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module.endswith(("_proj", ".w1", ".w2", ".w3")):
            quantized[name] = dense[name] = w
            continue
        q = quantize_rtn(w, bits=4, group_size=32)
        dense[name] = q.dequantize()
        if method == "gptq":
            packed = q.pack()
        else:
            packed = {"qweight": pack_int4(q.codes.t()), "qzeros": pack_int4(q.zeros),
                      "scales": q.scales}
        quantized |= {f"{module}.{k}": v.contiguous() for k, v in packed.items()}
        expert_weights += w.numel() if ".experts." in name else 0
    config = json.loads((path / "hf" / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
        if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
         "version": "gemm"})
    dirs = []
    for name, tensors, cfg in (("int4", quantized, config),
                               ("dense", dense, {k: v for k, v in config.items()
                                                 if k != "quantization_config"})):
        out = path / name
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg))
        for f in (path / "hf").glob("*token*"):
            (out / f.name).write_bytes(f.read_bytes())
        dirs.append(str(out))
    return dirs[0], dirs[1], expert_weights


@pytest.mark.parametrize("case, method", [("mixtral", "gptq"), ("mixtral", "awq"),
                                          ("qwen3-moe", "gptq")])
def test_int4_experts_equal_their_dequantized_weights(case, method, tmp_path):
    """GPTQ / AWQ per-expert ``qweight`` / ``qzeros`` / ``scales`` (Mixtral's
    ``w1``/``w3``/``w2``, Qwen3-MoE's ``gate_proj``/``up_proj``/``down_proj``) load
    into each expert's int4 linear layers, kept as INT4_ZP blocks (19 bytes per 32
    weights), and give the dense model of the dequantized weights' greedy ids."""
    int4_dir, dense_dir, expert_weights = _int4_checkpoints(tmp_path, case, method)
    int4 = LLM(int4_dir, dtype="float32", num_blocks=64)
    dense = LLM(dense_dir, dtype="float32", num_blocks=64)
    layers = _expert_linears(int4)
    assert layers and {m.quant_method.name for m in layers} == {method}
    assert all(m.int4_blocks is not None and not hasattr(m, "weight") for m in layers)
    assert sum(m.int4_blocks.numel() for m in layers) == expert_weights // 32 * 19
    assert not _expert_linears(dense)
    assert_same_greedy(int4, dense)
