"""Tensor parallelism inside one engine: a group of ranks, each holding a shard of
every layer (Megatron-LM's column/row split; Shoeybi et al. 2019, sec. 3).

- :mod:`~tandem.engine.parallel.communicator`: the collectives (all-reduce, gather,
  broadcast of a step's input) behind a small interface; Gloo on the CPU, NCCL on CUDA.
- :mod:`~tandem.engine.parallel.partition`: which heads, features and vocabulary
  rows each rank holds.
- :mod:`~tandem.engine.parallel.layers`: ``ColumnParallelLinear``,
  ``RowParallelLinear``, ``VocabParallelEmbedding``, ``ParallelLMHead``.
- :mod:`~tandem.engine.parallel.group`, :mod:`~tandem.engine.parallel.worker`,
  :mod:`~tandem.engine.parallel.runner`, :mod:`~tandem.engine.parallel.messages`:
  the process model: rank 0 in the engine's process runs the scheduler and the
  sampler and broadcasts each step's model input; ranks 1.. are worker processes
  that follow.

docs/tensor_parallel.md says what exists and what does not yet.
"""
