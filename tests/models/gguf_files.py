"""GGUF files of tiny Hugging Face checkpoints, written as llama.cpp's converter
(``convert_hf_to_gguf.py --outtype f32``) writes them, with the ``gguf`` package.

The tests cannot run the converter (it ships with llama.cpp, not with Tandem's
dependencies); this writer reproduces, for the architectures Tandem reads, the
converter's GGUF architecture, metadata keys and values, tensor names
(``gguf.TensorNameMap``) and layouts: Q/K rows permuted for interleaved RoPE (``llama``
only), Gemma's RMSNorm weights stored as ``1 + w``, Gemma 2's output projection
dropped (tied), Phi-3's fused ``attn_qkv`` / ``ffn_up`` kept and its ``longrope``
factors written as ``rope_factors_long`` / ``rope_factors_short`` tensors, llama3
RoPE scaling as a ``rope_freqs`` tensor and YaRN as ``rope.scaling.*`` keys, the
experts of Mixtral (``llama``), Qwen2-MoE and Qwen3-MoE stacked per projection
(``ffn_gate_exps`` ``[E, I, H]``, ...). It was
checked against the converter's own output (``benchmarks/gguf_converter_check.py``,
result in docs/models.md).

The tokenizer is not the converter's (the tiny checkpoints' ``WordLevel`` vocabulary
is not a format it converts): the file holds the same 512 tokens as a byte-level
(``gpt2``) vocabulary with zero scores and no merges, which transformers loads;
ids decode to their words, text does not encode to the same ids, so the tests pass
token ids.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np
import torch

# config.json architectures[0] -> the converter's GGUF architecture
GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}


_EXPERT_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate",
                "up_proj": "up", "down_proj": "down"}


def _rope(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "rope_theta" in cfg and "rope_theta" not in rope:
        rope = rope | {"rope_theta": cfg["rope_theta"]}
    return rope


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The converter's ``LlamaModel.permute``: half-split rotary rows -> interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _metadata(w, arch: str, cfg: dict) -> None:
    """The hyper-parameter keys the converter writes for ``arch`` (same order)."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                    cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = _rope(cfg)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    if arch == "phi3":
        original = rope.get("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings"))
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_rope_dimension_count(cfg["hidden_size"] // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
        return
    if arch == "gemma2":
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        return
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full.get("rope_type") == "yarn":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if full.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
        if full.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if full.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    elif full.get("rope_type") == "llama3" and arch == "llama":
        pass                                  # a rope_freqs tensor (_tensors)
    elif full.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {full['rope_type']!r}: not written by this test writer")
    w.add_rope_freq_base(full.get("rope_theta", 10000.0))
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            w.add_sliding_window(cfg["sliding_window"])


def _llama3_rope_freqs(cfg: dict, rope: dict) -> np.ndarray:
    """The converter's llama3 ``rope_freqs``: per frequency, the divisor of its
    inverse frequency (1 for short wavelengths, ``factor`` for long ones, smoothed
    between), computed as ``LlamaModel.generate_extra_tensors`` does (float64 Python
    arithmetic on float32 frequencies)."""
    base = rope.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), \
        rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _tensors(arch: str, cfg: dict, state: dict[str, torch.Tensor]):
    """``(gguf_name, float32 array)`` in the converter's names and layouts."""
    import gguf

    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()),
                                        cfg["num_hidden_layers"])
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        t = t.to(torch.float32)
        m = re.match(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$", name)
        if m:       # the converter stacks each projection's experts: [E, out, in]
            experts.setdefault((int(m[1]), _EXPERT_PROJ[m[3]]), {})[int(m[2])] = t
            continue
        if arch == "gemma2" and name == "lm_head.weight":
            continue                                 # the converter drops it
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, kv)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1
        new = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"{name}: no GGUF name for {arch}")
        yield new, t.numpy()
    for (layer, proj), per_expert in sorted(experts.items()):
        yield (f"blk.{layer}.ffn_{proj}_exps.weight",
               torch.stack([per_expert[e] for e in range(len(per_expert))]).numpy())
    rope = _rope(cfg)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_rope_freqs(cfg, rope)
    if arch == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)


def _tokenizer(w, path: pathlib.Path, cfg: dict) -> None:
    import gguf

    with open(path / "tokenizer.json") as f:
        vocab = json.load(f)["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {cfg.get("bos_token_id"), cfg.get("eos_token_id"), 0}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)


def write_gguf(checkpoint: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Write the GGUF file of the Hugging Face checkpoint dir ``checkpoint``
    (config.json, *.safetensors, tokenizer.json) to ``out``, float32; returns ``out``.

    Raises:
        ValueError: an architecture or RoPE type this writer does not convert.
    """
    import gguf
    from safetensors.torch import load_file

    checkpoint, out = pathlib.Path(checkpoint), pathlib.Path(out)
    with open(checkpoint / "config.json") as f:
        cfg = json.load(f)
    hf_arch = cfg["architectures"][0]
    if hf_arch not in GGUF_ARCH:
        raise ValueError(f"architectures: {hf_arch} is not converted by this writer")
    arch = GGUF_ARCH[hf_arch]
    state: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        state |= load_file(str(file))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(checkpoint.name)
    _metadata(w, arch, cfg)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(w, checkpoint, cfg)
    for name, data in _tensors(arch, cfg, state):
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
