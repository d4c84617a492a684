"""The Triton fused-MoE kernel against the torch expert layer
(:func:`tandem.engine.model.moe.fused_experts`) on small irregular shapes, and its
block alignment exactly. Under the interpreter on CPU (operands converted to
float32 before ``tl.dot``, so bfloat16 runs there too)."""

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model.moe import fused_experts
from tandem.kernels.fused_moe import fused_moe, moe_align_block_size


def test_align_block_size_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])          # pairs 0..5
    sorted_ids, block_experts = moe_align_block_size(ids, 5, 4)
    s = 6                                                  # the sentinel: T k
    assert sorted_ids.tolist() == [1, 4, s, s,  0, 2, 5, s,  3, s, s, s]
    assert block_experts.tolist() == [0, 2, 3]


def _silu_and_mul(x):
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 2), (5, 8, 2), (33, 8, 3)])
def test_fused_moe_matches_the_torch_expert_layer(device, num_tokens, num_experts, top_k,
                                                  dtype):
    gen = torch.Generator().manual_seed(0)
    h, i = 48, 40
    x = torch.randn(num_tokens, h, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * i, h, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, h, i, generator=gen) * i ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    want = fused_experts(x.float(), lambda e, a: F.linear(a, w13[e].float()),
                         lambda e, a: F.linear(a, w2[e].float()), weights, ids, num_experts,
                         _silu_and_mul)
    got = fused_moe(x.to(device), w13.to(device), w2.to(device), weights.to(device),
                    ids.to(device))
    assert got.dtype == dtype and got.shape == (num_tokens, h)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def test_fused_moe_refuses_bad_input_by_name(device):
    x = torch.zeros(3, 16, device=device)
    w13, w2 = torch.zeros(4, 32, 16, device=device), torch.zeros(4, 16, 16, device=device)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=device)
    weights = torch.zeros(3, 2, device=device)
    with pytest.raises(ValueError, match="^w2: expected shape"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="^topk_ids: expert ids"):
        fused_moe(x, w13, w2, weights, ids + 4)
    with pytest.raises(ValueError, match="^topk_weights: expected shape"):
        fused_moe(x, w13, w2, weights[:, :1], ids)


def test_the_moe_block_runs_the_backend_fused_kernel(device):
    """A :class:`FusedMoE` block whose stacked expert weights are not packed for
    oneDNN (as on a GPU) runs the Triton backend's ``fused_moe``: the same output as
    the torch backend's grouped dispatch, and the kernel is really called."""
    from tandem.engine.config import ModelConfig
    from tandem.engine.model.moe import FusedMoE
    from tandem.kernels.attention_backend import TorchAttentionBackend
    from tandem.kernels.backend import TritonAttentionBackend
    from tests.models.conftest import BASE

    cfg = ModelConfig.from_hf_dict(BASE | {"architectures": ["MixtralForCausalLM"],
                                           "model_type": "mixtral", "num_local_experts": 8,
                                           "num_experts_per_tok": 2})
    torch.manual_seed(0)
    moe = FusedMoE(cfg, None)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.1)
    moe = moe.to(device)
    x = torch.randn(19, cfg.hidden_size, device=device)
    calls = []

    class Counting(TritonAttentionBackend):
        def fused_moe(self, *args):
            calls.append(args[0].shape)
            return super().fused_moe(*args)

    with torch.no_grad():
        want = moe(x, TorchAttentionBackend())
        got = moe(x, Counting())
    assert calls == [(19, cfg.hidden_size)]
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
