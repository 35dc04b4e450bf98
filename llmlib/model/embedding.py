"""Embeddings: token ids in, vectors out; and the LM head, vectors in, one score per vocabulary entry out.

The lookup is a row copy: row ``i`` of the ``[vocab, d_model]`` table is token ``i``'s vector. It
equals multiplying a one-hot vector by the table (:func:`embed_one_hot`, kept for the book), but
costs ``d_model`` reads per token instead of ``vocab * d_model`` multiply-adds.

The LM head is the reverse map, ``logits = h @ W^T``. Many small models (SmolLM2, Llama-3.2-1B)
*tie* it to the embedding table, reusing the same matrix; larger ones keep a separate ``lm_head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TokenEmbedding(nn.Module):
    """The ``[vocab_size, d_model]`` table (state-dict name ``embed.weight``).

    ``scale`` multiplies every row on the way out: Gemma uses ``sqrt(d_model)``, so its tied
    table can keep small entries for the LM head while the stream starts at unit size. The factor
    is rounded to the table's dtype first, as the reference implementation does.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        device: torch.device | str | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        self.scale = scale
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model, device=device))
        # a loader builds on meta and fills from the checkpoint
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.scaled(F.embedding(ids, self.weight))

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        return x

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head when it is tied to this table: one score per row, :func:`unembed`."""
        return unembed(h, self.weight)


def embed_one_hot(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same lookup as a matrix product with one-hot rows: correct, and wasteful on purpose."""
    return F.one_hot(ids, weight.shape[0]).to(weight.dtype) @ weight


def unembed(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LM head: ``[..., d_model] -> [..., vocab]`` scores, one dot product per vocabulary entry.

    ``weight`` is ``lm_head.weight``, or ``embed.weight`` itself when the embeddings are tied.
    """
    return F.linear(h, weight)
