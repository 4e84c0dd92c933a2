"""The ``skipdecode`` command (typer). The library never prints; only this module does.

Subcommands: ``generate``, ``bench``, ``train``, ``eval``, ``serve``, ``info``. Heavy imports
happen inside each command so ``--help`` is instant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(
    help="SkipDecode (arXiv 2307.02628): batch- and KV-cache-compatible layer skipping for fast decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()


def fail(message: str, code: int = 2) -> None:
    """Print ``message`` as a clean error (no traceback) and exit with ``code``."""
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def resolve_policy(model, speedup, max_layers, min_layers, warmup_layers, horizon):
    """Policy from CLI flags (speedup or explicit bounds), else the checkpoint's; exits on error."""
    try:
        if speedup is not None or any(v is not None for v in (max_layers, min_layers, warmup_layers, horizon)):
            return model.policy_for(
                speedup=speedup, horizon=horizon, max_layers=max_layers, min_layers=min_layers,
                warmup_layers=warmup_layers,
            )
        return model.policy
    except ValueError as e:
        fail(str(e))


def load_model(model_name, device="cpu", dtype="float32", chat=None):
    """Load ``model_name`` (None: embedded default), turning load errors into clean exits."""
    from .adapters import UnsupportedArchitectureError
    from .loading import LoadError, load

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with err.status(f"loading {model_name or 'the embedded default model'} ..."):
            return load(model_name, device=device, dtype=dtype, chat=chat)
    except (LoadError, UnsupportedArchitectureError) as e:
        fail(str(e))


MODEL_HELP = "HF model id, checkpoint directory or .gguf file (default: embedded SmolLM2-135M-Instruct)."


@app.command()
def generate(
    prompts: List[str] = typer.Argument(None, help="Prompt(s); several run as one left-padded batch."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="Text file, one prompt per line (added to the batch)."),
    speedup: Optional[float] = typer.Option(None, "--speedup", "-s", help="Target speedup (>= 1); picks max/min layers (METHOD.md)."),
    max_layers: Optional[int] = typer.Option(None, "--max-layers", help="e_max: layers at step 0 of the decay."),
    min_layers: Optional[int] = typer.Option(None, "--min-layers", help="e_min: floor of the layer budget."),
    warmup_layers: Optional[int] = typer.Option(None, "--warmup-layers", help="Bottom layers that always run (default 1)."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Decode steps over which the budget decays (tokens)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Most tokens generated per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0: off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus mass in (0, 1] (1: off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (same seed, same tokens)."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Use the chat template (default: if the tokenizer has one)."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (texts, finish reasons, statistics) instead of streaming."),
) -> None:
    """Generate with a skip policy, streaming to the terminal, then print the statistics."""
    all_prompts = list(prompts or [])
    if prompts_file is not None:
        if not prompts_file.exists():
            fail(f"--prompts-file {prompts_file} does not exist")
        all_prompts += [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if not all_prompts:
        fail("give at least one prompt (argument) or --prompts-file")
    from .generate import generate as run_generate
    from .sampling import SamplingParams

    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as e:
        fail(str(e))
    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    sk = load_model(model, device, dtype, chat)
    policy = resolve_policy(sk, speedup, max_layers, min_layers, warmup_layers, horizon)
    single = len(all_prompts) == 1

    def show(chunk) -> None:
        if as_json:
            return
        for row, delta in enumerate(chunk.deltas):
            if delta:
                prefix = "" if single else f"[{row}] "
                out.print(f"{prefix}{delta}", end="" if single else "\n", highlight=False, markup=False)

    try:
        result = run_generate(
            sk.adapter, sk.tokenizer, all_prompts, policy=policy, sampling=sampling,
            max_new_tokens=max_new_tokens, stop=stop, chat=sk.chat, on_chunk=show,
        )
    except ValueError as e:
        fail(str(e))
    if as_json:
        print(json.dumps({"texts": result.texts, "finish_reasons": result.finish_reasons,
                          "token_ids": result.token_ids, "stats": result.stats()}))
        return
    out.print()
    if not single:
        out.rule("results")
        for i, text in enumerate(result.texts):
            out.print(f"[bold][{i}][/] ({result.finish_reasons[i]}) {text}", highlight=False)
    s = result.stats()
    err.print(
        f"\n[dim]batch {s['batch_size']} | prompt {s['prompt_tokens']} tok | new {s['new_tokens']} tok | "
        f"TTFT {s['prefill_seconds'] * 1000:.0f} ms | step {s['step_seconds'] * 1000:.1f} ms | "
        f"{s['tokens_per_second']:.1f} tok/s | mean active layers {s['mean_active_layers']:.2f}/{s['num_layers']} | "
        f"theoretical speedup {s['theoretical_speedup']:.2f}x | policy {s['policy']}[/]",
        highlight=False,
    )


@app.command()
def info(model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP)) -> None:
    """Print the model's architecture, layer count and stored skip settings."""
    sk = load_model(model)
    print(json.dumps({"source": sk.source, "model_type": sk.model.config.model_type, "num_layers": sk.num_layers,
                      "policy": sk.policy.to_dict(), "chat": sk.chat, "skip_config": sk.skip_config}, indent=2))


# --- further subcommands (bench, train, eval, serve) are added below ---------------------------


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    speedup: Optional[float] = typer.Option(None, "--speedup", "-s", help="Default target speedup of requests that give none."),
    max_layers: Optional[int] = typer.Option(None, "--max-layers", help="Default e_max."),
    min_layers: Optional[int] = typer.Option(None, "--min-layers", help="Default e_min."),
    warmup_layers: Optional[int] = typer.Option(None, "--warmup-layers", help="Default warm-up layers."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Default horizon (tokens)."),
    name: str = typer.Option("skipdecode", "--name", help="Model name reported by /v1/models."),
    device: str = typer.Option("cpu", "--device", help="torch device."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models)."""
    if not 0 < port < 65536:
        fail(f"--port must be in 1..65535, got {port}")
    sk = load_model(model, device, dtype)
    sk.policy = resolve_policy(sk, speedup, max_layers, min_layers, warmup_layers, horizon)
    import uvicorn

    from .server import create_app

    err.print(f"serving {sk.source} as {name!r} on http://{host}:{port} (policy {sk.policy.to_dict()})")
    uvicorn.run(create_app(sk, name), host=host, port=port, log_level="info")


def main() -> None:
    """Console entry point (``skipdecode``)."""
    app()


if __name__ == "__main__":
    main()
