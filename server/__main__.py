"""`python -m server`: the OpenAI-compatible HTTP server's command line (vllm-serve flag names), served by Hypercorn.

Parses and checks the flags (model, tokenizer, template, port) before anything loads, turns on JAX's persistent
compilation cache, serves until SIGTERM/SIGINT and then drains; a bad command line is one line on stderr, never a
traceback; never exits non-zero after a clean shutdown, never zero when the model failed to load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys

from qwen_jax import SamplingParams
from server.version import version

log = logging.getLogger("qwen_jax.server")


def build_parser() -> argparse.ArgumentParser:
    """The command line: vllm-serve's flag names; every flag's help ends with its default."""
    from qwen_jax import ENGINE_ARGS, LOAD_FORMATS
    from server.serving import JSON_WHITESPACE

    def engine(name: str, text: str) -> str:
        """Help for an engine flag, whose default is the engine's (ENGINE_ARGS) and is shown as such."""
        return f"{text} (default: {ENGINE_ARGS[name]})"

    p = argparse.ArgumentParser(prog="python -m server", description="qwen-jax OpenAI-compatible server "
                                "(flags follow vllm serve)")
    p.add_argument("--version", action="version", version=f"qwen-jax {version()}")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vllm serve takes it (the same as --model) (default: --model's)")
    g = p.add_argument_group("Frontend")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on, checked before the model loads "
                                                          "(default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("QWEN_JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1, /invocations, /tokenize and /detokenize "
                        "(default: $QWEN_JAX_API_KEY, else none)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or the template itself in one line (default: the tokenizer's)")
    g.add_argument("--response-role", default="assistant",
                   help="the role of a chat completion's message (default: %(default)s)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' (always on here: a chat template that renders tools gets them, and "
                        "the reply is parsed for calls) (default: on)")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                   help="the format a forced tool call (tool_choice 'required' or a named function) is written "
                        "in: qwen3_coder / qwen3_xml, Qwen3.5's XML; hermes, Qwen3's JSON; replies are parsed "
                        "in either (default: the one the chat template teaches)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:<id>' instead of its text (default: off)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens (always given here) (default: on)")
    g.add_argument("--allowed-origins", type=json_list, default=["*"],
                   help="origins allowed cross-origin requests, a JSON list (default: [\"*\"])")
    g.add_argument("--allowed-methods", type=json_list, default=["*"],
                   help="methods allowed cross-origin, a JSON list (default: [\"*\"])")
    g.add_argument("--allowed-headers", type=json_list, default=["*"],
                   help="headers allowed cross-origin, a JSON list (default: [\"*\"])")
    g.add_argument("--allow-credentials", action="store_true",
                   help="cross-origin requests may carry credentials (default: off)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file (default: HTTP)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate file (default: "
                                                        "HTTP)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients with (default: "
                                                        "none)")
    g.add_argument("--root-path", default="",
                   help="the path prefix a proxy serves this server under (ASGI root_path) (default: none)")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="the HTTP server's own log level (Hypercorn's here; trace is debug) (default: "
                        "--log-level's)")
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log", "--disable-log-requests",
                   action="store_true",
                   help="no log line per request (method, path, status, latency) (default: one line each)")
    g.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies get 413 (default: %(default)s)")
    g.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT nothing new is admitted and requests not started get 503; running ones "
                        "may take this many seconds to finish before each is ended with an error body (or an SSE "
                        "error event and [DONE]); a second signal ends them at once (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="the least severe log records written (default: %(default)s)")
    g = p.add_argument_group("ModelConfig")
    g.add_argument("--model", default=None,
                   help="an HF model directory, or a hub id (org/name) already in the local Hugging Face cache "
                        "(nothing is downloaded) (default: the built-in tiny random model)")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory or cached hub id other than the model's (default: the model's)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names a request's 'model' may give (any other is a 404); the first is the one "
                        "responses and metrics carry; /v1/models lists them all (default: the model directory's "
                        "name)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vllm serve's command lines; not needed: no model code is ever loaded from a "
                        "checkpoint (default: off)")
    g.add_argument("--revision", default=None,
                   help="the revision of a hub id's model in the local Hugging Face cache (default: main)")
    g.add_argument("--hf-overrides", type=json_dict, default=None,
                   help="a JSON object put over config.json's entries, e.g. '{\"max_position_embeddings\": "
                        "32768}' (default: none)")
    g.add_argument("--generation-config", default="auto",
                   help="where requests' sampling defaults come from: auto, the model's generation_config.json "
                        "(temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps every "
                        "request); vllm, none (OpenAI's); or a directory holding a generation_config.json "
                        "(default: auto)")
    g.add_argument("--override-generation-config", type=json_dict, default=None,
                   help="a JSON object of generation-config entries put over those, e.g. '{\"temperature\": 0.5}' "
                        "(default: none)")
    g.add_argument("--dtype", default=None, choices=("auto", "bfloat16", "float16", "float32"),
                   help=engine("dtype", "weights' and activations' type; auto: the checkpoint's"))
    g.add_argument("--seed", type=int, default=None,
                   help=engine("seed", "seed of the random weights and of requests sent without one"))
    g.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence, prompt and completion (default: the model's "
                        "max_position_embeddings, at most 8192)")
    g.add_argument("--max-logprobs", type=int, default=SamplingParams.MAX_LOGPROBS,
                   help="the most logprobs per token a request may ask for, at most the sampler's "
                        f"{SamplingParams.MAX_LOGPROBS} (default: %(default)s)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run each step's kernels one by one, without CUDA graphs (XLA's command buffers "
                        "off): slower, for debugging (default: graphs on)")
    g = p.add_argument_group("LoadConfig")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default=None,
                   help=engine("load_format", "auto reads the checkpoint; dummy makes random weights of its shapes "
                                              "(config.json alone is needed); dummy_echo, a benchmarking aid for "
                                              "--speculative-config, makes those weights with every layer's "
                                              "residual writers zero and the MTP head drafting what the model will "
                                              "emit: every draft is accepted at random weights' cost"))
    g.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache a hub id is looked up in; nothing is downloaded (default: "
                        "$HF_HOME's)")
    g = p.add_argument_group("StructuredOutputsConfig")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="the think block (<think>...</think>) goes to reasoning_content; these parsers' tags are "
                        "the ones split (default: on)")
    g.add_argument("--json-whitespace", choices=tuple(JSON_WHITESPACE), default="bounded",
                   help="whitespace between JSON tokens in structured outputs (response_format, structured_outputs) "
                        "when a request does not say: runs of at most 16 characters, any, or none (a request's "
                        "structured_outputs any_whitespace / disable_any_whitespace overrides it; default: "
                        "%(default)s)")
    g = p.add_argument_group("ParallelConfig")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help=engine("tensor_parallel_size", "devices each replica's weights are split over"))
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help=engine("data_parallel_size", "independent replicas, each on its own devices"))
    g.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help=engine("enable_expert_parallel", "split the routed experts over the devices instead of "
                                                         "each expert's weights"))
    g.add_argument("--layout", default="auto",
                   help="where the model runs: 'auto' puts it on every visible GPU of this host in the best measured "
                        "layout unless -tp, -dp or --enable-expert-parallel is given (one GPU: itself; its table: "
                        "sharding/devices.py AUTO_LAYOUTS), or 'DP=2,TP=2' / 'TP=4,EP' / 'EP=4' (default: "
                        "%(default)s)")
    g.add_argument("--num-hosts", type=int, default=None,
                   help="processes (hosts) serving one model together, joined by jax.distributed; host 0 alone "
                        "serves HTTP (default: $JAX_NUM_PROCESSES, else 1)")
    g.add_argument("--host-index", type=int, default=None,
                   help="this host, 0..num-hosts-1: 0 serves HTTP and schedules every step, the others serve no "
                        "HTTP and run host 0's steps until it stops (default: $JAX_PROCESS_ID, else 0)")
    g.add_argument("--coordinator-address", default=None,
                   help="host:port on host 0 for jax.distributed's coordinator (default: $JAX_COORDINATOR_ADDRESS)")
    g = p.add_argument_group("CacheConfig")
    g.add_argument("--block-size", type=int, default=None,
                   help=engine("block_size", "tokens per KV cache block"))
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help=engine("gpu_memory_utilization", "the share of each device the engine takes: weights, caches "
                                "and the programs' working memory"))
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=engine("enable_prefix_caching", "reuse the cache of a prompt's already computed prefix"))
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="the KV cache's type: auto, the activations' (another type, such as fp8, is refused: "
                        "nothing that changes outputs vs BF16) (default: %(default)s)")
    g = p.add_argument_group("SchedulerConfig")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences each replica runs at once (default: the most, up to 64, whose recurrent state "
                        "and KV cache at --max-model-len each fit in memory; the start-up log says how many)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=engine("max_num_batched_tokens", "tokens each replica runs in one step"))
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prompts longer than a step's token budget are prefilled over several steps (always on "
                        "here; --no-enable-chunked-prefill is refused) (default: on)")
    g.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode steps run in one program for batches of a few requests (default: 4 on a GPU, 1 "
                        "elsewhere)")
    g.add_argument("--max-queue-len", type=int, default=1024,
                   help="engine requests allowed to wait beyond --max-num-seqs; more are answered 503 "
                        "(default: %(default)s)")
    g = p.add_argument_group("SpeculativeConfig")
    g.add_argument("--speculative-config", default=None,
                   help=engine("speculative_config", "speculative decoding with the model's MTP head: by default "
                               "where it pays, when the checkpoint has the head; JSON such as '{\"method\": \"mtp\", "
                               "\"num_speculative_tokens\": 2}' for k drafts on every step that can verify; 'off'"))
    g = p.add_argument_group("ObservabilityConfig")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="accepted; this server logs no periodic stats (they are at /metrics) (default: off)")
    g = p.add_argument_group("qwen-jax", "the engine's compilation and kernels")
    g.add_argument("--kernels", choices=("auto", "reference", "gpu"), default=None,
                   help=engine("kernels", "hot ops as the GPU kernels of pallas_kernels/ (gpu), as jnp references "
                                          "(reference), or the kernels on a GPU and the references elsewhere "
                                          "(auto)"))
    g.add_argument("--warmup", choices=("auto", "minimal", "full"), default="auto",
                   help="step programs compiled before /health turns 200: 'full' compiles every token bucket up to "
                        "--max-num-batched-tokens; auto: full on a GPU, minimal on the CPU (default: %(default)s)")
    g.add_argument("--compilation-cache-dir", default=os.environ.get("QWEN_JAX_COMPILATION_CACHE"),
                   help="JAX persistent compilation cache; 'none' turns it off (default: "
                        "$QWEN_JAX_COMPILATION_CACHE, else ~/.cache/qwen_jax/jax_compilation_cache)")
    g = p.add_argument_group("refused", "vllm serve's flags for what this engine does not do")
    for flag, what in REFUSED_FLAGS.items():
        switch = flag in REFUSED_SWITCHES
        g.add_argument(flag, default=None, action="store_true" if switch else "store",
                       help=f"refused: {what} (default: {'off' if switch else 'none'})")
    return p


# --enforce-eager: XLA runs each kernel on its own instead of recording CUDA graphs (command buffers)
EAGER_XLA_FLAG = "--xla_gpu_enable_command_buffer="
# vllm serve's --tool-call-parser names -> the format of the tool-call grammar (server/tools.py)
TOOL_CALL_PARSERS = {"qwen3_coder": "qwen_3_5", "qwen3_xml": "qwen_3_5", "hermes": "qwen_3"}
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# vllm serve's flags for what this engine does not do: giving one is a one-line error at start (exit 2)
REFUSED_FLAGS = {
    "--quantization": "weights stay in BF16 (no quantization)",
    "--enable-lora": "no LoRA adapters",
    "--lora-modules": "no LoRA adapters",
    "--limit-mm-per-prompt": "text only (no images or other media)",
}
REFUSED_SWITCHES = ("--enable-lora",)  # of those, the flags that take no value


ENGINE_FLAGS = ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "max_model_len",
                "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "enable_prefix_caching",
                "load_format", "dtype", "seed", "kernels", "num_scheduler_steps", "speculative_config", "num_hosts",
                "host_index", "coordinator_address", "tokenizer", "block_size", "hf_overrides",
                "generation_config", "override_generation_config")


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vllm serve's --allowed-origins '["http://a"]')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def json_dict(text: str) -> dict:
    """A flag's JSON object (vllm serve's --hf-overrides '{"max_position_embeddings": 32768}')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def engine_args(args: argparse.Namespace) -> dict:
    """The flags the engine takes, only those given (the engine's defaults apply to the rest)."""
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}


class UsageError(Exception):
    """A command line that cannot be served: reported in one line, before anything loads."""


def check_args(args: argparse.Namespace) -> None:
    """Resolve the model, tokenizer and chat template and check the flags, before anything loads; a problem is a
    UsageError."""
    from qwen_jax import (
        ModelNotFound,
        parse_layout,
        parse_speculative_config,
        read_model_config,
        resolve_path,
        sampling_defaults,
    )

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    # the name a client knows the model by: --model as given (a hub id stays a hub id), as vLLM serves it
    args.model_as_given = args.model
    try:
        if args.model is not None:
            args.model = resolve_path(args.model, args.revision, args.download_dir)
            read_model_config(args.model, overrides=args.hf_overrides)  # ModelNotFound without config.json
        if args.tokenizer is not None:
            args.tokenizer = resolve_path(args.tokenizer, args.revision, args.download_dir)
    except (ModelNotFound, ValueError) as exc:  # (ValueError: --hf-overrides that break the config)
        raise UsageError(str(exc).replace("hf_overrides", "--hf-overrides", 1)) from None
    try:
        sampling_defaults(args.model or "", args.generation_config, args.override_generation_config)
    except ValueError as exc:
        flag = "--override-generation-config" if args.override_generation_config else "--generation-config"
        raise UsageError(f"{flag}: {exc}") from None
    if args.chat_template is not None:
        args.chat_template = read_chat_template(args.chat_template)
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"--{flag.replace('_', '-')} {path!r} is not a file")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise UsageError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag, what in REFUSED_FLAGS.items():
        if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None:
            raise UsageError(f"{flag} is not supported: {what}")
    if args.kv_cache_dtype != "auto":
        raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported: the KV cache keeps the "
                         f"activations' type (auto)")
    if args.enable_chunked_prefill is False:
        raise UsageError("--no-enable-chunked-prefill is not supported: long prompts are always prefilled in chunks")
    try:
        parse_speculative_config(args.speculative_config)
    except ValueError as exc:
        raise UsageError(str(exc).replace("speculative_config", "--speculative-config", 1)) from None
    if args.layout != "auto":
        try:
            parse_layout(args.layout)
        except ValueError as exc:
            raise UsageError(f"--{exc}") from None
        given = [flag for flag, value in (("-tp", args.tensor_parallel_size), ("-dp", args.data_parallel_size),
                                          ("--enable-expert-parallel", args.enable_expert_parallel)) if value]
        if given:
            raise UsageError(f"--layout {args.layout} and {', '.join(given)} both set the layout: give one")
    if not 0 <= args.max_logprobs <= SamplingParams.MAX_LOGPROBS:
        raise UsageError(f"--max-logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}] (the sampler's limit), got "
                         f"{args.max_logprobs}")


def read_chat_template(value: str) -> str:
    """--chat-template: a file's content, or the value itself when it is a template (has Jinja markup)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise UsageError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, taken now (before the model loads) and handed to Hypercorn; UsageError when taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE events go out as they come
        sock.bind(address)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def enable_compilation_cache(path: str | None) -> str | None:
    """Persist compiled XLA executables so a restart skips compilation (thresholds lowered to cache everything)."""
    if path is not None and path.lower() == "none":
        return None
    from qwen_jax import default_cache_dir

    path = path or os.path.join(default_cache_dir(), "jax_compilation_cache")
    os.makedirs(path, exist_ok=True)
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


async def serve(app, sock: socket.socket, graceful_timeout: float, args: argparse.Namespace | None = None) -> int:
    """Serve `app` until SIGTERM/SIGINT (then drain: see ServerState.drain; a second signal cuts the wait short), a
    failed engine start or the engine core's death; returns the process exit code (non-zero for the last two, so
    that a supervisor restarts the server)."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # Hypercorn owns the socket from here
    config.backlog = 2048
    # Requests are drained before Hypercorn is told to stop (ServerState.drain): by then only answers being written
    # and idle connections are left for its own graceful shutdown.
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = 30
    config.accesslog = None
    config.errorlog = "-"
    if args is not None:
        config.root_path = args.root_path
        config.certfile, config.keyfile, config.ca_certs = args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs
    stop = asyncio.Event()
    hurry = asyncio.Event()
    exit_code = 0
    loop = asyncio.get_running_loop()
    state = app.extensions["qwen_jax"]
    draining: list[asyncio.Task] = []

    async def drain() -> None:
        await state.drain(graceful_timeout, hurry)
        stop.set()

    def on_signal(sig: signal.Signals) -> None:
        if draining:  # a second signal: end the running requests now
            log.info("%s again: ending the running requests now", sig.name)
            hurry.set()
            return
        log.info("%s: draining (new requests get 503)", sig.name)
        draining.append(asyncio.create_task(drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    async def watch_engine() -> None:
        nonlocal exit_code
        while state.start_task is None:
            await asyncio.sleep(0.05)
        await asyncio.gather(state.start_task, return_exceptions=True)
        if state.start_error is not None:
            log.error("shutting down: the engine failed to start (%s)", state.start_error)
            exit_code = 1
            stop.set()

    def engine_died(reason: str) -> None:
        nonlocal exit_code
        log.error("shutting down: the engine core died (%s)", reason)
        exit_code = 1
        stop.set()

    state.engine.on_dead(engine_died)
    watcher = asyncio.create_task(watch_engine())
    try:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)
    finally:
        for task in (watcher, *draining):
            task.cancel()
        await asyncio.gather(watcher, *draining, return_exceptions=True)
    log.info("server stopped")
    return exit_code


def follow(model: str, args: dict) -> int:
    """Host > 0 of several: no HTTP server. Builds the same engine as host 0 (joining it through jax.distributed)
    and runs host 0's steps, its warm-up included, until host 0's engine shuts down."""
    from qwen_jax import EngineCore

    engine = EngineCore(model, **args)
    log.info("host %d: following host 0 (no HTTP server here)", args["host_index"])
    steps = engine.follow()
    log.info("host 0 stopped after %d steps", steps)
    return 0


def default_model_names(args: argparse.Namespace, engine) -> tuple[str, ...]:
    """The names a server without --served-model-name answers to: the model directory's name (listed first, as this
    server always has) and --model as given, the name vLLM serves it under, so a client written for vLLM finds it;
    a hub id alone (it resolves to a snapshot folder, whose name no client knows)."""
    given = args.model_as_given
    if given is None:  # the built-in model
        return (engine.model_name,)
    if not os.path.exists(given):  # a hub id from the local cache
        return (given,)
    return tuple(dict.fromkeys((engine.model_name, given)))


def main(argv: list[str] | None = None) -> int:
    from qwen_jax import host_settings

    args = build_parser().parse_args(argv)
    args.num_hosts, args.host_index, args.coordinator_address = host_settings(
        args.num_hosts, args.host_index, args.coordinator_address)
    following = args.num_hosts > 1 and args.host_index > 0  # a host that runs host 0's steps and serves no HTTP
    try:
        check_args(args)
        sock = None if following else bind_socket(args.host, args.port)
    except UsageError as exc:
        print(f"python -m server: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.uvicorn_log_level is not None:
        logging.getLogger("hypercorn").setLevel("DEBUG" if args.uvicorn_log_level == "trace"
                                                else args.uvicorn_log_level.upper())
    if args.enforce_eager:  # before any engine process starts: they read XLA's flags when JAX starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {EAGER_XLA_FLAG}".strip()
    if args.trust_remote_code:
        log.info("--trust-remote-code is not needed: qwen-jax runs its own model code, never a checkpoint's")
    cache = enable_compilation_cache(args.compilation_cache_dir)
    log.info("JAX compilation cache: %s", cache or "off")
    model = args.model
    if model is None:
        from qwen_jax import ensure_default_model

        model = ensure_default_model()
        log.info("no --model given: serving the built-in default model at %s", model)
    if following:
        return follow(model, engine_args(args))
    from qwen_jax import AsyncLLM
    from server.app import ServerConfig, create_app

    # the core processes start loading and compiling at once, while this front reads the tokenizer and builds
    engine = AsyncLLM.from_engine_args(model, warmup=args.warmup, layout=args.layout, launch=True,
                                       **engine_args(args))
    if engine.sampling_defaults:
        log.warning("requests that do not set them sample with the model's generation config: %s (--generation-config"
                    " vllm: OpenAI's defaults instead)", engine.sampling_defaults)
    dp = engine.engine_args.get("data_parallel_size") or 1
    log.info("layout: %d data-parallel replica(s) x tensor-parallel size %s%s", dp,
             engine.engine_args.get("tensor_parallel_size") or "all devices",
             ", experts split" if engine.engine_args.get("enable_expert_parallel") else "")
    # --max-num-seqs is per data-parallel replica (as in vLLM): the engine runs dp times as many sequences at once.
    running = (args.max_num_seqs or 64) * dp
    config = ServerConfig(served_model_names=tuple(args.served_model_name or default_model_names(args, engine)),
                          api_key=args.api_key,
                          max_num_seqs=running, max_queue_len=args.max_queue_len,
                          max_body_bytes=args.max_request_bytes, max_logprobs=args.max_logprobs,
                          chat_template=args.chat_template, access_log=not args.disable_access_log,
                          json_whitespace=args.json_whitespace,
                          tool_call_format=TOOL_CALL_PARSERS.get(args.tool_call_parser),
                          response_role=args.response_role,
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                          allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials)
    app = create_app(engine, config)
    return asyncio.run(serve(app, sock, args.graceful_timeout, args))


if __name__ == "__main__":
    sys.exit(main())
