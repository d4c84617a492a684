"""A checkpoint whose config asks for something Tandem does not implement is refused
at load, with an error naming that field: never served wrongly. One test per kind
of field."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_sliding_windows_per_layer_are_read_from_the_config():
    """Mistral windows every layer; Qwen2 the layers from ``max_window_layers`` on
    (and none without ``use_sliding_window``); ``layer_types`` decides where present;
    a window as long as the context is kept (it marks the layer) but cannot bind."""
    def windows(**cfg):
        return ModelConfig.from_hf_dict(LLAMA | cfg).layer_windows

    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    assert windows(**mistral, sliding_window=24) == (24, 24)
    assert windows(**mistral, sliding_window=None) == ()
    assert windows(**qwen2, use_sliding_window=True, sliding_window=32,
                   max_window_layers=1) == (None, 32)
    assert windows(**qwen2, use_sliding_window=False, sliding_window=32) == ()
    assert windows(sliding_window=16,
                   layer_types=["full_attention", "sliding_attention"]) == (None, 16)
    assert windows(**mistral, sliding_window=256) == (256, 256)


def test_a_layer_type_without_an_implementation_is_refused(tmp_path):
    err = _refused(tmp_path, LLAMA | {"sliding_window": 16, "layer_types": [
        "chunked_attention", "full_attention"]})
    assert err.field == "layer_types" and "chunked_attention" in str(err)


def test_a_backend_without_sliding_windows_or_soft_capping_is_refused_by_name(tmp_path):
    """The Triton kernels have neither: a model that needs them is refused on that
    backend (naming the field), never run with them ignored."""
    from tandem.engine.model.layers import DecoderForCausalLM
    from tandem.kernels.attention_backend import TorchAttentionBackend

    class NoWindows(TorchAttentionBackend):
        name = "plain"
        supports_sliding_window = supports_logit_softcap = False

    def model(**cfg):
        with torch.device("meta"):
            return DecoderForCausalLM(ModelConfig.from_hf_dict(LLAMA | cfg))

    windowed = model(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    windowed.check_backend(TorchAttentionBackend())
    with pytest.raises(UnsupportedModelError, match="'plain' attention backend") as info:
        windowed.check_backend(NoWindows())
    assert info.value.field == "sliding_window"
    capped = model(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                   attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedModelError) as info:
        capped.check_backend(NoWindows())
    assert info.value.field == "attn_logit_softcapping"
    model(sliding_window=256).check_backend(NoWindows())     # cannot bind: no window


@pytest.mark.parametrize("key, rope", [
    ("rope_parameters", {"rope_type": "mrope", "rope_theta": 1e4, "factor": 2.0}),
    ("rope_parameters", {"rope_type": "su", "rope_theta": 1e4, "short_factor": [1.0]}),
    ("rope_scaling", {"type": "mrope", "factor": 2.0}),       # transformers 4's spelling
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
def test_soft_capping_is_refused_where_transformers_does_not_read_it(tmp_path, key):
    """Gemma 2/3 cap; on a Llama the field would be ignored by transformers too, so
    it is refused rather than guessed."""
    err = _refused(tmp_path, LLAMA | {key: 30.0})
    assert err.field == key and "soft-capping" in str(err)


def test_longrope_needs_both_factor_lists(tmp_path):
    err = _refused(tmp_path, LLAMA | {"original_max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8}})
    assert err.field == "rope_parameters.long_factor"


def test_scaled_rope_of_sliding_layers_is_refused(tmp_path):
    err = _refused(tmp_path, LLAMA | {"rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}})
    assert err.field == "rope_parameters.sliding_attention.rope_type"


@pytest.mark.parametrize("key, act", [("hidden_act", "gelu"), ("hidden_act", "relu"),
                                      ("hidden_activation", "gelu")])
def test_unknown_activation_is_refused(tmp_path, key, act):
    err = _refused(tmp_path, LLAMA | {key: act})
    assert err.field == key and repr(act) in str(err)


def test_mlp_bias_is_refused(tmp_path):
    assert _refused(tmp_path, LLAMA | {"mlp_bias": True}).field == "mlp_bias"


def test_unknown_architecture_is_refused_by_name(tmp_path):
    """A real OLMoE checkpoint, and a config with only an unknown ``model_type``."""
    save_tiny_checkpoint(tmp_path, "OlmoeConfig", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(UnsupportedModelError, match="OlmoeForCausalLM") as info:
        LLM(str(tmp_path), dtype="float32", num_blocks=8)
    assert info.value.field == "architectures"
    err = _refused(tmp_path, {k: v for k, v in LLAMA.items() if k != "architectures"}
                   | {"model_type": "olmoe"})
    assert err.field == "model_type" and "'olmoe'" in str(err)


RETRY_AFTER_A_REFUSAL = """
import sys
from tandem.engine.llm import LLM
from tandem.engine.model.registry import UnsupportedModelError
try:
    LLM(sys.argv[1], dtype="float32", num_blocks=8)
except UnsupportedModelError:
    pass
else:
    sys.exit("not refused")
# The refused engine's tokenizer load (transformers' import) is over, not still
# running beside the retry, which would see a half-initialised module.
spec = sys.modules["transformers"].__spec__
print("initializing", getattr(spec, "_initializing", False))
LLM(sys.argv[2], dtype="float32", num_blocks=8)
print("loaded")
"""


def test_a_refusal_leaves_nothing_running_and_a_retry_loads(tmp_path):
    """In a fresh interpreter (transformers not imported yet): a refused checkpoint,
    then at once a good one, as a user fixing a config in a notebook would. The
    tokenizer loads in a thread beside the model; the refusal waits for it, so the
    retry does not import transformers beside it (which raised ImportError)."""
    import subprocess
    import sys

    bad, good = tmp_path / "olmoe", tmp_path / "llama"
    save_tiny_checkpoint(bad, "OlmoeConfig", num_experts=4, num_experts_per_tok=2)
    save_tiny_checkpoint(good, "LlamaConfig")
    out = subprocess.run([sys.executable, "-c", RETRY_AFTER_A_REFUSAL, str(bad), str(good)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["initializing", "False", "loaded"]


MIXTRAL = BASE | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                  "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE = BASE | {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48}


@pytest.mark.parametrize("config, field", [
    (MIXTRAL | {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    (MIXTRAL | {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    (MIXTRAL | {"num_local_experts": 0}, "num_local_experts"),
    (QWEN2_MOE | {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    (QWEN2_MOE | {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    (QWEN2_MOE | {"qkv_bias": False}, "qkv_bias"),
])
def test_mixture_of_experts_fields_are_refused_by_name(tmp_path, config, field):
    assert _refused(tmp_path, config).field == field


def test_mixture_of_experts_layers_and_windows_are_read_as_transformers_builds_them():
    """Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` make layers dense; Mixtral
    and Qwen3-MoE window every layer whatever ``max_window_layers`` says; Qwen2-MoE
    without ``layer_types`` slides its even layers below ``max_window_layers``."""
    def cfg(config, **extra):
        return ModelConfig.from_hf_dict(config | extra)

    qwen3 = QWEN2_MOE | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    assert cfg(MIXTRAL).moe.sparse_layers == (True, True)
    assert cfg(MIXTRAL).moe.norm_topk_prob and cfg(MIXTRAL).moe.topk_weights_float32
    assert cfg(qwen3, mlp_only_layers=[0]).moe.sparse_layers == (False, True)
    assert cfg(qwen3, decoder_sparse_step=2).moe.sparse_layers == (False, True)
    assert cfg(qwen3).moe.shared_expert_intermediate_size == 0
    assert cfg(QWEN2_MOE).moe.shared_expert_intermediate_size == 48
    assert not cfg(QWEN2_MOE).moe.norm_topk_prob
    assert cfg(MIXTRAL, sliding_window=24).layer_windows == (24, 24)
    assert cfg(qwen3, use_sliding_window=True, sliding_window=24,
               max_window_layers=1).layer_windows == (24, 24)
    assert cfg(QWEN2_MOE | {"num_hidden_layers": 4}, use_sliding_window=True,
               sliding_window=24, max_window_layers=2).layer_windows == (24, None, None, None)
    assert cfg(LLAMA).moe is None


def test_batch_invariant_mode_is_refused_for_mixture_of_experts():
    from tandem.kernels.attention_backend import TorchAttentionBackend

    class Invariant(TorchAttentionBackend):
        batch_invariant = True

    with torch.device("meta"):
        model = MODEL_REGISTRY.model_class("MixtralForCausalLM")(
            ModelConfig.from_hf_dict(MIXTRAL))
    model.check_backend(TorchAttentionBackend())
    with pytest.raises(ValueError, match="^batch_invariant: mixture-of-experts"):
        model.check_backend(Invariant())


def test_gguf_fields_are_refused_by_name():
    fields = {"general.architecture": "llama", "llama.embedding_length": 64,
              "llama.attention.head_count": 4, "llama.feed_forward_length": 128,
              "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
              "llama.context_length": 256, "llama.vocab_size": 512}
    assert ModelConfig.from_gguf_fields(fields, True).architecture == "LlamaForCausalLM"
    for extra, field in [({"general.architecture": "bert"}, "general.architecture"),
                         ({"llama.rope.scaling.type": "longrope"}, "llama.rope.scaling.type"),
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
    """``tandem quantize`` calibrates with a dense Llama forward of its own (one loader
    for every method): a Qwen2 checkpoint (Q/K/V biases) must not be quantized with
    its biases ignored."""
    from tandem.quantize.dense import load_dense

    save_tiny_checkpoint(tmp_path, "Qwen2Config")
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM") as info:
        load_dense(str(tmp_path))
    assert info.value.field == "architectures"
