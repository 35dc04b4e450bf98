"""The batching engine: ``llmlib.LLM`` and its streaming, thread-backed twin ``AsyncLLM`` (chapter 10).

The split follows nano-vllm and vLLM:

* :class:`~llmlib.block_manager.BlockManager` — which KV blocks each sequence owns;
* :class:`~llmlib.scheduler.Scheduler` — which sequences run this step, and how many tokens each;
* :class:`ModelRunner` — turns the scheduled chunks into forward passes over the paged cache and
  samples one token for every sequence that reached its end;
* :class:`LLM` — requests in, text out: tokenizing, detokenizing, stop strings, results.

One engine *step* is: schedule, run, sample, append, detokenize. Every running sequence advances by
one token per step, and new prompts join as soon as there is room, so the batch is always as full
as memory and the token budget allow (continuous batching, {cite}`kwon2023`).

Forward passes. A step is one forward pass over one row: the new tokens of every scheduled
sequence, prefill chunks and single decode tokens alike, back to back, with no padding. The weight
matrices are read once per step and multiply all those tokens together; attention, the only part
that must keep sequences apart, is computed sequence by sequence by the paged step
(:meth:`~llmlib.paged_cache.PagedStep.attend`). The LM head is applied only to the positions whose
next token is sampled.
"""
from __future__ import annotations

import asyncio
import codecs
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Sequence as Seq

import torch

from llmlib.block_manager import BlockManager
from llmlib.paged_cache import PagedKVCache, SeqChunk
from llmlib.sampling import SamplingParams, sample
from llmlib.scheduler import ScheduledChunk, Scheduler, Sequence
from llmlib.stopping import find_stop, held_back


# ---- results --------------------------------------------------------------------------------------

@dataclass
class RequestMetrics:
    """Timings (``time.perf_counter`` seconds) and counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's state as the engine reports it (after a step, or at the end).

    ``text`` and ``token_ids`` are cumulative (``cumulative`` is True); ``delta_text`` and
    ``delta_token_ids`` are what this step added, for streaming. ``finish_reason`` is None while
    the request runs, then ``"stop"`` (EOS or a stop string), ``"length"`` or ``"abort"``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative: bool = True

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """What the engine did so far (reset with :meth:`LLM.reset_stats`)."""

    steps: int = 0
    forward_passes: int = 0
    prefill_tokens: int = 0  # tokens computed in prefill chunks (prompts and recomputes)
    decode_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache saved from being computed
    prefix_hit_blocks: int = 0
    preemptions: int = 0
    num_blocks: int = 0
    block_size: int = 0
    used_blocks: int = 0  # right now
    peak_used_blocks: int = 0
    slots_allocated: int = 0  # summed over steps: slots in blocks held by running sequences
    slots_used: int = 0  # summed over steps: of those, slots holding a token

    @property
    def block_usage(self) -> float:
        """Fraction of the pool held by sequences right now."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def waste(self) -> float:
        """Allocated-but-unused share of the KV memory in use, averaged over steps."""
        return 1.0 - self.slots_used / self.slots_allocated if self.slots_allocated else 0.0


class QueueFull(RuntimeError):
    """The engine holds as many unfinished requests as it was allowed (a server answers 503)."""


# ---- the model runner -----------------------------------------------------------------------------

def _hidden_then_head(model: Any, ids: torch.Tensor, positions: torch.Tensor, cache: Any,
                      select: torch.Tensor | None) -> torch.Tensor:
    """The model's forward pass, with the LM head only on the flat positions ``select``.

    A packed prefill row holds many prompts but needs the next-token scores of only their last
    tokens; the LM head (vocab x d_model) would otherwise be a quarter of a small model's work. If
    the model does not expose its parts (embed, rope, layers, norm), call it whole and pick rows.
    """
    parts = ("embed", "rope", "layers", "norm", "lm_head_weight")
    if select is None or not all(hasattr(model, p) for p in parts):
        logits = model(ids, positions, cache)
        return logits.reshape(-1, logits.shape[-1]) if select is None else logits.reshape(-1, logits.shape[-1])[select]
    from llmlib.embedding import unembed

    x = model.embed(ids)
    cos, sin = model.rope(positions, x.dtype)
    for layer in model.layers:
        x = layer(x, cos, sin, positions, cache)
    x = x.reshape(-1, x.shape[-1])[select]
    return unembed(model.norm(x), model.lm_head_weight)


class ModelRunner:
    """Owns the paged KV pool; runs the scheduled chunks through the model and samples."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, *,
                 cuda_graphs: bool | None = None, max_graph_rows: int = 64, max_model_len: int | None = None) -> None:
        cfg = model.config
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        # With graphs the pool gets one block more than the block manager hands out: the scratch
        # block that a fixed-shape step's padding rows write into.
        self.cache = PagedKVCache(cfg.n_layers, num_blocks + (1 if cuda_graphs else 0), cfg.n_kv_heads, block_size,
                                  cfg.head_dim, device=self.device, dtype=self.dtype)
        self.graphs = None
        if cuda_graphs:
            from llmlib.cuda_graphs import PagedDecodeGraphs

            max_len = max_model_len or cfg.max_seq_len
            self.graphs = PagedDecodeGraphs(self._forward_rows, self.cache, scratch_block=num_blocks,
                                            max_rows=max_graph_rows, max_blocks=-(-max_len // block_size),
                                            enabled=self.device.type == "cuda")
        self.forward_passes = 0

    def _forward_rows(self, ids: torch.Tensor, positions: torch.Tensor, step: Any) -> torch.Tensor:
        """The forward pass a fixed-shape decode step runs (and a CUDA graph records): logits [rows, V]."""
        return _hidden_then_head(self.model, ids, positions, step, None)

    def _forward(self, chunks: list[ScheduledChunk], select: list[int]) -> torch.Tensor:
        """One forward pass over ``chunks`` packed into one row; logits [len(select), V]."""
        step = self.cache.step([[SeqChunk(c.seq.block_table, c.start, c.length) for c in chunks]])
        ids: list[int] = []
        for c in chunks:
            ids += c.seq.token_ids[c.start:c.start + c.length]
        self.forward_passes += 1
        ids_t = torch.tensor([ids], dtype=torch.long).to(self.device)
        sel = torch.as_tensor(select, dtype=torch.long).to(self.device)
        return _hidden_then_head(self.model, ids_t, step.positions, step, sel)

    @torch.inference_mode()
    def execute(self, chunks: Seq[ScheduledChunk], generators: dict[int, torch.Generator | None]) -> dict[int, int]:
        """Run one step's chunks; return ``{seq_id: sampled token}`` for chunks that reach their end.

        Every chunk, prefill and decode alike, goes into one row: the weight-matrix products see
        all of the step's tokens at once (one pass over the weights per step), and the paged step
        computes attention sequence by sequence (:meth:`~llmlib.paged_cache.PagedStep.attend`), so
        packing costs nothing in attention. Prefill chunks first, then decode ones.
        """
        if self.graphs is not None and self.graphs.fits(chunks):
            # every sequence decodes one token: the fixed-shape step (a CUDA graph replay on a GPU)
            self.forward_passes += 1
            logits = self.graphs.run(chunks, [c.seq.token_ids[c.start] for c in chunks])
            keep = [i for i, c in enumerate(chunks) if c.samples]  # a 1-token slice of a prompt samples nothing
            return self._sample([chunks[i] for i in keep], logits[keep], generators)
        order = [c for c in chunks if c.length > 1] + [c for c in chunks if c.length == 1]
        ends, sampled, t = [], [], 0
        for c in order:
            t += c.length
            if c.samples:  # sample at the last token of every chunk that completes its sequence
                ends.append(t - 1)
                sampled.append(c)
        logits = self._forward(order, ends or [t - 1])  # a step of partial prompts samples nothing
        return self._sample(sampled, logits, generators)

    def _sample(self, sampled: list[ScheduledChunk], logits: torch.Tensor,
                generators: dict[int, torch.Generator | None]) -> dict[int, int]:
        if not sampled:
            return {}
        logits = logits.float()
        params = [c.seq.params for c in sampled]
        gens = [generators.get(c.seq.seq_id) for c in sampled]
        seen = [c.seq.token_ids for c in sampled] if any(p.repetition_penalty != 1.0 for p in params) else None
        toks = sample(logits, params, gens, seen).tolist()
        return {c.seq.seq_id: t for c, t in zip(sampled, toks)}


# ---- per-request text state -----------------------------------------------------------------------

class _Request:
    """Detokenizer and stop-string state of one request (tokens -> text, held back near stops)."""

    def __init__(self, request_id: str, prompt: str | None, seq: Sequence, params: SamplingParams,
                 generator: torch.Generator | None) -> None:
        self.request_id, self.prompt, self.seq, self.params, self.generator = request_id, prompt, seq, params, generator
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # all decoded text (stop string cut off once found)
        self.emitted = 0  # characters of text already handed out as deltas
        self.tokens_emitted = 0
        self.stopped = False

    def output(self, final_reason: str | None = None) -> RequestOutput:
        s = self.seq
        reason = final_reason or s.finish_reason
        visible = len(self.text) if reason is not None else len(self.text) - held_back(self.text, self.params.stop)
        visible = max(visible, self.emitted)
        delta = self.text[self.emitted:visible]
        self.emitted = visible
        out_ids = s.output_token_ids
        delta_ids = out_ids[self.tokens_emitted:]
        self.tokens_emitted = len(out_ids)
        m = RequestMetrics(
            arrival_time=s.arrival_time, first_scheduled_time=s.first_scheduled_time,
            first_token_time=s.first_token_time, finished_time=s.finished_time,
            num_prompt_tokens=s.num_prompt_tokens, num_cached_tokens=s.prompt_cached_tokens,
            num_generated_tokens=len(out_ids), num_preemptions=s.num_preemptions,
        )
        return RequestOutput(self.request_id, self.prompt, list(s.prompt_token_ids), self.text[:visible],
                             list(out_ids), reason, m, delta, delta_ids)


# ---- the engine -----------------------------------------------------------------------------------

def _load_tokenizer_for(path: Path) -> Any:
    from llmlib.tokenizer import load_tokenizer

    if path.is_dir():
        for cand in [path / "tokenizer.json", *sorted(path.glob("*.tiktoken"))]:
            if cand.exists():
                return load_tokenizer(cand)
        return None  # a folder with weights only: token-id prompts still work
    return load_tokenizer(path)


class LLM:
    """Continuous batching over a paged KV cache: many requests, one model, one step at a time.

    >>> llm = LLM(path)                                        # .gguf file or Hugging Face folder
    >>> outs = llm.generate(["Hi", "Once upon"], SamplingParams(max_tokens=32, temperature=0))

    ``model`` may also be a loaded :class:`llmlib.model.Transformer` (then pass ``tokenizer``, or
    give prompts as token ids). ``num_blocks`` sizes the KV pool (default: ``kv_cache_bytes`` worth,
    1 GiB on a CPU, most of the free memory on a GPU, never more than ``max_num_seqs`` full-length
    sequences need). ``max_num_batched_tokens`` is the per-step token budget.

    ``cuda_graphs`` (default: on for CUDA) runs every step in which all sequences decode one token
    as a replay of a CUDA graph (:class:`llmlib.cuda_graphs.PagedDecodeGraphs`), captured per
    power-of-two batch size and history length the first time one is needed, or ahead of time with
    :meth:`capture_graphs`. ``cuda_graphs=True`` on a CPU runs the same fixed-shape steps without
    capturing (what the tests exercise).
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        tokenizer: Any = None,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        if isinstance(model, (str, Path)):
            from llmlib.loading import load_model

            path = Path(model)
            if isinstance(dtype, str):
                from llmlib.device import pick_dtype

                dtype = pick_dtype(device or ("cuda" if torch.cuda.is_available() else "cpu"), dtype)
            model_obj = load_model(path, device=device, dtype=dtype)
            if tokenizer is None:
                tokenizer = _load_tokenizer_for(path)
        elif isinstance(model, torch.nn.Module):
            model_obj = model
            if device is not None or dtype is not None:
                model_obj = model_obj.to(device=device, dtype=dtype if isinstance(dtype, torch.dtype) else None)
        else:
            raise TypeError(f"LLM: model must be a path or a loaded Transformer, got {type(model).__name__}")
        self.model = model_obj.eval()
        self.tokenizer = tokenizer
        self.config = cfg = model_obj.config
        p = next(model_obj.parameters())
        self.device, self.dtype = p.device, p.dtype
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"LLM: block_size must be a positive integer, got {block_size!r}")
        max_len = min(cfg.max_seq_len, max_model_len or cfg.max_seq_len)
        bytes_per_block = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * block_size * p.element_size()
        if num_blocks is None:
            if kv_cache_bytes is None:
                if self.device.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(self.device)
                    kv_cache_bytes = int(free * 0.8)
                else:
                    kv_cache_bytes = 1 << 30
            # never more than max_num_seqs full-length sequences (plus one block each) could use
            needed = max_num_seqs * (-(-max_len // block_size) + 1)
            num_blocks = max(1, min(needed, kv_cache_bytes // bytes_per_block))
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"LLM: num_blocks must be a positive integer, got {num_blocks!r}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if self.device.type == "cuda" else 512
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                                   enable_chunked_prefill=enable_chunked_prefill)
        self.max_model_len = self.scheduler.max_model_len
        self.runner = ModelRunner(self.model, num_blocks, block_size, cuda_graphs=cuda_graphs,
                                  max_graph_rows=max_num_seqs, max_model_len=max_len)
        eos = set(cfg.eos_token_ids or ())
        if tokenizer is not None and getattr(tokenizer, "eos_id", None) is not None:
            eos.add(int(tokenizer.eos_id))
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._block_hits0 = 0

    def capture_graphs(self, max_rows: int | None = None, max_tokens: int | None = None) -> int:
        """Capture the decode-step graphs for up to ``max_rows`` sequences of up to ``max_tokens``
        tokens ahead of time (warm-up before timing); returns how many steps exist (0: graphs off)."""
        g = self.runner.graphs
        if g is None:
            return 0
        bs = self.block_manager.block_size
        return g.capture(max_rows, None if max_tokens is None else -(-max_tokens // bs))

    # ---- requests -----------------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids); token-id prompts pass through, checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("LLM has no tokenizer: pass prompts as lists of token ids, or tokenizer=")
            ids = list(self.tokenizer.encode(prompt))
            if getattr(self.tokenizer, "add_bos", False) and self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id] + ids
            return prompt, ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
            return None, list(prompt)
        raise TypeError(f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}")

    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run (checked before it is queued)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens): nothing to continue from")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the engine's "
                f"maximum sequence length of {self.max_model_len} tokens")

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it starts at the next :meth:`step` there is room. Returns its id."""
        params = params if params is not None else SamplingParams()
        text, ids = self.encode(prompt)
        self.validate(ids, params)
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(seq_id=next(self._ids), prompt_token_ids=ids, max_tokens=params.max_tokens,
                       eos_token_ids=self.eos_token_ids, ignore_eos=params.ignore_eos, params=params,
                       request_id=rid)
        req = _Request(rid, text, seq, params, params.make_generator(self.device))
        self.scheduler.add(seq)
        self._requests[rid] = req
        self._by_seq[seq.seq_id] = req
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks. False if it is unknown or already finished."""
        req = self._requests.pop(str(request_id), None)
        if req is None:
            return False
        self._by_seq.pop(req.seq.seq_id, None)
        self.scheduler.finish(req.seq, "abort")
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
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self._account_memory()
        gens = {c.seq.seq_id: self._by_seq[c.seq.seq_id].generator for c in chunks if c.samples}
        next_tokens = self.runner.execute(chunks, gens)
        touched = self.scheduler.postprocess(chunks, next_tokens)
        outs = []
        for seq in touched:
            req = self._by_seq[seq.seq_id]
            self._append_text(req)
            outs.append(req.output())
            if seq.is_finished:
                del self._requests[req.request_id]
                del self._by_seq[seq.seq_id]
        self._stats.steps += 1
        return outs

    def _append_text(self, req: _Request) -> None:
        seq = req.seq
        tok = seq.token_ids[-1]
        if seq.finish_reason == "stop" and tok in self.eos_token_ids and not req.params.ignore_eos:
            req.text += req.decoder.decode(b"", final=True)
            return  # the EOS token ends the text without being part of it
        if self.tokenizer is not None:
            piece = req.decoder.decode(self.tokenizer.id_to_bytes(tok))
            req.text += piece
            if req.params.stop:
                hit = find_stop(req.text, req.params.stop, len(req.text) - len(piece))
                if hit is not None:
                    req.text = req.text[:hit]  # the stop string itself is not part of the text
                    req.stopped = True
                    if seq.is_finished:
                        seq.finish_reason = "stop"  # the same token also reached max_tokens
                    else:
                        self.scheduler.finish(seq, "stop")
                    return
        if seq.is_finished:
            req.text += req.decoder.decode(b"", final=True)

    def _account_memory(self) -> None:
        allocated, used = self.block_manager.usage(self.scheduler.running)
        st = self._stats
        st.slots_allocated += allocated
        st.slots_used += used
        st.peak_used_blocks = max(st.peak_used_blocks, self.block_manager.num_used_blocks)

    # ---- batch API ----------------------------------------------------------------------------
    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
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

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the counters (prefill tokens, prefix-cache hits, preemptions, blocks)."""
        s, bm = self.scheduler.stats, self.block_manager
        st = self._stats
        return EngineStats(
            steps=st.steps, forward_passes=self.runner.forward_passes, prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens, cached_tokens=s.cached_tokens,
            prefix_hit_blocks=bm.num_prefix_hit_blocks - self._block_hits0, preemptions=s.preemptions,
            num_blocks=bm.num_blocks, block_size=bm.block_size, used_blocks=bm.num_used_blocks,
            peak_used_blocks=st.peak_used_blocks, slots_allocated=st.slots_allocated, slots_used=st.slots_used,
        )

    def reset_stats(self) -> None:
        from llmlib.scheduler import SchedulerStats

        self.scheduler.stats = SchedulerStats()
        self._stats = EngineStats()
        self.runner.forward_passes = 0
        self._block_hits0 = self.block_manager.num_prefix_hit_blocks

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.cache.nbytes


# ---- the async engine -----------------------------------------------------------------------------

class RequestStream:
    """The async side of one request: ``async for out in stream`` yields :class:`RequestOutput`\\ s."""

    def __init__(self, engine: "AsyncLLM", request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False

    def put(self, item: Any) -> None:  # called from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    """An :class:`LLM` stepping in a background thread, with an asyncio streaming API for servers.

    The engine thread owns the :class:`LLM`: requests and aborts reach it through a thread-safe
    queue and are applied between steps, so the event loop never waits for a forward pass.
    ``max_queue`` bounds the unfinished requests (waiting and running); one more raises
    :class:`QueueFull`, which a server turns into a 503.
    """

    def __init__(self, model: "str | Path | torch.nn.Module | LLM", tokenizer: Any = None, *,
                 max_queue: int = 1024, **llm_kwargs: Any) -> None:
        self.llm = model if isinstance(model, LLM) else LLM(model, tokenizer, **llm_kwargs)
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams (touched by both threads)
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.error: BaseException | None = None

    # what a server reads
    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def model(self) -> torch.nn.Module:
        return self.llm.model

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def stats(self) -> EngineStats:
        return self.llm.stats()

    # ---- the engine thread ----------------------------------------------------------------------
    def start(self) -> "AsyncLLM":
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="llmlib-engine", daemon=True)
            self._thread.start()
        return self

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd, rid, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                ids, params = payload
                with self._lock:
                    stream = self._streams.get(rid)
                if stream is None:
                    continue  # aborted before it was ever added
                try:
                    self.llm.add_request(ids, params, request_id=rid)
                except (ValueError, TypeError) as e:
                    self._close(rid, e)
            elif cmd == "abort":
                self.llm.abort(rid)

    def _close(self, rid: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.put(item)

    def _loop(self) -> None:
        while not self._stop:
            self._apply_commands()
            if not self.llm.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = self.llm.step()
            except BaseException as e:  # noqa: BLE001 - hand the failure to every waiting client
                self.error = e
                for rid in list(self._streams):
                    self.llm.abort(rid)
                    self._close(rid, RuntimeError(f"the engine failed: {e!r}"))
                continue
            for out in outs:
                if out.finished:
                    self._close(out.request_id, out)
                else:
                    with self._lock:
                        stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)

    def shutdown(self) -> None:
        """Stop the engine thread (unfinished requests are aborted)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for rid in list(self._streams):
            self.llm.abort(rid)
            self._close(rid, RuntimeError("the engine was shut down"))

    close = shutdown

    def __enter__(self) -> "AsyncLLM":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- the asyncio API --------------------------------------------------------------------------
    def submit(self, prompt: str | Seq[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        """Queue a request now (call from a running event loop); iterate the result for outputs.

        Raises at once: :class:`QueueFull` when ``max_queue`` requests are unfinished, ValueError or
        TypeError for a request that could never run (too long, bad params, bad ids).
        """
        params = params if params is not None else SamplingParams()
        _, ids = self.llm.encode(prompt)
        self.llm.validate(ids, params)
        rid = str(request_id) if request_id is not None else f"async-{next(self._ids)}"
        self.start()
        with self._lock:
            if len(self._streams) >= self.max_queue:
                raise QueueFull(f"{len(self._streams)} requests in flight (max_queue={self.max_queue})")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            stream = RequestStream(self, rid)
            self._streams[rid] = stream
        self._commands.put(("add", rid, (ids, params)))
        self._wake.set()
        return stream

    async def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a :class:`RequestOutput` per step in which the request got tokens; the last one has
        ``finish_reason`` set. Leaving the loop early (a client disconnect cancels the task, or the
        generator is closed) aborts the request and frees its KV blocks."""
        rs = self.submit(prompt, params, request_id)
        try:
            async for out in rs:
                yield out
        finally:
            if not rs.finished:
                self.abort(rs.request_id)

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """Run one request to the end and return its final output."""
        last = None
        async for out in self.stream(prompt, params, request_id):
            last = out
        assert last is not None
        return last

    def abort(self, request_id: str) -> None:
        """Cancel a request (safe from any thread, idempotent); its blocks are freed between steps."""
        rid = str(request_id)
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.finished = True
        self._commands.put(("abort", rid, None))
        self._wake.set()
