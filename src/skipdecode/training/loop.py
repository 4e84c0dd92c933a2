"""The training loop: :func:`train` (docs/method.md "Training: the model must learn the schedule").

The loop runs on Hugging Face Accelerate, so ``accelerate launch`` / ``torchrun`` runs it
data-parallel unchanged: the loss is computed inside an ``nn.Module``
(:class:`~skipdecode.training.loss.SkipLossModule`) whose forward is the prepared (DDP, autocast)
one. The data order is a pure function of ``seed``: each optimizer step takes the next
``batch_size * num_processes * grad_accum`` indices of a stream of seeded per-epoch permutations,
which makes resuming reproduce the uninterrupted run exactly.

**Gradient checkpointing** (project choice): Hugging Face's ``activation_checkpointing_enable``
(``gradient_checkpointing_enable`` on older versions) with ``use_reentrant=False``. Every decoder
layer is a ``GradientCheckpointingLayer`` whose ``forward`` checkpoints itself, and our loop calls
the stock layer modules, so the loop honours it with no layer code copied.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..adapters import Adapter, get_adapter
from ..data import Example
from ..model import SkipModel
from ..policy import SkipPolicy
from ..paths import first_existing, remove_new_empty_dirs
from . import checkpoint as ck
from .batching import Batch, TokenizedExample, _hash_examples, _Order, _policy_index, build_layer_mask, collate
from .config import TrainConfig, TrainConfigError, build_policies, resolve_device
from .loss import SkipLossModule, position_weights, target_logits
from .prepare import choose_horizon, load_run_data, teacher_answers, tokenize_run
from .record import TrainResult, skip_config_record
from .start import prepare_start_model, trainable_for_full_fine_tuning
from ..peft_compat import quiet_peft_save_lookup
from ..generate import _eos_ids
from ..loading import warn_if_slow_bfloat16
from .on_policy import load_init_bridge, load_init_lora, on_policy_rows, on_policy_targets, student_answers
from .teacher import load_teacher

__all__ = ["train"]

log = ck.log


class _Run:
    """One invocation of :func:`train`: its settings, data, model, optimizer and logs."""

    def __init__(self, model: Any, config: TrainConfig) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.wall_start = time.perf_counter()
        self.config = config
        self.device = resolve_device(config.device)
        self.out_dir = Path(config.out_dir)
        if isinstance(model, SkipModel):
            self.sk = model
        else:
            from ..loading import load

            self.sk = load(model, adapter=False)  # the stock weights, never a shipped skip adapter
        self.base_name = config.base_model or ck._base_model_name(self.sk, model)
        prepare_start_model(self.sk, self.base_name, config)  # before any data work
        self.tokenizer = self.sk.tokenizer
        self.chat = self.sk.chat if config.chat is None else config.chat
        self.num_layers = self.sk.num_layers
        self.eos_ids = _eos_ids(self.tokenizer, self.sk.model)  # as generate() stops (on-policy answers)
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        max_positions = self.sk.adapter.max_positions
        if max_positions is not None and config.max_length > max_positions:
            raise TrainConfigError("max_length", f"must be <= the model's context of {max_positions} positions, "
                                                 f"got {config.max_length}")
        set_seed(config.seed)
        if config.bf16 and self.device == "cpu":
            warn_if_slow_bfloat16("bf16 autocast (bf16=True)")
        self.accelerator = Accelerator(cpu=self.device == "cpu", mixed_precision="bf16" if config.bf16 else "no")
        self.main = self.accelerator.is_main_process
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched != self.world:  # e.g. an earlier PartialState() fixed a non-distributed state
            raise RuntimeError(f"launched with WORLD_SIZE={launched} but Accelerate runs {self.world} process(es): "
                               "the processes would train independently")
        if self.main:
            ck.check_out_dir(self.out_dir)
        self.ckpt, self.saved = ck.find_resume_checkpoint(self.out_dir, config, self.world, main=self.main)
        self.train_log: list[dict] = []
        self.val_log: list[dict] = []
        self.totals = {"tokens": 0, "targets": 0}
        self.spent_seconds = 0.0  # optimizer-step time of all invocations (s): the max_minutes budget
        self.stopped_on_budget = False
        self.start_step = 0
        self.peft_model = None
        self.bridge_record: dict[str, Any] | None = None
        self.bridge: nn.Module | None = None
        self.bridge_params: list[nn.Parameter] = []  # trained bridge parameters (entry_bridge_lr)
        # a separate KL teacher: loaded once, before any data work, so a bad one fails early
        self.own_teacher = load_teacher(config.teacher, self.sk, self.accelerator.device) if config.teacher else None

    # ---- data ---------------------------------------------------------------------------
    def prepare_data(self, data: Any, val_data: Any) -> None:
        """Examples, data order, distillation answers, token ids, horizon and policies."""
        c = self.config
        self.rd = load_run_data(data, val_data, c, self.tokenizer, self.chat)
        self.n_train = len(self.rd.train_raw)
        self.step_examples = c.batch_size * self.world * c.grad_accum
        self.total_steps = c.max_steps if c.max_steps is not None else max(
            1, math.ceil(c.epochs * self.n_train / self.step_examples))
        self.order = _Order(self.n_train, c.seed)
        if c.distill:
            self.rd.answers = self._distill_answers()
        self.train_items = tokenize_run(self.rd, self.rd.train_raw, c, self.tokenizer, self.chat)
        self.val_items = [x for x in tokenize_run(self.rd, self.rd.val_raw, c, self.tokenizer, self.chat)
                          if x is not None]
        self.data_hash = _hash_examples([x for x in self.train_items if x is not None])
        ck.check_same_data(self.ckpt, self.saved, self.data_hash, self.rd.info)  # a resume reads its data again
        self.horizon = choose_horizon(self.rd, c, self.tokenizer)
        self.policies = build_policies(c, self.num_layers, self.horizon)
        self.labels = [label for label, _ in self.policies]

    def _distill_answers(self) -> dict[str, list[int]]:
        """Teacher answers: from the checkpoint on resume, else from ``distill_answers_from``, else
        generated before any weight changes."""
        c = self.config
        if self.ckpt is not None:
            return ck.load_distill_answers(self.ckpt)
        used = sorted(set(self.order.take(0, self.total_steps * self.step_examples)))
        needed = list(dict.fromkeys([self.rd.train_raw[i].prompt for i in used] + [e.prompt for e in self.rd.val_raw]))
        if c.distill_answers_from is not None:  # another run's teacher answers, checked to fit
            return ck.reuse_distill_answers(c.distill_answers_from, c, needed)
        hf_model = self.sk.model
        was_training = hf_model.training
        hf_model.to(self.accelerator.device).eval()
        settings = {**{name: getattr(c, name) for name in ck.ANSWER_FIELDS}, "base_model": self.base_name}
        single = self.world == 1  # a killed single-process run keeps the answers it made
        answers = teacher_answers(
            self.sk.adapter, self.tokenizer, needed, chat=self.chat, max_new_tokens=c.distill_max_new_tokens,
            batch_size=c.distill_batch_size, accelerator=self.accelerator,
            done=ck.load_partial_answers(self.out_dir, settings) if single else None,
            on_batch=(lambda made: ck.save_partial_answers(self.out_dir, settings, made)) if single else None,
            progress=c.progress and self.main)
        hf_model.train(was_training)
        return answers

    # ---- model --------------------------------------------------------------------------
    def build_model(self) -> None:
        """LoRA or full model, the frozen teacher, gradient checkpointing, optimizer, scheduler."""
        from transformers import get_scheduler

        from ..layout import row_major

        c = self.config
        hf_model = self.sk.model
        row_major(hf_model)  # plain nn.Linear layers and contiguous weights, as peft and AdamW expect (load() makes them weight-first)
        hf_model.to(self.accelerator.device)
        if c.entry_bridge:
            self._attach_bridge(hf_model)
        self.teacher_adapter: Adapter | None = self.own_teacher
        if c.kl_weight > 0 and c.lora_r == 0 and self.own_teacher is None:
            teacher = copy.deepcopy(hf_model).eval().requires_grad_(False)  # the original weights, frozen
            self.teacher_adapter = get_adapter(teacher)
        if c.lora_r > 0:
            from peft import LoraConfig, get_peft_model

            from ..peft_compat import quiet_peft_checkpointing_warning

            lora_cfg = LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha or 2 * c.lora_r, lora_dropout=c.lora_dropout,
                                  target_modules="all-linear", bias="none", task_type="CAUSAL_LM")
            with quiet_peft_checkpointing_warning():  # peft 0.21 reads a property transformers 5.24 deprecated
                self.peft_model = get_peft_model(hf_model, lora_cfg)
            if c.init_adapter is not None and self.ckpt is None:  # warm start (a resume loads its checkpoint)
                load_init_lora(self.peft_model, c.init_adapter, c.lora_r, c.lora_alpha or 2 * c.lora_r)
            inner = self.peft_model.base_model.model  # the HF model, LoRA layers injected in place
            trainable: nn.Module = self.peft_model
        else:
            inner = trainable = trainable_for_full_fine_tuning(hf_model)  # refuses a wholly frozen model
        adapter = get_adapter(inner)
        if c.kl_weight > 0 and self.peft_model is not None and self.own_teacher is None:
            self.teacher_adapter = adapter  # run under peft_model.disable_adapter(): the frozen base
        if c.gradient_checkpointing:
            _enable_checkpointing(inner, adapter)
        if self.ckpt is not None:
            ck.load_weights(self.ckpt, hf_model, self.peft_model)
        module = SkipLossModule(trainable, adapter, sparse=c.teacher_forcing == "sparse", prompt_grad=c.prompt_grad,
                                base_prefill=c.base_prefill)
        if self.bridge_params:  # a trained bridge: a submodule, so that Accelerate moves and wraps it
            module.entry_bridge = self.bridge
        module.train()
        self.params = [p for p in module.parameters() if p.requires_grad and not _holds(self.bridge_params, p)]
        groups = [{"params": self.params}]
        if self.bridge_params:
            groups.append({"params": self.bridge_params, "lr": c.entry_bridge_lr, "weight_decay": 0.0})
        optimizer = torch.optim.AdamW(groups, lr=c.lr, weight_decay=c.weight_decay)
        warmup = c.warmup_steps if c.warmup_steps is not None else int(c.warmup_ratio * self.total_steps)
        self.scheduler = get_scheduler(c.lr_scheduler, optimizer, num_warmup_steps=min(warmup, self.total_steps),
                                       num_training_steps=self.total_steps)
        # The scheduler is not prepared: Accelerate would step it once per process.
        self.module, self.optimizer = self.accelerator.prepare(module, optimizer)
        if self.ckpt is not None:
            self._restore_state()

    def _attach_bridge(self, hf_model: nn.Module) -> None:
        """Fit the entry bridge on the base model (or load the checkpoint's) and attach it, frozen."""
        from ..entry_bridge import ENTRY_BRIDGE_FILE, EntryBridge, attach_entry_bridge
        from .bridge import fit_training_bridge

        if self.ckpt is not None:
            bridge = ck._read(self.ckpt / ENTRY_BRIDGE_FILE, lambda p: EntryBridge.load(p.parent), "the entry bridge")
            self.bridge_record = (self.saved.get("entry_bridge") or {})
        elif self.config.init_adapter is not None:  # warm start: the adapter's own bridge, no fit
            bridge = load_init_bridge(self.config.init_adapter)
            self.bridge_record = {"source": bridge.source, "targets": list(bridge.targets),
                                  "init_adapter": self.config.init_adapter}
        else:
            bridge, self.bridge_record = fit_training_bridge(
                hf_model, self.train_items, self.policies, self.num_layers, self.config.entry_bridge_examples,
                progress=self.config.progress and self.main)
        bridge.requires_grad_(self.config.entry_bridge_lr is not None)
        self.bridge_record = {**(self.bridge_record or {}), "trained": self.config.entry_bridge_lr is not None}
        self.bridge = bridge
        self.bridge_params = list(bridge.parameters()) if self.config.entry_bridge_lr is not None else []
        attach_entry_bridge(hf_model, bridge)

    def _restore_state(self) -> None:
        state = ck.load_train_state(self.ckpt, self.saved, self.optimizer, self.scheduler, self.rank)
        self.start_step = state["step"]
        self.train_log, self.val_log, self.totals = state["train_log"], state["val_log"], state["totals"]
        self.spent_seconds = state["train_seconds"]

    def unwrapped(self) -> SkipLossModule:
        """The loss module without Accelerate's wrappers."""
        return self.accelerator.unwrap_model(self.module)

    # ---- one step -----------------------------------------------------------------------
    def batch_inputs(self, items: list[TokenizedExample], policy: SkipPolicy) -> tuple[Batch, torch.Tensor]:
        """A collated batch on the run's device and its (B, T, L) layer mask under ``policy``."""
        batch = collate(items, self.pad_id).to(self.accelerator.device)
        T = batch.input_ids.shape[1]
        lm = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, T, self.num_layers,
                              device=self.accelerator.device)
        return batch, lm

    def teacher_logits(self, batch: Batch) -> torch.Tensor | None:
        """Full-depth teacher logits (N, V) at the target positions, or None without KL."""
        if self.teacher_adapter is None:
            return None
        base = self.peft_model is not None and self.own_teacher is None  # the LoRA base, adapter off
        ctx = self.peft_model.disable_adapter() if base else contextlib.nullcontext()
        with torch.no_grad(), ctx, self.accelerator.autocast():
            return target_logits(self.teacher_adapter, batch, None).float()

    def with_student_answers(self, items: list[TokenizedExample], policy: SkipPolicy) -> list[TokenizedExample]:
        """``items`` with the first ``on_policy_rows`` rows answered by the student itself
        (:func:`student_answers`, greedy under ``policy``); unchanged without ``on_policy``."""
        c = self.config
        rows = on_policy_rows(c.on_policy, len(items))
        if not rows:
            return items
        base = self.peft_model.disable_adapter if c.base_prefill else None
        mine = student_answers(self.unwrapped().adapter, items[:rows], policy, max_new_tokens=c.distill_max_new_tokens,
                               max_length=c.max_length, eos_token_ids=self.eos_ids, pad_token_id=self.pad_id,
                               prefill_context=base)
        return mine + list(items[rows:])

    def micro_batches(self, step: int) -> list[list[TokenizedExample]]:
        """This process's micro-batches of optimizer step ``step`` (a pure function of the seed)."""
        c, world, rank = self.config, self.world, self.rank
        indices = self.order.take(step * self.step_examples, self.step_examples)
        out = []
        for j in range(c.grad_accum):
            g = indices[j * c.batch_size * world:(j + 1) * c.batch_size * world]
            mine = [self.train_items[i] for i in g[rank * c.batch_size:(rank + 1) * c.batch_size]]
            if any(x is None for x in mine):  # pragma: no cover - planning guarantees it
                raise RuntimeError(f"step {step}: an example without targets was drawn")
            out.append(mine)
        return out

    def train_step(self, step: int, policy: SkipPolicy) -> torch.Tensor:
        """Forward, backward and optimizer step; returns (ce, kl, tokens, targets, weight) summed over
        processes (ce and kl weighted by ``position_half_life`` when set; weight: the targets' summed
        weights, the target count when unweighted)."""
        acc, c = self.accelerator, self.config
        micro = [self.with_student_answers(items, policy) for items in self.micro_batches(step)]
        weights = [position_weights([len(x.response_ids) for x in items], c.position_half_life, acc.device)
                   for items in micro]  # None: every target weighs 1
        # each micro-batch's summed target weight (its response-token count when unweighted)
        w_sums = [float(w.sum()) if w is not None else float(sum(len(x.response_ids) for x in items))
                  for w, items in zip(weights, micro)]
        total = torch.tensor(sum(w_sums), dtype=torch.float64, device=acc.device)
        if self.world > 1:  # normalise by the global token weight: N processes == 1 process
            total = acc.reduce(total, "sum")
        # DDP averages the processes' gradients, hence the factor world: the step's gradient is
        # that of (sum of all processes' weighted token losses) / (their summed weights; the
        # target count when unweighted).
        scale = self.world / float(total)
        stats = torch.zeros(5, dtype=torch.float64, device=acc.device)  # ce, kl, tokens, targets, weight
        for j, items in enumerate(micro):
            ctx = contextlib.nullcontext() if j == len(micro) - 1 else acc.no_sync(self.module)
            with ctx:
                batch, lm = self.batch_inputs(items, policy)
                t_logits = self.teacher_logits(batch)
                rows = on_policy_rows(c.on_policy, len(items))
                targets = on_policy_targets(batch, t_logits, rows) if rows else None
                ce, kl = self.module(batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens,
                                     lm, t_logits, targets, weights[j])
                loss = (ce + c.kl_weight * kl) * scale  # (weighted) token mean over the whole step
                stats += torch.tensor([float(ce.detach()), float(kl.detach()), batch.n_tokens, batch.n_targets,
                                       w_sums[j]], dtype=torch.float64, device=acc.device)
                acc.backward(loss)
        if c.max_grad_norm > 0:
            acc.clip_grad_norm_(self.params, c.max_grad_norm)
            if self.bridge_params:
                acc.clip_grad_norm_(self.bridge_params, c.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return acc.reduce(stats, "sum")

    # ---- validation ---------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Mean CE per response token on the validation set, per policy (all processes)."""
        from tqdm.auto import tqdm

        acc, m = self.accelerator, self.unwrapped()
        m.eval()
        mine = self.val_items[self.rank::self.world]
        result = {}
        size = self.config.batch_size
        with torch.no_grad():
            for label, policy in self.policies:
                sums = torch.zeros(2, dtype=torch.float64, device=acc.device)
                starts = range(0, len(mine), size)
                for start in tqdm(starts, desc=f"validation ({label}x)", unit="batch", leave=False,
                                  dynamic_ncols=True, disable=not (self.config.progress and self.main)):
                    batch, lm = self.batch_inputs(mine[start:start + size], policy)
                    with acc.autocast():
                        ce, _ = m(batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens, lm)
                    sums += torch.tensor([float(ce), batch.n_targets], dtype=torch.float64, device=acc.device)
                sums = acc.reduce(sums, "sum")
                result[label] = float(sums[0] / sums[1]) if float(sums[1]) > 0 else float("nan")
        m.train()
        return result

    def log_val(self, step: int) -> None:
        """Evaluate and append to the validation log (nothing without validation data)."""
        if not self.val_items:
            return
        by = self.evaluate()
        self.val_log.append({"step": step, "loss": sum(by.values()) / len(by), "by_policy": by})
        log.info("step %d: val loss %s", step, by)

    # ---- records and saving -------------------------------------------------------------
    @property
    def task(self) -> str | None:
        """The task of the data: the config's, else "e2e" for an E2E CSV file, else None (one
        value for the run record and the checkpoint's ``skipdecode.json``)."""
        if self.config.task:
            return self.config.task
        return "e2e" if str(self.rd.info.get("path", "")).lower().endswith(".csv") else None

    def data_record(self, step: int) -> dict[str, Any]:
        """What the run read and saw up to ``step``."""
        rd = self.rd
        return {**rd.info, "task": self.task, "n_examples": rd.n_examples, "n_train": self.n_train,
                "n_train_dropped_too_long": rd.n_dropped, "n_val": len(self.val_items),
                "n_val_dropped_too_long": rd.n_val_dropped, "examples_seen": step * self.step_examples,
                "epochs_seen": step * self.step_examples / self.n_train, "order_seed": self.config.seed,
                "distill_prompts": len(rd.answers) if self.config.distill else 0}

    def skip_config_extra(self, step: int) -> dict[str, Any]:
        """The run's part of the saved ``skipdecode.json``."""
        c = self.config
        return skip_config_record({  # portable paths (skipdecode.paths), the base model loadable from here
            "task": self.task,
            "response_separator": None if self.chat else c.response_separator,
            "horizon": self.horizon,
            "speedups": [float(s) for s in c.speedups] if c.speedups else None,
            "policies": {label: p.to_dict() for label, p in self.policies},
            "base_model": self.base_name,
            "training": {"config": c.to_dict(), "step": step, "total_steps": self.total_steps,
                         "lora": c.lora_r > 0, "distill": c.distill, "kl_weight": c.kl_weight,
                         "teacher": c.teacher, "stopped_on_budget": self.stopped_on_budget,
                         "entry_bridge": self.bridge_record},
            "data": self.data_record(step),
            "losses": {"train": [[r["step"], r["loss"]] for r in self.train_log],
                       "val": [[r["step"], r["loss"]] for r in self.val_log]},
        }, self.base_name)

    def save_model(self, target: Path, step: int) -> Path:
        """Write the model (HF checkpoint or LoRA adapter) + skipdecode.json atomically."""
        inner_model = self.unwrapped().model
        hf_inner = inner_model.base_model.model if self.peft_model is not None else inner_model
        kept = {k: v for k, v in self.sk.skip_config.items() if k not in ("training", "losses", "data")}
        sk_save = SkipModel(hf_inner, self.tokenizer, policy=self.policies[0][1], chat=self.chat,
                            source=self.base_name or "", skip_config=kept)
        if self.peft_model is None:
            return sk_save.save_pretrained(target, extra=self.skip_config_extra(step))
        sk_save.model = inner_model  # PeftModel.save_pretrained writes only the adapter
        with quiet_peft_save_lookup():
            return sk_save.save_pretrained(target, extra=self.skip_config_extra(step))

    def save_checkpoint(self, step: int) -> Path:
        """Checkpoint ``out_dir/checkpoint-<step>`` (model + train_state), written atomically."""
        state = {"step": step, "total_steps": self.total_steps, "config": self.config.to_dict(),
                 "data_hash": self.data_hash, "horizon": self.horizon, "train_log": self.train_log,
                 "val_log": self.val_log, "tokens_seen": self.totals["tokens"],
                 "target_tokens_seen": self.totals["targets"], "num_processes": self.world,
                 "train_seconds": self.spent_seconds, "entry_bridge": self.bridge_record}
        return ck.save_checkpoint(
            self.out_dir, step, accelerator=self.accelerator, save_model=lambda d: self.save_model(d, step),
            optimizer=self.optimizer, scheduler=self.scheduler, state=state,
            answers=self.rd.answers if self.config.distill else None, keep=self.config.save_total_limit)

    def record(self, step: int, final_dir: Path | None, train_seconds: float, tokens_now: int,
               targets_now: int) -> TrainResult:
        """The run's :class:`TrainResult` after ``step`` steps."""
        c = self.config
        return TrainResult(
            out_dir=str(self.out_dir), final_dir=str(final_dir) if final_dir else None, steps=step,
            total_steps=self.total_steps, examples_seen=step * self.step_examples, tokens_seen=self.totals["tokens"],
            target_tokens_seen=self.totals["targets"], wall_seconds=time.perf_counter() - self.wall_start,
            train_seconds=train_seconds, tokens_per_second=tokens_now / train_seconds if train_seconds > 0 else 0.0,
            target_tokens_per_second=targets_now / train_seconds if train_seconds > 0 else 0.0,
            train_log=self.train_log, val_log=self.val_log, policy=self.policies[0][1].to_dict(),
            policies={label: p.to_dict() for label, p in self.policies}, horizon=self.horizon,
            num_layers=self.num_layers, lora=c.lora_r > 0, distill=c.distill, data=self.data_record(step),
            resumed_from=str(self.ckpt) if self.ckpt else None, config=c.to_dict(),
            train_seconds_total=self.spent_seconds, stopped_on_budget=self.stopped_on_budget,
            stopped_at_step=step if self.stopped_on_budget else None, session_steps=step - self.start_step,
            session_tokens=tokens_now, session_target_tokens=targets_now)

    def write_record(self, res: TrainResult) -> None:
        """``out_dir/train_record.json`` (main process only)."""
        if self.main:
            ck.write_record(self.out_dir, res.to_dict())

    # ---- the loop -----------------------------------------------------------------------
    def run(self, callback: Callable[[dict], None] | None) -> TrainResult:
        """Train from ``start_step`` to ``total_steps`` (or until the ``max_minutes`` budget is
        spent), then validate, save ``final/`` and write the record."""
        from tqdm.auto import tqdm

        c = self.config
        if self.start_step == 0:
            self.log_val(0)
        bar = tqdm(total=self.total_steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (c.progress and self.main))
        meter = {"seconds": 0.0, "tokens": 0, "targets": 0}
        log.info("training %d params (%s), %d steps of %d examples, policies %s, horizon %d",
                 sum(p.numel() for p in self.params), "LoRA" if self.peft_model is not None else "full",
                 self.total_steps, self.step_examples, self.labels, self.horizon)
        end = self.start_step
        try:
            while end < self.total_steps and not self.budget_spent():
                self._one_step(end, meter, bar, callback)
                end += 1
        finally:
            bar.close()
        self.stopped_on_budget = end < self.total_steps
        if self.stopped_on_budget:
            log.info("stopping after step %d of %d: the max_minutes budget (%g min) is spent (%.2f min)",
                     end, self.total_steps, c.max_minutes, self.spent_seconds / 60)
        if not self.val_log or self.val_log[-1]["step"] != end:
            self.log_val(end)
        final_dir = self.out_dir / "final"
        self.accelerator.wait_for_everyone()
        if self.main:
            self.save_model(final_dir, end)
            (self.out_dir / ck.PARTIAL_ANSWERS).unlink(missing_ok=True)  # the checkpoints hold them now
        self.accelerator.wait_for_everyone()
        if self.peft_model is not None:  # leave the caller's model plain, with the adapter merged in place
            self.peft_model.merge_and_unload()
        result = self.record(end, final_dir, meter["seconds"], meter["tokens"], meter["targets"])
        self.write_record(result)
        return result

    def budget_spent(self) -> bool:
        """Whether the optimizer-step time of all invocations has passed ``max_minutes`` (the
        same answer on every process: the main process's clock decides)."""
        over = self.config.max_minutes is not None and self.spent_seconds > self.config.max_minutes * 60
        if self.world > 1:
            from accelerate.utils import broadcast_object_list

            over = broadcast_object_list([over])[0]
        return bool(over)

    def _one_step(self, step: int, meter: dict, bar: Any, callback: Callable[[dict], None] | None) -> None:
        c = self.config
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        label, policy = self.policies[_policy_index(c.seed, step, len(self.policies))]
        lr = self.scheduler.get_last_lr()[0]
        stats = self.train_step(step, policy)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        n_tok, n_tgt = int(stats[2]), int(stats[3])
        meter["seconds"] += seconds
        self.spent_seconds += seconds
        meter["tokens"] += n_tok
        meter["targets"] += n_tgt
        self.totals["tokens"] += n_tok
        self.totals["targets"] += n_tgt
        # the step's (position-weighted, with position_half_life) mean per target token
        loss_value = float(stats[0] / stats[4]) if n_tgt else float("nan")
        kl_value = float(stats[1] / stats[4]) if n_tgt else float("nan")
        done = step + 1
        self.train_log.append({"step": done, "loss": loss_value, "kl": kl_value, "lr": lr, "speedup": label,
                               "tokens": n_tok, "seconds": seconds})
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{meter['tokens'] / meter['seconds']:.0f}", policy=label,
                        refresh=False)
        if c.eval_every and done % c.eval_every == 0 and done < self.total_steps:
            self.log_val(done)
        ckpt_path = None
        if c.checkpoint_every and done % c.checkpoint_every == 0:
            ckpt_path = self.save_checkpoint(done)
            self.write_record(self.record(done, None, meter["seconds"], meter["tokens"], meter["targets"]))
        if callback is not None:
            callback({"step": done, "total_steps": self.total_steps, "loss": loss_value, "lr": lr,
                      "speedup": label, "checkpoint": str(ckpt_path) if ckpt_path else None})


def _holds(params: list[nn.Parameter], p: nn.Parameter) -> bool:
    """Whether ``p`` is one of ``params`` (by identity)."""
    return any(p is q for q in params)


def _enable_checkpointing(inner: nn.Module, adapter: Adapter) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(inner, "activation_checkpointing_enable"):
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # pragma: no cover - older transformers
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not all(getattr(layer, "gradient_checkpointing", False) for layer in adapter.layers):
        raise RuntimeError("gradient checkpointing was not switched on for every decoder layer")


def train(
    model: SkipModel | str | os.PathLike | None,
    data: str | os.PathLike | Sequence[Example | str],
    config: TrainConfig,
    *,
    val_data: str | os.PathLike | Sequence[Example] | None = None,
    callback: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Fine-tune ``model`` with its skip schedule in place (docs/method.md "Training").

    Args:
        model: a :class:`SkipModel`, or anything :func:`skipdecode.load` takes (None: the embedded
            default), loaded with ``adapter=False`` (the stock weights: a shipped skip adapter is
            never the starting point of a new run). It is trained in place and moved to the run's device. With LoRA the adapter
            is injected into its layers (peft) and merged into the weights when the run ends, so
            the model is plain again; a run stopped early leaves the unmerged LoRA layers in it.
        data: a data file / dataset name for :func:`skipdecode.data.load_examples`, or a list of
            :class:`~skipdecode.data.Example` (with ``distill``, plain prompt strings too).
        config: the :class:`TrainConfig`.
        val_data: explicit validation data (default: ``config.val_fraction`` of ``data``).
        callback: called on every process after each optimizer step (and after that step's
            checkpoint is written) with ``{"step", "total_steps", "loss", "lr", "speedup",
            "checkpoint"}``; an exception it raises stops the run (checkpoints stay usable).

    Returns:
        :class:`TrainResult`, also written to ``out_dir/train_record.json``; the model is in
        ``out_dir/final`` (a LoRA run saves only the adapter there, plus ``base_model``).

    Raises:
        TrainConfigError: settings that do not fit the model or the data (``.field`` names it),
            e.g. a speedup too high for the layer count, ``out_dir`` holding another run's
            checkpoints without ``resume`` or a finished model (``final/``) with no checkpoint to
            resume from, a resume whose settings differ from the checkpoint's, or ``eval_every``
            > 0 with no validation data (``val_fraction`` 0 and no ``val_data``).
        skipdecode.data.DataError: the data cannot be read, or no example fits ``max_length``.
        skipdecode.loading.LoadError: ``model`` cannot be loaded.
    """
    if config.needs_val_data and val_data is None:  # the API's val_fraction defaults to 0
        raise TrainConfigError("eval_every", f"validation every {config.eval_every} steps needs validation data: "
                                             "set val_fraction > 0 or pass val_data")
    existing = first_existing(config.out_dir)
    try:
        run = _Run(model, config)
        run.prepare_data(data, val_data)
        run.build_model()
        return run.run(callback)
    except BaseException:  # a run refused or stopped before it wrote anything leaves no empty out_dir
        remove_new_empty_dirs(config.out_dir, existing)
        raise
