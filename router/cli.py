"""The ``tandem`` command line.

    tandem serve [--mode disaggregated|colocated]   start a cluster and the gRPC router
    tandem router --redis-url URL                    one more router over a running cluster
    tandem demo "question" ...                       start a cluster, stream answers, stop
    tandem generate --endpoint HOST:PORT "prompt"    gRPC client, streaming
    tandem chat --endpoint HOST:PORT "message"       gRPC client, chat template, streaming
    tandem generate "prompt" ...                     no endpoint: offline, engine in this process
    tandem quantize --method gptq --output DIR       int4 GPTQ / RTN / AWQ checkpoint, or a
                                                     GGUF file in another block type (q8_0,
                                                     q4_k_m, ...)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time


DEFAULT_BURST_PREFILL_TOKENS = 256
"""``tandem serve``'s ``--burst-prefill-tokens``: measured in benchmarks/README.md
("Splitting a burst of prompts over steps")."""


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face checkpoint dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="the type the model computes in (its dense weights and activations)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="memory for each worker's KV cache (GiB) when --num-blocks is not given")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks each engine's model is sharded over (Megatron-style; rank 0 in "
                        "the worker's process, the others its subprocesses; see "
                        "docs/tensor_parallel.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture of experts over several ranks: spread whole experts over "
                        "them (default: split every expert over them, as vLLM does)")
    p.add_argument("--moe-dispatch", default="all_reduce", choices=["all_reduce", "all_to_all"],
                   help="with --enable-expert-parallel: all_reduce (every rank runs its "
                        "experts on every token, one all-reduce sums them) or all_to_all "
                        "(tokens dispatched to their experts' ranks and combined back)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "int4"],
                   help="KV cache element type: auto (the model dtype), fp8_e4m3 (1 byte "
                        "per element with per-head scales calibrated at start; twice the "
                        "blocks of bfloat16 per GiB) or int4 (K per channel, V per token, "
                        "after KIVI; 2.7x the blocks of bfloat16 at head dim 64); "
                        "every attention backend")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of earlier prompts' common prefixes")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole in one step (default: in chunks that share "
                        "steps with decoding requests)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="the most sequences in one step's batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="one step's token budget (decode tokens plus prompt chunks)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="auto: triton on CUDA, the compiled CPU kernels on CPU (torch ops where "
                        "they do not build); torch: plain torch ops")
    p.add_argument("--quantization", default="none", choices=["none", "gguf", "gptq", "awq"],
                   help="linear layers' weight format: none (dense, in --dtype; a GPTQ or AWQ "
                        "checkpoint directory, e.g. from `tandem quantize`, is detected from its "
                        "config.json), gguf (a GGUF model's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K "
                        "blocks kept packed, read by the quantized kernels), gptq, awq; see "
                        "docs/quantization.md")
    p.add_argument("--activation-quantization", default="none", choices=["none", "int8"],
                   help="CPU, with weights in quantized blocks (--quantization gguf, or a GPTQ "
                        "/ AWQ checkpoint): int8 quantizes the activations of products of up "
                        "to 32 rows (decode steps; prefill chunks stay float, every product "
                        "with --batch-invariant) per 32 values and multiplies in integers "
                        "(AVX-512 VNNI / AVX2), as llama.cpp does; none (default) keeps them "
                        "as they are")
    p.add_argument("--batch-invariant", action="store_true",
                   help="CPU: compute every token the same way whatever else is batched, so "
                        "seeded and greedy outputs do not depend on batch composition, "
                        "chunking, prefix caching or preemption (see docs/batch_invariance.md)")
    p.add_argument("--small-batch-linear", default="auto", choices=["auto", "on", "off"],
                   help="bfloat16 on a CPU with AMX: linear layers of steps of up to 1280 "
                        "tokens on AMX tiles from a second, panel-packed copy of the dense "
                        "weights (1.05-1.3x oneDNN's speed there; TANDEM_AMX_LINEAR_MAX_ROWS "
                        "moves the bound); with AVX-512 BF16 and no AMX, steps of up to 256 "
                        "tokens by AVX-512 BF16 dot products from the same copy (1.3-1.7x "
                        "oneDNN's at 1-16 tokens; TANDEM_DPBF16_LINEAR_MAX_ROWS); float32 on "
                        "AVX-512F: steps of up to 1024 tokens by AVX-512 FMAs from a float32 "
                        "panel copy (TANDEM_AVX512_F32_LINEAR_MAX_ROWS); auto (default): on "
                        "while that copy takes at most a tenth of the machine's memory")
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft_model"],
                   help="speculative decoding on decode workers: ngram (prompt lookup) or "
                        "draft_model (see docs/speculative_decoding.md); default off")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per request and step (with --speculative-method; default 4)")
    p.add_argument("--speculative-draft-model", default=None,
                   help="draft_model: a .gguf file or checkpoint dir with the target's "
                        "tokenizer (default: the target model itself)")
    p.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="ngram: shortest suffix (tokens) to look up (default 2)")
    p.add_argument("--prompt-lookup-max", type=int, default=None,
                   help="ngram: longest suffix (tokens) to look up (default 5)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens whose probability reaches it")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (-1: all)")
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed (reproducible output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args):
    from tandem.engine.sampling.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


_SMALL_BATCH_LINEAR = {"auto": None, "on": True, "off": False}


def _engine_config(args):
    from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig

    spec_args = {"num_speculative_tokens": args.num_speculative_tokens,
                 "prompt_lookup_min": args.prompt_lookup_min,
                 "prompt_lookup_max": args.prompt_lookup_max,
                 "draft_model": args.speculative_draft_model}
    given = {k: v for k, v in spec_args.items() if v is not None}
    speculative = None
    if args.speculative_method is None:
        if given:
            raise ValueError(f"{next(iter(given))}: needs --speculative-method")
    else:
        if args.speculative_method != "draft_model" and "draft_model" in given:
            raise ValueError("draft_model: --speculative-draft-model needs "
                             "--speculative-method draft_model")
        speculative = SpeculativeConfig(method=args.speculative_method, **given)
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, moe_dispatch=args.moe_dispatch,
        attention_backend=args.attention_backend, quantization=args.quantization,
        activation_quantization=args.activation_quantization,
        batch_invariant=args.batch_invariant, speculative=speculative,
        small_batch_linear=_SMALL_BATCH_LINEAR[args.small_batch_linear],
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
                          enable_prefix_caching=not args.no_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=not args.no_chunked_prefill,
                                  burst_prefill_tokens=getattr(args, "burst_prefill_tokens",
                                                               None) or None))


_GGUF_MAGIC = b"GGUF"


def check_model_path(flag: str, model: str | None) -> None:
    """Check, in this process and before anything starts, that ``model`` names a model
    Tandem loads: a GGUF file (its magic bytes are read) or a Hugging Face checkpoint
    directory whose config.json is a JSON object; None is the default model, which
    must be installed.

    Args:
        flag: the option that named it, for the message (``--model``).

    Raises:
        ValueError: one line naming ``flag`` and the path, and what is wrong there.
    """
    from tandem.engine.model.model_files import resolve_model

    try:
        files = resolve_model(model)
    except FileNotFoundError as exc:
        if model is None:
            raise ValueError(f"{flag}: {exc}") from None
        if not os.path.exists(model):
            raise ValueError(f"{flag}: {model}: no such file or directory") from None
        if os.path.isdir(model):
            raise ValueError(f"{flag}: {model}: a directory without config.json (expected a "
                             "Hugging Face checkpoint directory or a .gguf file)") from None
        raise ValueError(f"{flag}: {model}: not a .gguf file or a Hugging Face checkpoint "
                         "directory") from None
    try:
        if files.format == "gguf":
            with open(files.path, "rb") as f:
                magic = f.read(4)
            if magic != _GGUF_MAGIC:
                raise ValueError(f"{flag}: {files.path}: not a GGUF file (it starts with "
                                 f"{magic!r}, not {_GGUF_MAGIC!r})")
        else:
            path = os.path.join(files.path, "config.json")
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{flag}: {path}: expected a JSON object")
    except OSError as exc:
        raise ValueError(f"{flag}: {model}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: {files.path}/config.json is not valid JSON ({exc})") from None


def _check_model_args(args) -> None:
    """The model paths a command would load, checked before any worker or Ray starts
    (:func:`check_model_path`), and its tensor-parallel sizes against the model's
    attention heads (:func:`check_tensor_parallel_sizes`). Raises ValueError."""
    if getattr(args, "endpoint", None):         # a client of a running server: loads nothing
        return
    if hasattr(args, "model") and args.func is not _cmd_quantize:    # quantize checks its own
        check_model_path("--model", args.model)
        check_tensor_parallel_sizes(args)
    draft = getattr(args, "speculative_draft_model", None)
    # Only a draft the engine would load: with another method the engine config
    # refuses the flag itself, naming the method it needs.
    if draft is not None and getattr(args, "speculative_method", None) == "draft_model":
        check_model_path("--speculative-draft-model", draft)


def check_tensor_parallel_sizes(args) -> None:
    """Each tensor-parallel size above 1 the command would start, checked against the
    model's attention heads (:func:`~tandem.engine.parallel.partition.head_partition`)
    before Ray starts, so that a size the model's heads cannot be split into is
    refused naming its flag (``--prefill-tensor-parallel-size``), not by a worker
    after the cluster came up. Reads the model's config (a GGUF file's metadata:
    seconds), only when a size is above 1.

    Raises:
        ValueError: ``<flag>: <n> ranks cannot share ...``, or a size below 1.
    """
    if not hasattr(args, "tensor_parallel_size"):
        return
    if hasattr(args, "prefill_tensor_parallel_size"):      # serve: a size per pool
        prefill, decode = _tensor_parallel_sizes(args)

        def flag(pool: str) -> str:
            own = getattr(args, f"{pool}_tensor_parallel_size") is not None
            return f"--{pool}-tensor-parallel-size" if own else "--tensor-parallel-size"
        sizes = {flag("decode"): decode}
        if args.mode != "colocated":
            sizes[flag("prefill")] = prefill
    else:
        sizes = {"--tensor-parallel-size": args.tensor_parallel_size}
    if all(n == 1 for n in sizes.values()):
        return
    from tandem.engine.model.loader import checkpoint_config
    from tandem.engine.model.model_files import resolve_model
    from tandem.engine.parallel.partition import head_partition

    cfg = checkpoint_config(resolve_model(args.model))

    def splits(n: int) -> bool:
        try:
            head_partition(cfg.num_heads, cfg.num_kv_heads, n, 0)
        except ValueError:
            return False
        return True
    for name, n in sizes.items():
        try:
            head_partition(cfg.num_heads, cfg.num_kv_heads, n, 0)
        except ValueError as exc:
            fits = [str(k) for k in range(1, cfg.num_heads + 1) if splits(k)]
            raise ValueError(f"{name}: {str(exc).removeprefix('tensor_parallel_size: ')}; "
                             f"this model's heads split into {', '.join(fits)}") from None


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"],
                   help="disaggregated: prefill workers compute prompts and send their KV to "
                        "decode workers; colocated: every worker does both")
    p.add_argument("--burst-prefill-tokens", type=int, default=DEFAULT_BURST_PREFILL_TOKENS,
                   help="split a burst of new prompts over the steps of a worker that decodes: "
                        "a step that holds prompt tokens admits another new prompt only while "
                        "they stay within this many per decoding sequence + 1, so the first "
                        "prompts of a burst answer a step sooner (0: no split, the token budget "
                        "alone decides; prefill workers never split; see "
                        "SchedulerConfig.burst_prefill_tokens)")
    p.add_argument("--host", default="127.0.0.1", help="the address the router's ports bind")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--num-decode", type=int, default=1,
                   help="decode workers (the workers, colocated)")
    p.add_argument("--kv-transport", default="gloo", choices=["gloo", "nccl"],
                   help="how KV moves between workers: gloo (CPU tensors, TCP) or nccl (GPU)")
    p.add_argument("--cpu-affinity", action="store_true",
                   help="pin prefill and decode workers to disjoint cores (torch threads to match)")
    p.add_argument("--lend-idle-cores", action="store_true",
                   help="CPU, disaggregated, one machine: each worker runs on its half (share) "
                        "of the cores plus the other workers' while they are idle; the workers "
                        "are not pinned (not with --cpu-affinity, --ray-address or tensor "
                        "parallelism)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port for /metrics and /health (0 = any free port)")
    _add_http_arg(p, 8000)
    _add_tool_args(p)
    p.add_argument("--ray-address", default=None, help="existing Ray cluster (default: embedded)")
    p.add_argument("--routing-policy", default="prefix_aware",
                   choices=["prefix_aware", "least_loaded"],
                   help="how the router picks workers (see tandem.router.routing)")
    _add_conditional_disaggregation_args(p)
    p.add_argument("--redis-url", default=None,
                   help="the cluster state (default: start an embedded redis-server)")
    p.add_argument("--lease-ttl", type=float, default=10.0,
                   help="seconds a worker may miss its heartbeat before it counts as dead")
    p.add_argument("--worker-wait-timeout", type=float, default=60.0,
                   help="seconds a request whose decode worker died waits for a replacement "
                        "when no other decode worker is alive, before it fails (UNAVAILABLE)")
    p.add_argument("--engine-nice", type=int, default=5,
                   help="how much lower (Linux nice, 0-19) the workers' engine threads run than "
                        "the threads that deliver their tokens; 0: same priority")
    p.add_argument("--prefill-block-size", type=int, default=None,
                   help="prefill workers' block size if different (must match; for testing)")
    for pool in ("prefill", "decode"):
        p.add_argument(f"--{pool}-tensor-parallel-size", type=int, default=None,
                       help=f"{pool} workers' tensor-parallel ranks (default: "
                            "--tensor-parallel-size); the two pools' sizes may differ"
                            + ("; disaggregated mode only" if pool == "prefill" else "")
                            + "; the model's attention heads must split into them")
    _add_autoscale_args(p)


def _add_autoscale_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("autoscaling (a planner sizes the prefill and decode pools)")
    g.add_argument("--autoscale", action="store_true",
                   help="run the planner (one active per cluster, elected in Redis)")
    g.add_argument("--planner-mode", default="load", choices=["load", "slo"],
                   help="slo: size pools from request rate, ISL/OSL and per-worker capacity "
                        "at the SLOs; load: queue / KV usage saturation rules")
    g.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT target (p90), seconds")
    g.add_argument("--itl-slo", type=float, default=0.1, help="ITL target (p90), seconds")
    g.add_argument("--prefill-capacity", type=float, default=None,
                   help="prompt tokens/s one prefill worker serves within --ttft-slo "
                        "(slo mode; measured with benchmarks/autoscaling.py --profile)")
    g.add_argument("--decode-capacity", type=float, default=None,
                   help="output tokens/s one decode worker serves within --itl-slo (slo mode)")
    g.add_argument("--planner-interval", type=float, default=30.0,
                   help="seconds between planner decisions")
    for pool in ("prefill", "decode"):
        g.add_argument(f"--min-{pool}", type=int, default=1, help=f"fewest {pool} workers")
        g.add_argument(f"--max-{pool}", type=int, default=4, help=f"most {pool} workers")
    g.add_argument("--max-total-devices", type=int, default=None,
                   help="GPUs (CPU core sets) both pools may hold together; a worker of "
                        "tensor-parallel size N counts N (default: no cap)")
    g.add_argument("--scale-down-cooldown", type=float, default=90.0,
                   help="seconds after a change of a pool before it may shrink")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a retiring worker may finish its requests before the rest "
                        "migrate to other workers")


def _planner_config(args, prefill_tp: int = 1, decode_tp: int = 1):
    """The PlannerConfig of the autoscaling flags (None without --autoscale);
    ``prefill_tp`` / ``decode_tp`` are the pools' tensor-parallel sizes (devices per
    worker), against which ``--max-total-devices`` is checked.

    Raises:
        ValueError: naming the flag: a device budget that cannot hold the initial
            pools (``--num-prefill`` x prefill size + ``--num-decode`` x decode size),
            or any PlannerConfig error.
    """
    from tandem.control.planner import PlannerConfig

    if not args.autoscale:
        return None
    budget = args.max_total_devices
    initial = args.num_prefill * prefill_tp + args.num_decode * decode_tp
    if budget is not None and budget < initial:
        raise ValueError(f"--max-total-devices: {budget} devices cannot hold the initial pools "
                         f"({args.num_prefill} prefill x {prefill_tp} + {args.num_decode} "
                         f"decode x {decode_tp} = {initial})")
    return PlannerConfig(mode=args.planner_mode, interval_s=args.planner_interval,
                         ttft_slo_s=args.ttft_slo, itl_slo_s=args.itl_slo,
                         prefill_capacity_tok_s=args.prefill_capacity,
                         decode_capacity_tok_s=args.decode_capacity,
                         min_prefill=args.min_prefill, max_prefill=args.max_prefill,
                         min_decode=args.min_decode, max_decode=args.max_decode,
                         scale_up_cooldown_s=min(30.0, args.planner_interval),
                         scale_down_cooldown_s=args.scale_down_cooldown,
                         max_total_devices=budget)


def _add_http_arg(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--http-port", type=int, default=default,
                   help=f"the OpenAI-compatible HTTP API's port (default {default}; "
                        "0 = any free port, -1 = off)")


def _http_port(args) -> int | None:
    return None if args.http_port < 0 else args.http_port


def _add_conditional_disaggregation_args(p: argparse.ArgumentParser) -> None:
    """The router's choice between a prefill worker and the decode worker itself."""
    p.add_argument("--max-prefill-queue-tokens", type=int, default=None, metavar="N",
                   help="disaggregated: prefill a request on its decode worker when its prefill "
                        "worker already has this many prompt tokens in flight (conditional "
                        "disaggregation; default: always on the prefill worker)")
    p.add_argument("--prefer-local-prefill", action="store_true",
                   help="disaggregated: prefill a request on its decode worker while that "
                        "worker has no decode batch and the prefill worker no more prompt "
                        "tokens in flight than it, or when its prefix cache holds all of the "
                        "prompt but one block (no KV cache moves; default: always on the "
                        "prefill worker)")


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    from tandem.router.tool_parsers import TOOL_PARSERS

    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice='auto' on the HTTP API: tool calls are read from "
                        "the output by --tool-call-parser (needs it)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the output format of the model's tool calls (hermes: Hermes/Qwen "
                        "<tool_call> JSON; llama3_json: Llama 3 JSON)")


def _tool_config(args) -> dict:
    """ServeConfig's tool-calling fields from the flags (vLLM's pair: both or neither
    for tool_choice='auto')."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser")
    return {"enable_auto_tool_choice": args.enable_auto_tool_choice,
            "tool_call_parser": args.tool_call_parser}


def _http_banner(server) -> str:
    scheme = "http" if server.config.tls is None else "https"
    return f" (OpenAI API on {scheme}://{server.config.host}:{server.http_port}/v1)" \
        if server.http_port is not None else ""


def _add_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[],
                   help="a key clients must send as 'authorization: Bearer KEY' (repeatable; "
                        "also --api-key-file and $TANDEM_API_KEYS, comma-separated; none = open)")
    p.add_argument("--api-key-file", default=None,
                   help="API keys, one per line ('#' starts a comment line)")
    p.add_argument("--auth-health", action="store_true",
                   help="the health service requires a key too (default: open, for probes)")
    p.add_argument("--ssl-certfile", default=None, help="serve TLS with this PEM certificate chain")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's PEM private key")
    p.add_argument("--ssl-ca-certs", default=None,
                   help="PEM CA bundle that signs client certificates")
    p.add_argument("--ssl-cert-reqs", default="none", choices=["none", "required"],
                   help="required: clients must present a certificate signed by --ssl-ca-certs")
    p.add_argument("--rate-limit", type=float, default=0.0,
                   help="requests per second per API key (token bucket shared by every "
                        "router through Redis; 0 = off); refused with 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--rate-burst", type=float, default=0.0,
                   help="requests a key may save up (default: max(1, --rate-limit))")
    p.add_argument("--max-concurrent-requests", type=int, default=0,
                   help="requests in flight at once per API key (0 = no cap)")


def _security_config(args) -> dict:
    """ServeConfig fields from the security flags and $TANDEM_API_KEYS (read here, at the
    edge: the keys go no further than the store's digests)."""
    from tandem.control.rate_limits import RateLimits
    from tandem.router.auth import APIKeyStore
    from tandem.router.tls import TLSConfig

    return {"api_keys": APIKeyStore.from_sources(args.api_key, args.api_key_file),
            "auth_health": args.auth_health,
            "tls": TLSConfig.from_args(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                                       args.ssl_cert_reqs),
            "rate_limits": RateLimits(args.rate_limit, args.rate_burst,
                                      args.max_concurrent_requests)}


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None,
                   help="API key of the server (default: $TANDEM_API_KEY)")
    p.add_argument("--tls", action="store_true",
                   help="connect over TLS (implied by --ssl-ca; without it the default roots "
                        "verify the server)")
    p.add_argument("--ssl-ca", default=None,
                   help="PEM CA bundle that signed the server's certificate")
    p.add_argument("--ssl-certfile", default=None,
                   help="this client's PEM certificate, for servers that require one")
    p.add_argument("--ssl-keyfile", default=None, help="this client's PEM private key")


def _serve_config(args):
    import dataclasses

    from tandem.engine.config import CacheConfig
    from tandem.router.launcher import ServeConfig

    prefill_tp, decode_tp = _tensor_parallel_sizes(args)
    engine = dataclasses.replace(_engine_config(args), tensor_parallel_size=decode_tp)
    prefill_engine = None
    if args.prefill_block_size is not None or prefill_tp != decode_tp:
        prefill_engine = dataclasses.replace(
            engine, tensor_parallel_size=prefill_tp,
            cache=dataclasses.replace(engine.cache, block_size=args.prefill_block_size
                                      or engine.cache.block_size))
    return ServeConfig(mode=args.mode, host=args.host, port=args.port,
                       num_prefill=args.num_prefill, num_decode=args.num_decode, engine=engine,
                       prefill_engine=prefill_engine, kv_transport=args.kv_transport,
                       cpu_affinity=args.cpu_affinity, lend_idle_cores=args.lend_idle_cores,
                       metrics_port=args.metrics_port,
                       http_port=_http_port(args), ray_address=args.ray_address, routing_policy=args.routing_policy,
                       max_prefill_queue_tokens=args.max_prefill_queue_tokens,
                       prefer_local_prefill=args.prefer_local_prefill,
                       redis_url=args.redis_url, lease_ttl_s=args.lease_ttl,
                       autoscale=_planner_config(args, prefill_tp, decode_tp),
                       drain_timeout_s=args.drain_timeout,
                       worker_wait_timeout_s=args.worker_wait_timeout,
                       engine_nice=args.engine_nice, **_tool_config(args))


def _tensor_parallel_sizes(args) -> tuple[int, int]:
    """The prefill and decode (or colocated) workers' ``tensor_parallel_size`` from
    ``--tensor-parallel-size`` and the per-pool flags.

    Raises:
        ValueError: naming the flag: a size below 1, or a prefill size in colocated
            mode (no prefill pool there).
    """
    default = args.tensor_parallel_size
    sizes = {"--tensor-parallel-size": default}
    prefill = args.prefill_tensor_parallel_size
    decode = args.decode_tensor_parallel_size
    if prefill is not None:
        sizes["--prefill-tensor-parallel-size"] = prefill
    if decode is not None:
        sizes["--decode-tensor-parallel-size"] = decode
    for flag, n in sizes.items():
        if n < 1:
            raise ValueError(f"{flag}: must be at least 1, got {n}")
    if args.mode == "colocated":
        if prefill is not None:
            raise ValueError("--prefill-tensor-parallel-size: colocated mode has no prefill "
                             "workers; size its workers with --tensor-parallel-size (or "
                             "--decode-tensor-parallel-size)")
    return (prefill or default), (decode or default)


def _cmd_serve(args) -> int:
    import dataclasses

    from tandem.router.launcher import TandemServer

    def banner(server) -> str:
        redis = server.redis.url if server.redis is not None else server.config.redis_url
        return f"tandem: serving {server.config.mode} on {args.host}:{server.port} (cluster " \
               f"state {redis}; {server.security_summary}){_http_banner(server)}"
    cfg = dataclasses.replace(_serve_config(args), **_security_config(args))
    return _run_until_signal(TandemServer(cfg), banner, args)


def _cmd_router(args) -> int:
    from tandem.engine.config import EngineConfig
    from tandem.router.launcher import RouterServer, ServeConfig

    cfg = ServeConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                      http_port=_http_port(args), ray_address=args.ray_address,
                      routing_policy=args.routing_policy, redis_url=args.redis_url,
                      max_prefill_queue_tokens=args.max_prefill_queue_tokens,
                      prefer_local_prefill=args.prefer_local_prefill,
                      engine=EngineConfig(model=args.model), **_security_config(args),
                      **_tool_config(args))

    def banner(server) -> str:
        return f"tandem: router {server.router_id} on {args.host}:{server.port} " \
               f"({server.security_summary}){_http_banner(server)}"
    return _run_until_signal(RouterServer(cfg), banner, args)


def _run_until_signal(server, banner, args) -> int:
    """Start ``server``, print ``banner(server)``, serve until SIGINT/SIGTERM, stop."""
    import asyncio
    import signal

    async def run() -> None:
        await server.start()
        stop = asyncio.Event()

        def on_signal() -> None:
            if stop.is_set():       # a second Ctrl-C: the bounded stop goes on
                still_stopping()
            stop.set()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):     # before the banner: a Ctrl-C
            loop.add_signal_handler(sig, on_signal)     # right after it stops cleanly
        extra = f", metrics on http://{args.host}:{server.metrics_port}/metrics" \
            if server.metrics_port else ""
        print(banner(server) + extra, flush=True)
        await stop.wait()
        print("tandem: shutting down", flush=True)
        await server.stop()

    def still_stopping(*_) -> None:
        # os.write, not print: this also runs as a plain signal handler, which may
        # interrupt a print to the same stream.
        os.write(sys.stdout.fileno(), b"tandem: still shutting down (requests, workers, "
                 b"then Redis; bounded)\n")

    try:
        asyncio.run(run())
    finally:
        # The loop's handlers are gone with it, and Ray's own shutdown (its local
        # processes: a second or two) still follows: run it here, where a Ctrl-C is
        # acknowledged rather than raised as KeyboardInterrupt mid-cleanup. Past
        # this point (the interpreter's exit, which resets Python-level handlers) a
        # Ctrl-C is ignored.
        sys.stdout.flush()
        signal.signal(signal.SIGINT, still_stopping)
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 0


def _request(args, text: str, chat: bool):
    from tandem.v1 import tandem_pb2 as pb

    sp = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, stop=args.stop)
    if args.seed is not None:
        sp.seed = args.seed
    if chat:
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(
            role="user", content=text)]), sampling=sp, stream=True)
    return pb.GenerateRequest(prompt=text, sampling=sp, stream=True)


def stream_over_grpc(endpoint: str, prompts: list[str], args, chat: bool, out=None) -> int:
    """Send each prompt to ``endpoint`` and print the streamed text as it arrives
    (to ``out``, default: the current ``sys.stdout``).

    ``args`` may carry the client flags (``api_key``, ``tls``, ``ssl_ca``,
    ``ssl_certfile``, ``ssl_keyfile``); without ``api_key``, $TANDEM_API_KEY is sent.
    """
    import grpc

    from tandem.router.auth import API_KEY_ENV
    from tandem.router.grpc_security import bearer_metadata, open_channel
    from tandem.v1 import tandem_pb2 as pb
    from tandem.v1 import tandem_pb2_grpc as pb_grpc

    out = out if out is not None else sys.stdout
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    metadata = bearer_metadata(api_key)
    channel = open_channel(endpoint, tls=getattr(args, "tls", False),
                           ca_certs=getattr(args, "ssl_ca", None),
                           certfile=getattr(args, "ssl_certfile", None),
                           keyfile=getattr(args, "ssl_keyfile", None))
    with channel:
        stub = pb_grpc.TandemStub(channel)
        for text in prompts:
            print(f"\n>>> {text}", file=out, flush=True)
            t0 = time.perf_counter()
            ttft, final = None, None
            try:
                for resp in stub.Generate(_request(args, text, chat), metadata=metadata):
                    if ttft is None and resp.token_ids:
                        ttft = time.perf_counter() - t0
                    print(resp.text, end="", file=out, flush=True)
                    if resp.finish_reason:
                        final = resp
            except grpc.RpcError as exc:
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            dt = time.perf_counter() - t0
            reason = pb.FinishReason.Name(final.finish_reason) if final else "?"
            n = final.usage.completion_tokens if final else 0
            print(f"\n[{n} tokens, {reason}, TTFT {1000 * (ttft or 0):.0f} ms, {dt:.2f} s]",
                  file=out, flush=True)
    return 0


def _cmd_chat(args) -> int:
    prompts = args.messages or [line.strip() for line in sys.stdin if line.strip()]
    return stream_over_grpc(args.endpoint, prompts, args, chat=True)


def _cmd_demo(args) -> int:
    import dataclasses

    from tandem.router.launcher import BackgroundServer, init_ray

    cfg = dataclasses.replace(_serve_config(args), port=0)
    init_ray(cfg.ray_address)   # from the main thread, so Ray can install its signal handlers
    print(f"tandem: starting a {cfg.mode} cluster (Ray, {cfg.num_prefill} prefill + "
          f"{cfg.num_decode} decode workers) ...", flush=True)
    t0 = time.perf_counter()
    server = BackgroundServer(cfg)
    print(f"tandem: serving on {server.address} after {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        return stream_over_grpc(server.address, args.prompts, args, chat=not args.raw)
    finally:
        server.stop()
        print("tandem: cluster stopped", flush=True)


def _cmd_generate(args) -> int:
    if args.endpoint:
        return stream_over_grpc(args.endpoint, args.prompts, args, chat=args.chat)
    from tandem.engine.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
              num_blocks=args.num_blocks, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
              enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
              enable_chunked_prefill=not args.no_chunked_prefill, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              attention_backend=args.attention_backend, quantization=args.quantization,
              activation_quantization=args.activation_quantization,
              batch_invariant=args.batch_invariant,
              small_batch_linear=_SMALL_BATCH_LINEAR[args.small_batch_linear],
              speculative_config=_engine_config(args).speculative,
              tensor_parallel_size=args.tensor_parallel_size)
    params = _sampling_params(args)
    t0 = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(list(args.prompts), params)
    dt = time.perf_counter() - t0
    n_out = 0
    for prompt, out in zip(args.prompts, outs):
        c = out.outputs[0]
        n_out += len(c.token_ids)
        print(f"\n>>> {prompt}\n{c.text.strip()}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    print(f"\n{len(outs)} prompts, {n_out} output tokens in {dt:.2f} s "
          f"({n_out / dt:.1f} tok/s, batched)", file=sys.stderr)
    return 0


def _cmd_profile(args) -> int:
    from tandem.router.capacity_profile import profile_capacity
    from tandem.engine.runtime.llm_engine import LLMEngine

    engine = LLMEngine(_engine_config(args))
    prof = profile_capacity(engine, args.isl, args.osl, args.ttft_slo, args.itl_slo,
                            args.max_concurrency, args.seed,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    for kind, cap in (("prefill", prof.prefill_capacity_tok_s),
                      ("decode", prof.decode_capacity_tok_s)):
        print(f"{kind} capacity: " + ("none (no concurrency met the SLO)" if cap is None
                                      else f"{cap:.1f} tok/s"))
    print("serve with: tandem serve --autoscale " + " ".join(prof.serve_flags()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**prof.to_dict(), "engine": {"model": args.model, "dtype": args.dtype,
                                                    "kv_cache_dtype": args.kv_cache_dtype,
                                                    "quantization": args.quantization}},
                      f, indent=2)
            f.write("\n")
    return 0


def _cmd_quantize(args) -> int:
    from tandem.quantize.autogptq import quantize_model

    t0 = time.perf_counter()
    if args.method in GGUF_REQUANTIZE_METHODS:
        from tandem.engine.model.model_files import resolve_model
        from tandem.quantize.gguf_writer import requantize_gguf

        try:
            src = resolve_model(args.model)
        except (FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if src.format != "gguf":
            print(f"error: --method {args.method} rewrites a .gguf file; {src.path} is not one",
                  file=sys.stderr)
            return 2
        stats = requantize_gguf(src.path, args.output, args.method.upper())
        print(f"tandem: wrote {args.output}: {args.method.upper()}, "
              f"{stats['file_bytes_after'] / 2**20:.1f} MiB (from "
              f"{stats['file_bytes_before'] / 2**20:.1f}), in {time.perf_counter() - t0:.1f} s")
        return 0
    if args.method == "awq":
        from tandem.quantize.awq import awq_quantize
        from tandem.quantize.dense import data_path

        path = args.calibration_file or data_path("calibration.txt")
        with open(path) as f:
            text = f.read()
        kwargs = {"num_calibration_tokens": args.num_calibration_tokens} \
            if args.num_calibration_tokens else {}
        stats = awq_quantize(args.model, args.output, text, bits=args.bits,
                             group_size=args.group_size, **kwargs)
        print(f"tandem: wrote {args.output}: awq ({args.bits}-bit, group size "
              f"{args.group_size}, {stats['calibration_tokens']} calibration tokens), in "
              f"{time.perf_counter() - t0:.1f} s")
        return 0
    try:
        result = quantize_model(
            args.model, args.output, args.method, bits=args.bits, group_size=args.group_size,
            desc_act=args.desc_act, damp=args.damp, calibration_file=args.calibration_file,
            num_calibration_tokens=args.num_calibration_tokens,
            uniform_hessian=args.uniform_hessian, progress=sys.stderr.isatty())
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    qc = result.quantization_config
    details = [f"{qc['bits']}-bit", f"group size {qc['group_size']}"]
    if qc["desc_act"]:
        details.append("act-order")
    if result.num_calibration_tokens:
        details.append(f"{result.num_calibration_tokens} calibration tokens")
    print(f"tandem: wrote {result.output}: {args.method} ({', '.join(details)}), "
          f"{len(result.quantized)} linear layers, in {time.perf_counter() - t0:.1f} s")
    return 0


GGUF_REQUANTIZE_METHODS = ("q8_0", "q6_k", "q5_0", "q4_k_m", "q4_k", "q4_0", "q4_1")


def _add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", required=True, choices=["gptq", "rtn", "awq",
                                                       *GGUF_REQUANTIZE_METHODS],
                   help="gptq (Frantar et al. 2022: error feedback from calibration "
                        "activations) or rtn (round-to-nearest, no calibration; also the "
                        "experts of a Mixtral, Qwen2-MoE or Qwen3-MoE checkpoint, as gptq "
                        "quantizes them too): an AutoGPTQ "
                        "checkpoint dir; awq (Lin et al. 2023: activation-aware scales and "
                        "clipping; MoE experts too): an AutoAWQ checkpoint dir; q8_0, q6_k, q5_0, q4_k, q4_0, "
                        "q4_1: the GGUF file rewritten in that block type, q4_k_m: in "
                        "llama.cpp's Q4_K_M mix (--output is a .gguf path)")
    p.add_argument("--model", default=None,
                   help="a .gguf file or a dense Hugging Face checkpoint dir "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--output", required=True,
                   help="gptq, rtn, awq: the checkpoint directory to write (must not exist "
                        "or be empty); GGUF methods: the .gguf file to write (replaced if it "
                        "exists)")
    p.add_argument("--bits", type=int, default=4, choices=[2, 4, 8],
                   help="bits per weight (gptq, rtn, awq; the GGUF methods name their own)")
    p.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale/zero group (-1: one group per row)")
    p.add_argument("--desc-act", action="store_true",
                   help="gptq: act-order (quantize columns by decreasing activation energy)")
    p.add_argument("--damp", type=float, default=0.01,
                   help="gptq: Hessian dampening, a fraction of its mean diagonal")
    p.add_argument("--calibration-file", default=None,
                   help="gptq, awq: calibration text (default: the shipped data/calibration.txt)")
    p.add_argument("--num-calibration-tokens", type=int, default=None,
                   help="gptq, awq: use only the first N calibration tokens (default: all for "
                        "gptq, 4096 for awq)")
    p.add_argument("--uniform-hessian", action="store_true",
                   help="gptq: count every calibration token once (the paper's H = 2 X X^T) "
                        "instead of weighting the attention sink and massive activations "
                        "(see tandem.quantize.autogptq.hessian_token_weights)")


def build_parser() -> argparse.ArgumentParser:
    """The ``tandem`` argument parser (each subcommand sets ``func``)."""
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a cluster and serve gRPC until interrupted")
    _add_serve_args(s)
    _add_engine_args(s)
    _add_security_args(s)
    s.set_defaults(func=_cmd_serve)

    r = sub.add_parser("router", help="run one more router over a running cluster's workers")
    r.add_argument("--redis-url", required=True, help="the cluster state of `tandem serve`")
    r.add_argument("--host", default="127.0.0.1", help="the address the router's ports bind")
    r.add_argument("--port", type=int, default=50052, help="gRPC port (0 = any free port)")
    r.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port for /metrics and /health (0 = any free port)")
    _add_http_arg(r, 8001)
    _add_tool_args(r)
    r.add_argument("--ray-address", default=None,
                   help="the Ray cluster (default: the one the cluster state names)")
    r.add_argument("--routing-policy", default="prefix_aware",
                   choices=["prefix_aware", "least_loaded"],
                   help="how the router picks workers (see tandem.router.routing)")
    _add_conditional_disaggregation_args(r)
    r.add_argument("--model", default=None, help="the served model (for its tokenizer)")
    _add_security_args(r)
    r.set_defaults(func=_cmd_router)

    d = sub.add_parser("demo", help="start a cluster, stream answers to prompts over gRPC, stop")
    d.add_argument("prompts", nargs="+")
    d.add_argument("--raw", action="store_true", help="send prompts as raw text (no chat template)")
    _add_serve_args(d)
    _add_engine_args(d)
    _add_sampling_args(d)
    d.set_defaults(func=_cmd_demo)

    g = sub.add_parser("generate", help="generate text: via --endpoint, or offline in this process")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--endpoint", default=None, help="a running server (host:port)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_client_args(g)
    _add_engine_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="chat with a running server (messages from args or stdin)")
    c.add_argument("messages", nargs="*")
    c.add_argument("--endpoint", default="127.0.0.1:50051", help="the server's gRPC address (host:port)")
    _add_client_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=_cmd_chat)

    pr = sub.add_parser("profile", help="measure one worker's prefill and decode capacity "
                                        "within TTFT / ITL targets, for --planner-mode slo")
    pr.add_argument("--isl", type=int, default=256, help="prompt tokens per request")
    pr.add_argument("--osl", type=int, default=64, help="output tokens per request")
    pr.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT target (p90), seconds")
    pr.add_argument("--itl-slo", type=float, default=0.1, help="ITL target (p90), seconds")
    pr.add_argument("--max-concurrency", type=int, default=64,
                    help="the sweep's last concurrency (1, 2, 4, ... up to it)")
    pr.add_argument("--seed", type=int, default=0, help="of the random prompts")
    pr.add_argument("--out", default=None, help="JSON file for the profile")
    _add_engine_args(pr)
    pr.set_defaults(func=_cmd_profile)

    q = sub.add_parser("quantize", help="quantize a model's linear layers: a GPTQ (gptq, rtn) "
                                        "or AWQ checkpoint directory, or a GGUF file in "
                                        "another block type")
    _add_quantize_args(q)
    q.set_defaults(func=_cmd_quantize)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


_FIELD = re.compile(r"(?<![\w/.-])([a-z][a-z0-9_]*)(=[\w.-]+)?")


def with_flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` (a config's error, which names config fields: ``cpu_affinity``,
    ``mode=disaggregated``) with each field that is one of ``parser``'s options
    written as its flag (``--cpu-affinity``, ``--mode disaggregated``), so a user of
    the command line reads what to type. Plain words (``mode`` alone) are kept; only
    names with an underscore or a ``=value`` are fields."""
    flags = {a.dest: next((o for o in a.option_strings if o.startswith("--")), None)
             for a in parser._actions if a.option_strings}

    def sub(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        flag = flags.get(name)
        if flag is None or ("_" not in name and value is None):
            return m.group(0)
        return flag + (" " + value[1:] if value else "")
    return _FIELD.sub(sub, message)


def main(argv: list[str] | None = None) -> int:
    """Run the ``tandem`` command line.

    Returns:
        The exit status: 0 on success; 2 for a usage error (a bad flag, a flag
        combination the engine refuses, a model path that holds no model Tandem
        loads), found before any worker or Ray starts and printed as one
        ``error: ...`` line; 1 when the cluster state (Redis) is unreachable
        (one ``error:`` line naming it) or a command failed.
    """
    from tandem.control.state import ClusterStateUnavailable

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        _check_model_args(args)
        return args.func(args)
    except ValueError as exc:
        print(f"error: {with_flag_names(str(exc), _subcommand_parser(parser, args.command))}",
              file=sys.stderr)
        return 2
    except ClusterStateUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
