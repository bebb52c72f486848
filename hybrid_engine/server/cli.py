"""`serve_hybrid.py` command line: engine flags, server flags, start-up and clean shutdown."""
import argparse
import asyncio
import functools
import json
import logging
import math
import signal
import socket
import sys
from types import FrameType
from typing import Any

import jinja2
import torch
import uvicorn

from hybrid_engine.chat_template import load_chat_template, render_chat
from hybrid_engine.config import DTYPES, MAMBA_SSM_CACHE_DTYPES, EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.server.api import build_app
from hybrid_engine.server.async_llm import AsyncLLM
from hybrid_engine.server.connections import quiet_connection_logs, uvicorn_config
from hybrid_engine.server.engine_host import EngineProcessDied
from hybrid_engine.server.limits import ServerLimits
from hybrid_engine.server.reasoning import REASONING_PARSERS
from hybrid_engine.server.tool_calls import TOOL_CALL_PARSERS
from hybrid_engine.spec.config import SpeculativeConfig
from hybrid_engine.tokenizer import special_token_pattern

logger = logging.getLogger("hybrid_engine.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (engine flags mirror `EngineConfig`)."""
    p = argparse.ArgumentParser(description="OpenAI-compatible HTTP server for hybrid Mamba-2/attention/MoE models.")
    p.add_argument("--model", default=None,
                   help="checkpoint directory or 'preset:NAME' (default: the embedded tiny model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send as `model`; responses name the one asked for, else the "
                        "first (default: the engine's)")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="the chat template: a Jinja template, or the path of a file holding one (default: the "
                        "tokenizer's)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split chat replies' thinking (<think>...</think>) into `reasoning` (vLLM's flag; the names "
                        "all split the same way, docs/server.md) (default: none, replies are all content)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let chat replies call the request's tools (tool_choice 'auto'), parsed out with "
                        "--tool-call-parser (vLLM's flags)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="how the model writes tool calls: 'hermes' (<tool_call>{...}</tool_call>: Hermes, Qwen, "
                        "Granite-4.0), 'nemotron_json' (<TOOLCALL>[...]</TOOLCALL>: Nemotron-Nano-v2) or "
                        "'qwen3_coder' (<tool_call><function=...>: Nemotron-3-Nano, Qwen3-Coder)")
    p.add_argument("--device", default=None, help="'cuda' or 'cpu' (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    p.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES,
                   help="SSM state cache dtype (default: the checkpoint config's mamba_ssm_cache_dtype, else float32)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests in the running batch (Mamba slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: max(8192 on CUDA / 2048 on CPU, --max-num-seqs))")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings; more is an error)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    p.add_argument("--kv-block-size", type=int, default=None, help="tokens per KV block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="engine seed (requests without a seed derive theirs)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--no-async-scheduling", action="store_true", help="disable launch-ahead scheduling")
    p.add_argument("--no-cuda-graphs", action="store_true", help="disable CUDA graphs")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks and Mamba state checkpoints across requests that share a prefix "
                        "(docs/cache.md; default: on)")
    p.add_argument("--prefix-cache-max-checkpoints", type=int, default=None, metavar="N",
                   help="Mamba state checkpoints the prefix cache may keep (docs/cache.md; default: 2 per "
                        "--max-num-seqs, fewer on CUDA if they would take over a quarter of the memory left after "
                        "weights and activations)")
    p.add_argument("--prefix-cache-checkpoint-interval", type=int, default=None, metavar="N",
                   help="tokens between Mamba state checkpoints of a long prompt, a multiple of --kv-block-size "
                        "(docs/cache.md; default: the smallest multiple >= 512)")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests admitted beyond --max-num-seqs before answering 429")
    p.add_argument("--max-prompts-per-request", type=int, default=None,
                   help="sequences (prompts x n choices) one request may bring (more is a 400; default: --max-num-seqs)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT before they are aborted")
    defaults = ServerLimits()
    p.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                   help="larger request bodies are answered 413 before they are read (default: 8 MiB)")
    p.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help="this many open connections are served (the first to open); a request on a further "
                        "one is answered 503 and that connection closed (default: 2048)")
    p.add_argument("--timeout-keep-alive", type=float, default=defaults.timeout_keep_alive,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--request-read-timeout", type=float, default=defaults.request_read_timeout,
                   help="seconds a request's head and body have to arrive in full before the connection is closed")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": "PATH", "num_speculative_tokens": 4}\' '
                        "(docs/speculative.md; default: off)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N GPUs (N processes, started by the server; docs/parallel.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: MoE layers hold whole experts per GPU instead of a slice "
                        "of every expert")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine loop in a process of its own, so that HTTP work never holds the "
                        "interpreter lock the engine's step needs (docs/server.md; default: on); "
                        "--no-engine-process runs it on a thread of the server process")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    args = p.parse_args(argv)
    if args.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.enable_expert_parallel and args.tensor_parallel_size == 1:
        p.error("--enable-expert-parallel splits experts over the --tensor-parallel-size GPUs: give a size > 1")
    args.speculative_config = _speculative_config(p, args.speculative_config)
    if args.max_waiting_requests < 0:
        p.error("--max-waiting-requests must be >= 0")
    if args.max_prompts_per_request is not None and args.max_prompts_per_request < 1:
        p.error("--max-prompts-per-request must be >= 1")
    if args.prefix_cache_max_checkpoints is not None and args.prefix_cache_max_checkpoints < 0:
        p.error(f"--prefix-cache-max-checkpoints must be >= 0, got {args.prefix_cache_max_checkpoints}")
    _check_checkpoint_interval(p, args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template, "--chat-template")
        except ValueError as exc:
            p.error(str(exc))
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        p.error(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    try:
        args.limits = ServerLimits(max_request_body_bytes=args.max_request_body_bytes,
                                   max_connections=args.max_connections, timeout_keep_alive=args.timeout_keep_alive,
                                   request_read_timeout=args.request_read_timeout)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _chat_template_problem(tokenizer: Any | None, template: str) -> str:
    """Why the server cannot chat with `template` ("" if it can): a model without a
    tokenizer, or a template that does not parse (a Jinja syntax error: the line is named).
    A template that cannot render one user message alone may still render real
    conversations (it may want a system message first): that is logged, not refused."""
    if tokenizer is None:
        return "this model has no tokenizer to render chat with"
    try:
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], special_token_pattern(tokenizer),
                    chat_template=template)
    except ValueError as exc:
        if isinstance(exc.__cause__, jinja2.TemplateSyntaxError):
            return f"line {exc.__cause__.lineno}: {exc.__cause__.message}"
        logger.warning("--chat-template cannot render one user message alone: %s", " ".join(str(exc).split()))
    return ""


def _check_checkpoint_interval(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--prefix-cache-checkpoint-interval must be a positive multiple of the KV block size the
    engine will use (a checkpoint ends a block), so the usage error comes before loading."""
    interval = args.prefix_cache_checkpoint_interval
    if interval is None:  # the engine's default fits its block size
        return
    if interval < 1:
        p.error(f"--prefix-cache-checkpoint-interval must be >= 1, got {interval}")
    block = args.kv_block_size
    if block is None:
        try:  # the engine's own default for the device
            block = EngineConfig(device=args.device).resolve().kv_block_size
        except ValueError:  # a bad --device: the engine names it at start-up
            return
    if block > 0 and interval % block:
        p.error(f"--prefix-cache-checkpoint-interval must be a multiple of the KV block size ({block} tokens; "
                f"--kv-block-size), got {interval}")


def _speculative_config(p: argparse.ArgumentParser, text: str | None) -> dict | None:
    """--speculative-config as a validated dict (a usage error names what is wrong)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        p.error(f"--speculative-config must be a JSON object: {exc}")
    if not isinstance(value, dict):
        p.error(f"--speculative-config must be a JSON object, got {text!r}")
    if value.get("method") == "proposer":
        p.error("--speculative-config: method 'proposer' takes a Python object: use the library "
                "(LLM(speculative_config=...)); the server offers 'ngram' and 'draft_model'")
    try:
        SpeculativeConfig.from_dict(value)
    except ValueError as exc:
        p.error(f"--speculative-config: {exc}")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe."""
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, async_scheduling=not args.no_async_scheduling,
        cuda_graphs=not args.no_cuda_graphs, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        kv_block_size=args.kv_block_size, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed, load_format=args.load_format,
        speculative_config=args.speculative_config, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_max_checkpoints=args.prefix_cache_max_checkpoints,
        prefix_cache_checkpoint_interval=args.prefix_cache_checkpoint_interval,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
    )


# After --shutdown-timeout the in-flight requests are aborted; this long is left for their
# final "abort" responses to reach the clients before uvicorn cancels what still runs.
_ABORT_GRACE_S = 5.0


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown aborts the engine's in-flight requests after `abort_after`
    seconds, so their clients get a complete response with finish_reason "abort" rather than a
    dropped connection."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, abort_after: float):
        super().__init__(config)
        self._llm, self._abort_after = llm, abort_after

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self._abort_after, self._llm.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _exit_now(signum: int, _: FrameType | None) -> None:
    raise SystemExit(0)


def _bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening) to every address `host` resolves to, as uvicorn binds
    them. Done before the engine loads, so a bad or taken address fails at once rather than
    after minutes of loading; connections are refused until serving starts. Raises ValueError
    or OSError saying which address."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):  # getaddrinfo may repeat one
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: "::" must not also claim the IPv4 port
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets


# Start-up failures that are the operator's to fix (a bad flag, config, checkpoint, tokenizer
# file or address, too little memory, an engine process killed while loading): reported in
# one line, not as a traceback.
_START_ERRORS = (ValueError, OSError, torch.OutOfMemoryError, EngineProcessDied)


def main(argv: list[str] | None = None) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, exit 0; a start-up failure prints
    "cannot start: <reason>" on stderr and exits 2."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Loading can take a while; a signal meanwhile simply exits (stopping the engine process).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_now)
    config = engine_config(args)
    sockets: list[socket.socket] = []
    try:
        sockets = _bind_sockets(args.host, args.port)
        llm = AsyncLLM(functools.partial(LLMEngine, config), max_waiting_requests=args.max_waiting_requests,
                       max_prompts_per_request=args.max_prompts_per_request, engine_process=args.engine_process)
    except _START_ERRORS as exc:
        for sock in sockets:
            sock.close()
        print(f"cannot start: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:  # from here on, every way out stops the engine (and its process)
        info = llm.info
        if args.chat_template is not None:
            problem = _chat_template_problem(info.tokenizer, args.chat_template)
            if problem:
                print(f"cannot start: --chat-template: {problem}", file=sys.stderr)
                return 2
        served = args.served_model_name or [info.model_name]
        logger.info(
            "serving %s (model %s) on http://%s:%d | device=%s dtype=%s kernels=%s | capacity: %d concurrent "
            "requests (+%d waiting, at most %d prompts per request), %d KV tokens (%d blocks x %d), max context %d "
            "tokens | engine %s",
            ", ".join(map(repr, served)), info.model_name, args.host, args.port, info.device, info.dtype, info.kernels, info.max_num_seqs,
            args.max_waiting_requests, llm.max_prompts_per_request, info.kv_tokens, info.total_kv_blocks,
            info.kv_block_size, info.max_request_tokens,
            "on a thread" if llm.engine_pid is None else f"process {llm.engine_pid}",
        )
        # uvicorn handles SIGTERM/SIGINT while serving (stop accepting, let open requests
        # finish for --shutdown-timeout, after which _DrainingServer aborts the rest in the
        # engine and they answer with finish_reason "abort", run the app's shutdown), then
        # restores the previous handler (`_exit_now`, so a signal before uvicorn took over
        # exits too) and re-raises the signal: a clean exit 0.
        app = build_app(llm, served, args.limits, args.chat_template, args.reasoning_parser,
                        args.tool_call_parser if args.enable_auto_tool_choice else None)
        http_config = uvicorn_config(app, args.limits, host=args.host, port=args.port, log_level=args.log_level,
                                     timeout_graceful_shutdown=args.shutdown_timeout + _ABORT_GRACE_S)
        quiet_connection_logs()
        server = _DrainingServer(http_config, llm, abort_after=args.shutdown_timeout)
        server.run(sockets=sockets)
    finally:
        llm.shutdown()
    return 0 if server.started else 1
