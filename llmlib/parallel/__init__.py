"""Tensor parallelism: one model split over ``N`` processes (GPUs, or CPU processes), Megatron-style.

``llmlib.LLM(path, tensor_parallel_size=N)`` (and ``llmlib generate`` / ``llmlib serve`` with
``--tensor-parallel-size N``) runs the batching engine with every weight matrix cut ``N`` ways:

* :mod:`~llmlib.parallel.shard` — which slice of each tensor a rank holds, and why (MoE layers
  split by the expert matrices);
* :mod:`~llmlib.parallel.load` — a rank reads only its slices from the checkpoint
  (:mod:`llmlib.checkpoints.lazy`: safetensors slices, GGUF rows of the memory-mapped file);
* :mod:`~llmlib.parallel.comm` — the all-reduce after each row-parallel product, the
  vocabulary-parallel embedding, the logit gather; hooked onto the model, which does not change;
* :mod:`~llmlib.parallel.plan` — the step plan the driver sends, as integers;
* :mod:`~llmlib.parallel.group` — getting the ranks into ``torch.distributed`` groups (gloo on
  a CPU, NCCL on CUDA), and the failures they report;
* :mod:`~llmlib.parallel.worker` — a rank: its shard, its part of the KV pool, its loop;
* :mod:`~llmlib.parallel.driver` — rank 0 beside the scheduler: starts the others, sends each
  step, samples, notices a rank that dies and shuts the rest down.

On one machine llmlib starts ranks ``1 .. N-1`` itself (the caller's process is rank 0). Across
machines, ``torchrun`` starts them, and every rank runs the same command; rank 0 drives, the
others serve. For example, eight GPUs over two machines (the checkpoint at the same path on
both)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-id llmlib \\
        -m llmlib serve --model /models/llama-3-70b --tensor-parallel-size 8

and on one machine ``torchrun --nproc-per-node 3 -m llmlib generate --model M.gguf
--tensor-parallel-size 3 "prompt"`` is the same path the tests run.
"""

from llmlib._lazy import lazy_exports

_EXPORTS = {
    "TPOptions": "llmlib.parallel.driver",
    "TensorParallelError": "llmlib.parallel.group",
    "RankReport": "llmlib.parallel.worker",
    "load_shard": "llmlib.parallel.load",
    "shard_config": "llmlib.parallel.shard",
    "shard_specs": "llmlib.parallel.shard",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
