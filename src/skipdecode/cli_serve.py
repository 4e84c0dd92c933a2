"""``skipdecode serve``: the OpenAI-compatible HTTP server (:mod:`skipdecode.server`) on uvicorn.
:mod:`skipdecode.cli` registers it on its app."""

from __future__ import annotations

import os
from typing import Optional

import typer

from .cli_common import (
    COHORT_HELP,
    COMPILE_HELP,
    MODEL_HELP,
    NO_ADAPTER_HELP,
    PREFIX_CACHE_HELP,
    QUANTIZE_HELP,
    check_cohort_option,
    check_policy_options,
    check_quantize_option,
    err,
    fail,
    load_model,
    resolve_policy,
    set_threads,
)

__all__ = ["serve"]


def _check_can_listen(host: str, port: int) -> None:
    """Exit with a one-line error when ``host:port`` cannot be bound (port in use, bad host).

    Binds and closes a socket with the options uvicorn uses (``SO_REUSEADDR``), so a port in
    TIME_WAIT is not reported busy.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        fail(f"--host {host!r}: cannot resolve it ({e.strerror})")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            fail(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                 "is another server using it? Choose another --port")


def kv_cache_bytes(gib: Optional[float]) -> Optional[int]:
    """``--kv-cache-gb`` as the engine's ``max_cache_bytes``: None (the default) ->
    :func:`~skipdecode.kv_budget.serve_default_bytes`, 0 -> None (no bound), else GiB -> bytes."""
    from .kv_budget import serve_default_bytes

    if gib is None:
        return serve_default_bytes()
    return max(1, int(gib * 2**30)) if gib > 0 else None


def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    speedup: Optional[float] = typer.Option(None, "--speedup", "-s", help="Default target speedup of requests that give none."),
    max_layers: Optional[int] = typer.Option(None, "--max-layers", help="Default e_max."),
    min_layers: Optional[int] = typer.Option(None, "--min-layers", help="Default e_min."),
    warmup_layers: Optional[int] = typer.Option(None, "--warmup-layers", help="Default warm-up layers, also of requests that send their own speedup or layers (they may send warmup_layers)."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Default horizon (tokens), also of requests that send their own speedup or layers (they may send horizon)."),
    full_depth_steps: Optional[int] = typer.Option(None, "--full-depth-steps", help="Default first decode steps at full depth, with the base model's weights, also of requests that send their own speedup or layers (default: the model's schedule's; requests may send full_depth_steps)."),
    name: str = typer.Option("skipdecode", "--name", help="Model name reported by /v1/models."),
    device: str = typer.Option("cpu", "--device", help="torch device."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    max_batch_size: int = typer.Option(32, "--max-batch-size", help="Most rows decoding at once (in-flight batching)."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Most rows waiting for a slot; beyond it requests get 429."),
    serial: bool = typer.Option(False, "--serial", help="Serve one row at a time (the one-at-a-time design, for comparison)."),
    cohort_size: int = typer.Option(1, "--cohort-size", help=COHORT_HELP.format(what="requests")),
    align_steps: Optional[int] = typer.Option(None, "--align-steps", help="Hold waiting requests, at most this many engine steps, while every running row is more than this many decode steps old, so that rows join in waves and share their full-depth steps (default 8 in flight, 0 with --serial; 0: off; docs/serving.md)."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help=PREFIX_CACHE_HELP + " /health reports its hits."),
    prefill_chunk_tokens: int = typer.Option(256, "--prefill-chunk-tokens", help="Chunked prefill: a prompt with more tokens than this to compute is prefilled this many tokens per engine step, between the running rows' decode steps, so that running streams keep going meanwhile (outputs unchanged; 0: off, a long prompt holds every running row for its whole prefill; docs/serving.md)."),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", help="Bound on the key/value cache (GiB): a request that would take it past this waits for rows to finish, one that cannot fit alone gets a 400 (default: 40 percent of the machine's memory; 0: no bound; docs/serving.md)."),
    stream_interval: int = typer.Option(1, "--stream-interval", help="Tokens per streamed event: a row's tokens are sent in groups of this many (its first and last token at once), as vLLM's and SGLang's --stream-interval; larger values spend less CPU per token on HTTP and client (docs/serving.md). 1: one event per token."),
    no_adapter: bool = typer.Option(False, "--no-adapter", help=NO_ADAPTER_HELP),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SKIPDECODE_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on the /v1/ routes (401 otherwise), as vLLM's --api-key; /health and /metrics stay open."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads for the model (default: torch's, one per core); "
                                          "fewer than the cores leaves one for the HTTP layer and tokenizer."),
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) with /health and Prometheus /metrics."""
    check_quantize_option(quantize)
    set_threads(threads)
    if not 0 < port < 65536:
        fail(f"--port must be in 1..65535, got {port}")
    check_cohort_option(cohort_size, max_batch_size, "--max-batch-size")
    if cohort_size > 1 and serial:
        fail("--cohort-size applies to in-flight batching; drop it or --serial")
    if max_waiting < 0:
        fail(f"--max-waiting must be >= 0, got {max_waiting}")
    if align_steps is not None and align_steps < 0:
        fail(f"--align-steps must be >= 0, got {align_steps}")
    if prefill_chunk_tokens < 0:
        fail(f"--prefill-chunk-tokens must be >= 0 (tokens per prefill chunk; 0: off), got {prefill_chunk_tokens}")
    if kv_cache_gb is not None and not 0 <= kv_cache_gb < 2**33:
        fail(f"--kv-cache-gb must be a number of GiB >= 0 (0: no bound), got {kv_cache_gb}")
    if stream_interval < 1:
        fail(f"--stream-interval must be >= 1 (tokens per streamed event), got {stream_interval}")
    if not name.strip():
        fail(f"--name must be a non-empty model name (requests name it in 'model'), got {name!r}")
    if api_key is None and os.environ.get("SKIPDECODE_API_KEY") is not None:
        fail("SKIPDECODE_API_KEY is set but empty; give it the key, or unset it to serve without a key")
    if api_key is not None:
        from .server import check_api_key

        try:
            api_key = check_api_key(api_key, "--api-key (or SKIPDECODE_API_KEY)")
        except ValueError as e:
            fail(str(e))
    if align_steps and serial:
        fail("--align-steps applies to in-flight batching; drop it or --serial")
    if align_steps is None:
        from .admission import SERVE_ALIGN_STEPS

        align_steps = 0 if serial else SERVE_ALIGN_STEPS
    check_policy_options(speedup, max_layers, min_layers, horizon, full_depth_steps, warmup_layers)
    _check_can_listen(host, port)  # before the model load: a busy port fails in a second, cleanly
    from .scheduler import on_fresh_thread

    # loaded on a thread that ends, so that the engine thread's OpenMP team is the only one left
    try:
        sk = on_fresh_thread(load_model, model, device, dtype, quantize=quantize, compile=compile, adapter=not no_adapter)
        if getattr(sk, "compile_report", None) is not None:  # long prompts' variants too, before serving
            from .compile_warmup import warm_up_long_prompts

            on_fresh_thread(warm_up_long_prompts, sk, sk.compile_report, 0 if serial else prefill_chunk_tokens)
    except KeyboardInterrupt:
        # the loading thread may be inside torch's C++ code: leave at once, without the interpreter's
        # shutdown (which, racing that thread, could end in a C++ abort instead of exit code 130)
        err.print("interrupted while loading the model", markup=False)
        err.file.flush()
        os._exit(130)
    sk.policy = resolve_policy(sk, speedup, max_layers, min_layers, warmup_layers, horizon, full_depth_steps)
    from .info import describe_policy
    from .server import create_app

    key_note = "; /v1/ requests need the API key" if api_key is not None else ""
    policy = describe_policy(sk.policy.to_dict(), sk.num_layers)
    err.print(f"serving {sk.source} as {name!r} on http://{host}:{port} (policy: {policy}){key_note}", markup=False)
    app_ = create_app(sk, name, max_batch_size=max_batch_size, max_waiting=max_waiting, serial=serial,
                      cohort_size=cohort_size, prefix_cache=prefix_cache, align_steps=align_steps,
                      prefill_chunk_tokens=prefill_chunk_tokens, max_cache_bytes=kv_cache_bytes(kv_cache_gb),
                      stream_interval=stream_interval, api_key=api_key,
                      policy_defaults={k: v for k, v in (("warmup_layers", warmup_layers), ("horizon", horizon),
                                                         ("full_depth_steps", full_depth_steps)) if v is not None})
    run_server(app_, host, port)


def run_server(app, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn (as ``uvicorn.run``) until a signal stops it.

    The first Ctrl-C (or SIGTERM) stops gracefully, as uvicorn does: no new connections, the
    requests in flight finish, then the app's shutdown stops the engine thread. A second one
    while that lasts (uvicorn: "CTRL+C to force quit") exits at once, with one line and status
    130 (143 for SIGTERM): uvicorn's own forced exit skips the app's shutdown, so the engine
    thread was still inside torch when the interpreter ended, which printed the cancelled
    streams' tracebacks and aborted (SIGABRT).

    Raises:
        SystemExit: 3 (uvicorn's ``STARTUP_FAILURE``) when the server did not start.
    """
    import signal
    import sys

    import uvicorn

    from .server import uvicorn_options

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig in (signal.SIGINT, signal.SIGTERM):
                sys.stderr.write("second interrupt: exiting now; the requests in flight are cut off\n")
                sys.stderr.flush()
                os._exit(128 + sig)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, **uvicorn_options()))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on, once stopped (as uvicorn.run)
        pass
    if not server.started:
        raise SystemExit(3)
