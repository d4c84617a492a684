"""GGUF metadata -> the Hugging Face ``config.json`` fields of the same model.

A GGUF file written by llama.cpp's ``convert_hf_to_gguf.py`` keeps the model's
hyper-parameters under ``{arch}.*`` keys (``qwen3.attention.head_count``, ...) and a
few as tensors (Phi-3's ``rope_factors_long`` / ``rope_factors_short``, Llama 3.1's
llama3 RoPE divisors ``rope_freqs``). This module
turns them back into the ``config.json`` dict the converter read, so that one code
path (:meth:`~tandem.engine.config.ModelConfig.from_hf_dict`, with its refusals)
builds the config of both formats. What the file does not record is filled the way
llama.cpp's own loader fills it (``src/models/<arch>.cpp``): Gemma 2's alternating
sliding layers (pattern 2) and Gemma 3's five-in-six (pattern 6), Gemma's
attention scale ``key_length ** -0.5`` (``hidden / heads`` for the 27B models),
Gemma 3's local RoPE base 10000; mixture-of-experts files (Mixtral written as
``llama`` with ``expert_count``, ``qwen2moe``, ``qwen3moe``) route as llama.cpp does:
every layer sparse, the top-k weights renormalised for Mixtral and Qwen3-MoE, not
for Qwen2-MoE.

The converter drops some fields it cannot express: Mistral's ``sliding_window``
(written as a ``llama`` file without it) and Qwen2's ``use_sliding_window`` /
``max_window_layers``; such a file describes, and is served as, a model without a
window, as llama.cpp serves it.

Keys Tandem does not implement are refused by key (:class:`UnsupportedModelError`).
"""

from __future__ import annotations

from typing import Iterable

from tandem.engine.model.registry import MODEL_REGISTRY, UnsupportedModelError

# GGUF general.architecture -> the config.json "architectures" entry it was converted
# from (llama.cpp writes Mistral as "llama": the layouts are the same).
GGUF_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}

# The converter's Q/K row permutation (LlamaModel.permute): interleaved rotary pairs.
PERMUTED_QK_ARCHITECTURES = ("llama",)
# The converter stores Gemma's RMSNorm weights as ``1 + w`` (every "*norm.weight").
NORM_PLUS_ONE_ARCHITECTURES = ("gemma2", "gemma3")

# llama.cpp's default sliding-layer pattern per architecture (layer i slides when
# (i + 1) % n != 0) and the layer counts of the models whose attention scale is
# hidden / heads (the 27B ones).
_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6}
_HIDDEN_PER_HEAD_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
# RoPE scaling types read from {arch}.rope.scaling.type (llama.cpp's names).
_ROPE_SCALING = ("none", "linear", "yarn")
# YaRN keys the converter writes when the config has them -> transformers' names.
_YARN_KEYS = {"rope.scaling.yarn_beta_fast": "beta_fast",
              "rope.scaling.yarn_beta_slow": "beta_slow",
              "rope.scaling.yarn_attn_factor": "attention_factor"}


def hf_config_from_gguf(fields: dict, tensor_names: Iterable[str] = (),
                        rope_factors: dict[str, list[float]] | None = None) -> dict:
    """The ``config.json`` dict of a GGUF file.

    Args:
        fields: the file's metadata as plain values (``{"qwen3.block_count": 2, ...}``).
        tensor_names: the file's tensor names (biases and ``output.weight`` are
            told by their presence).
        rope_factors: the ``rope_factors_long.weight`` / ``rope_factors_short.weight``
            tensors as lists (Phi-3 ``longrope``) and ``rope_freqs.weight`` (llama3
            scaling of a ``llama`` file), when the file has them.

    Raises:
        UnsupportedModelError: ``general.architecture`` not read by Tandem;
            ``{arch}.rope.scaling.type`` other than ``none`` / ``linear`` / ``yarn``;
            ``{arch}.rope.scaling.yarn_ext_factor`` other than 1; a ``rope_freqs``
            tensor on a file other than ``llama`` or beside a scaling type;
            ``{arch}.attention.sliding_window`` on a ``llama`` file;
            ``{arch}.rope.dimension_count`` below the head size (partial rotary);
            ``{arch}.attention.value_length`` unlike ``key_length``.
        ValueError: a required key missing.
    """
    arch = fields.get("general.architecture")
    MODEL_REGISTRY.resolve_gguf(arch)           # refuses an unregistered one by name
    if arch not in GGUF_HF_ARCHITECTURES:
        raise UnsupportedModelError("general.architecture", f"GGUF architecture {arch!r} "
                                    "has no metadata reader")
    names = set(tensor_names)
    rope_factors = rope_factors or {}

    def get(key: str, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    layers = int(get("block_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length")
                   or fields.get(f"{arch}.rope.dimension_count") or hidden // heads)
    if int(fields.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{arch}.attention.value_length",
                                    "a value head size unlike the key head size")
    rope_dim = fields.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedModelError(f"{arch}.rope.dimension_count", f"partial rotary "
                                    f"embedding ({rope_dim} of {head_dim}) is not supported")
    vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ValueError(f"GGUF file lacks {arch}.vocab_size and tokenizer.ggml.tokens")
    cfg = {
        "architectures": [GGUF_HF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _opt_int(fields.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(fields.get("tokenizer.ggml.eos_token_id")),
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    theta = float(get("rope.freq_base", 10000.0))
    rope: dict = {"rope_type": "default", "rope_theta": theta}
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in _ROPE_SCALING:
        raise UnsupportedModelError(f"{arch}.rope.scaling.type", f"GGUF RoPE scaling "
                                    f"{scaling!r} is not supported ({', '.join(_ROPE_SCALING)})")
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": theta,
                "factor": float(get("rope.scaling.factor"))}
    if scaling == "yarn":
        ext = fields.get(f"{arch}.rope.scaling.yarn_ext_factor")
        if ext is not None and float(ext) != 1.0:
            raise UnsupportedModelError(f"{arch}.rope.scaling.yarn_ext_factor",
                                        f"YaRN extrapolation factor {ext} (only 1.0, "
                                        "transformers' YaRN, is supported)")
        rope = {"rope_type": "yarn", "rope_theta": theta,
                "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings":
                    int(get("rope.scaling.original_context_length"))}
        rope.update({hf: float(fields[f"{arch}.{key}"]) for key, hf in _YARN_KEYS.items()
                     if fields.get(f"{arch}.{key}") is not None})
    if "rope_freqs.weight" in names:
        # llama3 scaling: the converter writes the per-frequency divisors, not the
        # band parameters (conversion/llama.py, generate_extra_tensors)
        if arch != "llama" or scaling != "none":
            raise UnsupportedModelError("rope_freqs.weight", "per-frequency RoPE factors "
                                        f"are read for llama files without "
                                        f"{arch}.rope.scaling.type only")
        if "rope_freqs.weight" not in rope_factors:
            raise ValueError("rope_freqs.weight: its values were not passed")
        factors = [float(x) for x in rope_factors["rope_freqs.weight"]]
        rope = {"rope_type": "llama3", "rope_theta": theta, "factor": max(factors),
                "freq_factors": factors}
    window = fields.get(f"{arch}.attention.sliding_window")
    if arch == "llama" and window is not None:
        raise UnsupportedModelError(f"{arch}.attention.sliding_window",
                                    "a sliding window on a llama file is not supported")
    experts = fields.get(f"{arch}.expert_count")
    if experts and arch == "llama":                 # Mixtral, written as llama
        cfg["architectures"] = ["MixtralForCausalLM"]
        cfg["num_local_experts"] = int(experts)
        cfg["num_experts_per_tok"] = int(get("expert_used_count"))
    elif arch == "qwen2moe":
        # llama.cpp's qwen2moe: every layer sparse, top-k weights not renormalised,
        # a shared expert when the file has one
        cfg.update(num_experts=int(get("expert_count")),
                   num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(
                       get("expert_shared_feed_forward_length")),
                   norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "qwen3moe":
        # llama.cpp's qwen3moe: every layer sparse, top-k weights renormalised
        cfg.update(num_experts=int(get("expert_count")),
                   num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")),
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "phi3":
        _phi3(cfg, fields, rope, rope_factors, window)
    elif arch in ("gemma2", "gemma3"):
        _gemma(cfg, arch, fields, rope, window)
    else:
        cfg["rope_parameters"] = rope
    return cfg


def _phi3(cfg: dict, fields: dict, rope: dict, rope_factors: dict, window) -> None:
    """Phi-3: ``longrope`` when the file has its factor tensors (the converter writes
    no scaling type for it), a window on every layer when ``sliding_window`` > 0."""
    if window:
        cfg["sliding_window"] = int(window)
    long = rope_factors.get("rope_factors_long.weight")
    short = rope_factors.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise UnsupportedModelError("rope_factors_long.weight", "longrope needs both the "
                                    "long and the short factors")
    if long is not None:
        original = fields.get("phi3.rope.scaling.original_context_length")
        if not original:
            raise ValueError("GGUF file lacks phi3.rope.scaling.original_context_length")
        rope = {"rope_type": "longrope", "rope_theta": rope["rope_theta"],
                "long_factor": list(long), "short_factor": list(short),
                "original_max_position_embeddings": int(original)}
        attn = fields.get("phi3.rope.scaling.attn_factor")
        if attn is not None:
            rope["attention_factor"] = float(attn)
        cfg["original_max_position_embeddings"] = int(original)
    cfg["rope_parameters"] = rope


def _gemma(cfg: dict, arch: str, fields: dict, rope: dict, window) -> None:
    """Gemma 2 / 3: GeGLU, soft-caps, the query scale and the sliding-layer pattern
    as llama.cpp derives them."""
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // heads
                                    if layers == _HIDDEN_PER_HEAD_SCALE_LAYERS[arch]
                                    else cfg["head_dim"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = fields.get(f"{arch}.{key}")
        cfg[key] = float(value) if value else None
    if arch == "gemma3" and cfg["attn_logit_softcapping"] is not None:
        raise UnsupportedModelError(f"{arch}.attn_logit_softcapping", "Gemma 3 has no "
                                    "attention soft-capping")
    if arch == "gemma2" and window is None:
        window = 4096                               # llama.cpp's Gemma 2 default
    if not window:
        cfg["sliding_window"] = None
        cfg["rope_parameters"] = rope
        return
    cfg["sliding_window"] = int(window)
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERNS[arch])
    if isinstance(pattern, (list, tuple)):
        sliding = [bool(p) for p in pattern]
        if len(sliding) != layers:
            raise UnsupportedModelError(f"{arch}.attention.sliding_window_pattern",
                                        f"{len(sliding)} entries for {layers} layers")
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    local = float(fields.get(f"{arch}.rope.freq_base_swa",
                             rope["rope_theta"] if arch == "gemma2" else 10000.0))
    if arch == "gemma2":
        if local != rope["rope_theta"]:
            raise UnsupportedModelError(f"{arch}.rope.freq_base_swa", "a local RoPE base "
                                        "on Gemma 2 is not supported")
        cfg["rope_parameters"] = rope
    else:
        cfg["rope_parameters"] = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": local}}


def _opt_int(v) -> int | None:
    return None if v is None else int(v)
