"""Triton kernels on one GPU: correctness against the torch references, then speed.

    python benchmarks/kernels_gpu.py --out benchmarks/results/kernels_h200.json
    python benchmarks/kernels_gpu.py --quick --out /tmp/kernels.json   # fewer shapes

Every case first checks the kernel's output against its torch reference (the
reference evaluated in float32 on the same rounded inputs, max |error| against
the tolerance of tests/kernels), then times the kernel and a PyTorch peer with
``triton.testing.do_bench`` (median of repeated runs, ms):

* decode attention: achieved memory bandwidth, bytes of K/V context read plus
  q and out, in GB/s and as a share of ``--peak-gbps`` (H200 HBM3e: 4800).
  Peers: ``torch.nn.functional.scaled_dot_product_attention`` over K/V gathered
  beforehand into contiguous ``[B, Hkv, S, D]`` (gather not timed: torch's best
  case), and the reference op (gather + SDPA, timed).
* prefill attention: TFLOP/s of causal attention, ``4 * Hq * D * (visible
  query-key pairs)``, as a share of ``--peak-tflops`` (H200 dense bf16: 989).
  Peer: SDPA with ``is_causal`` over contiguous K/V (prompts without a cached
  prefix; SDPA's causal mask is top-left aligned, so prefix cases have none).
* reshape_and_cache, RMSNorm (+residual), RoPE, SiLU-and-mul: GB/s of the bytes
  each must move, against the eager torch reference.
* GGUF linear (Q4_0, Q4_1, Q8_0 weights kept packed): decode shapes (M <= 16)
  in GB/s of packed weight bytes plus x and out, larger M in TFLOP/s
  (``2 * M * N * K``). Peers: ``F.linear`` over the weights dequantized
  beforehand to x's dtype (cuBLAS on dense 16-bit weights, dequantization not
  timed), and the reference op (dequantize + float32 matmul, timed). Weights
  are random bytes with small valid fp16 scales (no gguf quantization pass).

Prints a table and, with ``--out``, writes the rows as JSON. Exits 2 without
CUDA and 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F


def _import_kernels() -> types.SimpleNamespace:
    """The kernel modules, from the installed ``tandem`` distribution or, on a
    machine where the repository is only checked out, straight from ``kernels/``."""
    try:
        import tandem.kernels  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        tandem = types.ModuleType("tandem")
        tandem.__path__ = []
        sys.modules["tandem"] = tandem
        spec = importlib.util.spec_from_file_location(
            "tandem.kernels", root / "kernels" / "__init__.py",
            submodule_search_locations=[str(root / "kernels")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["tandem.kernels"] = module
        spec.loader.exec_module(module)
    from tandem.kernels import activation, gguf_linear, paged_decode_attention
    from tandem.kernels import paged_prefill_attention, reference, reshape_and_cache, rms_norm
    from tandem.kernels import rotary
    return types.SimpleNamespace(activation=activation, decode=paged_decode_attention,
                                 prefill=paged_prefill_attention, ref=reference,
                                 cache=reshape_and_cache, rms_norm=rms_norm, rotary=rotary,
                                 gguf=gguf_linear)


# (atol, rtol) of the kernel against the float32 reference, as in tests/kernels.
ATTN_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
            torch.bfloat16: (1.6e-2, 1.6e-2)}
ELEM_TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3),
            torch.bfloat16: (1e-2, 8e-3)}
# GGUF linear, per element relative to sum |x| |w| (tests/kernels/test_kernels_gguf.py).
GGUF_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
GGUF_QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def _bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _check(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> tuple[float, bool]:
    got, want = got.float(), want.float()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    return err, bool(torch.allclose(got, want, atol=tol[0], rtol=tol[1]))


def _paged_kv(seq_lens: list[int], hkv: int, d: int, bs: int, dtype: torch.dtype,
              gen: torch.Generator):
    """Caches of random K/V with shuffled, non-contiguous block tables."""
    dev = gen.device
    nblk = [math.ceil(n / bs) for n in seq_lens]
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=dev)
    used = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, bs, hkv, d)
    k = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    return k, v, tables


def _sdpa_flash_ms(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs
                   ) -> tuple[float, str]:
    """Median ms of SDPA pinned to its FlashAttention backend, and a label.

    Flash takes GQA natively in recent torch; where it refuses, K/V are expanded
    to the query heads beforehand (outside the timing), which costs it G x the
    K/V reads, and the label says so.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q4.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        try:
            F.scaled_dot_product_attention(q4, k, v, enable_gqa=group > 1, **kwargs)
            label = "sdpa flash"
        except RuntimeError:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            group = 1
            label = "sdpa flash, K/V expanded"
        ms = _bench(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=group > 1,
                                                           **kwargs))
    return ms, label


def _gather(cache: torch.Tensor, tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, Hkv, seq_len, D]`` contiguous, for equal-length sequences."""
    bs = cache.shape[1]
    nblk = math.ceil(seq_len / bs)
    return cache[tables[:, :nblk].long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


def bench_decode(kn, b: int, hq: int, hkv: int, d: int, seq_len: int, dtype: torch.dtype,
                 args, num_splits: int | None = None) -> dict:
    gen = torch.Generator(device=args.device).manual_seed(0)
    k, v, tables = _paged_kv([seq_len] * b, hkv, d, args.block_size, dtype, gen)
    q = torch.randn(b, hq, d, generator=gen, device=args.device, dtype=torch.float32).to(dtype)
    lens = torch.full((b,), seq_len, dtype=torch.int32, device=args.device)
    scale = d ** -0.5
    splits = (kn.decode.choose_num_splits(b, hkv, seq_len, q.device)
              if num_splits is None else num_splits)

    def run():
        return kn.decode.paged_decode_attention(q, k, v, tables, lens, scale, seq_len,
                                                num_splits=splits)

    want = kn.ref.paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, lens,
                                             scale, seq_len)
    err, ok = _check(run(), want, ATTN_TOL[dtype])
    del want
    ms = _bench(run)
    elem = q.element_size()
    nbytes = 2 * b * seq_len * hkv * d * elem + 2 * b * hq * d * elem
    kg, vg = _gather(k, tables, seq_len), _gather(v, tables, seq_len)
    sdpa_ms, sdpa_label = _sdpa_flash_ms(q.view(b, hq, 1, d), kg, vg, scale=scale)
    del kg, vg
    ref_ms = _bench(lambda: kn.ref.paged_decode_attention_ref(q, k, v, tables, lens, scale,
                                                              seq_len))
    gbps = nbytes / ms / 1e6
    return dict(kernel="decode_attention",
                case=f"B={b} Hq={hq} Hkv={hkv} D={d} ctx={seq_len} splits={splits}",
                dtype=str(dtype).removeprefix("torch."), ms=ms, metric="GB/s", value=gbps,
                pct_peak=100 * gbps / args.peak_gbps,
                peer=f"{sdpa_label} (pre-gathered KV)", peer_ms=sdpa_ms,
                peer_value=nbytes / sdpa_ms / 1e6,
                peer2="ref(gather+sdpa)", peer2_ms=ref_ms, max_err=err, ok=ok)


def bench_prefill(kn, b: int, hq: int, hkv: int, d: int, q_len: int, prefix: int,
                  dtype: torch.dtype, args) -> dict:
    gen = torch.Generator(device=args.device).manual_seed(1)
    seq_len = prefix + q_len
    k, v, tables = _paged_kv([seq_len] * b, hkv, d, args.block_size, dtype, gen)
    t = b * q_len
    q = torch.randn(t, hq, d, generator=gen, device=args.device, dtype=torch.float32).to(dtype)
    qsl_cpu = [i * q_len for i in range(b + 1)]
    qsl = torch.tensor(qsl_cpu, dtype=torch.int32, device=args.device)
    lens = torch.full((b,), seq_len, dtype=torch.int32, device=args.device)
    scale = d ** -0.5

    def run():
        return kn.prefill.paged_prefill_attention(q, k, v, tables, qsl, lens, q_len, scale)

    want = kn.ref.paged_prefill_attention_ref(q.float(), k.float(), v.float(), tables, qsl_cpu,
                                              [seq_len] * b, scale)
    err, ok = _check(run(), want, ATTN_TOL[dtype])
    del want
    ms = _bench(run)
    pairs = b * (q_len * prefix + q_len * (q_len + 1) // 2)
    flops = 4 * hq * d * pairs
    row = dict(kernel="prefill_attention",
               case=f"B={b} Hq={hq} Hkv={hkv} D={d} q_len={q_len} prefix={prefix}",
               dtype=str(dtype).removeprefix("torch."), ms=ms, metric="TFLOP/s",
               value=flops / ms / 1e9, pct_peak=100 * flops / ms / 1e9 / args.peak_tflops,
               peer=None, peer_ms=None, peer_value=None, max_err=err, ok=ok)
    if prefix == 0:
        kg, vg = _gather(k, tables, seq_len), _gather(v, tables, seq_len)
        q4 = q.view(b, q_len, hq, d).transpose(1, 2).contiguous()
        sdpa_ms, sdpa_label = _sdpa_flash_ms(q4, kg, vg, is_causal=True, scale=scale)
        row.update(peer=f"{sdpa_label} (is_causal)", peer_ms=sdpa_ms,
                   peer_value=flops / sdpa_ms / 1e9)
    return row


def _elem_row(kernel: str, case: str, dtype, ms: float, nbytes: int, ref_ms: float,
              err: float, ok: bool, args) -> dict:
    gbps = nbytes / ms / 1e6
    return dict(kernel=kernel, case=case, dtype=str(dtype).removeprefix("torch."), ms=ms,
                metric="GB/s", value=gbps, pct_peak=100 * gbps / args.peak_gbps,
                peer="torch reference", peer_ms=ref_ms, peer_value=nbytes / ref_ms / 1e6,
                max_err=err, ok=ok)


def bench_elementwise(kn, t: int, dtype: torch.dtype, args) -> list[dict]:
    gen = torch.Generator(device=args.device).manual_seed(2)
    dev = args.device
    rows = []

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    # reshape_and_cache: T tokens of 8 KV heads x 128 into a shuffled cache.
    hkv, d, bs = 8, 128, args.block_size
    nb = math.ceil(t / bs) * 2
    slots = torch.randperm(nb * bs, generator=gen, device=dev)[:t]
    key, value = randn(t, hkv, d), randn(t, hkv, d)
    kc, vc = randn(nb, bs, hkv, d), randn(nb, bs, hkv, d)
    kr, vr = kc.clone(), vc.clone()
    kn.cache.reshape_and_cache(key, value, kc, vc, slots)
    kn.ref.reshape_and_cache_ref(key, value, kr, vr, slots)
    ok = torch.equal(kc, kr) and torch.equal(vc, vr)
    ms = _bench(lambda: kn.cache.reshape_and_cache(key, value, kc, vc, slots))
    ref_ms = _bench(lambda: kn.ref.reshape_and_cache_ref(key, value, kr, vr, slots))
    rows.append(_elem_row("reshape_and_cache", f"T={t} Hkv={hkv} D={d}", dtype, ms,
                          4 * key.numel() * key.element_size(), ref_ms, 0.0, ok, args))

    # RMSNorm with residual, Llama-3-8B hidden size.
    h = 4096
    x, res = randn(t, h), randn(t, h)
    w = torch.rand(h, generator=gen, device=dev) + 0.5
    (y, r), (y_ref, r_ref) = kn.rms_norm.rms_norm(x, w, 1e-5, res), kn.ref.rms_norm_ref(
        x, w, 1e-5, res)
    err, ok = _check(y, y_ref, ELEM_TOL[dtype])
    ok = ok and torch.equal(r, r_ref)
    ms = _bench(lambda: kn.rms_norm.rms_norm(x, w, 1e-5, res))
    ref_ms = _bench(lambda: kn.ref.rms_norm_ref(x, w, 1e-5, res))
    rows.append(_elem_row("rms_norm+residual", f"T={t} H={h}", dtype, ms,
                          4 * x.numel() * x.element_size(), ref_ms, err, ok, args))

    # RoPE on views of a fused QKV output, 32 query / 8 KV heads of 128.
    hq = 32
    qkv = randn(t, (hq + 2 * hkv) * d)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    cos_sin = kn.ref.rope_cos_sin_cache(d, 8192, 500000.0, device=dev)
    pos = torch.randint(0, 8192, (t,), generator=gen, device=dev)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    kn.rotary.rotary_embedding(pos, q1, k1, cos_sin)
    kn.ref.rotary_embedding_ref(pos, q2, k2, cos_sin)
    err_q, ok_q = _check(q1, q2, ELEM_TOL[dtype])
    err_k, ok_k = _check(k1, k2, ELEM_TOL[dtype])
    ms = _bench(lambda: kn.rotary.rotary_embedding(pos, q, k, cos_sin))
    ref_ms = _bench(lambda: kn.ref.rotary_embedding_ref(pos, q, k, cos_sin))
    rows.append(_elem_row("rotary_embedding", f"T={t} Hq={hq} Hkv={hkv} D={d}", dtype, ms,
                          2 * t * (hq + hkv) * d * q.element_size(), ref_ms,
                          max(err_q, err_k), ok_q and ok_k, args))

    # SiLU-and-mul, Llama-3-8B FFN width.
    f = 14336
    gu = randn(t, 2 * f)
    err, ok = _check(kn.activation.silu_and_mul(gu),
                     kn.ref.silu_and_mul_ref(gu.float()).to(dtype), ELEM_TOL[dtype])
    ms = _bench(lambda: kn.activation.silu_and_mul(gu))
    ref_ms = _bench(lambda: kn.ref.silu_and_mul_ref(gu))
    rows.append(_elem_row("silu_and_mul", f"T={t} F={f}", dtype, ms,
                          3 * t * f * gu.element_size(), ref_ms, err, ok, args))
    return rows


def _random_gguf_weight(kn, n: int, k: int, qtype: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, row_bytes]`` uint8 of random quants with fp16 scales in [1e-3, 1e-2)
    (and Q4_1 minimums in [-1e-2, 0)), built on the device in one pass."""
    dev = gen.device
    block_weights, block_bytes = kn.ref.GGUF_BLOCK_SIZES[qtype]
    nb = k // block_weights
    q = torch.randint(0, 256, (n, nb, block_bytes), generator=gen, device=dev,
                      dtype=torch.uint8)
    d = torch.rand(n, nb, generator=gen, device=dev) * 9e-3 + 1e-3
    q[..., 0:2] = d.half().view(torch.uint8).view(n, nb, 2)
    if qtype == 3:
        m = -torch.rand(n, nb, generator=gen, device=dev) * 1e-2
        q[..., 2:4] = m.half().view(torch.uint8).view(n, nb, 2)
    return q.view(n, nb * block_bytes)


def bench_gguf_linear(kn, m: int, n: int, k: int, qtype_name: str, dtype: torch.dtype,
                      args) -> dict:
    gen = torch.Generator(device=args.device).manual_seed(3)
    qtype = GGUF_QTYPES[qtype_name]
    qweight = _random_gguf_weight(kn, n, k, qtype, gen)
    x = torch.randn(m, k, generator=gen, device=args.device, dtype=torch.float32).to(dtype)

    def run():
        return kn.gguf.gguf_linear(x, qweight, qtype, k)

    w = kn.ref.dequantize_gguf_reference(qweight, qtype, k)
    got = run().float()
    want = x.float() @ w.T
    mag = x.float().abs() @ w.abs().T
    rel = ((got - want).abs() / mag.clamp_min(1e-30)).max().item()
    ok = rel <= GGUF_TOL[dtype]
    w_dense = w.to(dtype)
    del w, got, want, mag
    ms = _bench(run)
    peer_ms = _bench(lambda: F.linear(x, w_dense))
    ref_ms = _bench(lambda: kn.ref.gguf_linear_reference(x, qweight, qtype, k))
    elem = x.element_size()
    if m <= 16:
        io = (m * k + m * n) * elem
        nbytes, peer_bytes = qweight.numel() + io, n * k * elem + io
        metric, value, peer_value = "GB/s", nbytes / ms / 1e6, peer_bytes / peer_ms / 1e6
        pct = 100 * value / args.peak_gbps
    else:
        flops = 2 * m * n * k
        metric, value, peer_value = "TFLOP/s", flops / ms / 1e9, flops / peer_ms / 1e9
        pct = 100 * value / args.peak_tflops
    return dict(kernel=f"gguf_linear {qtype_name}", case=f"M={m} N={n} K={k}",
                dtype=str(dtype).removeprefix("torch."), ms=ms, metric=metric, value=value,
                pct_peak=pct, peer="F.linear, dense weights", peer_ms=peer_ms,
                peer_value=peer_value, peer2="ref(dequant+matmul)", peer2_ms=ref_ms,
                max_err=rel, ok=ok)


def run_all(kn, args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    rows = []
    decode_cases = [
        # (B, Hq, Hkv, D, context)
        (1, 32, 8, 128, 32768),       # one long sequence: split-K territory
        (8, 32, 8, 128, 8192),
        (64, 32, 8, 128, 4096),
        (256, 32, 8, 128, 1024),      # many sequences: grid already full
        (64, 9, 3, 64, 2048),         # SmolLM2-135M, GQA 3
        (32, 64, 8, 128, 4096),       # GQA 8 (70B-class)
    ]
    prefill_cases = [
        # (B, Hq, Hkv, D, q_len, prefix)
        (1, 32, 8, 128, 8192, 0),
        (4, 32, 8, 128, 2048, 0),
        (2, 32, 8, 128, 2048, 6144),  # chunked prefill / cached prefix
        (8, 9, 3, 64, 1024, 0),       # SmolLM2-135M
    ]
    gguf_cases = [
        # (M, N, K), Llama-3-8B projections
        (1, 4096, 4096),              # decode, attention output
        (1, 14336, 4096),             # decode, MLP up
        (1, 4096, 14336),             # decode, MLP down
        (16, 14336, 4096),            # decode batch
        (512, 14336, 4096),           # prefill chunk
        (4096, 4096, 4096),
    ]
    if args.quick:
        decode_cases, prefill_cases = decode_cases[::2], prefill_cases[::2]
        gguf_cases = gguf_cases[::2]
    for case in decode_cases:
        rows.append(bench_decode(kn, *case, dtype, args))
        print(_fmt(rows[-1]), flush=True)
    # Split-K against the single pass on the split-K case.
    rows.append(bench_decode(kn, *decode_cases[0], dtype, args, num_splits=1))
    print(_fmt(rows[-1]), flush=True)
    for case in prefill_cases:
        rows.append(bench_prefill(kn, *case, dtype, args))
        print(_fmt(rows[-1]), flush=True)
    for row in bench_elementwise(kn, 8192 if not args.quick else 2048, dtype, args):
        rows.append(row)
        print(_fmt(row), flush=True)
    for qtype_name in GGUF_QTYPES:
        for case in gguf_cases:
            rows.append(bench_gguf_linear(kn, *case, qtype_name, dtype, args))
            print(_fmt(rows[-1]), flush=True)
    return rows


HEADER = (f"{'kernel':<20} {'case':<46} {'ms':>8} {'value':>9} {'unit':<7} {'%peak':>6} "
          f"{'peer ms':>8} {'peer':>9} {'x peer':>6} {'max err':>9} ok  peer")


def _fmt(r: dict) -> str:
    peer_ms = f"{r['peer_ms']:8.4f}" if r.get("peer_ms") else f"{'-':>8}"
    peer_v = f"{r['peer_value']:9.1f}" if r.get("peer_value") else f"{'-':>9}"
    speedup = f"{r['peer_ms'] / r['ms']:6.2f}" if r.get("peer_ms") else f"{'-':>6}"
    return (f"{r['kernel']:<20} {r['case']:<46} {r['ms']:8.4f} {r['value']:9.1f} "
            f"{r['metric']:<7} {r['pct_peak']:6.1f} {peer_ms} {peer_v} {speedup} "
            f"{r['max_err']:9.2e} {'yes' if r['ok'] else 'NO ':<3} {r.get('peer') or '-'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    parser.add_argument("--peak-gbps", type=float, default=4800.0,
                        help="device memory bandwidth, GB/s (H200: 4800)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="device dense bf16/fp16 TFLOP/s (H200: 989)")
    parser.add_argument("--quick", action="store_true", help="every other shape, smaller T")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_gpu.py: no CUDA device found; this benchmark needs a GPU "
              "(the CPU checks are `pytest tests/kernels`)", file=sys.stderr)
        return 2

    import triton
    args.device = torch.device("cuda")
    kn = _import_kernels()
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}  torch {torch.__version__}  triton {triton.__version__}  "
          f"dtype {args.dtype}  block size {args.block_size}")
    print(HEADER, flush=True)
    with torch.inference_mode():
        rows = run_all(kn, args)
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} correctness checks passed")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "dtype": args.dtype,
            "block_size": args.block_size, "peak_gbps": args.peak_gbps,
            "peak_tflops": args.peak_tflops, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
