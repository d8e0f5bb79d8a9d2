"""The training and held-out sets of a shared feature corpus (`data.eval_conversations > 0`).

A run trains on the first `data.num_conversations` of the corpus (plus, with
`data.add_regenerated = N`, the target's own replies to the first N) and evaluates on its
held-out tail. Whatever of that is not on disk yet is captured first (eagle_lab.training.corpus).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from eagle_lab.drafters.eagle.eagle3 import eagle3_layer_ids
from eagle_lab.errors import EagleLabError
from eagle_lab.models.embedded import cache_root
from eagle_lab.training.batches import ExampleSource
from eagle_lab.training.corpus import CorpusStore, CorpusStores, capture_split, open_corpus
from eagle_lab.training.corpus_layout import corpus_key
from eagle_lab.training.data import load_conversations, tokenize_conversation
from eagle_lab.training.regenerate import regenerated_pool

log = logging.getLogger(__name__)


def features_root(trainer_cfg) -> Path:
    """Where captured feature shards live: trainer.features_dir, else the cache."""
    return Path(trainer_cfg.features_dir) if trainer_cfg.features_dir else cache_root() / "features"


@dataclass
class CorpusSources:
    """What a run reads: train is None when it does not train (eval_only, capture_only);
    eval is None when it only captures."""

    train: ExampleSource | None
    eval: ExampleSource | None
    parts: list[dict] = field(default_factory=list)  # per part: replies, conversations, examples, tokens
    conversations: int = 0  # training conversations asked for, over all parts


def open_corpus_sources(cfg, target, layer_ids: tuple[int, ...], rank: int,
                        barrier: Callable[[], None], rewrite: Callable[[bool], object]) -> CorpusSources:
    """cfg: the run's TrainConfig. rewrite(regenerated) -> the target's replies to the source's prompts (or None for the
    source's own replies); barrier() waits for every rank after each part is captured."""
    data = cfg.data
    conversations, stats = load_conversations(replace(data, num_conversations=0))
    parts = [(data.regenerate.enabled, data.num_conversations)]
    if data.add_regenerated > 0:
        parts.append((True, data.add_regenerated))
    opened = [_open_part(cfg, target, layer_ids, rank, barrier, rewrite(regenerated), conversations, stats,
                         count, primary=not index)
              for index, (regenerated, count) in enumerate(parts)]
    if cfg.trainer.capture_only:
        return CorpusSources(None, None)
    evals = ExampleSource(target, None, opened[0][1], layer_ids)
    if cfg.trainer.eval_only:  # the training split is not read
        return CorpusSources(None, evals)
    train = CorpusStores([store for store, _ in opened])
    described = [{"replies": "target" if regenerated else "source", "conversations": store.count,
                  "examples": len(store), "tokens": store.tokens}
                 for (regenerated, _), (store, _) in zip(parts, opened)]
    log.info("features: %d train examples (%d tokens), %d held-out examples (%d tokens)", len(train),
             train.tokens, len(evals.store), evals.store.tokens)
    return CorpusSources(ExampleSource(target, None, train, layer_ids), evals, described,
                         sum(part["conversations"] for part in described))


def _open_part(cfg, target, layer_ids, rank, barrier, rewrite, conversations, stats, count: int,
               primary: bool):
    """One corpus of the source's conversations, with their own replies or the target's
    (`rewrite` not None) -> (a store of its first `count` training conversations, or None where
    training is not read; a store of its held-out tail for the primary corpus, else None)."""
    data = cfg.data
    held = data.eval_conversations
    if rewrite is not None:  # the target's own replies: the pool is the part rewritten so far
        conversations, held, count, dropped = regenerated_pool(
            rewrite, conversations, held, count, data.regenerate.block_conversations)
        stats.skipped["no_regenerated_reply"] = dropped
    fingerprint = {"source": data.source, "path": data.path, "max_length": data.max_length,
                   "eval_conversations": held, "shard_conversations": data.shard_conversations,
                   "dtype": str(target.dtype), "regenerate": rewrite.directory.name if rewrite else None}
    directory = features_root(cfg.trainer) / corpus_key(target.name, fingerprint)
    tokenize = lambda messages: tokenize_conversation(target.tokenizer, messages, data.max_length)  # noqa: E731
    corpus = open_corpus(directory, fingerprint, conversations, tokenize, held, data.shard_conversations,
                         write=rank == 0)
    train_counts, eval_counts = corpus.train_counts, corpus.eval_counts
    pool = corpus.train.conversations
    count = count or len(pool)
    if count > len(pool):
        what = "data.num_conversations" if primary else "data.add_regenerated"
        raise EagleLabError(f"{what}={count}, but '{data.name}' has {len(pool)} usable "
                            f"conversations besides the {held} held out (0 = all of them)")
    capture_layers = layer_ids
    if cfg.trainer.capture_layers == "eagle3" and not capture_layers:
        capture_layers = eagle3_layer_ids(target.num_layers)
    have = sum(corpus.train.is_complete(k, capture_layers) for k in corpus.train.shards_for(count))
    log.info("data %s%s: %s. Corpus %s: %d conversations (%.2fM tokens at max_length %d) + %d held out "
             "(%.2fM tokens). Requested the first %d (%.2fM tokens): %d of %d shards on disk", data.name,
             " (the target's replies)" if rewrite is not None else "", stats.summary(), directory, len(pool),
             sum(train_counts) / 1e6, data.max_length, held, sum(eval_counts) / 1e6, count,
             sum(train_counts[:count]) / 1e6, have, len(corpus.train.shards_for(count)))
    wait = not cfg.trainer.capture_only  # a capture worker leaves others' shards to them
    if primary:
        capture_split(target, corpus.eval, held, tokenize, eval_counts, capture_layers, wait=wait)
    if not cfg.trainer.eval_only:
        capture_split(target, corpus.train, count, tokenize, train_counts, capture_layers, wait=wait)
    barrier()
    if cfg.trainer.capture_only:
        return None, None
    evals = CorpusStore(corpus.eval, held, layer_ids) if primary else None
    train = None if cfg.trainer.eval_only else CorpusStore(corpus.train, count, layer_ids)
    return train, evals
