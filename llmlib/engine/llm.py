"""``llmlib.LLM``: requests in, text out, batched continuously over a paged KV cache (chapter 10).

The split follows nano-vllm and vLLM:

* :class:`~llmlib.engine.block_manager.BlockManager`: which KV blocks each sequence owns;
* :class:`~llmlib.engine.scheduler.Scheduler`: which sequences run this step, and how many tokens each;
* :class:`~llmlib.engine.runner.ModelRunner`: the scheduled chunks through the model, one token
  sampled for every sequence that reached its end;
* :mod:`~llmlib.engine.stopping`: where each sequence ends;
* :class:`LLM` (here): prompts prepared (:mod:`llmlib.prompts`), requests in, results out.

One engine *step* is: schedule, run, sample, append. Every running sequence advances a token a
step, and new prompts join as soon as there is room (continuous batching, {cite}`kwon2023`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from llmlib.engine.block_manager import BlockManager
from llmlib.engine.config import EngineConfig
from llmlib.engine.load import load_engine_model
from llmlib.engine.outputs import EngineStats, RequestOutput
from llmlib.engine.request import Choice, EngineRequest, choice_generator
from llmlib.engine.runner import ModelRunner, StepResult
from llmlib.engine.scheduler import Scheduler, SchedulerStats
from llmlib.engine.sequence import ScheduledChunk, Sequence, SequenceStatus
from llmlib.engine.speculate import engine_speculator
from llmlib.engine.stopping import check_length, prompt_only
from llmlib.prompts import Prompt, encode_prompt, eos_token_ids
from llmlib.sampling import SamplingParams


class LLM:
    """Continuous batching over a paged KV cache: many requests, one model, one step at a time.

    >>> llm = LLM(path)                                        # .gguf file or Hugging Face folder
    >>> outs = llm.generate(["Hi", "Once upon"], SamplingParams(max_tokens=32, temperature=0))

    ``model`` may also be a loaded :class:`llmlib.model.Transformer` (then pass ``tokenizer``, or
    give prompts as token ids). Everything else is an :class:`~llmlib.engine.config.EngineConfig`:
    pass one as ``config``, or its fields as keyword arguments (``LLM(path, max_num_seqs=8)``),
    which become one. It is resolved once, here (``llm.engine_config``, printed by
    :meth:`~llmlib.engine.config.EngineConfig.describe`): the format, the pool, the batch limits
    and the run mode, how every step runs.

    The format, when neither ``dtype`` nor ``quantization`` is given, is the machine's fastest
    accurate one for this engine's batches, where ``load_model(path)`` loads the plain float32
    reference on a CPU: the same file may run in two formats (``llm.model.weight_format`` says
    which). An engine of one sequence (``max_num_seqs=1``, what ``llmlib generate`` and ``chat``
    run) takes the format that decodes one request fastest.

    All-decode steps run on fixed shapes (:mod:`llmlib.engine.fixed_step`): replayed from CUDA
    graphs on a GPU (``cuda_graphs``, default on), or on a CPU through one compiled graph for
    every batch size (``compile``, default for a checkpoint: compiled by the first start and kept
    on disk for the next; ``llm.runner.decode_path`` says which ran).

    ``tensor_parallel_size=N`` splits the model over ``N`` ranks (:mod:`llmlib.parallel`): this
    process is rank 0 and keeps the scheduler and sampling; ``llm.shutdown()`` (or ``with``)
    stops the others.
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        **kwargs: Any,
    ) -> None:
        self._tp = None  # the tensor-parallel driver (llmlib.parallel.driver), when sharded
        try:
            asked = EngineConfig.of(config, **kwargs)
        except TypeError as e:  # an unknown keyword names itself
            raise TypeError(f"LLM: {e}") from None
        if asked.tensor_parallel_size != 1:
            from llmlib.parallel.driver import start_engine

            self._tp, model_obj, tokenizer = start_engine(
                model, asked.tensor_parallel_size, asked.device, asked.dtype, tokenizer,
                asked.tp_options,
            )  # fmt: skip
        else:
            asked = asked.with_format(model)
            model_obj, tokenizer = load_engine_model(model, tokenizer, asked)
        try:  # a sharded engine that fails to finish starting stops its ranks
            self.model = model_obj.eval()
            self.tokenizer = tokenizer
            # sharded, the model is rank 0's slice; the config stays the whole model's
            self.config = cfg = self._tp.config if self._tp else model_obj.config
            self.engine_config = ec = asked.resolved(model_obj, model)
            # the KV pool is held in the model's (activations') dtype, whatever the weights are in
            self.device, self.dtype = ec.device, ec.dtype
            self.block_manager = BlockManager(
                ec.num_blocks, ec.block_size, ec.enable_prefix_caching
            )
            self.scheduler = Scheduler(
                self.block_manager, max_num_seqs=ec.max_num_seqs, max_model_len=ec.max_model_len,
                max_num_batched_tokens=ec.max_num_batched_tokens,
                enable_chunked_prefill=ec.enable_chunked_prefill,
            )  # fmt: skip
            self.max_model_len = self.scheduler.max_model_len
            if self._tp is not None:
                self.runner: ModelRunner = self._tp.runner(ec.num_blocks, ec.block_size)
            else:
                self.runner = ModelRunner(
                    self.model, ec.num_blocks, ec.block_size, mode=ec.run_mode,
                    max_rows=ec.max_num_seqs, max_model_len=ec.max_model_len,
                    kv_cache_dtype=ec.kv_cache_dtype,
                )  # fmt: skip
                # a step compiled in memory compiles now, before any request waits for it
                self.runner.compile_now(min(32, ec.max_num_seqs))
                self.block_manager.outputs_apart = self.runner.rows is not None  # InvariantRows
            self.eos_token_ids = eos_token_ids(cfg, tokenizer)
            self._spec = engine_speculator(
                ec.speculative_config, self._tp is not None, self.model, self.runner.cache
            )
            self._requests: dict[str, EngineRequest] = {}
            self._by_seq: dict[int, tuple[EngineRequest, Choice]] = {}
            self._grammars: Any = None  # llmlib.structured.Grammars, made on the first json_schema
            self._ids = itertools.count()
            self._stats, self._block_hits0 = EngineStats(), 0
        except BaseException:
            self.shutdown()
            raise

    @property
    def compile_s(self) -> float | None:
        """Seconds compiling the step took in this process (None: loaded from disk, or none)."""
        return None if self._tp is not None else self.runner.compile_s

    # ---- tensor parallelism ----------------------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self._tp is None else self._tp.tp

    def tensor_parallel_report(self) -> list[Any]:
        """Every rank's weights, KV pool and time in all-reduce
        (:class:`llmlib.parallel.worker.RankReport`); empty when not sharded."""
        return [] if self._tp is None else self._tp.report()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (a no-op when not sharded); the engine is then done."""
        if self._tp is not None:
            self._tp.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def capture_graphs(self, max_rows: int | None = None, max_tokens: int | None = None) -> int:
        """Capture the decode-step graphs for up to ``max_rows`` sequences of up to ``max_tokens``
        tokens ahead of time (warm-up before timing); returns how many steps exist (0: graphs off)."""
        g = self.runner.graphs
        if g is None:
            return 0
        bs = self.block_manager.block_size
        return g.capture(max_rows, None if max_tokens is None else -(-max_tokens // bs))

    # ---- requests -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt, allow_special: bool = False) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids): text, a conversation (the chat template), or token
        ids, which pass through, checked (:func:`llmlib.prompts.encode_prompt`). ``allow_special``
        parses special tokens written in a text prompt as special (the completions convention)."""
        text, ids = encode_prompt(
            self.tokenizer, prompt, vocab_size=self.config.vocab_size, allow_special=allow_special
        )
        return (None if not text and not isinstance(prompt, str) else text), ids

    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run (checked before it is queued)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens): nothing to continue from")
        check_length(len(prompt_ids), params.max_tokens, self.max_model_len)
        if params.json_schema is not None:
            self.grammars().grammar(params.json_schema)  # SchemaError (a ValueError) says why not

    def grammars(self) -> Any:
        """The structured-output compiler for this engine's tokenizer and end tokens."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer")
            from llmlib.structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.eos_token_ids)
        return self._grammars

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        allow_special: bool = False,
    ) -> str:
        """Queue a request; it starts at the next :meth:`step` there is room. Returns its id."""
        params = params if params is not None else SamplingParams()
        text, ids = self.encode(prompt, allow_special)
        self.validate(ids, params)
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        choices = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._ids),
                prompt_token_ids=ids,
                max_tokens=params.max_tokens,
                eos_token_ids=self.eos_token_ids,
                ignore_eos=params.ignore_eos,
                params=params,
                request_id=rid,
                stop_token_ids=frozenset(params.stop_token_ids),
                use_prefix_cache=params.prompt_logprobs is None,
                matcher=None
                if params.json_schema is None
                else self.grammars().matcher(params.json_schema),
            )
            gen = choice_generator(params, i, self.device)
            choices.append(Choice(i, seq, params, gen, self.tokenizer))
        first = choices[0].seq
        first.forks = [c.seq for c in choices[1:]]
        for c in choices[1:]:
            c.seq.arrival_time = first.arrival_time
        req = EngineRequest(rid, text, params, choices)
        self.scheduler.add(first)
        self._requests[rid] = req
        for c in choices:
            self._by_seq[c.seq.seq_id] = (req, c)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks. False if it is unknown or already finished."""
        req = self._requests.pop(str(request_id), None)
        if req is None:
            return False
        for c in req.choices:
            self._by_seq.pop(c.seq.seq_id, None)
            self.scheduler.finish(c.seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, detokenize. Returns an output for every request that got
        a token this step (finished ones included); each carries the delta since the last report."""
        if self._spec is not None:
            self._spec.propose(self.scheduler.running, self.max_model_len)
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self._account_memory()
        gens = {}
        for c in chunks:
            if c.samples:
                for s in (c.seq, *c.seq.forks):
                    gens[s.seq_id] = self._by_seq[s.seq_id][1].generator
        if self._spec is not None:
            self._spec.fill(chunks, gens)  # a model's drafts, in the slots just given
        res = self.runner.execute(chunks, gens)
        for sid, entries in res.prompt_logprobs.items():
            req = self._by_seq[sid][0]
            for pos, e in entries:
                req.prompt_logprobs[pos] = e
        forked = [s for c in chunks if c.samples and c.seq.forks for s in self._fork(c, res)]
        touched = self.scheduler.postprocess(chunks, res.tokens, res.accepted) + forked
        reqs: dict[str, EngineRequest] = {}
        for seq in touched:
            req, choice = self._by_seq[seq.seq_id]
            choice.took_token(res.logprobs.get(seq.seq_id))
            reqs[req.request_id] = req
        outs = []
        for req in reqs.values():
            outs.append(req.output())
            if req.finished:
                del self._requests[req.request_id]
                for c in req.choices:
                    self._by_seq.pop(c.seq.seq_id, None)
                if self._spec is not None:
                    self._spec.forget(c.seq.seq_id for c in req.choices)
        self._stats.steps += 1
        return outs

    def _fork(self, c: ScheduledChunk, res: StepResult) -> list[Sequence]:
        """n > 1: the prompt is done; every other choice takes its KV blocks and its first token."""
        parent = c.seq
        if parent.status is not SequenceStatus.RUNNING:
            return []
        parent.num_computed_tokens = c.start + c.length
        children, parent.forks = parent.forks, []
        if reason := prompt_only(parent):  # a prompt scored: no choice generates
            for child in children:
                self.scheduler.finish(child, reason)
            return children
        for child in children:
            copies = self.block_manager.fork(parent, child)
            if copies is not None:
                self.runner.copy_blocks(copies)
            self.scheduler.adopt(child, parent, running=copies is not None)
            self.scheduler.append_token(child, res.tokens[child.seq_id])
        return children

    def _account_memory(self) -> None:
        allocated, used = self.block_manager.usage(self.scheduler.running)
        st = self._stats
        st.slots_allocated += allocated
        st.slots_used += used
        st.peak_used_blocks = max(st.peak_used_blocks, self.block_manager.num_used_blocks)

    # ---- batch API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; results in the order of ``prompts``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [final[r] for r in rids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, allow_special: bool = False
    ) -> Iterator[RequestOutput]:
        """One request, run to its end: every step's output for it, as it comes (each carries
        the text and tokens that step added, ``delta_text``; the last one is ``finished`` and
        has the request's metrics). Requests queued before it run alongside."""
        rid = self.add_request(prompt, params, allow_special=allow_special)
        try:
            while rid in self._requests:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
        finally:  # a consumer that stops early (Ctrl-C in a chat) frees the request's blocks
            self.abort(rid)

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the counters (prefill tokens, prefix-cache hits, preemptions, blocks)."""
        s, bm, st = self.scheduler.stats, self.block_manager, self._stats
        return replace(
            st,
            forward_passes=self.runner.forward_passes,
            prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens,
            cached_tokens=s.cached_tokens,
            prefix_hit_blocks=bm.num_prefix_hit_blocks - self._block_hits0,
            preemptions=s.preemptions,
            num_blocks=bm.num_blocks,
            block_size=bm.block_size,
            used_blocks=bm.num_used_blocks,
            spec_proposed=s.spec_proposed,
            spec_accepted=s.spec_accepted,
        )

    def reset_stats(self) -> None:
        self.scheduler.stats = SchedulerStats()
        self._stats = EngineStats()
        self.runner.forward_passes = 0
        self._block_hits0 = self.block_manager.num_prefix_hit_blocks
        if self._tp is not None:
            self._tp.reset_stats()  # every rank's step and all-reduce counters

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.cache.nbytes
