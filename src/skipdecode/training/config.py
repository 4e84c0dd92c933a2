"""Training settings: :class:`TrainConfig`, its error type and the policies it trains.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..data import TEMPLATES
from ..policy import LinearDecayPolicy, SkipPolicy, for_speedup, speedup_label, with_full_depth_steps

__all__ = ["TrainConfig", "TrainConfigError", "build_policies", "RESUME_FIELDS", "TEACHER_FORCING_MODES", "TRAIN_SEED_MAX"]

_SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")
_DEVICES = ("cpu", "cuda", "auto")
TEACHER_FORCING_MODES = ("sparse", "masked")
#: Largest training ``seed``: ``accelerate.utils.set_seed`` seeds numpy, which takes 0 .. 2**32 - 1.
TRAIN_SEED_MAX = 2**32 - 1


class TrainConfigError(ValueError):
    """An invalid training setting. ``field`` names the :class:`TrainConfig` field, ``reason``
    says what is wrong; ``str(err)`` is ``f"{field} {reason}"``."""

    def __init__(self, field_name: str, reason: str) -> None:
        self.field = field_name
        self.reason = reason
        super().__init__(f"{field_name} {reason}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one skip-aware fine-tuning run. Validated on construction.

    Schedule (give exactly one of ``speedup``, ``speedups``, ``max_layers``/``min_layers``):
        speedup: target speedup (>= 1) -> :func:`skipdecode.policy.for_speedup`; 1 = full depth.
        speedups: several targets; each optimizer step picks one at random (seeded), so one model
            serves all of them (mixed-policy training). The first is the checkpoint's default.
        max_layers, min_layers: explicit e_max / e_min (layers) of a linear-decay schedule; a
            missing one defaults to L (max) or to ``max_layers`` (min).
        warmup_layers: bottom layers that always run (layers), default 1.
        horizon: decay horizon T (tokens); None: the median response length of the training
            data in tokens (:func:`skipdecode.data.median_response_tokens`; with ``distill`` the
            median length of the teacher's answers).
        full_depth_steps: k >= 0, first decode steps that run every layer before a linear
            decay (:attr:`skipdecode.policy.LinearDecayPolicy.full_depth_steps`; ignored by a
            full-depth schedule). With ``base_prefill`` they run the base weights, as at inference,
            so their positions join the base model's no-grad prefill
            (:func:`skipdecode.training.loss.target_logits`; on-policy answers run them the same way).

    Data:
        task: prompt template of :data:`skipdecode.data.TEMPLATES` (None: the reader's default).
        max_length: longest prompt + response (tokens); longer responses are cut, examples whose
            prompt alone fills it are dropped (counted in the record).
        val_fraction: share of distinct prompts held out for validation, in [0, 1).
        max_val_examples: cap on the validation examples (keeps evaluation cheap).
        skip_bad_rows: drop malformed data rows instead of failing.
        chat: wrap prompts in the tokenizer's chat template (None: the model's setting), exactly as
            :func:`skipdecode.generate.encode_prompts` does at inference.
        response_separator: text put between a plain (non-chat) prompt and its response when
            neither side has whitespace there (default one space).

    Optimisation:
        epochs: passes over the training set (may be fractional); ignored when ``max_steps`` is set.
        max_steps: optimizer steps to run (overrides ``epochs``).
        max_minutes: wall-clock budget of optimizer-step time (minutes; None: no budget). The run
            stops after the first optimizer step that ends past it, then does what the end of a
            run does (final validation, ``final/`` saved, the record says ``stopped_on_budget``).
            The learning-rate schedule is still planned over ``max_steps``/``epochs``, so a run
            stopped by the budget ends mid-schedule. Counted: the time of the optimizer steps
            (forward, backward, optimizer; all invocations of a resumed run); not counted:
            loading, data preparation, validation, checkpoint saving.
        lr: peak learning rate of AdamW. weight_decay: AdamW decoupled weight decay.
        batch_size: examples per micro-batch per process. grad_accum: micro-batches per step.
        lr_scheduler: "cosine", "linear", "constant" or "constant_with_warmup"
            (:func:`transformers.get_scheduler`).
        warmup_ratio: share of steps of linear warm-up; ``warmup_steps`` (if set) overrides it.
        max_grad_norm: clip the global gradient norm to this (0: no clipping).
        gradient_checkpointing: recompute each layer in backward (HF activation checkpointing).
        seed: seeds data order, validation split, policy choice, LoRA init and dropout; in
            [0, :data:`TRAIN_SEED_MAX`] (``accelerate.utils.set_seed`` also seeds numpy, whose
            seeds are 32-bit). Not the sampling seed (:mod:`skipdecode.limits`).
        device: "cpu", "cuda" (Accelerate picks the process's GPU) or "auto".
        bf16: bf16 autocast (GPUs, and CPUs with AMX: 1.45x faster steps on this project's CPU,
            docs/quantization.md; slow on CPUs without AVX-512 bf16).
        teacher_forcing: "sparse" (default): each layer runs only on the prefix of positions whose
            plan includes it (exact; see :func:`skipdecode.forward.skip_forward`); "masked": every
            layer runs on every position and the update is masked (the reference; same values).
        prompt_grad: False: the prompt (all but its last token) runs at full depth under
            ``torch.no_grad()`` and the response positions train against its keys/values (the
            loss value is unchanged; no gradient flows through the prompt's activations).
            Cannot be combined with ``gradient_checkpointing``.
        base_prefill: True: the prompt (every token, its last included) is prefilled by the base
            model with the LoRA adapter switched off, as :func:`skipdecode.load` runs a
            decode-only skip adapter; the adapter trains on the decode positions only, and
            response token 0 (predicted by the prefill) is the base model's. Needs
            ``lora_r`` >= 1 and ``prompt_grad=False``.
        entry_bridge: True: before the first step, fit an entry bridge (an affine map per entry
            layer, :mod:`skipdecode.entry_bridge`; a project extension, not the paper's) by ridge
            least squares on the full-depth hidden states of the training responses, and train
            with it attached (frozen). It is saved with the model and applied by
            :func:`skipdecode.load`.
        entry_bridge_examples: at most this many training examples feed the fit (>= 1).
        entry_bridge_lr: None: the fitted bridge stays frozen; a number > 0: it trains too, with
            this learning rate (AdamW, no weight decay, the run's schedule; its gradient norm is
            clipped on its own, so it never scales down the model's). Needs ``entry_bridge``.

    Distillation:
        distill: train on the full-depth model's own greedy answers (computed before training,
            deduplicated by prompt; gold responses are ignored).
        kl_weight: add ``kl_weight * KL(teacher || student)`` per response token, where the teacher
            is a full-depth frozen model (>= 0; works with or without ``distill``).
        teacher: the KL teacher, a name or path :func:`skipdecode.load` takes (None: the model the
            run starts from, frozen; with LoRA the base with the adapter off). Loaded once,
            frozen, run at full depth under ``torch.no_grad()`` on the run's device and dtype; it
            must have the student's tokenizer vocabulary. Needs ``kl_weight`` > 0. It enters
            only the KL term: ``distill`` answers still come from the starting model.
        distill_max_new_tokens: longest teacher answer (tokens). distill_batch_size: prompts per
            teacher generation batch.
        distill_answers_from: a checkpoint folder of an earlier distillation run whose stored
            teacher answers this run reuses instead of generating them (they must cover every
            prompt the run needs, and its ``distill_max_new_tokens``, ``chat`` and
            ``response_separator`` must be this run's; the starting model must be the same, which
            the caller vouches for). Needs ``distill``. Saves the teacher pass (17 minutes for
            the shipped adapter on 2 CPU cores).
        on_policy: share of each micro-batch's rows, in [0, 1], that get the student's own greedy
            answer under the step's policy (generated at every step, at most
            ``distill_max_new_tokens`` tokens) instead of their stored response, with the teacher's
            argmax at each position as the cross-entropy target (on-policy distillation,
            :mod:`skipdecode.training.on_policy`; a project extension). Needs ``kl_weight`` > 0
            (the teacher's logits).
        position_half_life: None (the paper's loss: every response token weighs the same) or a
            number of tokens > 0: response token i's cross-entropy and KL terms weigh
            ``2 ** (-i / position_half_life)`` and the step's loss is their weighted mean
            (:func:`skipdecode.training.loss.position_weights`; a project extension). Early answer
            tokens then count more: a greedy answer that parts from the teacher's early loses most of
            a sequence-level agreement score. Validation losses stay unweighted.

    LoRA:
        lora_r: LoRA rank (0: full fine-tuning). lora_alpha: scaling numerator (None: 2 * r).
        lora_dropout: dropout on the LoRA path. init_adapter: a LoRA adapter folder (peft's, or a
            packed skip adapter) whose weights start the LoRA, and whose entry bridge starts the
            bridge when ``entry_bridge`` (no fit); its rank and alpha must be the run's.
            base_model: name or path recorded as the adapter's base in skipdecode.json (None:
            where the model was loaded from).

    Run:
        out_dir: run directory (see the module docstring).
        eval_every: validation every N steps (0: only at the start and the end).
        checkpoint_every: checkpoint every N steps (0: only the final model).
        save_total_limit: checkpoints kept (oldest deleted first).
        resume: continue from the newest checkpoint in ``out_dir`` (fresh start if none).
        progress: show a tqdm progress bar (loss, tokens/s, ETA) on stderr.

    Raises:
        TrainConfigError: (a ValueError) a field is invalid; ``.field`` names it.
    """

    out_dir: str
    speedup: float | None = None
    speedups: tuple[float, ...] | None = None
    max_layers: int | None = None
    min_layers: int | None = None
    warmup_layers: int = 1
    horizon: int | None = None
    full_depth_steps: int = 0
    task: str | None = None
    max_length: int = 256
    val_fraction: float = 0.0
    max_val_examples: int = 256
    skip_bad_rows: bool = False
    chat: bool | None = None
    response_separator: str = " "
    epochs: float = 1.0
    max_steps: int | None = None
    max_minutes: float | None = None
    lr: float = 2e-4
    weight_decay: float = 0.0
    batch_size: int = 8
    grad_accum: int = 1
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.05
    warmup_steps: int | None = None
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    teacher_forcing: str = "sparse"
    prompt_grad: bool = True
    base_prefill: bool = False
    entry_bridge: bool = False
    entry_bridge_examples: int = 512
    entry_bridge_lr: float | None = None
    seed: int = 0
    device: str = "cpu"
    bf16: bool = False
    distill: bool = False
    kl_weight: float = 0.0
    teacher: str | None = None
    distill_max_new_tokens: int = 64
    distill_batch_size: int = 16
    distill_answers_from: str | None = None
    on_policy: float = 0.0
    position_half_life: float | None = None
    init_adapter: str | None = None
    lora_r: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    base_model: str | None = None
    eval_every: int = 0
    checkpoint_every: int = 0
    save_total_limit: int = 1
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, (str, os.PathLike)) or not str(self.out_dir).strip():
            _fail("out_dir", f"must be a non-empty path, got {self.out_dir!r}")
        object.__setattr__(self, "out_dir", str(self.out_dir))
        _check_schedule(self)
        _check_data(self)
        _check_optimisation(self)
        _check_distill_lora(self)
        _check_run(self)

    @property
    def needs_val_data(self) -> bool:
        """True when ``eval_every`` > 0 but ``val_fraction`` is 0: validation then needs data given
        apart (``train(..., val_data=...)``); ``train`` raises ``TrainConfigError("eval_every")``
        without it and the CLI, which has no such option, refuses ``--eval-every`` at once."""
        return self.eval_every > 0 and self.val_fraction == 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of all fields."""
        d = asdict(self)
        if d["speedups"] is not None:
            d["speedups"] = list(d["speedups"])
        return d


def _fail(name: str, reason: str) -> None:
    raise TrainConfigError(name, reason)


def _check_int(c: "TrainConfig", name: str, low: int, *, optional: bool = False) -> None:
    v = getattr(c, name)
    if optional and v is None:
        return
    if not _is_int(v) or v < low:
        _fail(name, f"must be an integer >= {low}, got {v!r}")


def _check_bool(c: "TrainConfig", name: str, *, optional: bool = False) -> None:
    v = getattr(c, name)
    if optional and v is None:
        return
    if not isinstance(v, bool):
        _fail(name, f"must be true or false, got {v!r}")


def _check_schedule(c: "TrainConfig") -> None:
    if c.speedup is not None and (not _is_num(c.speedup) or c.speedup < 1):
        _fail("speedup", f"must be a finite number >= 1, got {c.speedup!r}")
    if c.speedups is not None:
        if isinstance(c.speedups, (str, bytes)) or not isinstance(c.speedups, Sequence):
            _fail("speedups", f"must be a list of numbers >= 1, got {c.speedups!r}")
        values = tuple(c.speedups)
        if not values:
            _fail("speedups", "must hold at least one speedup")
        for v in values:
            if not _is_num(v) or v < 1:
                _fail("speedups", f"must hold finite numbers >= 1, got {v!r}")
        if len(set(values)) != len(values):
            _fail("speedups", f"must not repeat a value, got {list(values)}")
        object.__setattr__(c, "speedups", tuple(float(v) for v in values))
    _check_int(c, "max_layers", 1, optional=True)
    _check_int(c, "min_layers", 1, optional=True)
    explicit = c.max_layers is not None or c.min_layers is not None
    layers = "max_layers" if c.max_layers is not None else "min_layers"  # the one given, for the message
    given = [n for n, on in (("speedup", c.speedup is not None), ("speedups", c.speedups is not None),
                             (layers, explicit)) if on]
    if not given:
        _fail("speedup", "is required: give speedup, speedups, or max_layers/min_layers (speedup=1 for full depth)")
    if len(given) > 1:
        _fail(given[1], f"cannot be combined with {given[0]}: give one way to set the schedule")
    if c.max_layers is not None and c.min_layers is not None and c.min_layers > c.max_layers:
        _fail("min_layers", f"must be <= max_layers ({c.max_layers}), got {c.min_layers}")
    _check_int(c, "warmup_layers", 0)
    _check_int(c, "horizon", 1, optional=True)
    _check_int(c, "full_depth_steps", 0)


def _check_data(c: "TrainConfig") -> None:
    if c.task is not None and c.task not in TEMPLATES:
        _fail("task", f"must be one of {', '.join(sorted(TEMPLATES))}, got {c.task!r}")
    _check_int(c, "max_length", 2)
    if not _is_num(c.val_fraction) or not 0 <= c.val_fraction < 1:
        _fail("val_fraction", f"must be in [0, 1), got {c.val_fraction!r}")
    _check_int(c, "max_val_examples", 1)
    _check_bool(c, "skip_bad_rows")
    _check_bool(c, "chat", optional=True)
    if not isinstance(c.response_separator, str):
        _fail("response_separator", f"must be a string, got {c.response_separator!r}")


def _check_optimisation(c: "TrainConfig") -> None:
    if not _is_num(c.epochs) or c.epochs <= 0:
        _fail("epochs", f"must be a number > 0, got {c.epochs!r}")
    _check_int(c, "max_steps", 1, optional=True)
    if c.max_minutes is not None and (not _is_num(c.max_minutes) or c.max_minutes <= 0):
        _fail("max_minutes", f"must be a number > 0 (minutes), got {c.max_minutes!r}")
    if not _is_num(c.lr) or c.lr <= 0:
        _fail("lr", f"must be a finite number > 0, got {c.lr!r}")
    if not _is_num(c.weight_decay) or c.weight_decay < 0:
        _fail("weight_decay", f"must be a number >= 0, got {c.weight_decay!r}")
    _check_int(c, "batch_size", 1)
    _check_int(c, "grad_accum", 1)
    if c.lr_scheduler not in _SCHEDULERS:
        _fail("lr_scheduler", f"must be one of {', '.join(_SCHEDULERS)}, got {c.lr_scheduler!r}")
    if not _is_num(c.warmup_ratio) or not 0 <= c.warmup_ratio < 1:
        _fail("warmup_ratio", f"must be in [0, 1), got {c.warmup_ratio!r}")
    _check_int(c, "warmup_steps", 0, optional=True)
    if not _is_num(c.max_grad_norm) or c.max_grad_norm < 0:
        _fail("max_grad_norm", f"must be a number >= 0 (0: no clipping), got {c.max_grad_norm!r}")
    _check_bool(c, "gradient_checkpointing")
    _check_int(c, "seed", 0)
    if c.seed > TRAIN_SEED_MAX:  # accelerate's set_seed seeds numpy too, which takes 32 bits only
        _fail("seed", f"must be an integer in [0, {TRAIN_SEED_MAX}] (2**32 - 1: numpy's seed range), got {c.seed!r}")
    if not isinstance(c.device, str) or c.device not in _DEVICES:
        _fail("device", f"must be one of {', '.join(_DEVICES)}, got {c.device!r}")
    _check_bool(c, "bf16")
    if c.teacher_forcing not in TEACHER_FORCING_MODES:
        _fail("teacher_forcing", f"must be one of {', '.join(TEACHER_FORCING_MODES)}, got {c.teacher_forcing!r}")
    _check_bool(c, "prompt_grad")
    _check_bool(c, "base_prefill")
    _check_bool(c, "entry_bridge")
    _check_int(c, "entry_bridge_examples", 1)
    speeds = list(c.speedups) if c.speedups else [c.speedup]
    if c.entry_bridge and c.max_layers is None and c.min_layers is None and all(v == 1 for v in speeds):
        _fail("entry_bridge", "needs a skip schedule (a speedup above 1): at full depth no token jumps, "
                              "so there is nothing to bridge")
    if c.entry_bridge_lr is not None:
        if isinstance(c.entry_bridge_lr, bool) or not isinstance(c.entry_bridge_lr, (int, float)) \
                or not math.isfinite(c.entry_bridge_lr) or c.entry_bridge_lr <= 0:
            _fail("entry_bridge_lr", f"must be a finite number > 0 (leave it unset to keep the fitted bridge), "
                                     f"got {c.entry_bridge_lr!r}")
        if not c.entry_bridge:
            _fail("entry_bridge_lr", "needs entry_bridge=true, i.e. --entry-bridge (there is no bridge to train)")
    if c.base_prefill and c.prompt_grad:
        _fail("base_prefill", "needs prompt_grad=false, i.e. --no-prompt-grad (the base model prefills the prompt "
                              "without gradient)")
    if not c.prompt_grad and c.gradient_checkpointing:
        _fail("gradient_checkpointing", "cannot be combined with prompt_grad=false, i.e. --no-prompt-grad (Hugging "
                                        "Face checkpointed layers drop the prompt's cached keys/values)")


def _check_path(c: "TrainConfig", name: str, what: str) -> bool:
    """An optional path field: a PathLike becomes its string; not None and not a non-empty string
    fails naming the field. Returns whether the field is set."""
    value = getattr(c, name)
    if value is None:
        return False
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
        object.__setattr__(c, name, value)
    if not isinstance(value, str) or not value.strip():
        _fail(name, f"must be {what}, got {value!r}")
    return True


def _check_distill_lora(c: "TrainConfig") -> None:
    _check_bool(c, "distill")
    if not _is_num(c.kl_weight) or c.kl_weight < 0:
        _fail("kl_weight", f"must be a number >= 0, got {c.kl_weight!r}")
    if _check_path(c, "teacher", "a model name or path"):
        if c.kl_weight == 0:
            _fail("teacher", "needs kl_weight > 0, i.e. --kl-weight W (the teacher only enters the KL term)")
    _check_int(c, "distill_max_new_tokens", 1)
    _check_int(c, "distill_batch_size", 1)
    if _check_path(c, "distill_answers_from", "a checkpoint folder"):
        if not c.distill:
            _fail("distill_answers_from", "needs distill=True, i.e. --distill (it supplies the teacher's answers)")
        if not os.path.isdir(c.distill_answers_from):
            _fail("distill_answers_from", f"must be an existing checkpoint folder, got {c.distill_answers_from!r}")
    if not _is_num(c.on_policy) or not 0 <= c.on_policy <= 1:
        _fail("on_policy", f"must be a share in [0, 1], got {c.on_policy!r}")
    if c.on_policy > 0 and c.kl_weight == 0:
        _fail("on_policy", "needs kl_weight > 0, i.e. --kl-weight W (its targets are the teacher's choices)")
    if c.position_half_life is not None and (not _is_num(c.position_half_life) or not c.position_half_life > 0
                                             or not math.isfinite(c.position_half_life)):
        _fail("position_half_life", f"must be a number of tokens > 0 (or unset), got {c.position_half_life!r}")
    _check_int(c, "lora_r", 0)
    if _check_path(c, "init_adapter", "a LoRA adapter folder"):
        if c.lora_r == 0:
            _fail("init_adapter", "needs lora_r >= 1 (it starts a LoRA adapter)")
        if not os.path.isdir(c.init_adapter):
            _fail("init_adapter", f"must be an existing folder, got {c.init_adapter!r}")
    if c.lora_alpha is not None and (not _is_num(c.lora_alpha) or c.lora_alpha <= 0):
        _fail("lora_alpha", f"must be a number > 0, got {c.lora_alpha!r}")
    if not _is_num(c.lora_dropout) or not 0 <= c.lora_dropout < 1:
        _fail("lora_dropout", f"must be in [0, 1), got {c.lora_dropout!r}")
    if c.lora_r == 0 and (c.lora_alpha is not None or c.lora_dropout):
        _fail("lora_alpha" if c.lora_alpha is not None else "lora_dropout", "needs lora_r >= 1 (a LoRA adapter)")
    if c.base_prefill and c.lora_r == 0:
        _fail("base_prefill", "needs lora_r >= 1 (the base model is the LoRA adapter switched off)")
    if c.base_model is not None and (not isinstance(c.base_model, str) or not c.base_model):
        _fail("base_model", f"must be a non-empty string, got {c.base_model!r}")


def _check_run(c: "TrainConfig") -> None:
    _check_int(c, "eval_every", 0)
    _check_int(c, "checkpoint_every", 0)
    _check_int(c, "save_total_limit", 1)
    _check_bool(c, "resume")
    _check_bool(c, "progress")



# Fields that must match to resume a run (everything that shapes data order, model or schedule).
RESUME_FIELDS = (
    "speedup", "speedups", "max_layers", "min_layers", "warmup_layers", "horizon", "full_depth_steps", "task",
    "max_length",
    "val_fraction", "max_val_examples", "chat", "response_separator", "epochs", "max_steps", "lr",
    "weight_decay", "batch_size", "grad_accum", "lr_scheduler", "warmup_ratio", "warmup_steps",
    "max_grad_norm", "seed", "distill", "kl_weight", "teacher", "distill_max_new_tokens", "lora_r", "lora_alpha",
    "lora_dropout", "skip_bad_rows", "prompt_grad", "base_prefill", "entry_bridge", "entry_bridge_examples",
    "entry_bridge_lr", "on_policy", "init_adapter", "position_half_life",
)


def build_policies(config: TrainConfig, num_layers: int, horizon: int) -> list[tuple[str, SkipPolicy]]:
    """The ``(label, policy)`` pairs trained by ``config`` for a model of ``num_layers`` layers.

    Labels are the speedups as text ("2", "2.5") or "custom" for explicit ``max_layers``/
    ``min_layers``. The first pair is the checkpoint's default policy.

    Args:
        config: the run's settings.
        num_layers: L (layers).
        horizon: T (tokens), >= 1.

    Raises:
        TrainConfigError: a schedule the model cannot run (e.g. a speedup above L / (w + 1));
            ``.field`` names the offending setting.
    """
    return [(label, with_full_depth_steps(p, config.full_depth_steps))
            for label, p in _build_policies(config, num_layers, horizon)]


def _build_policies(config: TrainConfig, num_layers: int, horizon: int) -> list[tuple[str, SkipPolicy]]:
    """:func:`build_policies` before ``full_depth_steps``."""
    field_of = "speedups" if config.speedups else "speedup"
    try:
        if config.speedups:
            return [(speedup_label(s), for_speedup(num_layers, s, horizon, warmup_layers=config.warmup_layers))
                    for s in config.speedups]
        if config.speedup is not None:
            return [(speedup_label(config.speedup),
                     for_speedup(num_layers, config.speedup, horizon, warmup_layers=config.warmup_layers))]
        e_max = config.max_layers if config.max_layers is not None else num_layers
        e_min = config.min_layers if config.min_layers is not None else e_max
        return [("custom", LinearDecayPolicy(num_layers=num_layers, max_layers=e_max, min_layers=e_min,
                                             warmup_layers=config.warmup_layers, horizon=horizon))]
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        if name == "warmup_layers" and "min_layers" in rest and config.min_layers is None:
            rest += "; min_layers defaults to max_layers"  # the floor the caller did not give
        if name in ("max_layers", "min_layers", "warmup_layers", "horizon"):
            raise TrainConfigError(name, f"{rest} (model has {num_layers} layers)") from None
        raise TrainConfigError(field_of, f"{rest} (model has {num_layers} layers)") from None


def resolve_device(device: str) -> str:
    """``TrainConfig.device`` as a torch device name: ``auto`` is cuda when torch sees one, else cpu.

    Raises:
        TrainConfigError: (field ``device``) ``cuda`` without a CUDA device."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError("device", "is 'cuda' but torch sees no CUDA device")
    return device
