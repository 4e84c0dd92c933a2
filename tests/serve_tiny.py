"""Serve the tiny random llama of conftest on loopback (for tests/test_server_loopback.py).

    python tests/serve_tiny.py PORT [--serial] [--max-batch-size N] [--max-waiting N] [--cohort-size K]
                                [--step-delay S] [--no-prefix-cache] [--chain] [--fail-seed S]
                                [--prefill-chunk-tokens C] [--max-cache-bytes B] [--context N]

``--chain`` serves conftest's chain model instead (after ``CHAIN_PROMPT`` it writes ``CHAIN_TEXT``,
then EOS, then ``CHAIN_TEXT`` again), for tests that need a known answer length.

``--fail-seed S`` makes the rows of requests with sampling seed S fail in the engine (their sampler
raises), for the failure-isolation tests.

``--step-delay S`` sleeps S seconds in every forward pass of the engine, so that the tiny model
decodes at the pace of a real one and a test can observe what happens *during* a long generation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from conftest import make_chain_model, make_config, make_model, make_tokenizer, model_from_config  # noqa: E402
import importlib  # noqa: E402

from skipdecode.model import SkipModel  # noqa: E402
from skipdecode.cli_serve import run_server  # noqa: E402
from skipdecode.server import create_app  # noqa: E402


#: the chain model's prompt and answer (``--chain``)
CHAIN_PROMPT = "Describe the restaurant:"
CHAIN_TEXT = "The Eagle is a coffee shop"


def fail_rows_seeded(seed: int) -> None:
    """Rows whose sampling seed is ``seed`` cannot draw a token (their sampler raises as a NaN in
    their own logits would): a request that fails inside the engine, for the failure-isolation
    tests."""
    import skipdecode.engine as engine_module
    from skipdecode.sampling import Sampler

    class FailingSampler(Sampler):
        def __call__(self, *args, **kwargs):
            raise RuntimeError("NaN in logits: refusing to sample")

    def make(params, device="cpu"):
        return (FailingSampler if params.seed == seed else Sampler)(params, device=device)

    engine_module.Sampler = make


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--serial", action="store_true")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-waiting", type=int, default=256)
    parser.add_argument("--cohort-size", type=int, default=1)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--chain", action="store_true")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--fail-seed", type=int, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None)
    parser.add_argument("--max-cache-bytes", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="the llama's context (positions; default 256)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.step_delay:
        for name in ("skipdecode.engine", "skipdecode.generate", "skipdecode.chunked_prefill"):  # whichever drives the model
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue

            def slow(*a, _real=module.skip_forward, **kw):
                time.sleep(args.step_delay)
                return _real(*a, **kw)

            module.skip_forward = slow
    if args.fail_seed is not None:
        fail_rows_seeded(args.fail_seed)
    kwargs = {}
    if args.serial or args.max_batch_size != 32 or args.max_waiting != 256 or args.cohort_size != 1:
        kwargs = dict(serial=args.serial, max_batch_size=args.max_batch_size, max_waiting=args.max_waiting,
                      cohort_size=args.cohort_size)
    if args.no_prefix_cache:
        kwargs["prefix_cache"] = False
    if args.stream_interval != 1:
        kwargs["stream_interval"] = args.stream_interval
    if args.api_key is not None:
        kwargs["api_key"] = args.api_key
    if args.prefill_chunk_tokens is not None:
        kwargs["prefill_chunk_tokens"] = args.prefill_chunk_tokens
    if args.max_cache_bytes is not None:
        kwargs["max_cache_bytes"] = args.max_cache_bytes
    tok = make_tokenizer()
    model = make_chain_model(tok, CHAIN_PROMPT, CHAIN_TEXT) if args.chain else make_model("llama")
    if args.context is not None:
        config = make_config("llama")
        config.max_position_embeddings = args.context
        model = model_from_config(config)
    app = create_app(SkipModel(model, tok), "tiny", **kwargs)
    run_server(app, "127.0.0.1", args.port, log_level="warning")  # as `skipdecode serve` runs it


if __name__ == "__main__":
    main()
