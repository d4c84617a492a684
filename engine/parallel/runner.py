"""Rank 0's model runner in a tensor-parallel engine.

It is the :class:`~tandem.engine.runtime.model_runner.ModelRunner` (the same step:
block operations, packing, forward, sampling), on rank 0's shard of the model, plus
the announcements that let the other ranks run the same collectives
(:mod:`tandem.engine.parallel.messages`): a step's block operations before
they are applied, the forward pass's inputs as the model is called (a forward
pre-hook on the model, so the workers run exactly the inputs the runner built),
and the rows of each ``compute_logits`` call (a pre-hook on the LM head). Only
rank 0 samples: the LM head's gather gives it the whole logits.
"""

from __future__ import annotations

import inspect

from tandem.engine.model.layers import DecoderForCausalLM
from tandem.engine.parallel.communicator import Communicator
from tandem.engine.parallel.messages import BlockOps, LogitsRequest, StepInput
from tandem.engine.runtime.model_runner import ModelRunner, ModelRunnerOutput
from tandem.engine.scheduling.scheduler_output import SchedulerOutput


class TensorParallelModelRunner(ModelRunner):
    """A :class:`ModelRunner` on rank 0 of a tensor-parallel group.

    Args:
        model: rank 0's shard (built with ``comm``); this runner hooks it, so it
            must not serve another runner.
        comm: the group's communicator (rank 0).
        The other arguments are :class:`ModelRunner`'s.

    The KV cache may be fp8 (each rank holds the calibrated scales of its own KV
    heads, :func:`~tandem.engine.runtime.kv_scales.calibrate_kv_scales`) or int4
    (each rank keeps its own open-block K store; rank 0 sends the block pool's
    calls on its cache with the step's block operations, so every rank's store
    assigns the same entries, :class:`~tandem.engine.parallel.messages.BlockOps`).

    With a KV connector (a disaggregated worker), a step that sends prompts' KV
    announces the saves with its forward pass's input; each rank sends its own KV
    heads (:mod:`tandem.kvtransfer.sharded`).

    Raises:
        RuntimeError: (at a step) an earlier step raised on this rank: the other
            ranks may be inside that step's collectives, so the group is out of step
            for good (build a new engine).
    """

    def __init__(self, model: DecoderForCausalLM, *args, comm: Communicator, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.comm = comm
        self.broken: BaseException | None = None
        """The exception that interrupted a step, after which no step runs."""
        if self.kv_cache.open_keys is not None:      # int4: the other ranks replay these
            self.kv_cache.block_events = []
        self._forward_signature = inspect.signature(model.forward)
        model.register_forward_pre_hook(self._announce_step, with_kwargs=True)
        model.lm_head.register_forward_pre_hook(self._announce_logits)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.broken is not None:
            raise RuntimeError("tensor_parallel_size: an earlier step was interrupted "
                               f"({type(self.broken).__name__}: {self.broken}); the ranks are "
                               "out of step, build a new engine") from self.broken
        try:
            events = self.kv_cache.block_events or []
            if events:
                self.kv_cache.block_events = []
            if out.blocks_to_swap_out or out.blocks_to_swap_in or out.block_copies or events:
                self.comm.broadcast_object(BlockOps(list(out.blocks_to_swap_out),
                                                    list(out.blocks_to_swap_in),
                                                    list(out.block_copies), events))
            return super().execute(out)
        except BaseException as exc:
            self.broken = exc
            raise

    def _announce_step(self, module, args, kwargs):
        bound = self._forward_signature.bind(*args, **kwargs).arguments
        saves = ()
        if bound.get("after_layer") is not None and self.kv_connector is not None:
            saves = tuple(self.kv_connector.step_saves)
        # The other ranks pass their own fp8 scales / int4 store (their heads'), and
        # recompute the int4 write plan that meta carries from their own store.
        self.comm.broadcast_object(StepInput(bound["input_ids"], bound["positions"],
                                             bound["meta"], saves))

    def _announce_logits(self, module, args):
        self.comm.broadcast_object(LogitsRequest(args[0]))
