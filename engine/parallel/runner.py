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

    Raises:
        NotImplementedError: (at a step) a forward pass with a KV connector's
            per-layer callback, fp8 scales or an int4 store, which do not shard yet.
        RuntimeError: (at a step) an earlier step raised on this rank: the other
            ranks may be inside that step's collectives, so the group is out of step
            for good (build a new engine).
    """

    def __init__(self, model: DecoderForCausalLM, *args, comm: Communicator, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.comm = comm
        self.broken: BaseException | None = None
        """The exception that interrupted a step, after which no step runs."""
        self._forward_signature = inspect.signature(model.forward)
        model.register_forward_pre_hook(self._announce_step, with_kwargs=True)
        model.lm_head.register_forward_pre_hook(self._announce_logits)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.broken is not None:
            raise RuntimeError("tensor_parallel_size: an earlier step was interrupted "
                               f"({type(self.broken).__name__}: {self.broken}); the ranks are "
                               "out of step, build a new engine") from self.broken
        try:
            if out.blocks_to_swap_out or out.blocks_to_swap_in or out.block_copies:
                self.comm.broadcast_object(BlockOps(list(out.blocks_to_swap_out),
                                                    list(out.blocks_to_swap_in),
                                                    list(out.block_copies)))
            return super().execute(out)
        except BaseException as exc:
            self.broken = exc
            raise

    def _announce_step(self, module, args, kwargs):
        bound = self._forward_signature.bind(*args, **kwargs).arguments
        if any(bound.get(k) is not None for k in ("after_layer", "kv_scales", "open_keys")):
            raise NotImplementedError("tensor_parallel_size > 1: KV transfer and fp8 / int4 KV "
                                      "caches are not sharded yet")
        self.comm.broadcast_object(StepInput(bound["input_ids"], bound["positions"],
                                             bound["meta"]))

    def _announce_logits(self, module, args):
        self.comm.broadcast_object(LogitsRequest(args[0]))
