"""``SkipModel``: a Hugging Face causal LM, its tokenizer, its adapter and its skip policy."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from .adapters import get_adapter
from .generate import GenerationResult, StreamChunk, check_choices, generate, stream_generate
from .jsonio import dump
from .limits import check_stop
from .logprobs import check_logprobs
from .skip_config import weight_checksums
from .policy import SkipPolicy, check_policy, for_speedup, with_full_depth_steps
from .prompts import Prompt
from .sampling import SamplingParams

__all__ = ["SkipModel", "SKIP_CONFIG_NAME", "apply_umask", "write_json_atomic"]

SKIP_CONFIG_NAME = "skipdecode.json"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or a folder and everything under it) the modes a plain ``open`` /
    ``mkdir`` would have given it under the process umask (files 0o666, folders 0o777, less the
    umask). ``tempfile.mkstemp``/``mkdtemp``, used for atomic writes, create them private (0o600 /
    0o700), which would leave checkpoints unreadable by other users or containers."""
    mask = _umask()
    path = Path(path)
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            os.chmod(root, 0o777 & ~mask)
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as strict JSON (non-finite floats as null, :mod:`skipdecode.jsonio`) to
    ``path`` atomically (temp file in the same folder + rename), with the mode a plain ``open``
    would give it (:func:`apply_umask`).

    Raises:
        OSError: the folder cannot be written, or ``path`` is a folder (IsADirectoryError; the
            temp file is removed).
        TypeError: ``data`` holds an object JSON cannot represent.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:  # e.g. ``path`` is a folder: no temp file is left beside it
        Path(tmp).unlink(missing_ok=True)
        raise


class SkipModel:
    """A model ready for SkipDecode generation. Build it with :func:`skipdecode.load`.

    Args:
        model: HF ``*ForCausalLM`` (any registered architecture).
        tokenizer: its tokenizer.
        policy: default :class:`~skipdecode.policy.SkipPolicy` (None: full depth).
        chat: wrap prompts in the tokenizer's chat template by default.
        source: where the model came from (for reports).
        skip_config: the checkpoint's ``skipdecode.json`` content, if any.

    Raises:
        UnsupportedArchitectureError: the architecture has no adapter.
        ValueError: ``policy`` is not None or a policy object, or its ``num_layers`` differs from
            the model's layer count (:func:`skipdecode.policy.check_policy`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        policy: SkipPolicy | None = None,
        chat: bool = False,
        source: str = "",
        skip_config: dict | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = get_adapter(model)
        self.num_layers = self.adapter.num_layers
        self.policy = check_policy(policy, self.num_layers)
        self.chat = chat
        self.source = source
        self.skip_config = dict(skip_config or {})
        #: :class:`skipdecode.compiled.CompileReport` when loaded with ``compile=True``, else None
        self.compile_report: Any = None
        #: the folder whose entry bridge :func:`skipdecode.load` attached (:mod:`skipdecode.entry_bridge`), else None
        self.entry_bridge_path: Path | None = None

    @property
    def quantize(self) -> str | None:
        """``"int8"``/``"int4"`` when the weights are quantized (``load(quantize=...)``), else None."""
        from .quantize import quantized_mode

        return quantized_mode(self.model)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the model's parameters and buffers (each storage once): ``{"total",
        "quantized", "float"}`` (see :func:`skipdecode.quantize.resident_bytes`)."""
        from .quantize import resident_bytes

        return resident_bytes(self.model)

    @property
    def horizon(self) -> int:
        """Default horizon T (tokens) of ``--speedup`` schedules the checkpoint was not trained
        for: its ``skipdecode.json`` ``horizon`` (the training answers' median length), else the
        default policy's, else 32. A shipped schedule re-timed without retraining
        (:func:`skipdecode.skip_adapter.reschedule_adapter`) keeps the checkpoint's."""
        saved = self.skip_config.get("horizon")
        if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1:
            return saved
        return int(getattr(self.policy, "horizon", 32))

    def trained_policy(self, speedup: float) -> SkipPolicy | None:
        """The schedule this checkpoint was trained with for ``speedup`` (a ratio, e.g. 2), or None.

        It is the entry of the checkpoint's ``skipdecode.json`` ``policies`` whose label is the
        speedup as text (``format(speedup, "g")``: ``"2"``, ``"2.5"``). ``skipdecode train
        --speedups`` writes those labels; an explicit schedule (``--max-layers/--min-layers``,
        labelled ``"custom"``) gets one when it is installed with ``--as-speedup``
        (:func:`skipdecode.skip_adapter.install_adapter`). None for a non-number, a speedup <= 1,
        or a label the checkpoint does not have.

        Raises:
            ValueError: the entry is not a valid policy for this model (names the label).
        """
        from .policy import policy_from_dict, speedup_label

        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not 1 < speedup < float("inf"):
            return None  # for_speedup reports a bad value; 1 is full depth
        label = speedup_label(speedup)
        entry = (self.skip_config.get("policies") or {}).get(label)
        if entry is None:
            return None
        try:
            policy = check_policy(policy_from_dict(entry), self.num_layers)
        except ValueError as e:
            raise ValueError(f"skipdecode.json policies[{label!r}]: {e}") from None
        return policy

    def policy_for(self, speedup: float | None = None, horizon: int | None = None, **fields: int) -> SkipPolicy:
        """A policy for this model: ``speedup``, explicit ``max_layers``/``min_layers``/
        ``warmup_layers``/``full_depth_steps``/``horizon`` fields (the others kept from a
        linear-decay default policy), or (neither) the default policy.

        A ``speedup`` resolves to the schedule the checkpoint was trained with for it
        (:meth:`trained_policy`), unless a ``horizon`` or ``warmup_layers`` is given that differs
        from that schedule's; otherwise to :func:`~skipdecode.policy.for_speedup` (mean budget
        ``L / speedup`` over the horizon, docs/method.md "Target speedup").

        Raises:
            ValueError: invalid values (names the field).
        """
        from .policy import LinearDecayPolicy

        if speedup is not None and (fields.get("max_layers") is not None or fields.get("min_layers") is not None):
            raise ValueError("give either speedup or max_layers/min_layers, not both")
        horizon_given = horizon is not None
        if horizon_given and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
            raise ValueError(f"horizon must be an integer >= 1, got {horizon!r}")
        horizon = horizon if horizon_given else self.horizon
        if speedup is not None:
            return with_full_depth_steps(self._for_speedup(speedup, horizon, horizon_given, fields),
                                         fields.get("full_depth_steps"))
        given = {k: v for k, v in fields.items() if v is not None}
        # an explicit horizon alone re-times a linear-decay default instead of being ignored
        if given or (horizon_given and isinstance(self.policy, LinearDecayPolicy)):
            base = self.policy if isinstance(self.policy, LinearDecayPolicy) else None
            params = {
                "max_layers": base.max_layers if base else self.num_layers,
                "min_layers": base.min_layers if base else self.num_layers,
                "warmup_layers": base.warmup_layers if base else 1,
                "full_depth_steps": base.full_depth_steps if base else 0,
            }
            params.update(given)
            if "min_layers" not in given and params["min_layers"] > params["max_layers"]:
                params["min_layers"] = params["max_layers"]  # --max-layers alone: a constant budget
            if base is None and "max_layers" not in given and "min_layers" not in given:
                raise ValueError(
                    f"{'/'.join(given)} alone gives no skipping on a full-depth model: add speedup or "
                    "max_layers/min_layers"
                )
            if not horizon_given and base is not None:
                horizon = base.horizon  # kept from the default policy, as the other fields
            return LinearDecayPolicy(num_layers=self.num_layers, horizon=horizon, **params)
        if horizon_given:
            raise ValueError(
                "horizon alone gives no skipping on a full-depth model: add speedup or max_layers/min_layers"
            )
        return self.policy

    def _for_speedup(self, speedup: float, horizon: int, horizon_given: bool, fields: dict) -> SkipPolicy:
        """:meth:`policy_for`'s ``speedup`` case: the trained schedule for it when the horizon and
        warm-up agree with it, else :func:`~skipdecode.policy.for_speedup`."""
        warmup = fields.get("warmup_layers")  # 0 is a value (no warm-up), only None means "default"
        trained = self.trained_policy(speedup)
        if trained is not None and (not horizon_given or horizon == getattr(trained, "horizon", horizon)) \
                and (warmup is None or warmup == getattr(trained, "warmup_layers", warmup)):
            return trained
        return for_speedup(self.num_layers, speedup, horizon, warmup_layers=1 if warmup is None else warmup)

    def _kwargs(self, policy, temperature, top_k, top_p, seed, chat, penalties: dict) -> dict:
        policy = check_policy(self.policy if policy is None else policy, self.num_layers)
        return dict(
            policy=policy,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **penalties),
            chat=self.chat if chat is None else chat,
        )

    def generate(
        self,
        prompts: str | Sequence[Prompt],
        *,
        max_new_tokens: int = 64,
        policy: SkipPolicy | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        stop: Sequence[str] | str = (),
        chat: bool | None = None,
        max_batch_size: int | None = None,
        cohort_size: int = 1,
        prefix_cache: bool | int = True,
        logprobs: int | None = None,
        n: int = 1,
    ) -> GenerationResult:
        """Generate for one prompt or a batch (see :func:`skipdecode.generate.generate`); each
        prompt is a string, a conversation (list of ``{"role", "content"}`` messages) or a list of
        token ids, encoded by :func:`skipdecode.prompts.encode_prompt`. ``max_batch_size`` (rows)
        runs the prompts with in-flight batching, waiting prompts joining in cohorts of at least
        ``cohort_size`` rows and, with ``prefix_cache`` (default on), reusing the K/V of prompt
        prefixes they share (:class:`skipdecode.engine.Engine`). ``logprobs`` n (0-20) fills the
        result's ``logprobs`` (per prompt, a :class:`~skipdecode.logprobs.TokenLogprobs` per text
        token: its log-probability under the layers that ran for it and its n most likely
        alternatives, as vLLM's ``SamplingParams(logprobs=n)``).
        ``repetition_penalty`` (Hugging Face's, 1: off), ``frequency_penalty`` and
        ``presence_penalty`` (OpenAI's, -2..2, 0: off): :class:`~skipdecode.sampling.SamplingParams`.
        ``n`` choices per prompt (vLLM's and OpenAI's ``n``, Hugging Face's
        ``num_return_sequences``): the result's row ``k * n + j`` is prompt k's j-th, sampled
        with seed ``seed + j`` (:func:`skipdecode.generate.expand_choices`).

        Returns a :class:`GenerationResult` with texts, token ids, finish reasons and statistics.
        Raises ValueError on bad arguments (names the field), among them a ``policy`` that is not
        None (the model's policy) or a policy object (:func:`skipdecode.policy.check_policy`).
        """
        return generate(
            self.adapter,
            self.tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            stop=stop,
            max_batch_size=max_batch_size,
            cohort_size=cohort_size,
            prefix_cache=prefix_cache,
            logprobs=logprobs,
            n=n,
            **self._kwargs(policy, temperature, top_k, top_p, seed, chat, dict(
                repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty)),
        )

    def stream_generate(
        self,
        prompts: str | Sequence[Prompt],
        *,
        max_new_tokens: int = 64,
        policy: SkipPolicy | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        stop: Sequence[str] | str = (),
        chat: bool | None = None,
        logprobs: int | None = None,
        n: int = 1,
    ) -> Iterator[StreamChunk]:
        """Stream :class:`StreamChunk` text deltas per step (see :func:`stream_generate`).

        ``logprobs`` n (0-20): each chunk's ``logprobs`` (:class:`StreamChunk`). ``n`` choices
        per prompt: chunks hold ``len(prompts) * n`` rows, as :meth:`generate`'s result.

        Raises ValueError at once (not at the first step) for a bad ``stop``
        (:func:`skipdecode.limits.check_stop`), ``policy`` (:func:`skipdecode.policy.check_policy`),
        ``logprobs`` (:func:`skipdecode.logprobs.check_logprobs`) or ``n``
        (:func:`skipdecode.generate.check_choices`); other bad arguments when iteration starts."""
        stop = check_stop(stop)
        check_logprobs(logprobs)
        check_choices(n)
        if isinstance(prompts, str):
            prompts = [prompts]
        return stream_generate(
            self.adapter,
            self.tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            stop=stop,
            logprobs=logprobs,
            n=n,
            **self._kwargs(policy, temperature, top_k, top_p, seed, chat, dict(
                repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty)),
        )

    def save_pretrained(self, directory: str | os.PathLike, extra: dict | None = None) -> Path:
        """Write a normal HF checkpoint plus ``skipdecode.json`` (policy, chat flag, ``extra``, and
        ``weights_sha256``: the sha256 of each weight file, which :func:`skipdecode.load` checks).

        The directory is written under a temporary name and renamed into place, so a crash never
        leaves a half-written checkpoint. Returns the directory path. Column-major weights
        (:func:`skipdecode.layout.column_major`) are made contiguous first, as safetensors
        requires; the weight-first layers of :func:`skipdecode.load` stay as they are.

        Raises:
            ValueError: the weights are quantized (``load(quantize=...)``): save the float model
                and quantize it at load time instead; or the model runs a decode-only skip adapter.
        """
        if self.quantize is not None:
            raise ValueError(
                f"cannot save a {self.quantize}-quantized model: save the float model and pass quantize= to load()"
            )
        from .lowrank import has_decode_only_adapter

        if has_decode_only_adapter(self.model):
            raise ValueError(
                "cannot save a model that runs a decode-only skip adapter (its prefill uses the base weights, "
                "which one checkpoint cannot hold): save load(..., adapter=False) and keep the adapter folder"
            )
        from .layout import contiguous_weights

        contiguous_weights(self.model)  # safetensors stores contiguous tensors
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        config = dict(self.skip_config)
        config.update(policy=self.policy.to_dict(), chat=self.chat, num_layers=self.num_layers)
        config.update(extra or {})
        from .entry_bridge import entry_bridge_of

        bridge = entry_bridge_of(self.model)
        config.pop("entry_bridge", None)
        if bridge is not None:  # a project extension (skipdecode.entry_bridge), loaded back by load()
            config["entry_bridge"] = bridge.save(tmp)
        config["weights_sha256"] = weight_checksums(tmp)  # verified by load() (skipdecode.skip_config)
        write_json_atomic(tmp / SKIP_CONFIG_NAME, config)
        apply_umask(tmp)
        if target.exists():
            old = target.with_name(target.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        return target

    def __repr__(self) -> str:
        return f"SkipModel(source={self.source!r}, num_layers={self.num_layers}, policy={self.policy})"
