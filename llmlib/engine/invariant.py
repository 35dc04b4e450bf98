"""Batch-invariant steps: a token's logits bitwise the same whatever else shares its step.

Floating-point addition is not associative: summed in another order, a result can differ in its
last bits, and near a tie that flips a greedy choice. In the default engine a token's order
depends on its company: the matrix-product kernel is picked by the step's token count, and
attention splits keys into blocks sized by the chunk (``F.scaled_dot_product_attention``) or pads
a decode group to its longest member. So a request run alone, batched, chunked another way,
recomputed after a preemption or started from cached prefix blocks can give different logits
(Going further 3 measures by how much, :mod:`llmlib.analysis.invariance`).

``LLM(..., batch_invariant=True)`` fixes every reduction's order whatever the batch, as He et al.
("Defeating Nondeterminism in LLM Inference", 2025) and vLLM's batch-invariant mode do:

* weight-matrix products are taken ``ROW_TILE`` rows at a time, zero-padded (the last tile to a
  size checked to give a whole tile's bits, :func:`llmlib.kernels.prepare.row_tiled`), and row
  ``i`` of a product depends only on row ``i`` of its input;
* RMSNorm, RoPE, SiLU and the residual adds are per row already;
* attention (:class:`InvariantStep`) takes each query alone through the paged kernel
  (:mod:`llmlib.kernels.paged_attention`), in chunks fixed by its position and the block size;
  elsewhere in tiles of ``Q_TILE`` positions aligned to absolute positions, walking the keys from
  position 0 in tiles of ``K_TILE`` with an online softmax. A query's sums then depend only on
  its position and its sequence's keys: not on how its prompt was chunked, whether it is a prompt
  or a decoded token (so a recompute after preemption rebuilds the same keys and values), nor on
  the other sequences (masked keys add exact zeros; batched products compute each tile alone).

Products run in the model's format: a fixed shape makes invariant any deterministic kernel that
treats a tile's rows alike, as the view checks. Attention runs in float32. The cost:
``llmlib bench batching --batch-invariant``.

Compiled (by default on a CPU with AMX, :func:`~llmlib.device.compiles_by_default`), the mode
holds the shapes still instead (:class:`InvariantRows`): every token is one row of a group of
``PROMPT_TILE`` or ``ROW_TILE`` rows through the engine's compiled step. A compiled graph picks
its own kernels, but fed one shape it runs the same code every time; the engine checks at start
that a size computes every row alike (:meth:`InvariantRows.settle`), else runs the eager steps.
The graph is compiled once per machine and kept on disk (:mod:`llmlib.engine.fixed_step`), shared
with the default engine; compiled in memory, inductor may tune it differently in another process,
so the guarantee holds in one process. Results are not bitwise the eager steps', only as invariant.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from llmlib.engine.fixed_step import FixedStep, bucket
from llmlib.engine.paged_cache import PagedKVCache, PagedStep, SeqChunk, write_kv
from llmlib.kernels.paged_attention import decode_attention, serves_spec
from llmlib.model.attention import AttentionSpec, soft_cap

#: rows per weight-matrix product (bfloat16 oneDNN and float32 MKL both change kernels with M)
ROW_TILE = 32
#: rows per group of prompt tokens in the compiled mode (:class:`InvariantRows`)
PROMPT_TILE = 128
#: group sizes the compiled mode tries in turn (:meth:`InvariantRows.settle`)
ROW_CHOICES, PROMPT_CHOICES = (ROW_TILE, 48, 64), (PROMPT_TILE, 192, 256)
#: query positions per attention tile, and keys per key tile
Q_TILE = 2
K_TILE = 64


@dataclass
class _Tiles:
    """Each query tile's rows and keys, sorted by key tiles read, most first: the tiles reading
    key tile ``j`` are the first ``active[j]``, a prefix sliced without copies."""

    q_index: torch.Tensor  # [U * Q_TILE] flat token index of each row (padding: B * T)
    q_pos: torch.Tensor  # [U, Q_TILE] each row's position (padding rows: the tile's last)
    active: list[int]  # per key tile, how many query tiles read it
    rows: list[torch.Tensor]  # per key tile [active * Hkv * K_TILE]: pool rows, head-major
    hidden: list[torch.Tensor]  # per key tile [active, 1, Q_TILE, K_TILE]: key after query


class InvariantStep(PagedStep):
    """A :class:`~llmlib.engine.paged_cache.PagedStep` whose attention is batch-invariant."""

    def __init__(
        self,
        cache: PagedKVCache,
        rows: Seq[Seq[SeqChunk]],
        q_tile: int = Q_TILE,
        k_tile: int = K_TILE,
    ) -> None:
        super().__init__(cache, rows)
        self.q_tile, self.k_tile = q_tile, k_tile
        # the kernel orders each query's keys by its position alone; else the tiled loop does
        self.rows_plan = self._rows() if cache.kernel else None
        self.tiles = None if self.rows_plan else self._plan()
        self._windowed: dict[int, list[torch.Tensor]] = {}

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For :func:`~llmlib.kernels.paged_attention.decode_attention`, one query per row: each
        real token's flat index, its sequence's block table and its key count (position + 1)."""
        bs = self.cache.block_size
        T = self.shape[1]
        index, tables, lens = [], [], []
        for b, row in enumerate(self.rows):
            t0 = 0
            for c in row:
                end = c.start + c.length
                blocks = torch.as_tensor([int(x) for x in c.block_table[: -(-end // bs)]])
                index.append(b * T + t0 + torch.arange(c.length))
                tables.append(blocks.expand(c.length, -1))
                lens.append(torch.arange(c.start + 1, end + 1))
                t0 += c.length
        nb = max(t.shape[1] for t in tables)
        table = torch.zeros((sum(len(i) for i in index), nb), dtype=torch.long)
        i = 0
        for t in tables:
            table[i : i + len(t), : t.shape[1]] = t
            i += len(t)
        dev = self.cache.device
        return torch.cat(index).to(dev), table.to(dev), torch.cat(lens).to(dev)

    def _plan(self) -> _Tiles:
        bs, qt, kt = self.cache.block_size, self.q_tile, self.k_tile
        Hkv = self.cache.n_kv_heads
        B, T = self.shape
        units = []  # (key tiles, row indices, row positions, block table)
        for b, row in enumerate(self.rows):
            t0 = 0
            for c in row:
                end = c.start + c.length
                blocks = [int(x) for x in c.block_table[: -(-end // bs)]]
                for u in range(c.start // qt, (end - 1) // qt + 1):
                    top = min(end, (u + 1) * qt) - 1  # the tile's last real query
                    idx, pos = [], []
                    for p in range(u * qt, (u + 1) * qt):
                        real = c.start <= p < end
                        idx.append(b * T + t0 + p - c.start if real else B * T)
                        # padding rows look at the same keys as the last real one: finite, unread
                        pos.append(p if real else top)
                    units.append((top // kt + 1, idx, pos, blocks))
                t0 += c.length
        units.sort(key=lambda x: -x[0])  # stable: most key tiles first
        U, J = len(units), units[0][0]
        nb = max(len(x[3]) for x in units)
        table = torch.zeros((U, nb), dtype=torch.long)
        for i, x in enumerate(units):
            table[i, : len(x[3])] = torch.as_tensor(x[3])
        q_pos = torch.tensor([x[2] for x in units])
        last = q_pos.amax(1)
        k_pos = torch.arange(J * kt)
        # keys beyond a tile's last query read position 0 (a real key) and are masked
        kidx = torch.where(k_pos[None, :] <= last[:, None], k_pos[None, :], 0)
        slots = table.gather(1, kidx // bs) * bs + kidx % bs  # [U, J * kt]
        # the pool viewed as [slots * Hkv, D]: row slot * Hkv + h, gathered head-major
        pool_rows = slots[:, None, :] * Hkv + torch.arange(Hkv)[None, :, None]
        hidden = k_pos[None, None, :] > q_pos[:, :, None]  # [U, qt, J * kt]
        counts = torch.tensor([x[0] for x in units])
        active = [int((counts > j).sum()) for j in range(J)]
        dev = self.cache.device
        return _Tiles(
            torch.tensor([i for x in units for i in x[1]]).to(dev),
            q_pos.to(dev),
            active,
            [
                pool_rows[:n, :, j * kt : (j + 1) * kt].reshape(-1).to(dev)
                for j, n in enumerate(active)
            ],
            [hidden[:n, None, :, j * kt : (j + 1) * kt].to(dev) for j, n in enumerate(active)],
        )

    def _hidden(self, window: int | None) -> list[torch.Tensor]:
        """Per key tile, the keys each query row may not see (after it; beyond its window)."""
        tl = self.tiles
        if window is None:
            return tl.hidden
        if window not in self._windowed:
            kt, out = self.k_tile, []
            for j, (n, h) in enumerate(zip(tl.active, tl.hidden)):
                k_pos = torch.arange(j * kt, (j + 1) * kt, device=h.device)
                far = k_pos[None, None, :] <= tl.q_pos[:n, :, None] - window
                out.append(h | far[:, None])
            self._windowed[window] = out
        return self._windowed[window]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        positions: torch.Tensor | None = None,  # unused: the step's layout holds them
    ) -> torch.Tensor:
        """Write the new keys and values, then attend ``q [B, H, T, hd]``: one query per row by
        the paged kernel, else :meth:`attend_tiles`. ``spec`` gives only options, not the order."""
        write_kv(self.cache, self.layout, layer, k, v)
        if self.rows_plan is None:
            return self.attend_tiles(layer, q, spec)
        B, H, T, D = q.shape
        index, table, lens = self.rows_plan
        rows = q.transpose(1, 2).reshape(B * T, H, D)[index]
        o = decode_attention(
            rows, self.cache.k[layer], self.cache.v[layer], table, lens,
            scale=spec.scale, softcap=spec.softcap, window=spec.window,
        )  # fmt: skip
        out = q.new_zeros(B * T, H, D)
        out[index] = o
        return out.view(B, T, H, D).transpose(1, 2)

    def attend_tiles(self, layer: int, q: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        """Tiled online-softmax attention over keys already in the pool, each query tile pinned
        to its positions and each key tile counted from position 0 (the portable path)."""
        window = spec.window
        B, H, T, D = q.shape
        Hkv, qt, kt = self.cache.n_kv_heads, self.q_tile, self.k_tile
        rep = H // Hkv
        tl = self.tiles
        U = tl.q_pos.shape[0]
        R = rep * qt
        scale = spec.scale or D**-0.5
        softcap = spec.softcap
        flat = q.transpose(1, 2).reshape(B * T, H, D)
        flat = torch.cat([flat, flat.new_zeros(1, H, D)])  # the padding row
        # [U, qt, Hkv, rep, D] -> [U, Hkv, rep * qt, D]: the query heads sharing a KV head
        Q = flat[tl.q_index].view(U, qt, Hkv, rep, D).permute(0, 2, 3, 1, 4)
        Q = Q.reshape(U, Hkv, R, D).float()
        if softcap is None:
            Q = Q * scale  # the same product for every query: fold the scale in once
        kpool = self.cache.k[layer].view(-1, D)
        vpool = self.cache.v[layer].view(-1, D)
        dev = q.device
        m = torch.full((U, Hkv, R, 1), float("-inf"), device=dev)
        l = torch.zeros((U, Hkv, R, 1), device=dev)  # noqa: E741 - the softmax denominator
        acc = torch.zeros((U, Hkv, R, D), device=dev)
        for n, idx, hid in zip(tl.active, tl.rows, self._hidden(window)):
            kj = kpool.index_select(0, idx).view(n, Hkv, kt, D).float()
            vj = vpool.index_select(0, idx).view(n, Hkv, kt, D).float()
            s = torch.matmul(Q[:n], kj.transpose(-1, -2))  # [n, Hkv, R, kt]
            if softcap is not None:
                s = soft_cap(s * scale, softcap)
            # rows are (head in group, query in tile): the mask repeats over the heads
            s.view(n, Hkv, rep, qt, kt).masked_fill_(hid[:, :, None], float("-inf"))
            mn = m[:n]
            m_new = torch.maximum(mn, s.amax(dim=-1, keepdim=True))
            p = s.sub_(m_new).exp_()
            corr = (mn - m_new).exp_()
            l[:n].mul_(corr).add_(p.sum(dim=-1, keepdim=True))
            acc[:n].mul_(corr).add_(torch.matmul(p, vj))
            mn.copy_(m_new)
        o = (acc / l).view(U, Hkv, rep, qt, D).permute(0, 3, 1, 2, 4).reshape(U * qt, H, D)
        out = q.new_zeros(B * T + 1, H, D)
        out[tl.q_index] = o.to(q.dtype)  # padding rows all land in the extra row
        return out[: B * T].view(B, T, H, D).transpose(1, 2)


def rows_compile(model: torch.nn.Module, cache: PagedKVCache) -> str | None:
    """Why :class:`InvariantRows` cannot run over ``cache`` (None: it can): only the paged kernel
    sums in an order fixed by position (a masked fallback's depends on the padding)."""
    if not cache.kernel:
        return "the paged attention kernel does not run here"
    if not all(serves_spec(layer.attn.spec) for layer in getattr(model, "layers", ())):
        return "a layer's attention is not the fused function"
    return None


class InvariantRows:
    """Batch-invariant steps through one compiled graph, fed groups of a fixed number of rows.

    Every token is one row (id, position, block table): a prompt token in a group of
    ``prompt_rows`` rows, a generated one in a group of ``rows``, the last group of each kind
    padded with rows that write into the scratch block. A token's group depends only on whether
    it is in its prompt, so its logits stay the same alone, batched, chunked or recomputed.
    Two sizes, because a larger product costs less per row but more per step: prompts arrive
    hundreds of tokens at a time, decoding a handful. Blocks of generated tokens are named apart
    (:class:`~llmlib.engine.block_manager.BlockManager`'s ``outputs_apart``), so a next turn's
    prompt never reads keys computed as generated ones. Prompt groups run first, then generated
    ones, in packing order, so every token sees its sequence's earlier keys. The LM head runs on
    the ``rows`` rows of a group it samples; a prompt group closes early rather than sample more.
    """

    def __init__(
        self,
        forward,
        cache: PagedKVCache,
        scratch_block: int,
        max_blocks: int,
        rows: int = ROW_TILE,
        prompt_rows: int = PROMPT_TILE,
    ) -> None:
        self.forward, self.cache, self.scratch_block = forward, cache, scratch_block
        self.rows, self.prompt_rows, self.max_blocks = rows, prompt_rows, max_blocks
        self._steps: dict[tuple[int, int, int], FixedStep] = {}

    def _step(self, rows: int, blocks: int, heads: int) -> FixedStep:
        # a power of two (fewer buffers): the kernel reads only a row's blocks, so no sum changes
        nb = bucket(max(blocks, 2), max(self.max_blocks, 2))
        key = rows, nb, heads
        if key not in self._steps:
            self._steps[key] = FixedStep(self.cache, rows, nb, self.scratch_block, heads, False)
        return self._steps[key]

    @torch.inference_mode()  # as the engine's steps run (a graph compiled here serves them)
    def alike(self, rows: int, token: int = 1, heads: int = 0) -> bool | None:
        """Whether the graph computes every row of a ``rows``-row group alike: one token in every
        row (position 0, scratch block) must give bitwise equal logits, the LM head on ``heads``
        rows (0: all); None: its logits are all equal, telling nothing. A kernel may take a
        product's last rows with other code (MKL's float32 AVX2 kernel: rows 30 and 31 of 32)."""
        heads = heads or rows
        step, here = self._step(rows, 2, heads), SeqChunk([self.scratch_block], 0, 1)
        step.fill([here] * rows, [token] * rows, range(heads))
        logits = self.forward(step.ids, step.positions, step)
        if bool((logits[0] == logits[0, 0]).all()):
            return None
        return bool((logits == logits[:1]).all())

    def settle(self) -> str | None:
        """Take the first ``ROW_CHOICES`` and ``PROMPT_CHOICES`` that pass :meth:`alike` (prompt
        groups with the LM head on all rows and on ``rows``); None when found, else why not."""
        first = token = None
        for token in (1, 2, 3):  # a token whose logits are all equal tells nothing
            if (first := self.alike(ROW_TILE, token)) is not None:
                break
        if first is None:  # nothing to tell rows apart by: keep the preferred sizes
            return None
        later = (n for n in ROW_CHOICES[1:] if self.alike(n, token))
        rows = ROW_TILE if first else next(later, None)
        prompt = next(
            (n for n in PROMPT_CHOICES if self.alike(n, token) and self.alike(n, token, rows)),
            None,
        )
        if rows is None or prompt is None:
            return f"no group of {ROW_CHOICES} or {PROMPT_CHOICES} rows computes its rows alike"
        self.rows, self.prompt_rows = rows, prompt
        return None

    def run(self, chunks: Seq[SeqChunk], ids: Seq[int], select: Seq[int]) -> torch.Tensor:
        """Logits ``[len(select), vocab]`` at the flat token indices ``select`` of ``chunks``
        packed in order. A chunk's ``num_prompt_tokens`` routes its tokens (None: a prompt's)."""
        bs = self.cache.block_size
        total = sum(c.length for c in chunks)
        # every token's chunk, its position, and whether it is a prompt token
        of = torch.cat([torch.full((c.length,), i) for i, c in enumerate(chunks)])
        pos = torch.cat([torch.arange(c.start, c.start + c.length) for c in chunks])
        ends = torch.tensor([c.num_prompt_tokens or c.start + c.length for c in chunks])
        prompt = pos < ends[of]
        where = of.tolist(), pos.tolist()  # for the runs each group's rows are filled from
        sel = torch.as_tensor(list(select), dtype=torch.long)
        sampled = torch.zeros(total, dtype=torch.bool)
        sampled[sel] = True
        head_of = torch.full((total,), -1, dtype=torch.long)  # a sampled token's logits row
        out: torch.Tensor | None = None
        for route, n in ((prompt, self.prompt_rows), (~prompt, self.rows)):
            members = route.nonzero()[:, 0]
            g0 = 0
            while g0 < len(members):
                m = members[g0 : g0 + n]
                # at most `rows` sampled tokens a group: close it before the next one
                m = m[: int((sampled[m].cumsum(0) <= self.rows).sum())]
                g0 += len(m)
                heads = sampled[m].nonzero()[:, 0]  # rows of the group the LM head runs on
                step = self._step(n, int(pos[m].max()) // bs + 1, self.rows)  # rest: padding
                rows = _runs(chunks, m.tolist(), *where)
                step.fill(rows, [ids[i] for i in m.tolist()], heads.tolist())
                logits = self.forward(step.ids, step.positions, step)
                if out is None:
                    out = logits.new_empty(len(sel), logits.shape[-1])
                head_of[m[heads]] = torch.arange(len(heads))
                mine = torch.isin(sel, m)
                if bool(mine.any()):
                    out[mine] = logits[head_of[sel[mine]]]
        if out is None:
            raise ValueError("InvariantRows.run: a step with no tokens")
        return out


def _runs(chunks: Seq[SeqChunk], m: list[int], of: list[int], pos: list[int]) -> list[SeqChunk]:
    """The tokens ``m`` (flat indices, in order; ``of``, ``pos``: their chunks and positions) as
    runs of one chunk's consecutive tokens, for :meth:`~llmlib.engine.fixed_step.FixedStep.fill`."""
    out, first = [], 0
    for j in range(1, len(m) + 1):
        if j == len(m) or of[m[j]] != of[m[j - 1]] or m[j] != m[j - 1] + 1:
            out.append(SeqChunk(chunks[of[m[first]]].block_table, pos[m[first]], j - first))
            first = j
    return out
