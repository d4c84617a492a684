"""Weight loading: a Hugging Face safetensors checkpoint directory loads the same way as
the GGUF file (greedy tokens equal transformers'), and the mapping is strict."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.weights import WeightLoadError, gguf_name_to_hf, load_weights


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tokenizer):
    """A small random Llama saved by transformers (config.json + safetensors +
    tokenizer.json, the default model's tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.hf_tokenizer.save_pretrained(path)
    return str(path), model


def test_safetensors_checkpoint_greedy_matches_transformers(tiny_checkpoint):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    path, hf = tiny_checkpoint
    llm = LLM(path, dtype="float32", num_blocks=32)
    assert llm.engine.model_config.num_layers == 2 and not llm.engine.model_config.tie_word_embeddings
    prompt = [1, 520, 9531, 198, 4093, 314]
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           min_new_tokens=8, do_sample=False, pad_token_id=2)[0, len(prompt):]
    assert got[0].outputs[0].token_ids == want.tolist()


def test_unknown_and_missing_tensors_raise(tiny_checkpoint):
    from tandem.engine.config import ModelConfig
    from tandem.engine.model.llama import LlamaForCausalLM
    from tandem.engine.model.weights import iter_safetensors

    path, _ = tiny_checkpoint
    cfg = ModelConfig.from_hf_config(path)
    model = LlamaForCausalLM(cfg)
    tensors = dict(iter_safetensors(path))
    with pytest.raises(WeightLoadError, match="no place in the model"):
        load_weights(model, iter([*tensors.items(), ("model.layers.9.mlp.extra.weight",
                                                     torch.zeros(1))]))
    partial = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(WeightLoadError, match="not \\(fully\\) filled.*layers.1.mlp.gate_up_proj"):
        load_weights(model, iter(partial.items()))
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightLoadError, match="model.norm.weight: checkpoint shape"):
        load_weights(model, iter(bad.items()))


def test_gguf_names_map_strictly():
    assert gguf_name_to_hf("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(WeightLoadError, match="unknown GGUF tensor"):
        gguf_name_to_hf("blk.0.attn_q_norm.weight")


def test_rope_base_is_read_from_rope_parameters(tmp_path):
    """transformers >= 5 writes ``rope_parameters`` (no top-level ``rope_theta``);
    the default model's export (100000) must not fall back to 10000."""
    import json

    from tandem.engine.config import ModelConfig

    base = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    for extra, want in [({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}},
                         100000.0), ({"rope_theta": 500000.0}, 500000.0), ({}, 10000.0)]:
        (tmp_path / "config.json").write_text(json.dumps(base | extra))
        assert ModelConfig.from_hf_config(str(tmp_path)).rope_theta == want
    (tmp_path / "config.json").write_text(json.dumps(
        base | {"rope_parameters": {"rope_theta": 1e6, "rope_type": "mrope", "factor": 8.0}}))
    with pytest.raises(ValueError, match="rope_parameters.rope_type: RoPE scaling 'mrope'"):
        ModelConfig.from_hf_config(str(tmp_path))


def test_expert_parallelism_on_a_dense_model_is_ignored_with_a_warning(tiny_checkpoint, caplog):
    from tandem.engine.model.loader import load_model
    from tandem.engine.model.model_files import resolve_model

    path, _ = tiny_checkpoint
    with caplog.at_level("WARNING", logger="tandem.engine.model.loader"):
        load_model(resolve_model(path), torch.float32, torch.device("cpu"))
    assert not [r for r in caplog.records if "enable_expert_parallel" in r.getMessage()]
    with caplog.at_level("WARNING", logger="tandem.engine.model.loader"):
        model, cfg = load_model(resolve_model(path), torch.float32, torch.device("cpu"),
                                enable_expert_parallel=True)
    assert cfg.moe is None
    warned = [r.getMessage() for r in caplog.records if "enable_expert_parallel" in r.getMessage()]
    assert warned == [f"enable_expert_parallel: {path} (LlamaForCausalLM) has no experts; its "
                      "layers are split as tensor_parallel_size says, the flag changes nothing"]
