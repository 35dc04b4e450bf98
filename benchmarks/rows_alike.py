"""Which rows of one product a CPU's kernels compute another way, and the group sizes the
compiled batch-invariant engine settles on there. A check of correctness, not of speed.

    python benchmarks/rows_alike.py --out results/cpu/rows_alike.json
    LLMLIB_AS_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/rows_alike.py --out results/cpu/rows_alike_as_avx2.json

Part one, plain PyTorch: for each row count ``M``, one input row copied ``M`` times is multiplied
by each of the book model's matrix shapes (random values), in float32 and bfloat16; the record
lists the rows whose result is not bitwise row 0's. Any such row breaks batch invariance: a token's
sums would depend on the row it lands in.

Part two, the engine: the book's model in float32 and bfloat16, ``LLM(path,
batch_invariant=True, compile=True)`` from its package, and what
:meth:`llmlib.engine.invariant.InvariantRows.alike` says of every group size it may try, with
the sizes it took, and which other sizes give a row the bits of the generated tokens' group
(where none does, the group's size is the least a decode step can cost). Then the same model
eager (``compile=False``): the tile each kind of matrix takes in the batch-invariant view
(:func:`llmlib.kernels.prepare.row_tiled`), and the smaller sizes its last tile may be padded
to, where a row gets a whole tile's bits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

#: SmolLM2-135M's matrices (out x in): attention, MLP up and down, the LM head
SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576))
ROWS = (8, 16, 24, 30, 32, 36, 48, 64, 96, 128, 192, 256)
#: group sizes compared with the generated tokens' group
SIZES = (4, 8, 16, 24, 32, 48, 64, 128)


def unlike_rows(m: int, dtype: torch.dtype) -> list[int]:
    """Rows of ``m`` copies of one input row, times each shape, that differ from row 0."""
    g = torch.Generator().manual_seed(0)
    bad: set[int] = set()
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        y = torch.randn(1, k, generator=g).to(dtype).expand(m, -1).contiguous() @ w.T
        bad |= {r for r in range(m) if not torch.equal(y[r], y[0])}
    return sorted(bad)


@torch.inference_mode()
def same_bits(groups, n: int, token: int = 1) -> bool:
    """Whether a group of ``n`` rows gives a token the logits a group of ``groups.rows`` gives
    it, bit for bit (the token copied into every row, at position 0 of the scratch block)."""

    def row_0(rows: int) -> torch.Tensor:
        step = groups._step(rows, 2, rows)
        s, same = groups.scratch_block * groups.cache.block_size, torch.full((rows,), token)
        table = torch.full((rows, 1), groups.scratch_block)
        step.load(same, same * 0, same * 0 + s, table, torch.arange(rows))
        return groups.forward(step.ids, step.positions, step)[0].clone()

    return torch.equal(row_0(n), row_0(groups.rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import llmlib
    from llmlib.checkpoints.fetch import fetch_model
    from llmlib.device import machine_info
    from llmlib.engine.invariant import PROMPT_CHOICES, ROW_CHOICES
    from llmlib.kernels.flags import flags
    from llmlib.kernels.prepare import weight_matrices

    torch.set_num_threads(args.threads)
    products = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        products[name] = {str(m): unlike_rows(m, dtype) for m in ROWS}
        print(name, {m: r for m, r in products[name].items() if r})
    path = fetch_model(quiet=True)
    engines = {}
    for dtype in (torch.float32, torch.bfloat16):
        llm = llmlib.LLM(path, dtype=dtype, batch_invariant=True, compile=True)
        groups = llm.runner.rows
        name = str(dtype).removeprefix("torch.")
        engines[name] = {"decode_path": llm.runner.decode_path}
        if groups is not None:
            engines[name] |= {
                "alike": {str(n): groups.alike(n) for n in ROW_CHOICES + PROMPT_CHOICES},
                "generated_rows": groups.rows,
                "prompt_rows": groups.prompt_rows,
                "same_bits_as_generated_group": {str(n): same_bits(groups, n) for n in SIZES},
            }
        eager = llmlib.LLM(path, dtype=dtype, batch_invariant=True, compile=False)
        engines[name]["eager_tiles"] = {
            f"{getattr(t.inner, 'kind', t.dtype)} {list(t.shape)}": list(t.sizes)
            for t in (m.weight for m in weight_matrices(eager.runner.model).values())
        }
        print(name, engines[name])
    record = {
        "machine": machine_info("cpu"),
        "flags": flags().describe(),
        "threads": args.threads,
        "shapes": [list(s) for s in SHAPES],
        "rows_unlike_row_0": products,
        "engine": engines,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
