"""``skipdecode chat``: a multi-turn conversation in the terminal under a skip policy.

Each turn renders the whole conversation so far (an optional system message, then the user and
assistant turns) with the tokenizer's chat template, prefills it at full depth and streams the
answer under the policy; the answer's text is then added to the conversation. The turns run on one
in-flight engine (:class:`~skipdecode.engine.Engine`, one row) whose prefix cache carries over, so
a turn reuses the previous prompt's keys and values (in whole blocks of the cache) and prefills
the rest: the last answer, whose own keys and values lack the layers its steps skipped, and the new
message. The text is the same as after a full prefill.
Every answer starts its schedule at decode step 1, so its first tokens run the policy's widest
steps (the embedded model's 2x: its first 14 tokens at full depth). The conversation is the only
state: ``/reset`` empties it, ``/help`` lists the commands, ``/exit``, ``/quit`` or end of input (Ctrl-D) ends the session,
Ctrl-C stops the current answer (which is then not added; at the prompt it ends the session, exit
code 130). When the conversation and an answer of ``--max-new-tokens`` no longer fit the model's
context, its oldest exchanges (a user turn and its answer) are dropped until they do (a note on
stderr; the system message stays); a message that does not fit alone prints the library's message
and the session goes on.
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional

import typer

from .cli_common import (
    COMPILE_HELP,
    FREQUENCY_PENALTY_HELP,
    PRESENCE_PENALTY_HELP,
    REPETITION_PENALTY_HELP,
    STOP_HELP,
    TEMPERATURE_HELP,
    TOP_K_HELP,
    TOP_P_HELP,
    MODEL_HELP,
    NO_ADAPTER_HELP,
    QUANTIZE_HELP,
    THREADS_HELP,
    check_policy_options,
    err,
    fail,
    load_model,
    out,
    resolve_policy,
    sampling_from_options,
    set_threads,
    stock_weights_at_full_depth,
    stop_from_options,
)

__all__ = ["chat", "CHAT_COMMANDS"]

#: The session commands a line may hold instead of a message.
CHAT_COMMANDS = {"/reset": "start a new conversation", "/exit": "end the session", "/quit": "end the session",
                 "/help": "list these commands"}


def chat(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    speedup: Optional[float] = typer.Option(None, "--speedup", "-s", help="Target speedup (>= 1; default: the model's own policy, the embedded model's 2x)."),
    system: Optional[str] = typer.Option(None, "--system", help="System message that opens the conversation (default: the chat template's own, if any)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens per answer."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: int = typer.Option(0, "--top-k", help=TOP_K_HELP),
    top_p: float = typer.Option(1.0, "--top-p", help=TOP_P_HELP),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed of every answer (int64)."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help=REPETITION_PENALTY_HELP),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help=FREQUENCY_PENALTY_HELP),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help=PRESENCE_PENALTY_HELP),
    stop: List[str] = typer.Option([], "--stop", help=STOP_HELP),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    no_adapter: bool = typer.Option(False, "--no-adapter", help=NO_ADAPTER_HELP),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="After each answer, print its tokens/s, mean active layers and theoretical speedup to stderr."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """Chat in the terminal under a skip policy: multi-turn, streamed, /reset and /exit.

    Each answer starts the schedule again, so its first tokens run the widest steps (the embedded
    model's 2x: the first 14 at full depth); the oldest exchanges are dropped when the
    conversation outgrows the context."""
    set_threads(threads)
    sampling = sampling_from_options(temperature, top_k, top_p, seed, repetition_penalty, frequency_penalty,
                                     presence_penalty)
    stop = stop_from_options(stop)
    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if system is not None and not system.strip():
        fail("--system must hold text (leave it out for the chat template's default)")
    check_policy_options(speedup, None, None, None)
    sk = load_model(model, device, dtype, True, quantize, compile, adapter=not no_adapter)
    if not getattr(sk.tokenizer, "chat_template", None):
        fail(f"--model {model or 'default'}: its tokenizer has no chat template; use `skipdecode generate` for plain prompts")
    policy = resolve_policy(sk, speedup, None, None, None, None)
    sk = stock_weights_at_full_depth(sk, policy, (model, device, dtype, True, quantize, compile))
    opening = [{"role": "system", "content": system}] if system is not None else []
    from .info import describe_policy

    err.print(f"chat: {describe_policy(policy.to_dict(), sk.num_layers)}; {', '.join(CHAT_COMMANDS)}; Ctrl-D ends",
              style="dim", markup=False, highlight=False)
    run_session(sk, dict(policy=policy, sampling=sampling, max_new_tokens=max_new_tokens, stop=stop), opening, stats)


def run_session(sk: Any, settings: dict[str, Any], opening: list[dict], stats: bool) -> int:
    """Read lines from stdin until ``/exit``, ``/quit`` or end of input; answer each message.

    Args:
        sk: the :class:`~skipdecode.model.SkipModel` (with a chat template).
        settings: :func:`skipdecode.generate.generate`'s ``policy``, ``sampling``,
            ``max_new_tokens`` (tokens per answer) and ``stop`` for every answer.
        opening: the messages every conversation starts with (a system message, or none).
        stats: print each answer's statistics to stderr.

    Returns:
        The number of answers given (turns).
    """
    from .engine import Engine

    conversation = list(opening)
    turns = 0
    engine = Engine(sk.adapter, 1)  # its prefix cache keeps the conversation's prompts from turn to turn
    while True:
        line = _read_line()
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            conversation = list(opening)
            err.print("[dim]new conversation[/]")
            continue
        if text.startswith("/") and " " not in text:  # /help, or an unknown command: list them
            known = ", ".join(f"{c} ({w})" for c, w in CHAT_COMMANDS.items())
            err.print(f"commands: {known}" if text == "/help" else f"unknown command {text}: {known}",
                      markup=False, highlight=False)
            continue
        conversation = _fit(sk, conversation, len(opening), text, settings["max_new_tokens"])
        messages = conversation + [{"role": "user", "content": text}]
        answer = _answer(sk, settings, messages, stats, engine)
        if engine.busy:  # an answer stopped by Ctrl-C left its row in the engine
            engine = Engine(sk.adapter, 1)
        if answer is not None:
            conversation = messages + [{"role": "assistant", "content": answer}]
            turns += 1
    return turns


def _fit(sk: Any, conversation: list[dict], kept: int, text: str, max_new_tokens: int) -> list[dict]:
    """``conversation`` without its oldest exchanges (after its first ``kept`` messages) until it,
    the message ``text`` and ``max_new_tokens`` fit the context (:meth:`Adapter.check_context`);
    as it is when they fit, or when nothing is left to drop."""
    from .prompts import encode_prompt

    dropped = 0
    while len(conversation) > kept:
        ids = encode_prompt(sk.tokenizer, conversation + [{"role": "user", "content": text}], chat=True)
        try:
            sk.adapter.check_context(len(ids), max_new_tokens)
            break
        except ValueError:
            conversation = conversation[:kept] + conversation[kept + 2:]  # one user turn and its answer
            dropped += 1
    if dropped:
        err.print(f"(the conversation outgrew the context: its {dropped} oldest exchange(s) dropped)",
                  style="dim", markup=False, highlight=False)
    return conversation


def _read_line() -> str | None:
    """One line of input, after a ``>>>`` prompt on stderr when stdin is a terminal (piped input
    is not echoed, so a prompt would only run into the next stderr line); None at end of input."""
    if sys.stdin.isatty():
        err.print("[bold]>>> [/]", end="")
    try:
        return input()
    except EOFError:
        err.print()
        return None


def _answer(sk: Any, settings: dict[str, Any], messages: list[dict], stats: bool, engine: Any) -> str | None:
    """Stream the answer to ``messages`` to stdout, run on ``engine``; its text, or None when it
    failed (the library's message is printed) or was interrupted (Ctrl-C)."""
    from .inflight import generate_inflight

    def show(chunk) -> None:
        if chunk.deltas[0]:
            out.print(chunk.deltas[0], end="", highlight=False, markup=False)

    try:
        result = generate_inflight(sk.adapter, sk.tokenizer, [messages], chat=True, on_chunk=show, engine=engine,
                                   **settings)
    except ValueError as e:
        err.print(f"error: {e} (/reset starts a new conversation)", markup=False, highlight=False)
        return None
    except KeyboardInterrupt:
        out.print()
        err.print("[dim](answer stopped; not kept in the conversation)[/]")
        return None
    out.print()
    if stats:
        s = result.stats()
        err.print(f"[dim]prompt {s['prompt_tokens']} tok ({s['cached_prompt_tokens']} cached), "
                  f"{s['new_tokens']} tok, {s['tokens_per_second']:.1f} tok/s, "
                  f"{s['mean_active_layers']:.2f}/{sk.num_layers} layers, theoretical {s['theoretical_speedup']:.2f}x, "
                  f"{result.finish_reasons[0]}[/]", highlight=False)
    return result.texts[0]
