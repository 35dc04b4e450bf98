"""Running the server: ``llmlib serve`` on the command line, and :class:`ServerThread` for tests,
notebooks and benchmarks (uvicorn in a background thread)."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from llmlib.serve.app import DEFAULT_HOST, DEFAULT_PORT, create_app
from llmlib.serve.protocol import Limits


class ServerThread:
    """Run an app under uvicorn in a background thread on 127.0.0.1 (port 0 = any free port).

    ``with ServerThread(app) as s: ... s.url ...``; used by the tests, the notebook and the benchmark.
    """

    def __init__(
        self, app: Any, host: str = DEFAULT_HOST, port: int = 0, log_level: str = "warning"
    ):
        import uvicorn

        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="llmlib-server", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died while starting (port in use?)")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build_engine(
    model: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    max_queue: int = 1024,
    **engine_fields: Any,
):
    """Load a model into the async batching engine: ``(engine, model_id)``. ``max_queue`` is the
    one bound on requests in flight (one more gets a 503). The rest is the engine's
    :class:`~llmlib.engine.config.EngineConfig`, resolved as ``LLM`` resolves it (with neither a
    dtype nor a quantization, the machine's fastest accurate format for batches)."""
    from pathlib import Path

    from llmlib.checkpoints import resolve_model_path
    from llmlib.engine import AsyncLLM
    from llmlib.engine.config import EngineConfig

    path = resolve_model_path(model)
    if quantization == "none":
        quantization, dtype = None, dtype or "float32"
    config = EngineConfig(device=device, dtype=dtype, quantization=quantization, **engine_fields)
    engine = AsyncLLM(str(path), config=config, max_queue=max_queue)
    return engine, Path(path).stem if Path(path).is_file() else Path(path).name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="llmlib serve", description="An OpenAI-compatible server on llmlib's batching engine."
    )
    ap.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2, fetched)",
    )
    ap.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to bind (default 127.0.0.1: this machine only)",
    )
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests in the engine (running and waiting) before new ones get 503",
    )
    ap.add_argument("--max-n", type=int, default=Limits.max_n, help="most choices per request")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per engine step"
    )
    ap.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over steps (--no-enable-chunked-prefill: whole, alone if must)",
    )
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    ap.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 (default: the fastest accurate format here)",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=("none", "int8", "int4", "gguf"),
        help="weight-only int8, int4, or the GGUF file's own blocks (default: as --dtype)",
    )
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients must send (default: file name)",
    )
    ap.add_argument("--max-prompt-chars", type=int, default=Limits.max_prompt_chars)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy, shared CPU)",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N ranks (started here, or by torchrun: every rank runs this)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every request's logits bitwise independent of its batch (reproducible temperature 0)",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the CPU engine's decode steps compiled ahead of time, kept on disk (the first start "
        "compiles, about a minute; later ones load them). Default: on a CPU, except with "
        "--speculative or --tensor-parallel-size above 1",
    )
    from llmlib.speculative.config import SPEC_HELP, SpeculativeConfig

    ap.add_argument("--speculative", default=None, metavar="SPEC", help=SPEC_HELP)
    from llmlib.cli.common import add_kv_cache_arg

    add_kv_cache_arg(ap)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    try:
        spec = SpeculativeConfig.parse(args.speculative) if args.speculative else None
    except ValueError as e:
        ap.error(str(e))
    if args.tensor_parallel_size > 1:
        from llmlib.parallel.group import DistEnv

        env = DistEnv.from_env()
        if env is not None and env.rank != 0:  # under torchrun: only rank 0 serves HTTP
            from llmlib.parallel.worker import main as worker_main

            return worker_main()
    if args.max_queue < 1:
        ap.error("--max-queue must be at least 1")
    if args.max_n < 1 or args.max_num_seqs < 1:
        ap.error("--max-n and --max-num-seqs must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"llmlib serve: warning: binding {args.host}; anyone who can reach it can use this model",
            flush=True,
        )
    import uvicorn

    engine, name = build_engine(
        args.model,
        args.device,
        args.dtype,
        args.quantization,
        max_queue=args.max_queue,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size,
        batch_invariant=args.batch_invariant,
        compile=args.compile,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=spec,
    )
    name = args.served_model_name or name
    path = getattr(engine.llm.runner, "decode_path", "eager")
    if engine.llm.compile_s is not None:
        path += f" in {engine.llm.compile_s:.0f} s"
    what = "batch-invariant steps" if args.batch_invariant else "decode steps"
    print(f"llmlib serve: {what} {path}", flush=True)
    print(f"llmlib serve: engine: {engine.llm.engine_config.describe()}", flush=True)
    app = create_app(
        engine.start(),
        name,
        limits=Limits(max_prompt_chars=args.max_prompt_chars, max_n=args.max_n),
    )
    print(f"llmlib serve: {name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
