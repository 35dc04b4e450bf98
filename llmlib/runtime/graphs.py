"""Fixed-shape steps replayed from CUDA graphs: one launch instead of hundreds.

A decode step of a small model is a few hundred tiny kernels (norms, projections, RoPE,
attention, the FFN, per layer). On a GPU each launch costs the CPU a few microseconds, and at
small batches the kernels are so short that the GPU spends much of its time waiting for Python
to queue the next one. A CUDA graph records the whole step once and replays it with a single
launch, so the step costs what the GPU work costs.

A graph replays exactly the recorded kernels on exactly the recorded memory. So a step must have
a fixed shape and every input a fixed address: the step object holds its input buffers, a new
step's values are copied into them before each replay, and one graph is captured per shape (a
smaller step is padded up to the next captured one). :class:`StepGraphs` is that machinery, for
the engine's fixed-shape steps (:class:`llmlib.engine.fixed_step.FixedSteps`). Off CUDA the same
steps run as they are (eagerly, or through :mod:`llmlib.runtime.compile`).

A graph also replays without the host. A step that reads a value back (``.item()``,
``.tolist()``, ``nonzero``) or copies from host memory would replay its first step's answer
forever, or fail the capture with a CUDA error that names no line. :class:`HostSyncCheck`
names it instead: every capture's first warm-up runs under it, and the CPU tests trace the
CUDA steps under it on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: operators whose output the host must wait for: what each is, in the words a model's code uses
HOST_READS = {
    aten._local_scalar_dense.default: ".item() or .tolist()",
    aten.nonzero.default: "nonzero (torch.where of one argument, or a boolean index)",
    aten.masked_select.default: "a boolean-mask index",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.repeat_interleave.Tensor: "repeat_interleave by a tensor of counts",
    aten.equal.default: "torch.equal",
    aten.is_nonzero.default: "a tensor's truth value",
}


#: indexing whose boolean index is a hidden nonzero: how many elements it keeps is data
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _boolean_index(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


class HostSyncError(RuntimeError):
    """A step a CUDA graph would capture reads back to the host, or moves or mixes in host data."""


class HostSyncCheck(TorchDispatchMode):
    """While active, an operator that would make the host wait for the device or move a tensor
    between them raises :class:`HostSyncError` naming it: :data:`HOST_READS`, a copy between the
    CPU and another device, or a CPU tensor (even one number) handed to an operator on another
    device's, which a graph would read once, at capture. The meta device counts, so the CPU
    tests can trace the CUDA steps under it; a step on the CPU alone may read the host freely."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in tensors)
        if on_device and func in HOST_READS:
            raise HostSyncError(f"{HOST_READS[func]} in a step a CUDA graph captures ({func})")
        if on_device and func in _INDEXING and _boolean_index(args[1]):
            raise HostSyncError(f"a boolean-mask index in a step a CUDA graph captures ({func})")
        target = kwargs.get("device")
        if func is aten._to_copy.default and target is not None and tensors:
            src, dst = tensors[0].device.type, torch.device(target).type
            if src != dst and "cpu" in (src, dst):
                raise HostSyncError(f"a copy {src} to {dst} in a step a CUDA graph captures")
        elif on_device and any(t.device.type == "cpu" for t in tensors):
            shapes = [tuple(t.shape) for t in tensors if t.device.type == "cpu"]
            raise HostSyncError(
                f"{func} mixes CPU tensors {shapes} into a step a CUDA graph captures"
            )
        return func(*args, **kwargs)


class StepGraphs:
    """One fixed-shape step per key, each run as it is or replayed from its CUDA graph.
    ``make_step(key)`` builds a step (an object holding its input buffers); ``forward(step)``
    runs the model on it. With ``enabled`` (CUDA) each step is warmed up ``warmup`` times on a
    side stream (lazy initialisation, cuBLAS handles and autotuning must not happen inside a
    capture), then captured; every graph shares one memory pool."""

    def __init__(
        self,
        make_step: Callable[[Any], Any],
        forward: Callable[[Any], torch.Tensor],
        device: torch.device,
        enabled: bool,
        warmup: int = 2,
    ) -> None:
        if enabled and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.make_step, self.forward, self.device = make_step, forward, device
        self.enabled, self.warmup = enabled, warmup
        self.entries: dict[Hashable, tuple[Any, Any, torch.Tensor | None]] = {}
        self._pool = None
        self.replays = 0  # steps served from a captured graph
        self.runs = 0  # steps served (graph or not)

    @torch.inference_mode()
    def entry(self, key: Hashable) -> tuple[Any, Any, torch.Tensor | None]:
        """``(step, graph, output)`` of ``key``, built (and captured) the first time."""
        if key not in self.entries:
            step = self.make_step(key)
            graph = out = None
            if self.enabled:
                graph, out = self._capture(step)
            self.entries[key] = (step, graph, out)
        return self.entries[key]

    def _capture(self, step: Any) -> tuple[Any, torch.Tensor]:
        dev = self.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for i in range(self.warmup):
                if i == 0:  # a host read names itself here, not as a failed capture
                    with HostSyncCheck():
                        self.forward(step)
                else:
                    self.forward(step)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward(step)
        return graph, out

    def capture(self, keys: Iterable[Hashable]) -> int:
        """Build ``keys``' steps now (largest first, so one pool fits all); how many exist."""
        for key in keys:
            self.entry(key)
        if self.enabled:
            torch.cuda.synchronize(self.device)
        return len(self.entries)

    @torch.inference_mode()
    def run(self, key: Hashable, fill: Callable[[Any], None]) -> torch.Tensor:
        """Copy a step's values into ``key``'s buffers (``fill(step)``), run it, return its output
        (the graph's own output buffer when replayed: read it before the next run)."""
        step, graph, out = self.entry(key)
        fill(step)
        self.runs += 1
        if graph is None:
            return self.forward(step)
        graph.replay()
        self.replays += 1
        return out
