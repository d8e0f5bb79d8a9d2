"""`python train.py`: capture target features, train a draft head with DeepSpeed, export it.

Recipe shape (torchtune-style): setup -> capture -> train (log, eval, checkpoint) -> export.
The target is frozen and lives outside the DeepSpeed engine; only the head trains.
Launch on several GPUs/nodes with `deepspeed train.py ...` or `torchrun ... train.py ...`:
rank and world size come from the environment.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from eagle_lab.config import TrainConfig, to_object
from eagle_lab.drafters.card import HeadCard, write_card
from eagle_lab.drafters.eagle.eagle3 import eagle3_layer_ids
from eagle_lab.drafters.eagle.head import draft_lm_head_weight
from eagle_lab.errors import EagleLabError
from eagle_lab.models.device import cpu_has_bf16, training_dtype
from eagle_lab.models.target import load_target
from eagle_lab.training import checkpoint as ckpt
from eagle_lab.training.batches import ExampleSource, collate, epoch_order
from eagle_lab.training.corpus import CorpusStore, capture_split
from eagle_lab.training.corpus_layout import Split
from eagle_lab.training.corpus_sources import features_root, open_corpus_sources
from eagle_lab.training.data import build_datasets
from eagle_lab.training.deepspeed_setup import deepspeed_config, init_distributed, lr_lambda
from eagle_lab.training.draft_vocab import draft_vocabulary, supervised_counts
from eagle_lab.training.features import Example, features_key
from eagle_lab.training.global_batch import global_batch_step, summed_over_ranks
from eagle_lab.training.host_memory import reuse_freed_memory
from eagle_lab.training.losses import Batch, heldout_accuracy, prediction_steps
from eagle_lab.training.regenerate import target_rewrite
from eagle_lab.training.stop import GracefulStop
from eagle_lab.training.trainable import (
    draft_vocab_size,
    export_trainable,
    new_trainable,
    trainable_parameters,
    trained_dtype,
)

log = logging.getLogger(__name__)


# ---- the recipe ----------------------------------------------------------------------------

class Recipe:
    def __init__(self, cfg: TrainConfig, command: str = ""):
        self.cfg = cfg
        self.command = command  # how this run was started, for the head card
        self.train_conversations = 0  # conversations asked for (examples drop those without a reply)
        self.train_parts: list[dict] = []  # the feature corpus: what each part of the training set holds
        self.last_eval: dict[str, float] = {}
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = self.run_dir / "ckpt"
        self.metrics_path = self.run_dir / "metrics.jsonl"

    def setup(self) -> None:
        cfg = self.cfg
        cfg.validate()
        if ckpt.latest_checkpoint(self.ckpt_dir) and not (cfg.trainer.resume or cfg.trainer.capture_only
                                                          or cfg.trainer.eval_only):
            raise EagleLabError(f"{self.run_dir} already has checkpoints: pass trainer.resume=true to continue, "
                                "or name=<new name> for a fresh run")
        torch.manual_seed(cfg.trainer.seed)
        self.target = load_target(replace(cfg.target, dtype=training_dtype(cfg.trainer.capture_dtype, cfg.target)),
                                  trainable_layers=True)
        self.device = self.target.device
        self.rank, self.world = init_distributed(cfg.deepspeed.backend, self.device, cfg.deepspeed.timeout_min)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = self._layer_ids()
        if cfg.data.eval_conversations > 0:
            sources = open_corpus_sources(cfg, self.target, self.layer_ids, self.rank, self._barrier, self._rewrite)
            self.train_source, self.eval_source = sources.train, sources.eval
            self.train_parts, self.train_conversations = sources.parts, sources.conversations
            supervised = lambda: self.train_source.store.supervised_tokens()  # noqa: E731
        else:
            train_rows, eval_rows, _ = build_datasets(cfg.data, self.target.tokenizer, self._rewrite())
            self.train_rows, self.eval_rows = train_rows, eval_rows
            self.train_source, self.eval_source = self._sources()
            supervised = lambda: (torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"], dtype=torch.bool)]  # noqa: E731
                                  for r in train_rows)
        if cfg.trainer.capture_only:
            return
        if cfg.trainer.eval_only:
            self.head = self._trained_head()
            return
        self._set_max_steps()
        if self.rank == 0:
            OmegaConf.save(OmegaConf.structured(cfg), self.run_dir / "resolved_config.yaml")
        if cfg.trainer.init_from:
            self.head = self._trained_head(cfg.trainer.init_from).train()
            log.info("starting from the head at %s (its draft vocabulary of %d tokens kept)", cfg.trainer.init_from,
                     draft_vocab_size(self.head))
        else:
            counts = supervised_counts(supervised(), self.target.vocab_size)
            vocab_ids = draft_vocabulary(counts, cfg.head.draft_vocab_size, set(self.target.eos_token_ids))
            self.head = new_trainable(self.target, cfg.head, vocab_ids, self.device).train()
        self._init_engine()

    def _set_max_steps(self) -> None:
        """trainer.epochs > 0: as many steps as that many passes over the training set take."""
        tcfg = self.cfg.trainer
        if tcfg.epochs > 0:
            per_step = tcfg.micro_batch_size * tcfg.grad_accum * self.world
            tcfg.max_steps = max(1, math.ceil(tcfg.epochs * len(self.train_source) / per_step))
            log.info("trainer.epochs=%g over %d examples: max_steps=%d", tcfg.epochs, len(self.train_source),
                     tcfg.max_steps)

    def _rewrite(self, regenerated: bool | None = None):
        """Self-distillation (`data.regenerate.enabled`, or `regenerated`): the target's replies,
        shared by every later run."""
        if not (self.cfg.data.regenerate.enabled if regenerated is None else regenerated):
            return None
        if not self.cfg.data.regenerate.weights:
            return target_rewrite(self.target, self.cfg.data, self.rank, self.world, self._barrier, self._autocast)
        return target_rewrite(self._reply_target(), self.cfg.data, self.rank, self.world, self._barrier)

    def _reply_target(self):
        """data.regenerate.weights: the target loaded again on CPU in float32 with its linear layers stored that
        way (e.g. w4a8, how the embedded target is served), to write the replies."""
        weights = self.cfg.data.regenerate.weights
        if self.device.type != "cpu":
            raise EagleLabError(f"data.regenerate.weights={weights} writes the replies on CPU, but training runs "
                                f"on {self.device.type}: leave it empty to reply with the training target")
        return load_target(replace(self.cfg.target, device="cpu", dtype="float32", weights=weights))

    def _trained_head(self, path: str = ""):
        """The head at `path` (trainer.init_from) or head.path (trainer.eval_only), in float32: the dtype
        training keeps its weights in."""
        from eagle_lab.drafters.eagle.layouts import load_head

        option = "trainer.init_from" if path else "head.path"
        head = load_head(path or self.cfg.head.path, self.target)
        if head.arch.kind != self.cfg.head.kind:
            raise EagleLabError(f"{option} holds a {head.arch.kind} head, but head.kind={self.cfg.head.kind}: "
                                f"pass head={head.arch.kind}")
        return head.to(self.device).float()

    def evaluate_only(self) -> dict[str, float]:
        """Held-out top-1 of the head at head.path, written to <run_dir>/eval.json."""
        result = self.evaluate()
        if self.rank == 0:
            record = {"head": str(Path(self.cfg.head.path).expanduser().resolve()), "data": self.cfg.data.name,
                      "regenerated": self.cfg.data.regenerate.enabled, **self.last_eval}
            (self.run_dir / "eval.json").write_text(json.dumps(record, indent=1) + "\n")
            log.info("wrote %s", self.run_dir / "eval.json")
        return result

    def _layer_ids(self) -> tuple[int, ...]:
        """Hidden states the head reads (EAGLE-3 fuses three); EAGLE-2 reads only the top."""
        if self.cfg.head.kind != "eagle3":
            return ()
        return tuple(self.cfg.head.feature_layers) or eagle3_layer_ids(self.target.num_layers)

    def _sources(self):
        cfg = self.cfg
        if cfg.trainer.features == "online":
            return (ExampleSource(self.target, self.train_rows, None, self.layer_ids),
                    ExampleSource(self.target, self.eval_rows, None, self.layer_ids))
        root = features_root(cfg.trainer)
        data_fp = {k: v for k, v in OmegaConf.to_container(OmegaConf.structured(cfg.data)).items() if k != "name"}
        # Shards always hold EAGLE-3's layers too: one capture then serves both head kinds.
        capture_layers = self.layer_ids or eagle3_layer_ids(self.target.num_layers)
        key = features_key(self.target.name, {**data_fp, "dtype": str(self.target.dtype)}, capture_layers)
        stores = []
        stored_rows = lambda row: (row["input_ids"], row["loss_mask"])  # noqa: E731  rows come tokenized
        for name, rows in (("train", self.train_rows), ("eval", self.eval_rows)):
            split = Split(name, rows, root / key / name, cfg.data.shard_conversations)
            capture_split(self.target, split, len(rows), stored_rows, [len(ids) for ids in rows["input_ids"]],
                          capture_layers)
            self._barrier()
            stores.append(CorpusStore(split, len(rows), self.layer_ids))
            if len(stores[-1]) != len(rows):
                raise EagleLabError(f"{split.directory} holds {len(stores[-1])} examples, expected {len(rows)}: "
                                    "delete it to capture it again")
        log.info("features: %d train examples (%d tokens), %d eval examples in %s", len(stores[0]),
                 stores[0].tokens, len(stores[1]), root / key)
        return (ExampleSource(self.target, self.train_rows, stores[0], self.layer_ids),
                ExampleSource(self.target, self.eval_rows, stores[1], self.layer_ids))

    def _sum_over_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        return summed_over_ranks(counts, self.world, self.device)

    def _barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def _init_engine(self) -> None:
        import deepspeed

        cfg = self.cfg
        params = [p for p in self.head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                      weight_decay=cfg.optim.weight_decay)
        schedule = lr_lambda(cfg.optim.warmup_steps, cfg.trainer.max_steps, cfg.optim.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        engine_config = deepspeed_config(cfg.trainer.micro_batch_size, cfg.trainer.grad_accum, cfg.optim.grad_clip,
                                         cfg.deepspeed.zero_stage, cfg.deepspeed.bf16, self.device)
        self.engine, _, _, _ = deepspeed.initialize(model=self.head, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=engine_config)
        self.step, self.epoch, self.cursor = 0, 0, 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, its example order)
        latest = ckpt.latest_checkpoint(self.ckpt_dir) if cfg.trainer.resume else None
        if latest is not None:
            _, client = self.engine.load_checkpoint(str(latest), tag=ckpt.TAG)
            self.step, self.epoch, self.cursor = client["step"], client["epoch"], client["cursor"]
            torch.set_rng_state(client["torch_rng"])
            log.info("resumed from %s at step %d", latest, self.step)
        elif cfg.trainer.resume:
            log.info("trainer.resume=true but no checkpoint in %s: starting fresh", self.ckpt_dir)

    # ---- loop ----
    def _next_global_batch(self) -> list[list[int]]:
        """This rank's micro-batches of the next global batch: grad_accum x world x micro_batch_size
        examples of a seeded per-epoch permutation, whatever the split (so the split never changes
        which examples a step sees)."""
        tcfg = self.cfg.trainer
        micro = tcfg.micro_batch_size * self.world
        size = micro * tcfg.grad_accum
        order = self._epoch_order(size)
        if self.cursor + size > len(order):
            self.epoch, self.cursor = self.epoch + 1, 0
            order = self._epoch_order(size)
        chunk = order[self.cursor: self.cursor + size]
        self.cursor += size
        parts = [chunk[start: start + micro] for start in range(0, size, micro)]  # grad_accum parts
        return [part[self.rank::self.world] or chunk[:1] for part in parts]  # never empty: a tiny data set

    @property
    def loss_needs_greedy(self) -> bool:
        return self.cfg.loss.mask_outside_draft_vocab and self.head.reduced_vocab

    def _autocast(self):
        """bf16 matmuls for CPU training (fp32 weights and optimizer state stay); on CUDA,
        DeepSpeed's bf16 setting decides instead."""
        mode = self.cfg.trainer.cpu_autocast
        enabled = self.device.type == "cpu" and (mode == "on" or (mode == "auto" and cpu_has_bf16()))
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=enabled)

    def _epoch_order(self, size: int) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            lengths = self.train_source.lengths() if self.cfg.trainer.group_by_length else None
            self._order = (self.epoch, epoch_order(len(self.train_source), self.cfg.trainer.seed, self.epoch,
                                                   lengths, size))
        return self._order[1]

    def _batch(self, examples: list[Example]) -> Batch:
        return collate(examples, self.device, trained_dtype(self.head), use_layers=bool(self.layer_ids))

    def train(self) -> None:
        tcfg = self.cfg.trainer
        rows = draft_lm_head_weight(self.head, self.target).detach().to(trained_dtype(self.head))
        started = time.perf_counter()
        stop_at = min(tcfg.max_steps, tcfg.stop_at) if tcfg.stop_at > 0 else tcfg.max_steps
        bar = tqdm(total=tcfg.max_steps, initial=self.step, desc="train", unit="step", disable=self.rank != 0)
        window_tokens, window_start = 0, time.perf_counter()
        evaluated_at = -1
        with GracefulStop(self.world, self.device) as stop:
            while self.step < stop_at:
                self._train_step(rows)
                window_tokens += self._last_tokens
                bar.update(1)
                bar.set_postfix(loss=f"{self._last_loss:.3f}", acc=f"{self._last_metrics.get('acc_1', 0):.3f}")
                if self.step % tcfg.log_every == 0 or self.step == stop_at:
                    elapsed = time.perf_counter() - window_start
                    self._log({"step": self.step, "loss": self._last_loss, "lr": self.engine.get_lr()[0],
                               "tokens_per_s": window_tokens * self.world / max(elapsed, 1e-9), **self._last_metrics})
                    window_tokens, window_start = 0, time.perf_counter()
                out_of_time = tcfg.time_limit_min > 0 and time.perf_counter() - started > 60 * tcfg.time_limit_min
                signalled = stop.requested()
                if self.step % tcfg.save_every == 0 or self.step == stop_at or out_of_time or signalled:
                    self.save_checkpoint()  # before evaluating: a long evaluation never costs trained steps
                if signalled:
                    log.info("stopped by %s at step %d: checkpointed; resume with trainer.resume=true (the "
                             "held-out evaluation is skipped)", stop.received or "a signal to another rank", self.step)
                    bar.close()
                    return
                if self.step % tcfg.eval_every == 0 or self.step == tcfg.max_steps:
                    self._log({"step": self.step, **self.evaluate()})
                    evaluated_at = self.step
                if out_of_time:
                    log.info("time limit of %.1f min reached at step %d: checkpointed; resume with "
                             "trainer.resume=true", tcfg.time_limit_min, self.step)
                    break
        bar.close()
        if self.step > 0 and evaluated_at != self.step:  # stopped early: still report where it got
            self._log({"step": self.step, **self.evaluate()})

    def _train_step(self, rows: torch.Tensor) -> None:
        """One optimizer step (grad_accum micro-batches); sets _last_loss, _last_metrics, _last_tokens."""
        cfg = self.cfg
        batches = [self._batch(self.train_source.get(indices, with_greedy=self.loss_needs_greedy))
                   for indices in self._next_global_batch()]
        steps = prediction_steps(self.head, cfg.head.ttt_steps)
        self._last_loss, self._last_metrics = global_batch_step(self.engine, self.target, rows, batches, cfg.loss,
                                                                steps, self.world, self._autocast)
        self._last_tokens = sum(int(batch.valid.sum()) for batch in batches)
        self.step += 1

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.head.eval()
        count = min(len(self.eval_source), self.cfg.trainer.eval_sequences)
        size = self.cfg.trainer.micro_batch_size
        lengths = self.eval_source.lengths()
        chosen = sorted(range(count), key=lambda i: lengths[i])  # similar lengths per batch: little padding
        starts = list(range(0, count, size))[self.rank::self.world]  # each rank scores every world-th batch
        batches = (self._batch(self.eval_source.get(chosen[i: i + size], with_greedy=True)) for i in starts)
        result = heldout_accuracy(self.head, self.target, batches, self.cfg.trainer.eval_depth, self._sum_over_ranks)
        self.last_eval = {**result, "sequences": count}
        self.head.train()
        where = self.cfg.head.path if self.cfg.trainer.eval_only else f"step {self.step}"
        log.info("eval @ %s: %s", where, " ".join(f"{k}={v:.3f}" for k, v in result.items()))
        return result

    def save_checkpoint(self) -> None:
        partial = ckpt.partial_path(self.ckpt_dir, self.step)
        client = {"step": self.step, "epoch": self.epoch, "cursor": self.cursor, "torch_rng": torch.get_rng_state()}
        self.engine.save_checkpoint(str(partial), tag=ckpt.TAG, client_state=client)
        self._barrier()
        if self.rank == 0:
            final = ckpt.publish(self.ckpt_dir, self.step, self.cfg.trainer.keep_checkpoints)
            log.info("checkpoint %s", final)

    def export(self) -> Path | None:
        """Write the head (also after an early stop: a partly trained head still serves)."""
        if self.rank != 0:
            return None
        out, serve = export_trainable(self.head, self.target, self.run_dir / "head")
        write_card(out, self.card())
        log.info("exported head at step %d/%d -> %s (serve with: %s)", self.step, self.cfg.trainer.max_steps, out,
                 serve)
        return out

    def card(self) -> HeadCard:
        cfg, tcfg = self.cfg, self.cfg.trainer
        examples = max(len(self.train_source), 1)
        per_step = tcfg.micro_batch_size * tcfg.grad_accum * self.world
        depth = tcfg.eval_depth
        return HeadCard(
            target=self.target.name, kind=cfg.head.kind,
            train_conversations=self.train_conversations or examples, train_tokens=self.train_source.tokens,
            epochs=round(self.step * per_step / examples, 3), steps=self.step,
            heldout_top1=[round(self.last_eval[f"eval_acc_{d}"], 4) for d in range(1, depth + 1)
                          if f"eval_acc_{d}" in self.last_eval],
            heldout_conversations=int(self.last_eval.get("sequences", 0)),
            heldout_tau_chain=round(self.last_eval.get("eval_tau_chain", 0.0), 4),
            heldout_opening_top1=round(self.last_eval.get("eval_acc_1_opening", 0.0), 4),
            draft_vocab_size=draft_vocab_size(self.head), trainable_parameters=trainable_parameters(self.head),
            data={"name": cfg.data.name, "source": cfg.data.source, "max_length": cfg.data.max_length,
                  "eval_conversations": cfg.data.eval_conversations,
                  "heldout_replies": "target" if cfg.data.regenerate.enabled else "source",
                  **({"parts": self.train_parts} if self.train_parts else {})},
            recipe={"lr": cfg.optim.lr, "global_batch": per_step, "warmup_steps": cfg.optim.warmup_steps,
                    "min_lr_ratio": cfg.optim.min_lr_ratio, "epochs": tcfg.epochs,
                    "intermediate_size": cfg.head.intermediate_size, "ttt_steps": cfg.head.ttt_steps,
                    "loss": asdict(cfg.loss),
                    **({"init_from": tcfg.init_from} if tcfg.init_from else {})},
            command=self.command or "python train.py (overrides not recorded)")

    def _log(self, record: dict) -> None:
        if self.rank != 0:
            return
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


def run(raw: DictConfig, command: str = "") -> Path | None:
    """command: the command line that started the run, recorded in the head card."""
    cfg: TrainConfig = to_object(raw, TrainConfig)
    if not cfg.run_dir:
        raise EagleLabError("run_dir is empty")
    reuse_freed_memory()
    recipe = Recipe(cfg, command)
    recipe.setup()
    if cfg.trainer.capture_only:
        log.info("trainer.capture_only: features captured; nothing trained")
        return None
    if cfg.trainer.eval_only:
        recipe.evaluate_only()
        return None
    recipe.train()
    return recipe.export()
