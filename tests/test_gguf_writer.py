"""Requantizing a GGUF file (quantize/gguf_writer.py): the default model
rewritten as Q8_0 keeps every metadata field, holds exactly gguf-py's requantization
of every tensor, and serves the same greedy tokens natively and dense."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

from tandem.quantize.gguf_writer import (field_value, requantize_gguf,
                                                    target_type, tensor_kind)
from tandem.quantize.kquants import quantize_q4_k, quantize_q6_k


def test_tensor_kinds():
    assert tensor_kind("blk.3.attn_q.weight", 2) == "projection"
    assert tensor_kind("blk.12.ffn_down.weight", 2) == "projection"
    assert tensor_kind("token_embd.weight", 2) == "embedding"
    assert tensor_kind("output.weight", 2) == "embedding"
    assert tensor_kind("blk.0.attn_norm.weight", 1) == "norm"
    assert tensor_kind("output_norm.weight", 1) == "norm"
    assert tensor_kind("blk.0.attn_q.bias", 2) == "other"


VT = GGUFValueType
RNG = np.random.default_rng(0)


def _matrix(rows: int, cols: int) -> np.ndarray:
    return RNG.standard_normal((rows, cols)).astype(np.float32)


def tiny_gguf(path, *, file_type: bool = True, alignment: int | None = None,
              extra_fields=(), extra_tensors=()) -> str:
    """A small GGUF file written with gguf-py: fields of every value type and a few
    tensors of each kind in several types (not a loadable model)."""
    w = GGUFWriter(str(path), "llama")
    for key, value, vtype in [("t.u8", 200, VT.UINT8), ("t.i8", -5, VT.INT8),
                              ("t.u16", 60000, VT.UINT16), ("t.i16", -30000, VT.INT16),
                              ("t.u32", 4_000_000_000, VT.UINT32),
                              ("t.i32", -2_000_000_000, VT.INT32),
                              ("t.u64", 2 ** 63 + 5, VT.UINT64), ("t.i64", -2 ** 62, VT.INT64),
                              ("t.f32", 0.1, VT.FLOAT32), ("t.f64", 0.1, VT.FLOAT64),
                              ("t.bool", True, VT.BOOL), ("t.str", "h\u00e9llo", VT.STRING),
                              ("t.bytes", b"\xff\xfe not utf-8", VT.STRING)]:
        w.add_key_value(key, value, vtype)
    w.add_key_value("t.arr_u8", [1, 2, 255], VT.ARRAY, sub_type=VT.UINT8)
    w.add_key_value("t.arr_i64", [-1, 2 ** 40], VT.ARRAY, sub_type=VT.INT64)
    w.add_key_value("t.arr_f64", [0.1, -2.5], VT.ARRAY, sub_type=VT.FLOAT64)
    w.add_key_value("t.arr_bool", [True, False], VT.ARRAY, sub_type=VT.BOOL)
    w.add_key_value("t.arr_str", ["a", "b\u00e9", ""], VT.ARRAY, sub_type=VT.STRING)
    for key, value, vtype in extra_fields:
        w.add_key_value(key, value, vtype)
    if file_type:
        w.add_file_type(int(LlamaFileType.MOSTLY_Q4_1))
        w.add_quantization_version(2)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_tensor("token_embd.weight", quantize(_matrix(96, 64), QT.Q8_0), raw_dtype=QT.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", RNG.standard_normal(64).astype(np.float16))
    w.add_tensor("blk.0.attn_q.weight", quantize(_matrix(64, 64), QT.Q4_1), raw_dtype=QT.Q4_1)
    w.add_tensor("blk.0.attn_k.weight", quantize(_matrix(32, 64), QT.Q4_0), raw_dtype=QT.Q4_0)
    w.add_tensor("blk.0.ffn_down.weight", _matrix(64, 96))
    w.add_tensor("blk.0.ffn_up.weight", _matrix(96, 64).astype(np.float16))
    w.add_tensor("blk.0.extra.weight", _matrix(3, 5))
    w.add_tensor("output_norm.weight", RNG.standard_normal(64).astype(np.float32))
    w.add_tensor("output.weight", quantize(_matrix(96, 64), QT.Q8_0), raw_dtype=QT.Q8_0)
    for name, data in extra_tensors:
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def expected_tensor(t, qtype: QT, keep_embedding: bool = False) -> tuple[QT, np.ndarray]:
    """``(type, data)`` a requantized file must hold for source tensor ``t``."""
    kind = tensor_kind(t.name, len(t.shape))
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    if kind == "norm":
        return QT.F32, w
    if t.name == "output.weight" and qtype in (QT.Q4_0, QT.Q4_1) and not keep_embedding:
        # llama.cpp's rule: the output matrix in Q6_K, here Q8_0 (64-wide rows are
        # not whole super-blocks), as the source stores it: copied.
        assert t.tensor_type == QT.Q8_0
        return QT.Q8_0, t.data
    if kind == "other" or (kind == "embedding" and keep_embedding) or t.tensor_type == qtype:
        return t.tensor_type, t.data
    return qtype, quantize(w, qtype)


FILE_TYPES = {"Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
              "Q4_1": LlamaFileType.MOSTLY_Q4_1, "F16": LlamaFileType.MOSTLY_F16,
              "F32": LlamaFileType.ALL_F32}


@pytest.mark.parametrize("keep_embedding", [False, True])
@pytest.mark.parametrize("qtype", sorted(FILE_TYPES))
def test_tiny_file_fields_and_tensors_exactly(tmp_path, qtype, keep_embedding):
    src = GGUFReader(tiny_gguf(tmp_path / "src.gguf"))
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"an older file")                         # replaced
    stats = requantize_gguf(str(tmp_path / "src.gguf"), str(dst), qtype,
                            keep_embedding=keep_embedding)
    out = GGUFReader(str(dst))
    assert list(out.fields) == list(src.fields)
    for key, field in src.fields.items():
        if key == "general.file_type":
            assert field_value(out.fields[key]) == (int(FILE_TYPES[qtype]), VT.UINT32, None)
        elif not key.startswith("GGUF."):
            assert field_value(out.fields[key]) == field_value(field), key
    assert field_value(out.fields["t.bytes"])[0] == b"\xff\xfe not utf-8"
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    for s, o in zip(src.tensors, out.tensors):
        qt, data = expected_tensor(s, QT[qtype], keep_embedding)
        assert o.tensor_type == qt, s.name
        assert o.shape.tolist() == s.shape.tolist()
        assert np.array_equal(o.data.reshape(-1), np.asarray(data).reshape(-1)), s.name
    kinds = stats["kinds"]
    assert {k: v["count"] for k, v in kinds.items()} == {"embedding": 2, "norm": 2,
                                                         "projection": 4, "other": 1}
    assert kinds["norm"]["types_before"] == ["F16", "F32"]
    assert kinds["norm"]["types_after"] == ["F32"]
    assert kinds["other"]["bytes_after"] == kinds["other"]["bytes_before"] == 3 * 5 * 4
    assert kinds["projection"]["types_after"] == [qtype]
    assert stats["tensor_bytes_after"] == sum(int(t.n_bytes) for t in out.tensors)
    assert stats["file_bytes_after"] == dst.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.gguf", "src.gguf"]


def test_file_type_and_quantization_version_added_and_alignment_kept(tmp_path):
    src = tiny_gguf(tmp_path / "src.gguf", file_type=False, alignment=64)
    requantize_gguf(src, str(tmp_path / "q.gguf"), "Q4_0")
    requantize_gguf(src, str(tmp_path / "f.gguf"), "F16")
    q, f = GGUFReader(str(tmp_path / "q.gguf")), GGUFReader(str(tmp_path / "f.gguf"))
    source_keys = list(GGUFReader(src).fields)
    assert list(q.fields) == source_keys + ["general.file_type", "general.quantization_version"]
    assert field_value(q.fields["general.file_type"]) == (int(LlamaFileType.MOSTLY_Q4_0),
                                                          VT.UINT32, None)
    assert field_value(q.fields["general.quantization_version"]) == (2, VT.UINT32, None)
    assert list(f.fields) == source_keys + ["general.file_type"]
    for r in (q, f):
        assert r.alignment == 64
        assert all(t.data_offset % 64 == 0 for t in r.tensors)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="qtype"):
        requantize_gguf(str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "Q5_K")
    src = tiny_gguf(tmp_path / "src.gguf")
    with pytest.raises(ValueError, match="dst"):
        requantize_gguf(src, src, "Q8_0")
    nested = tiny_gguf(tmp_path / "nested.gguf",
                       extra_fields=[("t.nested", [[1, 2], [3]], VT.ARRAY)])
    with pytest.raises(ValueError, match="t.nested"):
        requantize_gguf(nested, str(tmp_path / "out.gguf"), "Q8_0")
    odd = tiny_gguf(tmp_path / "odd.gguf", extra_tensors=[("blk.1.attn_v.weight", _matrix(4, 48))])
    with pytest.raises(ValueError, match="blk.1.attn_v.weight"):
        requantize_gguf(odd, str(tmp_path / "out.gguf"), "Q8_0")
    requantize_gguf(odd, str(tmp_path / "out.gguf"), "F16")   # F16 has no blocks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nested.gguf", "odd.gguf",
                                                          "out.gguf", "src.gguf"]


def test_k_quant_targets_mix_and_fall_back_as_llama_cpp(tmp_path):
    """Q4_K_M: Q6_K for the output matrix and for attn_v / ffn_down of the layers
    llama.cpp gives more bits (of 2 layers: layer 1), Q4_K elsewhere; rows that are
    not whole 256-weight super-blocks take Q5_0 (for Q4_K) or Q8_0 (for Q6_K)."""
    wide = [("blk.1.ffn_down.weight", _matrix(8, 512)), ("blk.1.attn_v.weight", _matrix(4, 256)),
            ("blk.1.attn_q.weight", _matrix(4, 256))]
    src = GGUFReader(tiny_gguf(tmp_path / "src.gguf", extra_tensors=wide))
    dst = str(tmp_path / "q4_k_m.gguf")
    stats = requantize_gguf(src, dst, "Q4_K_M")
    out = {t.name: t for t in GGUFReader(dst).tensors}
    want = {"blk.0.attn_q.weight": QT.Q5_0, "blk.0.attn_k.weight": QT.Q5_0,
            "blk.0.ffn_down.weight": QT.Q5_0, "blk.0.ffn_up.weight": QT.Q5_0,
            "blk.1.ffn_down.weight": QT.Q6_K, "blk.1.attn_v.weight": QT.Q6_K,
            "blk.1.attn_q.weight": QT.Q4_K, "output.weight": QT.Q8_0,
            "token_embd.weight": QT.Q5_0}
    assert {name: out[name].tensor_type for name in want} == want
    for t in src.tensors:
        if t.name not in want:
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(t.shape.tolist()[::-1])
        packed = {QT.Q4_K: quantize_q4_k, QT.Q6_K: quantize_q6_k}.get(
            want[t.name], lambda a: quantize(a, want[t.name]))(w)
        assert np.array_equal(out[t.name].data.reshape(-1), packed.reshape(-1)), t.name
    assert stats["file_type"] == int(LlamaFileType.MOSTLY_Q4_K_M)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(dst).st_mode & 0o777 == 0o666 & ~umask
    assert stats["kinds"]["projection"]["types_after"] == ["Q4_K", "Q5_0", "Q6_K"]
    # A plain Q4_K target: the wide rows in Q4_K, the narrow ones in Q5_0.
    stats = requantize_gguf(src, dst, "Q4_K")
    out = {t.name: t.tensor_type for t in GGUFReader(dst).tensors}
    assert out["blk.1.ffn_down.weight"] == out["blk.1.attn_v.weight"] == QT.Q4_K
    assert out["blk.0.attn_q.weight"] == out["token_embd.weight"] == QT.Q5_0
    assert out["output.weight"] == QT.Q8_0           # Q6_K's fallback, as llama.cpp
    assert stats["file_type"] == int(LlamaFileType.MOSTLY_Q4_K_S)


def test_the_output_matrix_and_fallbacks_follow_llama_quantize():
    """Below 8 bits the output matrix (the token embedding when tied) is Q6_K, which
    576-wide rows cannot hold: Q8_0 then; K-quants fall back per row length."""
    assert target_type("token_embd.weight", "Q5_0", 30, False, 576) == "Q8_0"
    assert target_type("token_embd.weight", "Q5_0", 30, True, 576) == "Q5_0"
    assert target_type("output.weight", "Q4_0", 30, True, 512) == "Q6_K"
    assert target_type("output.weight", "Q8_0", 30, True, 512) == "Q8_0"
    assert target_type("output.weight", "F16", 30, True, 512) == "F16"
    assert target_type("blk.3.ffn_down.weight", "Q4_K", 30, True, 1536) == "Q4_K"
    assert target_type("blk.3.ffn_up.weight", "Q4_K", 30, True, 576) == "Q5_0"
    assert target_type("blk.0.attn_v.weight", "Q4_K_M", 30, False, 576) == "Q8_0"
    assert target_type("blk.3.attn_v.weight", "Q4_K_M", 30, False, 576) == "Q5_0"


@pytest.fixture(scope="module")
def requantized(gguf_source, tmp_path_factory):
    """``(source reader, Q8_0 file path, its reader, stats)``: the default model
    requantized to Q8_0 once for the module."""
    src = gguf_source
    dst = str(tmp_path_factory.mktemp("gguf") / "model-q8_0.gguf")
    stats = requantize_gguf(src, dst, "Q8_0")
    return src, dst, GGUFReader(dst), stats


@pytest.mark.slow
def test_metadata_fields_are_the_source_fields(requantized):
    src, _, out, _ = requantized
    assert list(out.fields) == list(src.fields)
    for key, field in src.fields.items():
        if key in ("GGUF.tensor_count", "GGUF.kv_count", "GGUF.version"):
            assert out.fields[key].contents() == field.contents()
        elif key == "general.file_type":
            assert field_value(out.fields[key]) == (int(LlamaFileType.MOSTLY_Q8_0),
                                                    GGUFValueType.UINT32, None)
        else:
            assert field_value(out.fields[key]) == field_value(field), key
    assert len(out.fields["tokenizer.ggml.tokens"].data) == 49152
    assert out.alignment == src.alignment


@pytest.mark.slow
def test_every_tensor_is_gguf_requantization_exactly(requantized):
    src, dst, out, stats = requantized
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    expected_types = {"projection": QT.Q8_0, "embedding": QT.Q8_0, "norm": QT.F32}
    counts = {}
    for s, o in zip(src.tensors, out.tensors):
        kind = tensor_kind(s.name, len(s.shape))
        counts[kind] = counts.get(kind, 0) + 1
        assert o.tensor_type == expected_types[kind], s.name
        assert o.shape.tolist() == s.shape.tolist()
        w = np.asarray(dequantize(s.data, s.tensor_type), dtype=np.float32)
        # Equal blocks, so equal dequantized values (and cheaper to compare).
        expected = w.reshape(o.data.shape) if kind == "norm" else quantize(w, QT.Q8_0)
        assert np.array_equal(o.data, expected), s.name
    assert counts == {"projection": 210, "embedding": 1, "norm": 61}
    kinds = stats["kinds"]
    assert {k: v["count"] for k, v in kinds.items()} == counts
    assert kinds["projection"]["types_before"] == ["Q4_1"]
    assert kinds["projection"]["types_after"] == ["Q8_0"]
    # Q4_1: 20 bytes per 32 weights; Q8_0: 34.
    assert kinds["projection"]["bytes_after"] == kinds["projection"]["bytes_before"] // 20 * 34
    assert kinds["embedding"]["bytes_after"] == kinds["embedding"]["bytes_before"]
    assert kinds["norm"]["bytes_after"] == kinds["norm"]["bytes_before"]
    assert stats["tensor_bytes_after"] == sum(int(t.n_bytes) for t in out.tensors)
    assert stats["file_bytes_after"] == out.data.shape[0]


@pytest.mark.slow
def test_q8_0_file_serves_natively(requantized, f32_weights, tmp_path_factory):
    """The written file loads with its blocks kept packed (the Q8_0 kernel reads the
    file's own bytes) and answers as the Q4_1 original does: Q8_0 of the Q4_1
    weights is within 1/254 of each block's largest weight."""
    from tandem.engine.llm import LLM
    from tandem.engine.model.linear import Linear
    from tandem.engine.sampling.sampling_params import SamplingParams

    _, dst, out, _ = requantized
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        native = LLM(model=dst, dtype="float32", num_blocks=16, quantization="gguf")
    model = native.engine.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert len(layers) == 4 * native.engine.model_config.num_layers
    assert {m.qtype for m in layers} == {int(QT.Q8_0)}
    down = next(t for t in out.tensors if t.name == "blk.0.ffn_down.weight")
    assert np.array_equal(model.model.layers[0].mlp.down_proj.qweight.numpy(), down.data)
    ids = [native.tokenizer.encode(p) for p in ["The capital of France is", "def fibonacci(n):"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for a, b in zip(native.generate(ids, greedy), f32_weights.generate(ids, greedy)):
        assert len(a.outputs[0].token_ids) == 8
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
