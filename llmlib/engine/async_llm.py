"""``AsyncLLM``: the batching engine stepping in a background thread, with an asyncio API."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from llmlib.engine.llm import LLM
from llmlib.engine.outputs import EngineStats, RequestOutput
from llmlib.sampling import SamplingParams


class QueueFull(RuntimeError):
    """The engine holds as many unfinished requests as it was allowed (a server answers 503)."""


class RequestStream:
    """One request's async side: ``async for out in stream`` yields :class:`RequestOutput`\\ s."""

    def __init__(self, engine: AsyncLLM, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False

    def put(self, item: Any) -> None:  # called from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
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

    The engine thread owns the :class:`LLM`: requests and aborts reach it between steps, so the
    event loop never waits for a forward pass. Over ``max_queue`` unfinished: :class:`QueueFull`."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module | LLM,
        tokenizer: Any = None,
        *,
        max_queue: int = 1024,
        **llm_kwargs: Any,
    ) -> None:
        self.llm = model if isinstance(model, LLM) else LLM(model, tokenizer, **llm_kwargs)
        self._owns_llm = not isinstance(model, LLM)  # then shutdown() stops its ranks too
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
    def start(self) -> AsyncLLM:
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
            except BaseException as e:
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
        if self._owns_llm:
            self.llm.shutdown()  # a tensor-parallel engine's worker processes (else a no-op)

    close = shutdown

    def __enter__(self) -> AsyncLLM:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- the asyncio API -------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        allow_special: bool = False,
    ) -> RequestStream:
        """Queue a request (from a running event loop); iterate the result for outputs. Raises
        :class:`QueueFull`, or ValueError/TypeError for a request that can never run (too long,
        bad params or ids, bad JSON schema). ``allow_special``: a prompt's special tokens count."""
        params = params if params is not None else SamplingParams()
        _, ids = self.llm.encode(prompt, allow_special)
        self.llm.validate(ids, params)
        rid = str(request_id) if request_id is not None else f"async-{next(self._ids)}"
        self.start()
        with self._lock:
            if len(self._streams) >= self.max_queue:
                raise QueueFull(
                    f"{len(self._streams)} requests in flight (max_queue={self.max_queue})"
                )
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            stream = RequestStream(self, rid)
            self._streams[rid] = stream
        self._commands.put(("add", rid, (ids, params)))
        self._wake.set()
        return stream

    async def stream(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a :class:`RequestOutput` per step that gave the request tokens, the last with
        ``finish_reason``. Leaving early (a client disconnect, a closed generator) aborts it."""
        rs = self.submit(prompt, params, request_id)
        try:
            async for out in rs:
                yield out
        finally:
            if not rs.finished:
                self.abort(rs.request_id)

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestOutput:
        """Run one request to the end and return its final output."""
        last = None
        async for out in self.stream(prompt, params, request_id):
            last = out
        assert last is not None
        return last

    def abort(self, request_id: str) -> None:
        """Cancel a request (from any thread, idempotent); its blocks are freed between steps."""
        rid = str(request_id)
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.finished = True
        self._commands.put(("abort", rid, None))
        self._wake.set()
