"""A checkpoint whose config asks for something Tandem does not implement is refused
at load, with an error naming that field: never served wrongly. One test per kind
of field."""

from __future__ import annotations

import json

import pytest

from tandem.engine.config import ModelConfig
from tandem.engine.llm import LLM
from tandem.engine.model.registry import MODEL_REGISTRY, UnsupportedModelError
from tests.models.conftest import BASE, save_tiny_checkpoint

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | BASE


def _refused(tmp_path, config: dict) -> UnsupportedModelError:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf_config(str(tmp_path))
    return info.value


def test_mistral_with_a_sliding_window_is_refused_at_load(tmp_path):
    """The issue's case: transformers' own Mistral checkpoint with a 24-token window
    was served as Llama (wrong tokens past 24 positions)."""
    save_tiny_checkpoint(tmp_path, "MistralConfig", sliding_window=24)
    with pytest.raises(UnsupportedModelError, match=r"^sliding_window: .*window 24 tokens") as info:
        LLM(str(tmp_path), dtype="float32", num_blocks=8)
    assert info.value.field == "sliding_window"


def test_a_window_that_cannot_bind_is_not_refused(tmp_path):
    """A window as long as the context never masks anything (Mistral v0.2+ writes
    ``null``; Qwen2 writes a window with ``use_sliding_window: false``)."""
    assert ModelConfig.from_hf_dict(LLAMA | {"model_type": "mistral", "architectures": [
        "MistralForCausalLM"], "sliding_window": 256}).architecture == "MistralForCausalLM"
    assert ModelConfig.from_hf_dict(LLAMA | {"architectures": ["Qwen2ForCausalLM"],
                                             "use_sliding_window": False,
                                             "sliding_window": 32}).architecture == "Qwen2ForCausalLM"


def test_per_layer_sliding_attention_is_refused(tmp_path):
    """Qwen2 with ``use_sliding_window``: transformers writes ``layer_types``."""
    save_tiny_checkpoint(tmp_path, "Qwen2Config", use_sliding_window=True, sliding_window=16,
                         max_window_layers=1)
    err = _refused(tmp_path, json.loads((tmp_path / "config.json").read_text()))
    assert err.field == "layer_types" and "sliding_attention" in str(err)


@pytest.mark.parametrize("key, rope", [
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]}),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}),       # transformers 4's spelling
])
def test_unknown_rope_scaling_type_is_refused(tmp_path, key, rope):
    err = _refused(tmp_path, LLAMA | {key: rope})
    assert err.field == f"{key}.rope_type"
    assert repr(rope.get("rope_type") or rope["type"]) in str(err)


def test_rope_scaling_missing_a_parameter_is_refused(tmp_path):
    err = _refused(tmp_path, LLAMA | {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})
    assert err.field == "rope_parameters.low_freq_factor"


def test_partial_rotary_embedding_is_refused(tmp_path):
    assert _refused(tmp_path, LLAMA | {"partial_rotary_factor": 0.5}).field == \
        "partial_rotary_factor"


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_capping_is_refused(tmp_path, key):
    err = _refused(tmp_path, LLAMA | {key: 30.0})
    assert err.field == key and "soft-capping" in str(err)


@pytest.mark.parametrize("key, act", [("hidden_act", "gelu_pytorch_tanh"),
                                      ("hidden_activation", "gelu")])
def test_unknown_activation_is_refused(tmp_path, key, act):
    err = _refused(tmp_path, LLAMA | {key: act})
    assert err.field == key and repr(act) in str(err)


def test_mlp_bias_is_refused(tmp_path):
    assert _refused(tmp_path, LLAMA | {"mlp_bias": True}).field == "mlp_bias"


def test_unknown_architecture_is_refused_by_name(tmp_path):
    """A real Gemma 2 checkpoint, and a config with only an unknown ``model_type``."""
    save_tiny_checkpoint(tmp_path, "Gemma2Config")
    with pytest.raises(UnsupportedModelError, match="Gemma2ForCausalLM") as info:
        LLM(str(tmp_path), dtype="float32", num_blocks=8)
    assert info.value.field == "architectures"
    err = _refused(tmp_path, {k: v for k, v in LLAMA.items() if k != "architectures"}
                   | {"model_type": "qwen3_moe"})
    assert err.field == "model_type" and "'qwen3_moe'" in str(err)


def test_gguf_fields_are_refused_by_name():
    fields = {"general.architecture": "llama", "llama.embedding_length": 64,
              "llama.attention.head_count": 4, "llama.feed_forward_length": 128,
              "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
              "llama.context_length": 256, "llama.vocab_size": 512}
    assert ModelConfig.from_gguf_fields(fields, True).architecture == "LlamaForCausalLM"
    for extra, field in [({"general.architecture": "qwen3"}, "general.architecture"),
                         ({"llama.rope.scaling.type": "linear"}, "llama.rope.scaling.type"),
                         ({"llama.attention.sliding_window": 24},
                          "llama.attention.sliding_window")]:
        with pytest.raises(UnsupportedModelError) as info:
            ModelConfig.from_gguf_fields(fields | extra, True)
        assert info.value.field == field


def test_every_registered_architecture_has_its_class():
    from tandem.engine.model.layers import DecoderForCausalLM

    for name in MODEL_REGISTRY.architectures:
        cls = MODEL_REGISTRY.model_class(name)
        assert cls.__name__ == name and issubclass(cls, DecoderForCausalLM)


def test_the_quantizers_refuse_what_their_llama_forward_cannot_compute(tmp_path):
    """``tandem quantize`` calibrates with a dense Llama forward of its own: a Qwen2
    checkpoint (Q/K/V biases) must not be quantized with its biases ignored."""
    from tandem.engine.quantization import awq, quantize

    save_tiny_checkpoint(tmp_path, "Qwen2Config")
    for load_dense in (quantize.load_dense, awq.load_dense):
        with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM") as info:
            load_dense(str(tmp_path))
        assert info.value.field == "architectures"
