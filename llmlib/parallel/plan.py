"""What the driver tells the workers each step: a few hundred integers, in one int64 tensor.

A worker has no scheduler and no block manager; all it needs to run a step is, per scheduled
chunk, the chunk's token ids, where it starts in its sequence, and the sequence's block table
(the same block ids index every rank's own part of the KV pool). Block tables only grow
between steps, so the driver sends each table's new blocks only (vLLM does the same), and every
rank keeps the tables in a :class:`BlockTables` mirror; a sequence whose blocks were freed
(finished, aborted, preempted) is *released*, and a table that changed in any other way is sent
whole again. The mirror is also what lets every rank say, at the end, that it holds no block.

The wire format is plain integers (no pickle): a header ``[command, n_released, n_payload]``,
then ``released seq ids + payload``. A step's payload is
``[n_chunks, n_select, (seq_id, start, length, keep, n_new, *new_blocks, *token_ids) per chunk,
*select]``: keep the first ``keep`` blocks of the mirrored table, append ``new_blocks``; run the
chunks packed into one row; return logits at the ``select`` positions of that row.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from llmlib.engine.paged_cache import SeqChunk

# commands
STEP, POOL, REPORT, PING, SHUTDOWN, RESET = 1, 2, 3, 4, 5, 6
COMMANDS = {STEP: "step", POOL: "pool", REPORT: "report", PING: "ping", SHUTDOWN: "shutdown"}
COMMANDS[RESET] = "reset"


@dataclass
class _Sent:
    seq: Any
    table: list[int]
    preemptions: int


class PlanEncoder:
    """The driver's side: turns scheduled chunks into step plans, remembering what it has sent."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def releases(self) -> list[int]:
        """Sequences whose blocks went back to the pool since they were last sent (to drop)."""
        gone = [
            sid
            for sid, s in self._sent.items()
            if s.seq.is_finished or not s.seq.block_table or s.seq.num_preemptions != s.preemptions
        ]
        for sid in gone:
            del self._sent[sid]
        return gone

    def step(self, chunks: Seq[Any], select: Seq[int]) -> list[int]:
        """The payload for one forward pass over ``chunks`` (engine ``ScheduledChunk`` objects)."""
        out = [len(chunks), len(select)]
        for c in chunks:
            seq = c.seq
            table = list(seq.block_table)
            prev = self._sent.get(seq.seq_id)
            keep = 0
            if prev is not None and prev.preemptions == seq.num_preemptions:
                k = len(prev.table)
                if k <= len(table) and table[:k] == prev.table:
                    keep = k
            new = table[keep:]
            self._sent[seq.seq_id] = _Sent(seq, table, seq.num_preemptions)
            tokens = seq.token_ids[c.start : c.start + c.length]
            out += [seq.seq_id, c.start, c.length, keep, len(new), *new, *tokens]
        return out + list(select)


class BlockTables:
    """Every rank's copy of the block tables of the sequences in flight."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tables: dict[int, list[int]] = {}

    def release(self, seq_ids: Seq[int]) -> None:
        for sid in seq_ids:
            self.tables.pop(int(sid), None)

    def held_blocks(self) -> int:
        """Distinct blocks the sequences in flight hold (0 once every sequence has finished)."""
        held: set[int] = set()
        for t in self.tables.values():
            held.update(t)
        return len(held)

    def decode_step(self, payload: list[int]) -> tuple[list[SeqChunk], list[int], list[int]]:
        """``(chunks, token ids packed in one row, positions to sample)`` of one step plan."""
        n_chunks, n_select = payload[0], payload[1]
        i = 2
        chunks: list[SeqChunk] = []
        ids: list[int] = []
        for _ in range(n_chunks):
            sid, start, length, keep, n_new = payload[i : i + 5]
            i += 5
            new = payload[i : i + n_new]
            i += n_new
            old = self.tables.get(sid, [])
            if keep > len(old):
                raise ValueError(
                    f"step plan keeps {keep} blocks of sequence {sid}, this rank has {len(old)}"
                )
            if any(not 0 <= b < self.num_blocks for b in new):
                raise ValueError(f"step plan names a block outside 0..{self.num_blocks - 1}: {new}")
            table = old[:keep] + new
            self.tables[sid] = table
            chunks.append(SeqChunk(table, start, length))
            ids += payload[i : i + length]
            i += length
        select = payload[i : i + n_select]
        if i + n_select != len(payload):
            raise ValueError("a step plan of the wrong length (driver and worker disagree)")
        return chunks, ids, select


def pack(values: Seq[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)
