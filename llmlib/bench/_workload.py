"""The workload both engine benchmarks share: seeded random requests, and one timed run of
:class:`~llmlib.engine.LLM` over them (``bench batching`` and its ``--formats`` side by side)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from llmlib.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


def make_requests(
    n: int,
    vocab_size: int,
    seed: int = 0,
    prompt_range=(20, 200),
    output_range=(16, 128),
    low_id: int = 100,
) -> list[Request]:
    """``n`` requests with uniform random prompt and output lengths (random token ids)."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(low_id, vocab_size) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*output_range),
        )
        for _ in range(n)
    ]


def run_continuous(
    model: Any,
    tokenizer: Any,
    requests: list[Request],
    max_num_seqs: int,
    block_size: int,
    max_num_batched_tokens: int,
    num_blocks: int | None = None,
    batch_invariant: bool = False,
    compile: bool = False,
) -> dict[str, Any]:
    from llmlib.engine import LLM

    llm = LLM(
        model,
        tokenizer,
        batch_invariant=batch_invariant,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        compile=compile,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    st = llm.stats()
    return {
        "outputs": [o.token_ids for o in outs],
        "seconds": dt,
        "waste": st.waste,
        "stats": st,
        "pool_blocks": st.num_blocks,
        "peak_used_blocks": st.peak_used_blocks,
        "compile_s": llm.compile_s,  # None: not compiled, or loaded from the disk cache
        "decode_path": llm.runner.decode_path,
    }
