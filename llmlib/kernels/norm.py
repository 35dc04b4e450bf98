"""RMSNorm in one pass per row, in C++ (``llmlib/kernels/csrc/rms_norm.cpp``).

PyTorch's CPU ``F.rms_norm`` is a chain of operators, each a pass over the row.
:class:`FusedRMSNorm` replaces :class:`llmlib.model.norm.RMSNorm` where the kernel builds
(AVX-512) and :attr:`llmlib.kernels.flags.Flags.fused_norm` allows (``LLMLIB_FUSED_NORM=0``):
float32 inside, one rounding at the end. Under autograd, off the CPU or for Gemma's
``1 + weight`` it is the plain module, and so in a compiled graph (:meth:`FusedRMSNorm.plain`,
:func:`llmlib.runtime.compile.graph_view`), since inductor fuses that itself.
"""

from __future__ import annotations

import functools

import torch

from llmlib.kernels import native
from llmlib.kernels.flags import flags
from llmlib.model.norm import RMSNorm

_FUSED_DTYPES = {  # (x, weight) pairs the kernel takes
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
}


class FusedRMSNorm(RMSNorm):
    """:class:`~llmlib.model.norm.RMSNorm` with the fused kernel's forward."""

    @classmethod
    def replacing(cls, norm: RMSNorm) -> FusedRMSNorm:
        """A fused norm holding ``norm``'s own gain (no copy)."""
        new = cls.__new__(cls)
        new.__dict__.update(norm.__dict__)
        return new

    def plain(self) -> RMSNorm:
        """The plain module holding this one's gain (no copy): what a compiled graph runs."""
        new = RMSNorm.__new__(RMSNorm)
        new.__dict__.update(
            {k: v.copy() if isinstance(v, dict) else v for k, v in vars(self).items()}
        )
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            not self.offset
            and x.device.type == "cpu"
            and (x.dtype, self.weight.dtype) in _FUSED_DTYPES
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return torch.ops.llmlib_norm.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


def available() -> bool:
    """Whether the flags choose the fused norm here and it builds (on the first call)."""
    return flags().fused_norm and native.has_avx512() and _built()


@functools.cache
def _built() -> bool:
    return native.build("llmlib_norm", "rms_norm.cpp", native.AVX512, "fused RMSNorm kernel")
