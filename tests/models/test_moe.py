"""The mixture-of-experts pieces against their references: routing against
transformers' own router modules (exact, float32 and bfloat16), the fused expert
layer against the per-expert loop and a per-token float64 computation, the packed
CPU experts against the stacked weights, and both checkpoint layouts of the experts.
(Greedy ids of whole MoE models against transformers: ``test_architectures.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import ModelConfig
from tandem.engine.model.moe import (FusedMoE, fused_experts, moe_loop_reference, route)
from tandem.engine.model.registry import MODEL_REGISTRY
from tandem.kernels.attention_backend import TorchAttentionBackend
from tests.models.conftest import BASE, save_tiny_checkpoint

MIXTRAL = BASE | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                  "num_local_experts": 8, "num_experts_per_tok": 2}


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config_class, norm", [("MixtralConfig", True),
                                                ("Qwen3MoeConfig", False),
                                                ("Qwen3MoeConfig", True)])
def test_routing_equals_transformers_router(config_class, norm, dtype):
    """Same weights, ids and dtypes as transformers' ``*TopKRouter`` (Mixtral keeps
    float32 weights; Qwen rounds them to the model dtype)."""
    import transformers

    extra = {"norm_topk_prob": norm} if config_class != "MixtralConfig" else {}
    cfg = getattr(transformers, config_class)(hidden_size=64, num_experts=8,
                                              num_experts_per_tok=3, **extra)
    module = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter \
        if config_class == "MixtralConfig" \
        else transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter
    torch.manual_seed(0)
    router = module(cfg).to(dtype)
    with torch.no_grad():
        router.weight.normal_()
        h = torch.randn(37, 64, dtype=dtype)
        _, want_w, want_ids = router(h)
        got_w, got_ids = route(F.linear(h, router.weight), 3, norm,
                               weights_float32=config_class == "MixtralConfig")
    assert got_w.dtype == want_w.dtype
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (7, 2), (37, 3)])
def test_fused_experts_equal_the_loop_and_a_per_token_computation(num_tokens, top_k, dtype):
    """Irregular widths (H 48, I 40); experts 0 and 5 receive no token. The fused
    layer equals transformers' per-expert loop bit for bit, and a float64 per-token
    sum of the routed experts up to rounding."""
    torch.manual_seed(0)
    e, h, i = 8, 48, 40
    w13 = (torch.randn(e, 2 * i, h) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i) * i ** -0.5).to(dtype)
    x = torch.randn(num_tokens, h).to(dtype)
    used = torch.tensor([1, 2, 3, 4, 6, 7])
    ids = torch.stack([used[torch.randperm(6)[:top_k]] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k)
    gate_up = lambda ex, a: F.linear(a, w13[ex])         # noqa: E731
    down = lambda ex, a: F.linear(a, w2[ex])             # noqa: E731
    got = fused_experts(x, gate_up, down, weights, ids, e, _silu_and_mul)
    assert got.dtype == dtype and got.shape == (num_tokens, h)
    assert torch.equal(got, moe_loop_reference(x, gate_up, down, weights, ids, e,
                                               _silu_and_mul))
    want = torch.zeros(num_tokens, h, dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            ex = int(ids[t, j])
            a = _silu_and_mul(x[t].double() @ w13[ex].double().T)
            want[t] += float(weights[t, j]) * (a @ w2[ex].double().T)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "onednn"), (torch.bfloat16, "onednn"),
                                          (torch.bfloat16, "amx")])
def test_packed_experts_equal_the_stacked_weights(dtype, kernel, monkeypatch):
    """The CPU path packs each expert once and drops the stacked copy: for oneDNN
    (bfloat16 bit-identical to ``F.linear`` on the stacked weights, float32 up to
    summation order) or, bfloat16 on an AMX host, into amx_linear's panels (the
    bound at 0 keeps oneDNN); the loop dispatch gives the fused one's result. 23
    tokens, top-2: up to 23 rows an expert, where the AMX tile unit sums in
    oneDNN's order (the same bits; beyond, bfloat16 roundings apart)."""
    import tandem.engine.model.moe as moe_module
    from tandem.kernels.cpu.linear import amx_linear_usable, packing_available

    if kernel == "amx" and not amx_linear_usable(64):
        pytest.skip("no AMX-BF16 on this CPU (or the OS refused tile state)")
    if kernel == "onednn" and not packing_available(dtype):
        pytest.skip(f"no oneDNN packed {dtype} matmul on this CPU")
    if kernel == "onednn":
        monkeypatch.setattr(moe_module, "AMX_LINEAR_MAX_ROWS", 0)
    torch.manual_seed(0)
    moe = FusedMoE(ModelConfig.from_hf_dict(MIXTRAL), None).to(dtype)
    x = torch.randn(23, 64).to(dtype)
    backend = TorchAttentionBackend()
    with torch.no_grad():
        moe.gate.weight.normal_()
        stacked = moe(x, backend)
        moe.process_weights_after_loading()
        moe.gate.process_weights_after_loading()
        assert not hasattr(moe.experts.gate_up_proj, "weight")
        assert (moe._panels is not None, moe._packed is not None) == (kernel == "amx",
                                                                      kernel == "onednn")
        packed = moe(x, backend)
        moe.impl = "loop"
        looped = moe(x, backend)
    assert torch.equal(packed, looped)
    if dtype == torch.bfloat16:
        assert torch.equal(packed, stacked)
    else:
        torch.testing.assert_close(packed, stacked, atol=1e-5, rtol=1e-5)


def test_per_expert_and_stacked_checkpoints_load_alike(tmp_path):
    """A Mixtral checkpoint as ``save_pretrained`` writes it (``block_sparse_moe.
    experts.{e}.w1/w2/w3``) and transformers 5's in-memory stacked tensors
    (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``) fill the same parameters."""
    from tandem.engine.model.weights import iter_safetensors, load_weights

    hf = save_tiny_checkpoint(tmp_path, "MixtralConfig", num_local_experts=4,
                              num_experts_per_tok=2)
    cfg = ModelConfig.from_hf_config(str(tmp_path))
    cls = MODEL_REGISTRY.model_class(cfg.architecture)
    assert cls(cfg).weight_mapping("model.layers.1.block_sparse_moe.experts.3.w3.weight") \
        == ("model.layers.1.mlp.experts.gate_up_proj.weight", 7)
    models = []
    for tensors in (iter_safetensors(str(tmp_path)), iter(hf.state_dict().items())):
        model = cls(cfg)
        load_weights(model, tensors)
        models.append(model)
    per_expert, stacked = (dict(m.named_parameters()) for m in models)
    assert per_expert.keys() == stacked.keys()
    for name, p in per_expert.items():
        assert torch.equal(p, stacked[name]), name
    layer = hf.model.layers[0].mlp.experts
    assert torch.equal(per_expert["model.layers.0.mlp.experts.gate_up_proj.weight"],
                       layer.gate_up_proj)
    assert torch.equal(per_expert["model.layers.0.mlp.experts.down_proj.weight"],
                       layer.down_proj)
