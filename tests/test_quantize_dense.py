"""The dense-model module every offline quantizer shares (quantize/dense.py): the
hook order of its layer forward, which tensors count as decoder linears, and the
checkpoint tensors it writes. (The loader and writer on the real model are exercised
by tests/test_quantize.py and tests/test_awq.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.kernels.reference import rope_cos_sin_cache
from tandem.quantize.dense import (GROUPS, check_output, decoder_layer, decoder_linear,
                                   expert_linear, quantized_state, run_layer)

# hidden 8, 2 query heads and 1 KV head of 4, FFN 12
CFG = SimpleNamespace(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                      rms_norm_eps=1e-6, rope_theta=10000.0)


def _layer(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (8, 8), "k": (4, 8), "v": (4, 8), "o": (8, 8), "gate": (12, 8),
              "up": (12, 8), "down": (8, 12), "ln1": (8,), "ln2": (8,)}
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def test_run_layer_calls_the_hook_per_group_in_order_and_uses_what_it_returns():
    lw = _layer()
    hs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(1)),
          torch.randn(3, 8, generator=torch.Generator().manual_seed(2))]
    cos_sin = rope_cos_sin_cache(4, 5, CFG.rope_theta)
    calls = []

    def hook(group, inputs, weights, residual):
        calls.append((group, [tuple(x.shape) for x in inputs], residual is not None))
        if group == "down":
            return {"down": torch.zeros_like(weights["down"])}
        return None

    acts = run_layer(CFG, dict(lw), hs, cos_sin, hook)
    assert calls == [("qkv", [(5, 8), (3, 8)], False), ("o", [(5, 8), (3, 8)], True),
                     ("gate_up", [(5, 8), (3, 8)], False), ("down", [(5, 12), (3, 12)], True)]
    assert [g for g, _, _ in calls] == list(GROUPS)
    for a, h in zip(acts, hs):
        assert torch.equal(a.mlp_out, torch.zeros_like(h))      # the hook's zero down_proj
        assert torch.equal(a.out, h + a.attn_out)
    # Without a hook, one batch of two sequences is each sequence alone (up to the
    # float32 summation order of the batched matmuls).
    batch = torch.stack([hs[0][:3], hs[1]])
    both = decoder_layer(CFG, dict(lw), batch, cos_sin)
    alone = run_layer(CFG, dict(lw), [hs[0][:3], hs[1]], cos_sin)
    for i in range(2):
        torch.testing.assert_close(both.out[i], alone[i].out, rtol=1e-6, atol=1e-5)


def test_decoder_linear_names_only_the_projection_weights():
    assert decoder_linear("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj"
    assert decoder_linear("model.layers.12.self_attn.o_proj.weight") == \
        "model.layers.12.self_attn.o_proj"
    for name in ("model.layers.3.mlp.up_proj.bias", "model.layers.3.input_layernorm.weight",
                 "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.x.mlp.up_proj.weight",
                 "model.layers.3.mlp.experts.0.up_proj.weight"):
        assert decoder_linear(name) is None, name


def test_expert_linear_names_only_the_expert_projection_weights():
    assert expert_linear("model.layers.3.mlp.experts.0.up_proj.weight") == \
        "model.layers.3.mlp.experts.0.up_proj"
    assert expert_linear("model.layers.1.block_sparse_moe.experts.7.w2.weight") == \
        "model.layers.1.block_sparse_moe.experts.7.w2"
    assert expert_linear("model.layers.3.mlp.shared_expert.up_proj.weight") == \
        "model.layers.3.mlp.shared_expert.up_proj"                   # Qwen2-MoE
    for name in ("model.layers.3.mlp.gate.weight", "model.layers.3.mlp.up_proj.weight",
                 "model.layers.1.block_sparse_moe.gate.weight",
                 "model.layers.3.mlp.shared_expert_gate.weight",
                 "model.layers.3.mlp.shared_expert.up_proj.bias",
                 "model.layers.3.mlp.experts.gate_up_proj",
                 "model.layers.3.mlp.experts.0.up_proj.bias"):
        assert expert_linear(name) is None, name


def test_quantized_state_packs_the_linears_it_is_given_and_stores_the_rest_in_float16():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7
    weights = {"model.layers.0.mlp.up_proj.weight": w, "model.layers.0.mlp.down_proj.weight": w,
               "model.norm.weight": w[0]}
    packed = {"qweight": torch.ones(1, dtype=torch.int32)}
    state = quantized_state(weights,
                            lambda module, t: packed if module.endswith("up_proj") else None)
    assert sorted(state) == ["model.layers.0.mlp.down_proj.weight",
                             "model.layers.0.mlp.up_proj.qweight", "model.norm.weight"]
    assert state["model.layers.0.mlp.up_proj.qweight"] is packed["qweight"]
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    assert torch.equal(state["model.norm.weight"], w[0].half())


def test_check_output_refuses_anything_but_an_absent_or_empty_directory(tmp_path):
    check_output(str(tmp_path / "absent"))
    check_output(str(tmp_path))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"^output_dir: .* exists and is not an empty directory$"):
        check_output(str(tmp_path), "output_dir")
    with pytest.raises(ValueError, match=r"^output: .*/f exists and is not an empty directory$"):
        check_output(str(tmp_path / "f"))
