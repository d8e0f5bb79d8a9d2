"""Typed configs: dataclasses registered in Hydra's ConfigStore.

Every YAML file under conf/ is merged onto these schemas, so a mistyped key or a value of
the wrong type fails at start-up with Hydra's message instead of being ignored. Library
code never sees OmegaConf: entry points turn configs into these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from eagle_lab.decoding.backend import DecodingConfig
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import TargetConfig
from eagle_lab.training.data import DataConfig
from eagle_lab.training.losses import LossConfig
from eagle_lab.training.trainable import check_kind
from eagle_lab.tree_search.tree_config import TreeConfig


@dataclass
class HeadConfig:
    kind: str = "eagle2"
    # "" = the head packaged for this target if there is one, else a random head (warned);
    # "random" = always a random head; otherwise a directory with config.json + model.safetensors
    path: str = ""
    draft_vocab_size: int = 0  # 0 = the target's full vocabulary
    ttt_steps: int = 1  # training: draft steps unrolled per position (EAGLE-3 "training-time test")
    feature_layers: list[int] = field(default_factory=list)  # eagle3: hidden_states indices; [] = (2, L//2, L-3)
    init_layer_from_target: bool = False  # training, eagle2: start the decoder layer from the target's last
    intermediate_size: int = 0  # training, eagle2/eagle3: the head MLP's width; 0 = the target's (capacity knob)
    draft_layers: int = 2  # head.kind=draft_lm: decoder layers of the standalone draft model
    medusa_heads: int = 4  # head.kind=medusa: heads, head k guessing the token k+1 places ahead
    # serving: the dtype the head drafts in. auto = bf16 beside an fp32 target on a CPU that runs bf16
    # natively (half the bytes per head step), else the target's. Drafts are proposals: exactness never
    # depends on their numerics.
    draft_dtype: str = "auto"
    # serving, beside a CPU target on the row-stable kernel: how the head's linear weights are stored: auto (as
    # draft_dtype when that is set; else w8a8 with AVX2 or AVX512-VNNI, else bf16) | fp32 | bf16 | w8a8 | w4a8
    draft_weights: str = "auto"
    seed: int = 0


@dataclass
class NgramConfig:
    """Hybrid drafting (eagle_lab/drafters/ngram.py): copy a continuation of the context as an extra
    tree branch. Also the settings of method=ngram and of the bench methods eagle+ngram / ngram."""

    enabled: bool = True  # merge n-gram branches into the EAGLE tree (method=eagle)
    min_match: int = 2  # shortest suffix of the committed sequence to look up
    max_match: int = 4  # longest suffix, tried first
    max_tokens: int = 8  # chain length (tree=online: the longest it may merge)


@dataclass
class MedusaConfig:
    path: str = ""  # method=medusa: Medusa heads trained with head=medusa (python train.py head=medusa)


@dataclass
class BenchConfig:
    dataset: str = "mt_bench"  # mt_bench | humaneval | a .jsonl file of prompts
    limit: int = 10
    methods: list[str] = field(default_factory=lambda: ["vanilla", "vanilla_eager", "eagle", "hf_greedy",
                                                         "hf_prompt_lookup"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    warmup: int = 1
    # mt_bench: write eagle's tau per temperature into the card.json of head.path (the packaged head's card only
    # when head.path names it)
    update_card: bool = False
    # each prompt run by every method in turn (order rotated per prompt), so a drift in the machine's
    # speed over the run falls on all methods alike; false: each method runs all prompts in one block
    interleave: bool = True
    # e.g. [1,2,4,8]: the batched server sweep (eagle_lab/benchmark/sweep.py)
    concurrency: list[int] = field(default_factory=list)
    # the llamacpp* methods (eagle_lab/benchmark/llama_cpp_runs.py): llama.cpp's source with its tools built
    # ("" = $EAGLE_LAB_LLAMA_CPP), the GGUF pair from `python -m eagle_lab.export format=gguf out=DIR`, which
    # target file of it ("" = target-f32.gguf, else the only target-*.gguf), and the EAGLE-3 chain's length
    llama_cpp: str = ""
    gguf_dir: str = ""
    gguf_target: str = ""
    llama_cpp_draft: int = 3
    llama_cpp_args: list[str] = field(default_factory=list)  # appended to every llama.cpp command, e.g. [--no-repack]
    # heads a method names after '/' (eagle/NAME@tree) besides the packaged eagle2 / eagle3: NAME -> directory
    heads: dict[str, str] = field(default_factory=dict)


@dataclass
class ServerConfig:
    """`mode=server`: the OpenAI-compatible HTTP server (eagle_lab/serving/)."""

    host: str = "127.0.0.1"  # loopback only unless asked: there is no TLS
    port: int = 8000  # 0 = a free port the OS picks (logged)
    api_key: str = ""  # "" = no key; else clients send "Authorization: Bearer <key>"
    max_batch: int = 8  # sequences decoded at once (one target forward scores all their trees)
    max_queue: int = 64  # requests waiting for a slot; one more is answered 429
    # at each batch size >= 2 and temperature, drafting or plain decoding as timed (eagle_lab/serving/batch_trees.py)
    tree_per_batch: bool = True
    # the most tokens (prompt + completion) one request may hold; each of the max_batch rows of the
    # static cache is sized for it
    context: int = 2048


@dataclass
class ServeConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    # method=draft_model: a causal LM with the target's tokenizer (draft_model.path=DIR), loaded like a target
    draft_model: TargetConfig = field(default_factory=lambda: TargetConfig(name="draft_model", source="pretrained"))
    medusa: MedusaConfig = field(default_factory=MedusaConfig)  # method=medusa
    bench: BenchConfig = field(default_factory=BenchConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    # auto: compiled graphs where they exist on this machine (python -m eagle_lab.compile builds them; runs of
    # decoding.compile_min_tokens or more build what they lack); true: always, building what is missing;
    # false: eager over a dynamic cache
    compile: str = "auto"
    mode: str = "generate"  # generate | bench | server
    method: str = "eagle"  # eagle | vanilla | ngram | draft_model | medusa
    prompt: str = ""
    prompts_file: str = ""
    chat: bool | None = None  # prompts through the tokenizer's chat template; None: the target's own default
    system: str = ""  # optional system message when chat=true
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    output: str = "text"  # text (streamed) | json (one object per prompt)
    # also decode each prompt plainly (method=vanilla, same backend) and print speed, tau and whether equal
    compare: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:  # the one check: every mode and the decoding below it rely on it
            raise EagleLabError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.tree.validate()
        if self.chat is None:
            self.chat = self.target.chat


@dataclass
class OptimConfig:
    lr: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    grad_clip: float = 0.5


@dataclass
class TrainerConfig:
    features: str = "offline"  # offline (capture shards once, then train) | online
    features_dir: str = ""  # offline shards; "" = <cache>/features/<target>-<data hash>
    capture_only: bool = False  # capture the requested data's features, then exit (a background job)
    # evaluate the head at head.path on this data's held-out set (eval.json in the run directory); no training
    eval_only: bool = False
    # corpus layout (data.eval_conversations > 0): which decoder layers shards store besides the top
    # feature: auto = what this head reads; eagle3 = EAGLE-3's default layers too (reused by a later run)
    capture_layers: str = "auto"
    # dtype the target runs in while training (capture and the loss's LM head): "target" = target.dtype;
    # "auto" = bfloat16 where matmuls in it are native (CUDA, CPUs with AMX/AVX512-BF16), else target.dtype
    capture_dtype: str = "target"
    epochs: float = 0.0  # > 0: max_steps = epochs x train examples / sequences per step (steps follow the data)
    max_steps: int = 1000  # optimizer steps
    micro_batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1
    eval_depth: int = 5  # draft positions whose top-1 accuracy is measured on held-out data
    eval_every: int = 200
    eval_sequences: int = 64
    log_every: int = 10
    save_every: int = 200
    keep_checkpoints: int = 2
    resume: bool = False
    # start from a trained EAGLE head's weights and draft vocabulary (fine-tuning, e.g. on the target's own
    # replies); the optimizer and the schedule start fresh. "" = a new head
    init_from: str = ""
    stop_at: int = 0  # stop (checkpointed) after this step in this run, e.g. to time-box a run
    time_limit_min: float = 0.0  # stop (checkpointed) after this many minutes; 0 = no limit
    group_by_length: bool = True  # batch sequences of similar length (less padding, same epochs)
    cpu_autocast: str = "auto"  # bf16 matmuls when training on CPU: auto (if the CPU has bf16), on, off
    seed: int = 0


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    bf16: str = "auto"  # auto: on when training on CUDA
    # how long a rank waits at a collective: ranks split capture and regeneration work unevenly, so one may
    # wait hours at the barrier after it (the launchers end every rank when one dies, so no hang outlives it)
    timeout_min: float = 360.0


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    name: str = "default"
    run_dir: str = ""

    def validate(self) -> None:
        """Raise EagleLabError for the first setting, or combination of settings, that a run cannot honour (the
        trainer calls it before any work starts)."""
        if self.deepspeed.timeout_min <= 0:
            raise EagleLabError(f"deepspeed.timeout_min must be > 0, got {self.deepspeed.timeout_min}")
        if self.trainer.features not in ("offline", "online"):
            raise EagleLabError(f"trainer.features must be offline or online, got '{self.trainer.features}'")
        if self.trainer.max_steps < 1 or self.trainer.micro_batch_size < 1 or self.trainer.grad_accum < 1:
            raise EagleLabError("trainer.max_steps, micro_batch_size and grad_accum must be >= 1")
        if self.trainer.epochs < 0:
            raise EagleLabError(f"trainer.epochs must be >= 0 (0: use trainer.max_steps), got {self.trainer.epochs}")
        if self.trainer.cpu_autocast not in ("auto", "on", "off"):
            raise EagleLabError(f"trainer.cpu_autocast must be auto, on or off, got '{self.trainer.cpu_autocast}'")
        if self.trainer.capture_layers not in ("auto", "eagle3"):
            raise EagleLabError(f"trainer.capture_layers must be auto or eagle3, got '{self.trainer.capture_layers}'")
        check_kind(self.head)
        loss = self.loss
        if min(loss.accept_weight, loss.distill_top_k, loss.align_top_k, loss.opening_tokens) < 0 \
                or loss.opening_weight <= 0:
            raise EagleLabError("loss.accept_weight, distill_top_k, align_top_k and opening_tokens must be >= 0 "
                                f"(0: off) and loss.opening_weight > 0, got {loss.accept_weight}, "
                                f"{loss.distill_top_k}, {loss.align_top_k}, {loss.opening_tokens}, "
                                f"{loss.opening_weight}")
        if self.data.eval_conversations < 0 or self.data.shard_conversations < 1:
            raise EagleLabError("data.eval_conversations must be >= 0 and data.shard_conversations >= 1")
        if self.trainer.eval_only and (self.trainer.capture_only or self.head.kind not in ("eagle2", "eagle3")
                                      or self.head.path in ("", "random")):
            raise EagleLabError("trainer.eval_only evaluates a trained EAGLE head: set head.path=<head directory> "
                                "(head.kind eagle2 or eagle3) and leave trainer.capture_only off")
        if self.trainer.init_from and (self.trainer.eval_only or self.head.kind not in ("eagle2", "eagle3")):
            raise EagleLabError("trainer.init_from starts training from a trained EAGLE head (head.kind eagle2 or "
                                "eagle3); trainer.eval_only evaluates head.path instead")
        if self.data.add_regenerated < 0 or (self.data.add_regenerated > 0 and (
                self.data.regenerate.enabled or self.data.eval_conversations == 0)):
            raise EagleLabError("data.add_regenerated=N mixes the target's replies to N conversations into a "
                                "feature corpus of the source's own (data.eval_conversations > 0, "
                                "data.regenerate.enabled=false)")
        if self.data.eval_conversations > 0 and self.trainer.features != "offline":
            raise EagleLabError("data.eval_conversations > 0 (the shared feature corpus) needs "
                                "trainer.features=offline")


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="serve_schema", node=ServeConfig)
    store.store(name="train_schema", node=TrainConfig)


def to_object(cfg: DictConfig, schema: type):
    """Resolved DictConfig -> the schema dataclass (nested dataclasses included)."""
    merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    return OmegaConf.to_object(merged)
