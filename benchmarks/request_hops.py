"""The path of one request through the package: which llmlib modules it enters and which calls
cross from one module into another, from ``LLM.add_request`` to its first sampled token.

    python benchmarks/request_hops.py --tree . --out results/cpu/request_hops.json
    python benchmarks/request_hops.py --tree /tmp/old --out ...   # a worktree of another commit

The engine runs SmolLM2 (GGUF) in float32, greedily. A warm-up request goes first, so imports and
kernel builds are not counted. ``sys.setprofile`` sees every Python call; a call counts as a hop
when the nearest llmlib frame below it belongs to another module. Calls inside C++ or torch are
not seen, so the figures are the Python structure a reader follows, not the work done.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def trace() -> dict:
    import torch

    from llmlib import LLM, SamplingParams

    try:
        from llmlib.checkpoints.fetch import default_model_path
    except ImportError:  # the tree before the layers change
        from llmlib.fetch import default_model_path

    torch.set_num_threads(1)
    llm = LLM(str(default_model_path()), dtype=torch.float32)

    def one(prompt: str) -> None:
        llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while not any(o.outputs[0].token_ids for o in llm.step()):
            pass

    one("A warm-up question?")
    modules: set[str] = set()
    calls: set[tuple[str, str]] = set()
    executed = 0

    def module_of(frame) -> str | None:
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith("llmlib") else None

    def profile(frame, event, _arg) -> None:
        nonlocal executed
        if event != "call" or (callee := module_of(frame)) is None:
            return
        modules.add(callee)
        back = frame.f_back
        while back is not None and module_of(back) is None:
            back = back.f_back
        if back is not None and (caller := module_of(back)) != callee:
            calls.add((f"{caller}.{back.f_code.co_name}", f"{callee}.{frame.f_code.co_name}"))
            executed += 1

    sys.setprofile(profile)
    one("What is a quadratic equation?")
    sys.setprofile(None)
    pairs = {(a.rsplit(".", 1)[0], b.rsplit(".", 1)[0]) for a, b in calls}
    return {
        "modules": sorted(modules),
        "n_modules": len(modules),
        "n_module_pairs": len(pairs),
        "n_distinct_calls": len(calls),
        "n_calls_executed": executed,
        "calls": [f"{a} -> {b}" for a, b in sorted(calls)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=".", help="the checkout whose llmlib is traced")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    sys.path.insert(0, str(tree))
    result = trace()
    commit = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {"tree": commit, **result}
    print(
        f"{commit}: {result['n_modules']} modules, {result['n_module_pairs']} module pairs, "
        f"{result['n_distinct_calls']} distinct calls between modules "
        f"({result['n_calls_executed']} executed)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
