"""A tensor-parallel engine's rank 1, 2, ...: a process that holds its shard of the
model and its own paged KV cache, and follows rank 0 step by step.

It runs no scheduler and no sampler. Rank 0 broadcasts what each step needs
(:mod:`tandem.engine.parallel.messages`); the worker applies the block operations
to its cache, runs the same forward pass on its shard (taking part in each
row-parallel layer's all-reduce) and its share of the LM head (taking part in the
gather of logits to rank 0). Started by
:class:`~tandem.engine.parallel.group.TensorParallelGroup` as
``python -P -m tandem.engine.parallel.worker``, with a pickled
:class:`~tandem.engine.parallel.group.WorkerInit` on its stdin.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from tandem.engine.kv.kv_connector import get_rank_kv_agent
from tandem.engine.model.layers import DecoderForCausalLM
from tandem.engine.parallel.communicator import Communicator, TorchDistributedCommunicator
from tandem.engine.parallel.group import (STORE_PREFIX, WorkerInit, backend_for, heartbeat,
                                          rank_device, rank_model_config, threads_per_rank)
from tandem.engine.parallel.messages import (BlockOps, CalibrateKVScales, LogitsRequest,
                                             Shutdown, StepInput, WorkerSetup)
from tandem.engine.parallel.partition import head_partition
from tandem.engine.runtime.model_runner import KVCache
from tandem.kernels.attention_backend import AttentionBackend, AttentionMetadata
from tandem.kernels.int4_kv import Int4WritePlan


@torch.inference_mode()
def follow(comm: Communicator, model: DecoderForCausalLM, kv_cache: KVCache,
           backend: AttentionBackend, kv_agent=None) -> None:
    """Run rank 0's steps on this rank's shard until a
    :class:`~tandem.engine.parallel.messages.Shutdown`.

    With a quantized KV cache the forward passes this rank's fp8 scales or int4
    open-block K store; a step's int4 write plan is recomputed from this rank's
    store (:func:`_int4_plan`) after the block pool's calls rank 0 sent are replayed.

    Raises:
        RuntimeError: a message of an unknown kind, the group broke (rank 0 gone), or
            this rank's int4 write plan differs from rank 0's.
    """
    while True:
        msg = comm.broadcast_object(None, src=0)
        if isinstance(msg, StepInput):
            meta = msg.meta
            if meta.int4_plan is not None:
                meta = dataclasses.replace(meta, int4_plan=_int4_plan(kv_cache, meta))
            saving = bool(msg.kv_saves) and kv_agent is not None
            if saving:
                kv_agent.start_save(msg.kv_saves)
            model(msg.input_ids, msg.positions, kv_cache.tensor, meta, backend,
                  kv_agent.save_kv_layer if saving else None,
                  kv_scales=kv_cache.scales, open_keys=kv_cache.open_keys)
            if saving:
                kv_agent.wait_for_save()
        elif isinstance(msg, LogitsRequest):
            model.lm_head(msg.hidden)            # this rank's vocabulary rows, gathered on rank 0
        elif isinstance(msg, BlockOps):
            for name, block_ids in msg.block_events:
                if name == "allocated":
                    kv_cache.blocks_allocated(block_ids)
                else:
                    kv_cache.blocks_released(block_ids)
            kv_cache.swap_out(msg.blocks_to_swap_out)
            kv_cache.swap_in(msg.blocks_to_swap_in)
            kv_cache.copy_blocks(msg.block_copies)
        elif isinstance(msg, Shutdown):
            return
        else:
            raise RuntimeError(f"tensor-parallel worker: unexpected message {type(msg).__name__}")


def _int4_plan(kv_cache: KVCache, meta: AttentionMetadata) -> Int4WritePlan:
    """This rank's int4 write plan for the step of ``meta``: recomputed from its own
    open-block K store (rebuilding or growing it as rank 0's did), which names the
    same entries as rank 0's plan in ``meta``.

    Raises:
        RuntimeError: the plans differ (the stores went out of step).
    """
    plan = kv_cache.plan_int4_write(meta.slot_mapping.tolist(), meta.block_tables,
                                    meta.seq_lens_cpu)
    want = meta.int4_plan
    for f in dataclasses.fields(plan):
        if not torch.equal(getattr(plan, f.name).cpu(), getattr(want, f.name).cpu()):
            raise RuntimeError(f"tensor-parallel worker: int4 write plan's {f.name} differs "
                               "from rank 0's (the open-block K stores are out of step)")
    return plan


def run_worker(init: WorkerInit) -> None:
    """Join the group, load this rank's shard, allocate the KV cache rank 0 sized,
    and :func:`follow`. A failure before following is written to the store (rank 0
    raises it) and re-raised.
    """
    from tandem.engine.model.loader import load_model
    from tandem.engine.model.model_files import resolve_model
    from tandem.engine.model.moe import set_moe_dispatch
    from tandem.engine.runtime.kv_scales import (calibrate_kv_scales, gather_model_kv_scales,
                                                 kv_cache_torch_dtype)
    from tandem.kernels.registry import get_attention_backend

    config, rank = init.config, init.rank
    torch.set_num_threads(config.num_threads
                          or (len(init.cpus) if init.cpus else threads_per_rank(init.world_size)))
    store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(
        init.host, init.port, is_master=False, timeout=datetime.timedelta(seconds=init.timeout_s)))
    device = rank_device(config.device, rank)
    threading.Thread(target=heartbeat, args=(init.host, init.port, rank), daemon=True,
                     name="tp-heartbeat").start()
    store.set(f"joined/{rank}", "ok")
    comm = TorchDistributedCommunicator(store, rank, init.world_size, backend_for(device), device,
                                        timeout_s=init.timeout_s)
    try:
        model, cfg = load_model(resolve_model(config.model), config.torch_dtype, device,
                                config.quantization, config.batch_invariant,
                                config.activation_quantization, comm=comm,
                                enable_expert_parallel=config.enable_expert_parallel,
                                small_batch_linear=config.small_batch_linear)
        set_moe_dispatch(model, config.moe_dispatch)
    except BaseException as exc:
        store.set(f"loaded/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"loaded/{rank}", "ok")
    kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, config.torch_dtype)
    setup = comm.broadcast_object(None, src=0)
    scales = None
    if isinstance(setup, CalibrateKVScales):        # fp8: this rank's heads' scales
        scales = calibrate_kv_scales(model, cfg, setup.token_ids, config.torch_dtype, device,
                                     setup.block_size)
        gather_model_kv_scales(scales, cfg, comm)   # rank 0's KV connector compares them
        setup = comm.broadcast_object(None, src=0)
    if isinstance(setup, Shutdown):
        return
    assert isinstance(setup, WorkerSetup), type(setup)
    # int4: the open-block K store starts with as many entries as rank 0's (the
    # engine's max_num_seqs), so that both grow alike.
    open_entries = config.scheduler.max_num_seqs if kv_dtype == torch.uint8 else None
    kv_cache = KVCache(rank_model_config(cfg, init.world_size, rank), setup.num_blocks,
                       config.cache.block_size, kv_dtype, device, setup.num_host_blocks,
                       scales, config.torch_dtype, open_entries)
    backend = get_attention_backend(config.attention_backend, device, config.torch_dtype,
                                    config.batch_invariant)
    # This rank's ends of the worker's KV channels (disaggregated serving), driven by rank 0.
    heads = head_partition(cfg.num_heads, cfg.num_kv_heads, init.world_size, rank)
    kv_agent = get_rank_kv_agent(rank, init.host, init.port, kv_cache.tensor, heads.kv_start)
    try:
        follow(comm, model, kv_cache, backend, kv_agent)
    finally:
        comm.close()


def _exit_when_stdin_closes(stream) -> None:
    # Rank 0 holds the other end: EOF means its engine shut down or its process died.
    while stream.read(1 << 16):
        pass
    os._exit(0)


def main() -> None:
    """The worker process's entry point (reads its :class:`WorkerInit` from stdin)."""
    stream = sys.stdin.buffer
    n = int.from_bytes(stream.read(8), "little")
    init: WorkerInit = pickle.loads(stream.read(n))
    if init.cpus:     # before any thread starts: they inherit it
        os.sched_setaffinity(0, init.cpus)
    threading.Thread(target=_exit_when_stdin_closes, args=(stream,), daemon=True,
                     name="tp-parent-watch").start()
    try:
        run_worker(init)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
