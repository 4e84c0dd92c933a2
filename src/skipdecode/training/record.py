"""The record of a training run (:class:`TrainResult`, ``out_dir/train_record.json``).

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["TrainResult", "skip_config_record"]


@dataclass
class TrainResult:
    """The record of a run (also written to ``out_dir/train_record.json``).

    Attributes:
        out_dir: the run directory. final_dir: the trained model's directory (``out_dir/final``).
        steps: optimizer steps done (all invocations). total_steps: steps planned.
        examples_seen, tokens_seen, target_tokens_seen: examples, real tokens (prompt + response)
            and response tokens processed by all processes, all invocations.
        wall_seconds: wall time of this invocation (s), loading and saving included.
        train_seconds: time spent in optimizer steps in this invocation (s).
        tokens_per_second, target_tokens_per_second: tokens (all / response) processed per second
            of optimizer-step time in this invocation.
        train_log: per step ``{"step", "loss" (mean CE per response token, nats), "kl", "lr",
            "speedup" (the policy label), "tokens", "seconds"}``.
        val_log: per evaluation ``{"step", "loss" (mean over policies), "by_policy": {label: loss}}``.
        policy: the default policy's dict. policies: ``{label: policy dict}``. horizon: T (tokens).
        num_layers: L. lora: LoRA run. distill: distillation run.
        data: what the run read and saw (spec, sha256, counts, examples/epochs seen).
        resumed_from: the checkpoint this invocation continued, or None.
        config: the :class:`TrainConfig` as a dict.
        train_seconds_total: optimizer-step time of all invocations (s), what ``max_minutes`` counts.
        stopped_on_budget: the run stopped on ``max_minutes`` before ``total_steps`` (it ended
            mid-schedule; ``final_dir`` still holds the model of step ``steps``).
        stopped_at_step: the step it stopped after on the budget (== ``steps``), else None.
        session_steps, session_tokens, session_target_tokens: optimizer steps, real tokens and
            response tokens of this invocation alone (a resume counts from its checkpoint; 0 when
            it resumed a run that had already finished). ``steps``, ``tokens_seen`` and
            ``target_tokens_seen`` are the run's totals; the rates above are this invocation's.

    ``train_record.json`` holds :meth:`to_dict` with its paths made portable
    (:func:`skipdecode.paths.portable_here`); the object keeps them as the run was given them.
    """

    out_dir: str
    final_dir: str | None
    steps: int
    total_steps: int
    examples_seen: int
    tokens_seen: int
    target_tokens_seen: int
    wall_seconds: float
    train_seconds: float
    tokens_per_second: float
    target_tokens_per_second: float
    train_log: list[dict] = field(default_factory=list)
    val_log: list[dict] = field(default_factory=list)
    policy: dict = field(default_factory=dict)
    policies: dict = field(default_factory=dict)
    horizon: int = 0
    num_layers: int = 0
    lora: bool = False
    distill: bool = False
    data: dict = field(default_factory=dict)
    resumed_from: str | None = None
    config: dict = field(default_factory=dict)
    train_seconds_total: float = 0.0
    stopped_on_budget: bool = False
    stopped_at_step: int | None = None
    session_steps: int = 0
    session_tokens: int = 0
    session_target_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict."""
        return asdict(self)


def skip_config_record(extra: dict[str, Any], base_model: str | None) -> dict[str, Any]:
    """The run's part of a saved ``skipdecode.json`` (``extra``) with portable paths
    (:func:`skipdecode.paths.portable_here`: no absolute path of this machine), and
    ``base_model`` set to ``base_model`` as :func:`skipdecode.paths.loadable_path` writes it: a
    LoRA adapter's ``base_model`` is where :func:`skipdecode.load` finds its base, so a local
    folder is written relative only when that relative path, read from the current directory,
    still names it (:func:`skipdecode.load` also looks a relative base up from the run folder's
    ancestors, which hold the folder it ran in when ``--out`` was relative).
    A model id or None is kept as it is."""
    from ..paths import loadable_path, portable_here

    out = portable_here(extra)
    out["base_model"] = loadable_path(base_model) if base_model else base_model
    return out
