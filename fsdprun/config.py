"""Recipes: typed schema, layered loading (`extends:`), command-line overrides, validation.

A recipe is YAML data read with a safe loader. `load_recipe("debug", ["optim.lr=1e-3"])`
resolves the layers in order (schema defaults, each `extends:` parent, the file, the
overrides), checks every key against the dataclass schema below (OmegaConf structured
configs do the type and enum checks), runs the cross-field checks, and returns one
`RecipeConfig` plus where each value came from. Every mistake raises `UserError` with one line
naming the key, the layer that set it and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import glob
import importlib.util
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdprun.errors import UserError
from fsdprun.trackers import tracker_errors

DEFAULT_SOURCE = "default"
CLI_SOURCE = "command line"


def _f(default: Any, help: str, **kwargs: Any) -> Any:
    """A schema field with its help text (feeds `fsdprun config --explain` and docs/recipes.md)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help}, **kwargs)


class Dtype(enum.Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class WrapPolicy(enum.Enum):
    block = "block"
    size = "size"
    classes = "classes"
    none = "none"


class Engine(enum.Enum):
    fsdp2 = "fsdp2"
    fsdp1 = "fsdp1"
    ddp = "ddp"


class Sharding(enum.Enum):
    full = "full"
    grad_op = "grad_op"
    hybrid = "hybrid"
    hybrid_zero2 = "hybrid_zero2"
    none = "none"


class CheckpointMode(enum.Enum):
    none = "none"
    full = "full"
    every_n = "every_n"
    selective = "selective"


class LossKind(enum.Enum):
    plain = "plain"
    chunked = "chunked"


class Float8(enum.Enum):
    off = "off"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class CompileMode(enum.Enum):
    default = "default"
    reduce_overhead = "reduce-overhead"
    max_autotune = "max-autotune"
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"


class OptimImpl(enum.Enum):
    auto = "auto"
    fused = "fused"
    foreach = "foreach"
    for_loop = "for_loop"


class Decay(enum.Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class NonFinite(enum.Enum):
    abort = "abort"
    skip = "skip"


class OnSaveError(enum.Enum):
    stop = "stop"
    continue_ = "continue"


class DataSource(enum.Enum):
    synthetic = "synthetic"
    tokens = "tokens"
    text = "text"


class TokenDtype(enum.Enum):
    auto = "auto"
    uint16 = "uint16"
    uint32 = "uint32"


class ModelInit(enum.Enum):
    pretrained = "pretrained"
    random = "random"


class DeviceKind(enum.Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"
    npu = "npu"
    xpu = "xpu"


@dataclass
class ModelConfig:
    family: str = _f("llama", "Model family; `llama` (RMSNorm, RoPE, GQA attention, SwiGLU).")
    dim: int = _f(256, "Hidden size.")
    n_layers: int = _f(4, "Number of transformer blocks.")
    n_heads: int = _f(8, "Attention heads.")
    n_kv_heads: int | None = _f(
        None, "Key/value heads for grouped-query attention; null = n_heads."
    )
    ffn_dim: int = _f(688, "Hidden size of the SwiGLU feed-forward.")
    vocab_size: int = _f(1024, "Vocabulary size.")
    max_seq_len: int = _f(256, "Longest sequence the RoPE table covers.")
    rope_theta: float = _f(10000.0, "RoPE base frequency.")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon.")
    tie_embeddings: bool = _f(False, "Share the token embedding with the output projection.")
    hf_path: str | None = _f(
        None,
        "A local HuggingFace model folder (config.json + safetensors; needs `pip install "
        "fsdprun[hf]`): the architecture comes from its config.json and the model.* "
        "architecture keys above are ignored. Relative to the recipe file that sets it.",
    )
    init: ModelInit = _f(
        ModelInit.pretrained,
        "With model.hf_path: `pretrained` loads the folder's weights (each rank reads only its "
        "shard), `random` initializes them.",
    )


@dataclass
class PrecisionConfig:
    param_dtype: Dtype = _f(
        Dtype.bf16, "Dtype of gathered parameters for compute (sharded master weights stay fp32)."
    )
    reduce_dtype: Dtype = _f(Dtype.fp32, "Dtype of the gradient reduce-scatter.")
    buffer_dtype: Dtype | None = _f(
        None,
        "fsdp1: MixedPrecision's buffer_dtype (cast module buffers, here the RoPE table); null = "
        "keep their dtype. fsdp2 and ddp do not cast buffers (no effect, said in the header).",
    )
    float8: Float8 = _f(
        Float8.off,
        "float8 training of the Linear layers through torchao (`pip install fsdprun[float8]`; "
        "fsdp2 only; CUDA compute capability >= 8.9, refused elsewhere before launch): "
        "`tensorwise` (one scale per tensor; float8 all-gather of the weights) or `rowwise` "
        "(one scale per row). Skips the output projection and Linears whose dims are not "
        "multiples of 16; weights, gradients and checkpoints stay in high precision.",
    )


@dataclass
class FsdpConfig:
    engine: Engine = _f(
        Engine.fsdp2,
        "Data-parallel engine: `fsdp2` (fully_shard, per-parameter sharding), `fsdp1` "
        "(FullyShardedDataParallel with the knobs below as FSDP1 spells them) or `ddp` "
        "(DistributedDataParallel with autocast: the unsharded baseline).",
    )
    sharding: Sharding = _f(
        Sharding.full,
        "What is sharded: `full` (ZeRO-3: parameters, gradients, optimizer state), `grad_op` "
        "(ZeRO-2: parameters stay gathered from forward to backward), `hybrid` (full inside "
        "groups of shard_group_size ranks, replicated across them), `hybrid_zero2` (grad_op "
        "inside groups), `none` (replicated, DDP-like). fsdp2: a 1-D or 2-D mesh plus "
        "reshard_after_forward; fsdp1: ShardingStrategy; ddp: ignored.",
    )
    shard_group_size: int | None = _f(
        None,
        "Ranks per shard group for hybrid/hybrid_zero2 (must divide the world size); "
        "null = launch.nproc_per_node (shard inside a node, replicate across nodes).",
    )
    reshard_after_forward: bool | None = _f(
        None,
        "fsdp2 only: override what fsdp.sharding implies (true = free gathered parameters "
        "after forward, ZeRO-3; false = keep them until backward, ZeRO-2); null = from "
        "fsdp.sharding.",
    )
    wrap: WrapPolicy = _f(
        WrapPolicy.block,
        "FSDP units: `block` = each transformer block then the root; `size` = modules with at "
        "least min_num_params not yet wrapped, then the root; `classes` = modules whose class "
        "name is in wrap_classes, then the root; `none` = the root only. fsdp1 uses its own "
        "auto_wrap_policy for each.",
    )
    min_num_params: int = _f(1_000_000, "Threshold of the `size` wrap policy.")
    wrap_classes: list[str] = _f([], "Class names for the `classes` wrap policy.")
    forward_prefetch: int = _f(
        0,
        "All-gather this many next units ahead in forward; 0 = none. fsdp2: explicit "
        "prefetch of that depth; fsdp1: forward_prefetch=True (one unit) when > 0.",
    )
    backward_prefetch: str = _f(
        "pre",
        "Backward prefetch: `pre` (gather the next unit before this one's gradients: FSDP1 "
        "BACKWARD_PRE, FSDP2's implicit prefetch), `post` (FSDP1 BACKWARD_POST), `none`, or a "
        "depth N >= 1 (fsdp2: explicit prefetch of N units; fsdp1: BACKWARD_PRE).",
    )
    limit_all_gathers: bool = _f(
        True,
        "fsdp1: rate-limit all-gathers in flight (FSDP1's limit_all_gathers). fsdp2 needs no "
        "limiter (no effect, said in the header).",
    )
    use_orig_params: bool = _f(
        True,
        "fsdp1: expose the original parameters (needed by compile and per-parameter weight "
        "decay); false = flat parameters. fsdp2 always keeps per-parameter tensors.",
    )
    cpu_offload: bool = _f(
        False, "Keep sharded parameters, gradients and optimizer state in host memory."
    )
    accumulate_unsharded: bool = _f(
        False,
        "Gradient accumulation without communication: keep every parameter's whole unsharded "
        "gradient on every rank until the last micro-step, then reduce once (fsdp2 "
        "set_requires_gradient_sync(False), in reduce_dtype; fsdp1 no_sync, in param_dtype). "
        "Saves the reduce-scatters of the other micro-steps at the cost of the whole model's "
        "gradients per rank (`fsdprun plan` counts them). false = reduce-scatter into the "
        "gradient shards on every micro-step (fsdp2 hybrid and none defer only the replica "
        "all-reduce). ddp and fsdp1 `none` always accumulate locally: their gradients are "
        "whole anyway.",
    )


@dataclass
class ActivationCheckpointingConfig:
    mode: CheckpointMode = _f(
        CheckpointMode.none,
        "Recompute block activations in backward: `none`, `full` (every block), `every_n`, "
        "`selective` (every block, op by op: matmul and attention outputs are kept, the cheap "
        "elementwise ops recomputed).",
    )
    every_n: int = _f(2, "With mode `every_n`: checkpoint every n-th block.")


@dataclass
class CompileConfig:
    enabled: bool = _f(False, "torch.compile the model.")
    per_block: bool = _f(
        True, "Compile each transformer block separately (fast, FSDP-friendly); false = whole."
    )
    fullgraph: bool = _f(False, "Ask torch.compile for a single graph (error on graph breaks).")
    mode: CompileMode = _f(CompileMode.default, "torch.compile mode.")


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "Peak learning rate of AdamW.")
    betas: list[float] = _f([0.9, 0.95], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    weight_decay: float = _f(0.1, "Decoupled weight decay.")
    implementation: OptimImpl = _f(
        OptimImpl.auto,
        "AdamW kernel: `auto` = fused on CUDA/XPU/NPU, foreach elsewhere; or force "
        "`fused`, `foreach`, `for_loop`.",
    )


@dataclass
class ScheduleConfig:
    warmup_steps: int = _f(0, "Linear warm-up from 0 to optim.lr over this many steps.")
    decay: Decay = _f(Decay.cosine, "Shape after warm-up: `cosine`, `linear` or `constant`.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of optim.lr.")


@dataclass
class TrainConfig:
    steps: int = _f(100, "Optimizer steps to run.")
    global_batch_size: int = _f(
        8, "Sequences per optimizer step over all ranks (kept when the world size changes)."
    )
    micro_batch_size: int = _f(
        1,
        "Sequences per rank per forward/backward; gradient accumulation = global_batch_size / "
        "(micro_batch_size x data-parallel ranks).",
    )
    seq_len: int = _f(256, "Tokens per sequence.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    seed: int = _f(0, "Seed of the initial weights and the data order.")
    nonfinite: NonFinite = _f(
        NonFinite.abort,
        "A non-finite loss or gradient norm on any rank: `abort` (saves nothing from that step) "
        "or `skip` the step (weights, optimizer state and LR schedule untouched).",
    )
    max_skipped: int = _f(5, "With nonfinite=skip: abort after this many skipped steps in a row.")
    loss: LossKind = _f(
        LossKind.plain,
        "`plain`: the model returns the logits and cross_entropy takes them (the fp32 logits of "
        "a micro-batch live until backward); `chunked`: the output projection and the loss are "
        "computed per chunk of loss_chunk_size tokens with their gradients, so the whole logits "
        "never exist (recommended for large vocabularies).",
    )
    loss_chunk_size: int = _f(4096, "With loss=chunked: tokens per chunk.")


@dataclass
class DataConfig:
    source: DataSource = _f(
        DataSource.synthetic,
        "`synthetic`: sample i is a function of (train.seed, i) only; a noisy permutation "
        "chain the model can learn, so the loss falls. `tokens`: pre-tokenized files "
        "(data.paths). `text`: .txt/.jsonl files tokenized at start by data.tokenizer. Token "
        "and text samples are windows of train.seq_len + 1 tokens in an order set by train.seed.",
    )
    noise: float = _f(0.1, "Synthetic data: probability that a token is random.")
    paths: list[str] = _f(
        [],
        "Training files. tokens: `.bin` (flat uint16/uint32 array, the nanoGPT layout) or "
        "`.npy` (1-D uint16/uint32); text: `.txt` (one document per file) or `.jsonl`. "
        "Relative paths are relative to the recipe file that sets them (the working directory "
        "for command-line overrides).",
    )
    val_paths: list[str] = _f(
        [], "Validation files, of the same kind as data.paths (or use data.val_fraction)."
    )
    val_fraction: float = _f(
        0.0,
        "Hold out this fraction of the training windows (the last ones) for validation; 0 = "
        "none. Not together with data.val_paths.",
    )
    token_dtype: TokenDtype = _f(
        TokenDtype.auto,
        "Element type of `.bin` token files: `auto` = what the data.json beside the file says "
        "(written by `fsdprun prepare-data`), else uint16 (nanoGPT).",
    )
    text_field: str = _f("text", "`.jsonl` text files: the field holding each document's text.")
    tokenizer: str = _f(
        "byte",
        "Tokenizer of `text` data: `byte` (built in: 256 byte values + end-of-text = 257 "
        "tokens) or the path of a HuggingFace tokenizer.json (needs `pip install tokenizers`).",
    )


@dataclass
class EvalConfig:
    every_steps: int = _f(
        0,
        "Compute the validation loss every this many steps and after the last step; 0 = off. "
        "Synthetic data validates on samples training never reads; token and text data need "
        "data.val_paths or data.val_fraction.",
    )
    batches: int = _f(
        4, "Global batches (of train.global_batch_size sequences) per validation pass."
    )


@dataclass
class CheckpointConfig:
    every_steps: int = _f(0, "Save a checkpoint every this many steps; 0 = only the final one.")
    save_final: bool = _f(True, "Save a checkpoint after the last step.")
    keep_last: int = _f(
        3, "Keep this many newest complete checkpoints, delete older ones; 0 = keep all."
    )
    async_save: bool = _f(
        False,
        "Write checkpoints in the background (DCP async save on a dedicated gloo group): training "
        "is blocked only while state is copied; at most one save in flight.",
    )
    load_from: str | None = _f(
        None,
        "Initialize the model weights (only) from this checkpoint directory — fine-tuning; the "
        "optimizer, schedule and data start fresh.",
    )
    on_save_error: OnSaveError = _f(
        OnSaveError.stop,
        "A save that fails (full disk, unwritable folder): `stop` the run (exit 1, one line: the "
        "checkpoint, bytes needed and free, the earlier checkpoint kept) or `continue` training "
        "and try again at the next save; a failed final save always fails the run. The partial "
        "folder is removed either way.",
    )


@dataclass
class LaunchConfig:
    nproc_per_node: int = _f(1, "Worker processes per node (one per device on GPU).")
    nnodes: int = _f(1, "Number of nodes.")
    node_rank: int = _f(0, "This node's rank; node 0 hosts the rendezvous store.")
    rdzv_endpoint: str = _f(
        "",
        "HOST:PORT of the c10d rendezvous; required with nnodes > 1. Empty = 127.0.0.1 with a "
        "free port (single node).",
    )
    rdzv_timeout_s: int = _f(300, "Seconds to wait for all nodes to join the rendezvous.")
    max_restarts: int = _f(
        0,
        "Times the elastic agent restarts the workers after a failure; a restarted group resumes "
        "from the newest complete checkpoint.",
    )
    timeout_s: int = _f(
        600,
        "Collective timeout: a rank that stops answering fails the run after this many seconds, "
        "naming the step and the rank, instead of hanging.",
    )
    device: DeviceKind = _f(
        DeviceKind.auto,
        "`auto` (cuda, then npu, then xpu, else cpu), `cuda` (nccl), `cpu` (gloo), `npu` "
        "(hccl; needs torch_npu), `xpu` (xccl).",
    )
    device_memory_gb: float | None = _f(
        None,
        "Memory of one device in GB (10^9 bytes), for `fsdprun plan`'s fits / does not fit; "
        "null = unknown (or give --device-memory).",
    )


@dataclass
class OutputConfig:
    run_dir: str | None = _f(
        None, "Run directory; null = runs/<recipe>-<YYYYmmdd-HHMMSS> under the working dir."
    )
    log_every: int = _f(10, "Log (and write metrics.jsonl) every this many steps.")
    metrics_file: str = _f(
        "metrics.jsonl",
        "File in the run directory for metrics events: a file name ending in .jsonl (no folder, "
        "no `..`).",
    )
    timing_warmup_steps: int = _f(
        2, "Steps left out of the step-time and throughput figures (compile, allocator warm-up)."
    )
    peak_tflops: float | None = _f(
        None,
        "Peak dense TFLOP/s of one device for MFU; null = look the device up in the built-in "
        "table (MFU n/a when it is not there).",
    )
    tensorboard: bool = _f(
        False,
        "Write the metrics to RUN_DIR/tensorboard/ for TensorBoard (rank 0; needs `pip install "
        "fsdprun[tensorboard]`). A resumed run appends to it.",
    )
    wandb: dict[str, str] | None = _f(
        None,
        "Log the metrics to Weights & Biases: a mapping of `project` (fsdprun), `name` (the run "
        "directory's name) and `mode` (`offline`: no network, RUN_DIR/wandb/, `wandb sync` "
        "later; `online`; `disabled`); `{}` for the defaults, null = off (needs `pip install "
        "fsdprun[wandb]`). A resumed run continues the same W&B run.",
    )


@dataclass
class ProfileConfig:
    enabled: bool = _f(
        False,
        "Run torch.profiler over `active` steps of this launch (after `wait` + `warmup` more) and "
        "write one trace per profiled rank, RUN_DIR/profile/rank-N.pt.trace.json (Chrome/Perfetto "
        "JSON; TensorBoard's profiler plugin opens the folder too).",
    )
    wait: int = _f(1, "Steps of this launch before the profiler starts warming up.")
    warmup: int = _f(1, "Steps profiled and discarded (the profiler's own start-up cost).")
    active: int = _f(2, "Steps recorded into the trace.")
    ranks: list[int] = _f([0], "Ranks that profile, each writing its own trace; [] = every rank.")
    memory_snapshot: bool = _f(
        False,
        "CUDA only: record the caching allocator's history from the profiler's start and dump "
        "it with the trace, RUN_DIR/profile/memory-rank-N.pickle (open it in "
        "pytorch.org/memory_viz).",
    )


@dataclass
class LoraConfig:
    rank: int = _f(
        0,
        "LoRA rank r: train low-rank adapters `scale * B @ A` (A: r x in, B: out x r) beside "
        "the lora.targets Linear layers of every block, with all other parameters frozen; 0 = "
        "off (full fine-tuning). Needs fsdp.engine fsdp2 or ddp.",
    )
    alpha: float = _f(16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank.")
    dropout: float = _f(0.0, "Dropout on the adapter's input (training only), in [0, 1).")
    targets: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        "Linear layers of the blocks that get adapters: names in either spelling (HF q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj = built-in wq, wk, wv, wo, w1, "
        "w3, w2) or module path patterns (`layers.*.attention.wq`). A target that matches no "
        "Linear is refused when the model is built.",
    )


def _lora_errors(cfg: RecipeConfig) -> list[str]:
    lora = cfg.lora
    if lora.rank < 0:
        return [f"lora.rank must be >= 0 (got {lora.rank}); 0 turns LoRA off"]
    if lora.rank == 0:
        return []
    errors = []
    if not (lora.alpha > 0 and math.isfinite(lora.alpha)):
        errors.append(f"lora.alpha must be > 0 (got {lora.alpha})")
    if not 0 <= lora.dropout < 1:
        errors.append(f"lora.dropout must be in [0, 1) (got {lora.dropout})")
    if not lora.targets:
        errors.append("lora.targets is empty; list Linear layers such as [q_proj, v_proj]")
    if cfg.fsdp.engine is Engine.fsdp1:
        # FSDP1 flattens a unit's frozen base weights and trainable adapters into one flat
        # parameter whose gradient and optimizer state cover the frozen part too.
        errors.append(
            f"lora.rank={lora.rank} needs fsdp.engine=fsdp2 or ddp (got fsdp1); set "
            "fsdp.engine=fsdp2"
        )
    if cfg.precision.float8 is not Float8.off:
        errors.append(
            f"lora.rank={lora.rank} does not combine with precision.float8="
            f"{cfg.precision.float8.value}; set precision.float8=off"
        )
    return errors


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    compile: CompileConfig = field(default_factory=CompileConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def world_size(self) -> int:
        return self.launch.nproc_per_node * self.launch.nnodes


# --------------------------------------------------------------------------------------------
# Schema introspection


def schema_fields() -> dict[str, dataclasses.Field]:
    """Every leaf key of the schema as a dotted name, in declaration order."""
    out: dict[str, dataclasses.Field] = {}
    for section in dataclasses.fields(RecipeConfig):
        for f in dataclasses.fields(section.default_factory):
            out[f"{section.name}.{f.name}"] = f
    return out


SECTIONS = tuple(f.name for f in dataclasses.fields(RecipeConfig))

# Recipe spellings that cannot be Python field names.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}


def _closest(key: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not match:
        # A misspelt leaf in the right section is the common case: compare leaf names there.
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        leaf_match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        match = [by_leaf[leaf_match[0]]] if leaf_match else []
    return f"; did you mean '{match[0]}'?" if match else ""


# --------------------------------------------------------------------------------------------
# Reading recipe files


@dataclass
class Layer:
    """One layer of a recipe: where it came from and its keys (dotted) and values."""

    source: str
    values: dict[str, Any]


@dataclass
class ResolvedRecipe:
    config: RecipeConfig
    name: str
    layers: list[Layer]
    provenance: dict[str, str]

    def to_yaml(self) -> str:
        return dump_config(self.config)


def builtin_recipes() -> dict[str, str]:
    """Built-in recipe names → the first comment line (what it is for)."""
    out = {}
    for entry in sorted(resources.files("fsdprun.recipes").iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".yaml"):
            desc = ""
            for line in entry.read_text().splitlines():
                if line.startswith("#") and not line.lstrip("# ").startswith("fsdprun "):
                    desc = line.lstrip("# ").strip()
                    break
            out[entry.name[: -len(".yaml")]] = desc
    return out


def _builtin_text(name: str) -> str | None:
    entry = resources.files("fsdprun.recipes") / f"{name}.yaml"
    return entry.read_text() if entry.is_file() else None


# A recipe is a few screens of plain data: section, key, value, at most a list of values.
MAX_YAML_DEPTH = 8


class _NotPlainData(yaml.MarkedYAMLError):
    """YAML that a recipe refuses although it parses: anchors, aliases, deep nesting."""


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader without anchors and aliases (`&name`, `*name`) and with bounded
    nesting. Nine levels of ten aliases each are 485 bytes of text that expand to 10^9 values
    once merged; a recipe reuses values with `extends:` or `${key}` references instead. The
    composer is recursive: the depth bound keeps a deep nest from exhausting the stack."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _NotPlainData(
                problem="YAML anchors and aliases (&name, *name) are not allowed; a recipe is "
                "plain data (reuse values with `extends:` or ${section.key} references)",
                problem_mark=event.start_mark,
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise _NotPlainData(
                problem=f"nested deeper than {MAX_YAML_DEPTH} levels; a recipe value is a plain "
                "value or a list of them",
                problem_mark=event.start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str) -> Any:
    """YAML text as Python data, the way recipes and overrides are read (see `RecipeLoader`).

    Raises:
        yaml.YAMLError: not YAML, a tag other than the standard ones, an anchor, an alias, too
            deep.
        ValueError: a value Python refuses to convert (an integer of more than 4300 digits).
    """
    return yaml.load(text, Loader=RecipeLoader)  # a SafeLoader: no object construction


def _read_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = load_yaml(text)
    except _NotPlainData as e:
        mark = e.problem_mark
        raise UserError(f"{source}: line {mark.line + 1}: {e.problem}") from e
    except ValueError as e:
        raise UserError(f"{source}: unreadable value ({str(e).split(':')[0]})") from e
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(
            f"{source}:{where}: YAML tag not allowed ({e.problem}); a recipe is plain data"
        ) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}:{where}: YAML syntax error: {problem}") from e
    if data is None:
        raise UserError(f"{source}: the recipe is empty; it needs at least one section")
    if not isinstance(data, dict):
        raise UserError(
            f"{source}: a recipe must be a mapping of sections (model:, train:, ...), "
            f"not a {type(data).__name__}"
        )
    return data


def _flatten(data: dict[str, Any], source: str) -> dict[str, Any]:
    fields = schema_fields()
    flat: dict[str, Any] = {}
    for section, body in data.items():
        section = str(section)
        if section not in SECTIONS:
            raise UserError(
                f"{source}: unknown section '{section}'{_closest(section, list(SECTIONS))}"
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise UserError(f"{source}: '{section}' must be a mapping of keys, not {body!r}")
        for key, value in body.items():
            dotted = f"{section}.{key}"
            dotted = ALIASES.get(dotted, dotted)
            if dotted not in fields:
                raise UserError(f"{source}: unknown key '{dotted}'{_closest(dotted, list(fields))}")
            _check_plain(dotted, value, source)
            _check_interpolation(dotted, value, source)
            flat[dotted] = value
    return flat


def _check_plain(key: str, value: Any, source: str) -> None:
    """A recipe value is a plain value or a flat list of them: refusing a container inside a
    container here keeps a deep nest away from OmegaConf, which recurses through it."""
    if isinstance(value, list | dict):
        items = value.values() if isinstance(value, dict) else value
        inner = next((v for v in items if isinstance(v, list | dict)), None)
        if inner is not None:
            raise UserError(
                f"{source}: {key}: a {type(inner).__name__} inside a {type(value).__name__} is "
                "not a recipe value; give a plain value or a flat list"
            )
        # OmegaConf cannot merge a list into a mapping or back (a bare TypeError).
        container = schema_fields()[key].type.partition("[")[0]
        if container in ("list", "dict") and type(value).__name__ != container:
            expected = "a list such as [a, b]" if container == "list" else "a mapping {k: v}"
            raise UserError(
                f"{source}: {key}: a {type(value).__name__} is not valid; give {expected}"
            )


# Plain references such as ${train.seq_len} are allowed; resolver calls such as ${oc.env:X}
# are not: a recipe is data and must not read the environment or run code.
_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")


def _check_interpolation(key: str, value: Any, source: str) -> None:
    if isinstance(value, list | dict):
        for item in value.values() if isinstance(value, dict) else value:
            _check_interpolation(key, item, source)
        return
    if not isinstance(value, str):
        return
    for ref in _INTERPOLATION.findall(value):
        if ref not in schema_fields():
            raise UserError(
                f"{source}: {key}: '${{{ref}}}' is not allowed; only references to other "
                f"recipe keys such as ${{train.seq_len}} are"
            )


def _resolve_path(ref: str, base: Path | None) -> tuple[str, str]:
    """A recipe reference → (identity, text). Files win over built-in names."""
    # A parent is looked up beside the recipe that extends it (never in the working directory).
    path = base / ref if base is not None else Path(ref)
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read the recipe: {e.strerror}") from e
        try:
            return str(path.resolve()), data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise UserError(
                f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the "
                "recipe as UTF-8"
            ) from e
    name = ref[:-5] if ref.endswith(".yaml") else ref
    text = _builtin_text(name) if "/" not in ref else None
    if text is not None:
        return f"builtin:{name}", text
    builtins = ", ".join(builtin_recipes())
    raise UserError(
        f"recipe '{ref}' is neither a file nor a built-in recipe (built-ins: {builtins})"
    )


# Keys holding file paths: a relative path means relative to the recipe file that set it, so a
# recipe and its data can move together (and built-in recipes find the data shipped beside them).
PATH_KEYS = ("data.paths", "data.val_paths", "data.tokenizer", "model.hf_path")


def _resolve_paths(values: dict[str, Any], base: Path) -> None:
    """Make the relative paths among `values` absolute against `base`, in place."""

    def resolve(key: str, item: Any) -> Any:
        if not isinstance(item, str) or not item or "${" in item:
            return item
        if key == "data.tokenizer" and item == "byte":
            return item
        return str((base / Path(item).expanduser()).resolve())

    for key in PATH_KEYS:
        if key not in values:
            continue
        value = values[key]
        if key in ("data.paths", "data.val_paths") and isinstance(value, str):
            value = [value]  # one file needs no list brackets
        if isinstance(value, list):
            values[key] = [resolve(key, item) for item in value]
        else:
            values[key] = resolve(key, value)


def _recipe_dir(identity: str) -> Path:
    if identity.startswith("builtin:"):
        return Path(str(resources.files("fsdprun.recipes")))
    return Path(identity).parent


def _load_layers(ref: str, base: Path | None, stack: tuple[str, ...]) -> list[Layer]:
    identity, text = _resolve_path(ref, base)
    source = identity if not identity.startswith("builtin:") else identity
    if identity in stack:
        chain = " -> ".join([*stack, identity])
        raise UserError(f"{source}: 'extends' cycle: {chain}; remove one of the links")
    data = _read_yaml(text, source)
    parents = data.pop("extends", None)
    if parents is None:
        parents = []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(f"{source}: 'extends' must be a recipe name or path, or a list of them")
    here = Path(identity).parent if not identity.startswith("builtin:") else None
    layers: list[Layer] = []
    for parent in parents:
        try:
            layers += _load_layers(parent, here, (*stack, identity))
        except UserError as e:
            if "neither a file nor a built-in" in str(e):
                raise UserError(f"{source}: extends {e}") from e
            raise
    values = _flatten(data, source)
    _resolve_paths(values, _recipe_dir(identity))
    layers.append(Layer(source, values))
    return layers


def parse_overrides(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`key=value` and `~key` strings → (values, keys to drop). Values are parsed as YAML."""
    fields = schema_fields()
    values: dict[str, Any] = {}
    drops: list[str] = []
    for item in overrides:
        if item.startswith("~"):
            key = ALIASES.get(item[1:], item[1:])
            if key not in fields:
                raise UserError(
                    f"override '{item}': unknown key '{key}'{_closest(key, list(fields))}"
                )
            drops.append(key)
            continue
        if "=" not in item:
            raise UserError(
                f"override '{item}' has no '='; write KEY=VALUE (or ~KEY to drop a key)"
            )
        key, raw = item.split("=", 1)
        key = ALIASES.get(key.strip(), key.strip())
        if key not in fields:
            raise UserError(f"override '{item}': unknown key '{key}'{_closest(key, list(fields))}")
        value = _parse_value(key, raw, fields[key])
        _check_plain(key, value, CLI_SOURCE)
        _check_interpolation(key, value, CLI_SOURCE)
        values[key] = value
    return values, drops


def _parse_value(key: str, raw: str, f: dataclasses.Field) -> Any:
    """An override's text as YAML (read as recipes are: no anchors, aliases or deep nests),
    except for string keys, which take the text verbatim (so a run dir `2024-01-01` or an
    endpoint `host:30` are not read as a date or a number)."""
    if f.type in ("str", "str | None"):
        return None if f.type == "str | None" and raw in ("null", "~") else raw
    try:
        return load_yaml(raw) if raw.strip() else ""
    except _NotPlainData as e:
        raise UserError(f"{CLI_SOURCE}: {key}: {e.problem}") from e
    except ValueError as e:
        raise UserError(f"{CLI_SOURCE}: {key}: unreadable value ({str(e).split(':')[0]})") from e
    except yaml.YAMLError:
        return raw


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        section, leaf = key.split(".", 1)
        out.setdefault(section, {})[leaf] = value
    return out


# Longest value that ${...} references may build (PATH_MAX on Linux): a chain of values that
# each repeat the previous one ten times would otherwise grow ten-fold per key.
MAX_EXPANDED_CHARS = 4096


def _check_expansion(merged: Any) -> None:
    """Refuse a value whose references would expand beyond MAX_EXPANDED_CHARS, measured on the
    unresolved values (nothing is expanded); reference cycles are left to OmegaConf."""
    raw = OmegaConf.to_container(merged, resolve=False, enum_to_str=True)
    sizes: dict[str, int] = {}

    def size(value: Any, stack: tuple[str, ...]) -> int:
        if isinstance(value, list):
            return 2 + sum(size(v, stack) + 2 for v in value)
        if not isinstance(value, str):
            return len(str(value))
        total = len(_INTERPOLATION.sub("", value))
        for ref in _INTERPOLATION.findall(value):
            if ref in stack or ref not in schema_fields():
                continue
            if ref not in sizes:
                section, leaf = ref.split(".")
                sizes[ref] = size(raw[section][leaf], (*stack, ref))
            total += sizes[ref]
        return total

    for key in schema_fields():
        section, leaf = key.split(".")
        value = raw[section][leaf]
        if "${" in str(value) and size(value, (key,)) > MAX_EXPANDED_CHARS:
            raise UserError(
                f"recipe: {key}: its ${{...}} references expand to more than "
                f"{MAX_EXPANDED_CHARS} characters; reference shorter values"
            )


def _merge(layers: list[Layer]) -> RecipeConfig:
    merged = OmegaConf.structured(RecipeConfig)
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, _nest(layer.values))
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            msg = str(e).splitlines()[0]
            raise UserError(f"{layer.source}: {key}: {msg}") from e
    _check_expansion(merged)
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise UserError(f"recipe: {key}: {str(e).splitlines()[0]}") from e


def load_recipe(
    recipe: str,
    overrides: list[str] | None = None,
    *,
    world_size: int | None = None,
    check: bool = True,
) -> ResolvedRecipe:
    """Resolve a recipe reference plus overrides into a validated config.

    Args:
        recipe: a YAML path or a built-in recipe name.
        overrides: `key=value` / `~key` strings, applied last.
        world_size: the real number of ranks when known (a worker); else launch.* decides.
        check: run the cross-field checks (`validate`); the caller runs them itself if False.

    Raises:
        UserError: anything wrong with the recipe, one line.
    """
    layers = _load_layers(recipe, None, ())
    values, drops = parse_overrides(overrides or [])
    for key in drops:
        for layer in layers:
            layer.values.pop(key, None)
    if values:
        _resolve_paths(values, Path.cwd())
        layers.append(Layer(CLI_SOURCE, values))
    config = _merge(layers)
    provenance = {key: DEFAULT_SOURCE for key in schema_fields()}
    for layer in layers:
        for key in layer.values:
            provenance[key] = layer.source
    errors = validate(config, world_size=world_size) if check else []
    if errors:
        raise UserError("; ".join(errors))
    name = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    return ResolvedRecipe(config=config, name=name, layers=layers, provenance=provenance)


# --------------------------------------------------------------------------------------------
# Cross-field checks


def validate(cfg: RecipeConfig, *, world_size: int | None = None) -> list[str]:
    """Checks that span keys; returns one message per problem (empty when valid)."""
    errors: list[str] = []
    m, t = cfg.model, cfg.train

    def positive(key: str, value: float) -> None:
        if not (value > 0 and math.isfinite(value)):  # NaN fails every comparison
            errors.append(f"{key} must be > 0 (got {value})")

    for key in (
        "model.dim", "model.n_layers", "model.n_heads", "model.ffn_dim", "model.vocab_size",
        "model.max_seq_len", "model.rope_theta", "model.norm_eps", "optim.lr", "optim.eps",
        "train.steps", "train.global_batch_size", "train.micro_batch_size", "train.seq_len",
        "launch.nproc_per_node", "launch.nnodes", "output.log_every", "fsdp.min_num_params",
        "launch.rdzv_timeout_s", "launch.timeout_s", "eval.batches",
    ):  # fmt: skip
        section, leaf = key.split(".")
        positive(key, getattr(getattr(cfg, section), leaf))
    for key in ("optim.weight_decay", "train.grad_clip", "schedule.warmup_steps",
                "launch.max_restarts", "launch.node_rank", "fsdp.forward_prefetch",
                "checkpoint.every_steps", "checkpoint.keep_last", "train.max_skipped",
                "output.timing_warmup_steps", "train.seed", "eval.every_steps"):  # fmt: skip
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        if not (value >= 0 and math.isfinite(value)):
            errors.append(f"{key} must be >= 0 (got {value})")
    errors += _string_errors(cfg)
    if errors:
        return errors

    n_kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    if m.dim % m.n_heads:
        errors.append(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads})")
    elif (m.dim // m.n_heads) % 2:
        errors.append(f"model.dim / model.n_heads ({m.dim // m.n_heads}) must be even for RoPE")
    if n_kv <= 0 or m.n_heads % n_kv:
        errors.append(
            f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({n_kv})"
        )
    if m.family != "llama":
        errors.append(f"model.family: '{m.family}' is not known; the built-in family is 'llama'")
    if m.hf_path is not None:
        if not (Path(m.hf_path) / "config.json").is_file():
            errors.append(f"model.hf_path: {m.hf_path} has no config.json (a HuggingFace folder?)")
        # find_spec only looks the package up: the check stays fast without importing it.
        if importlib.util.find_spec("transformers") is None:
            errors.append("model.hf_path needs transformers: pip install 'fsdprun[hf]'")
    elif t.seq_len > m.max_seq_len:
        errors.append(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            "raise model.max_seq_len or shorten train.seq_len"
        )
    ws = world_size if world_size is not None else cfg.world_size
    per_step = t.micro_batch_size * ws
    if t.global_batch_size % per_step:
        errors.append(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel ranks ({ws}) = "
            f"{per_step}; change one of them"
        )
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        errors.append(f"optim.betas must be two numbers in [0, 1) (got {cfg.optim.betas})")
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        errors.append(f"schedule.min_lr_ratio must be in [0, 1] (got {cfg.schedule.min_lr_ratio})")
    if cfg.schedule.warmup_steps > t.steps:
        errors.append(
            f"schedule.warmup_steps ({cfg.schedule.warmup_steps}) exceeds train.steps ({t.steps})"
        )
    errors += _fsdp_errors(cfg, ws)
    if cfg.fsdp.wrap is WrapPolicy.classes and not cfg.fsdp.wrap_classes:
        errors.append("fsdp.wrap is 'classes' but fsdp.wrap_classes is empty; list class names")
    if t.loss_chunk_size < 1:
        errors.append(f"train.loss_chunk_size must be >= 1 (got {t.loss_chunk_size})")
    if cfg.precision.float8 is not Float8.off and cfg.fsdp.engine is not Engine.fsdp2:
        errors.append(
            f"precision.float8={cfg.precision.float8.value} needs fsdp.engine=fsdp2 (got "
            f"{cfg.fsdp.engine.value}); or set precision.float8=off"
        )
    ac = cfg.activation_checkpointing
    if ac.mode is CheckpointMode.every_n and ac.every_n < 1:
        errors.append(f"activation_checkpointing.every_n must be >= 1 (got {ac.every_n})")
    if not 0 <= cfg.data.noise <= 1:
        errors.append(f"data.noise must be in [0, 1] (got {cfg.data.noise})")
    errors += _data_errors(cfg)
    if cfg.launch.node_rank >= cfg.launch.nnodes:
        errors.append(
            f"launch.node_rank ({cfg.launch.node_rank}) must be < launch.nnodes "
            f"({cfg.launch.nnodes})"
        )
    if cfg.launch.rdzv_endpoint and not re.fullmatch(r"[^:\s]+:\d+", cfg.launch.rdzv_endpoint):
        errors.append(f"launch.rdzv_endpoint '{cfg.launch.rdzv_endpoint}' must look like HOST:PORT")
    if cfg.launch.device_memory_gb is not None and not cfg.launch.device_memory_gb > 0:
        errors.append(f"launch.device_memory_gb must be > 0 (got {cfg.launch.device_memory_gb})")
    if cfg.output.peak_tflops is not None and cfg.output.peak_tflops <= 0:
        errors.append(f"output.peak_tflops must be > 0 (got {cfg.output.peak_tflops})")
    errors += tracker_errors(tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb)
    errors += _profile_errors(cfg.profile, cfg.launch.device, ws)
    errors += _lora_errors(cfg)
    return errors


def _profile_errors(p: ProfileConfig, device: DeviceKind, world_size: int) -> list[str]:
    errors = [f"profile.{key} must be >= 0 (got {getattr(p, key)})"
              for key in ("wait", "warmup") if getattr(p, key) < 0]  # fmt: skip
    if p.active < 1:
        errors.append(f"profile.active must be >= 1 (got {p.active})")
    bad = [r for r in p.ranks if not 0 <= r < world_size]
    if bad:
        errors.append(f"profile.ranks {bad} are not ranks of this run (0..{world_size - 1})")
    if p.memory_snapshot and not p.enabled:
        errors.append("profile.memory_snapshot covers the profiled steps: set profile.enabled=true")
    elif p.memory_snapshot:
        kind = device.value
        if device is DeviceKind.auto:
            from fsdprun.device import resolve_device_kind  # imports torch: only when needed

            kind = resolve_device_kind(kind)
        if kind != "cuda":
            errors.append(
                "profile.memory_snapshot records the CUDA caching allocator: it is CUDA-only and "
                f"this run is on {kind} (launch.device={device.value}); set "
                "profile.memory_snapshot=false"
            )
    return errors


# Every string key (and list of strings) of the schema, with the kind of text it holds; a test
# keeps this table complete. Kinds: `name` (non-empty), `class` (a Python class name),
# `file`/`folder` (a path that must not be the other kind; existence is checked where the path
# is used), `endpoint` (HOST:PORT, checked in validate), `run_file` (a .jsonl file name inside
# the run directory: the only place fsdprun writes).
STRING_KEYS: dict[str, tuple[str, str]] = {
    "model.family": ("name", "a model family (llama)"),
    "model.hf_path": ("folder", "a HuggingFace model folder, or null"),
    "fsdp.backward_prefetch": ("name", "pre, post, none or a depth >= 1"),
    "fsdp.wrap_classes": ("class", "module class names such as TransformerBlock"),
    "data.paths": ("file", "token or text files"),
    "data.val_paths": ("file", "token or text files"),
    "data.text_field": ("name", "the .jsonl field holding the text"),
    "data.tokenizer": ("file", "byte or a tokenizer.json file"),
    "checkpoint.load_from": ("folder", "a checkpoint folder (RUN_DIR/checkpoints/step-N), or null"),
    "launch.rdzv_endpoint": ("endpoint", "HOST:PORT, or empty for one node"),
    "output.run_dir": ("folder", "a folder, or null for runs/<recipe>-<time>"),
    "output.metrics_file": ("run_file", "a .jsonl file name in the run directory (metrics.jsonl)"),
    "lora.targets": ("name", "Linear layer names such as q_proj or wq, or path patterns"),
}
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _string_problem(kind: str, value: str, run_dir: str | None) -> str | None:
    """What is wrong with one string of a STRING_KEYS kind, or None."""
    if _CONTROL_CHARS.search(value):
        return "contains a control character"
    if kind == "endpoint":
        port = value.rpartition(":")[2]
        return "has a port above 65535" if port.isdigit() and int(port) > 65535 else None
    if not value.strip():
        return "is empty"
    path = Path(value)
    if kind == "class" and not value.isidentifier():
        return "is not a class name"
    if kind == "file" and value != "byte" and path.is_dir():
        return "is a folder"
    if kind == "folder" and path.exists() and not path.is_dir():
        return "is not a folder"
    if kind == "run_file":
        if path.is_absolute():
            return "is an absolute path"
        if ".." in path.parts:
            return "leaves the run directory"
        if path.name != value or value == ".":
            return "is not a plain file name"
        if not value.endswith(".jsonl"):
            return "does not end in .jsonl"
        if run_dir is not None and (Path(run_dir) / value).is_dir():
            return f"is a folder in {run_dir}"
    return None


def _string_errors(cfg: RecipeConfig) -> list[str]:
    """The STRING_KEYS checks: empty, wrong kind, control characters, escapes from the run
    directory. Values are quoted with repr, so every message stays one line."""
    errors = []
    for key, (kind, expected) in STRING_KEYS.items():
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        for item in value if isinstance(value, list) else [value]:
            if item is None:
                continue
            problem = _string_problem(kind, str(item), cfg.output.run_dir)
            if problem:
                errors.append(f"{key}: {str(item)!r} {problem}; expected {expected}")
    return errors


BACKWARD_PREFETCH_MODES = ("pre", "post", "none")


def backward_prefetch_depth(fsdp: FsdpConfig) -> int:
    """fsdp.backward_prefetch as a depth: pre/post = 1 unit, none = 0, N = N (validated)."""
    value = str(fsdp.backward_prefetch)
    if value in BACKWARD_PREFETCH_MODES:
        return 0 if value == "none" else 1
    return int(value)


def effective_sharding(fsdp: FsdpConfig) -> Sharding:
    """fsdp.sharding with fsdp2's reshard_after_forward override applied."""
    s, raf = fsdp.sharding, fsdp.reshard_after_forward
    if raf is None or fsdp.engine is not Engine.fsdp2:
        return s
    if raf is False:
        return {Sharding.full: Sharding.grad_op, Sharding.hybrid: Sharding.hybrid_zero2}.get(s, s)
    return {Sharding.grad_op: Sharding.full, Sharding.hybrid_zero2: Sharding.hybrid}.get(s, s)


def shard_group_size(cfg: RecipeConfig, world_size: int | None = None) -> int:
    """Ranks that share one copy of the model state under the effective sharding."""
    ws = world_size if world_size is not None else cfg.world_size
    sharding = effective_sharding(cfg.fsdp)
    if cfg.fsdp.engine is Engine.ddp or sharding is Sharding.none:
        return 1
    if sharding in (Sharding.hybrid, Sharding.hybrid_zero2):
        return cfg.fsdp.shard_group_size or min(cfg.launch.nproc_per_node, ws)
    return ws


def _fsdp_errors(cfg: RecipeConfig, ws: int) -> list[str]:
    f = cfg.fsdp
    errors = []
    value = str(f.backward_prefetch)
    if value not in BACKWARD_PREFETCH_MODES and not (value.isdigit() and int(value) >= 1):
        errors.append(
            f"fsdp.backward_prefetch: '{value}' is not valid; use pre, post, none or a depth >= 1"
        )
    if f.engine is not Engine.fsdp2 and f.reshard_after_forward is not None:
        errors.append(
            f"fsdp.reshard_after_forward is an fsdp2 knob; with fsdp.engine={f.engine.value} set "
            "fsdp.sharding (full = reshard, grad_op = keep) instead"
        )
    if f.shard_group_size is not None:
        if f.shard_group_size < 1 or ws % f.shard_group_size:
            errors.append(
                f"fsdp.shard_group_size ({f.shard_group_size}) must divide the world size ({ws})"
            )
    elif f.sharding in (Sharding.hybrid, Sharding.hybrid_zero2) and ws % min(
        cfg.launch.nproc_per_node, ws
    ):
        errors.append(
            f"fsdp.sharding={f.sharding.value}: launch.nproc_per_node "
            f"({cfg.launch.nproc_per_node}) must divide the world size ({ws}); set "
            "fsdp.shard_group_size"
        )
    if f.engine is Engine.ddp and f.cpu_offload:
        errors.append("fsdp.cpu_offload needs a sharding engine; use fsdp.engine=fsdp1 or fsdp2")
    if f.engine is Engine.fsdp1 and f.cpu_offload and _runs_on_cpu(cfg.launch.device):
        # FSDP1's CPUOffload pins host memory, which needs an accelerator; FSDP2's policy can
        # leave it unpinned.
        errors.append(
            f"fsdp.cpu_offload=true with fsdp.engine=fsdp1 needs an accelerator (FSDP1 pins host "
            f"memory), but this run is on CPU (launch.device={cfg.launch.device.value}); use "
            "fsdp.engine=fsdp2 (its CPU offload works on CPU) or fsdp.cpu_offload=false"
        )
    if f.engine is Engine.fsdp1 and not f.use_orig_params:
        if cfg.compile.enabled:
            errors.append("fsdp.use_orig_params=false does not work with compile.enabled=true")
        if cfg.optim.weight_decay > 0:
            errors.append(
                "fsdp.use_orig_params=false: flat parameters mix decayed and non-decayed "
                "tensors; set optim.weight_decay=0 or keep use_orig_params=true"
            )
    return errors


# Device nodes that accelerator drivers create: NVIDIA, WSL2's GPU bridge, AMD ROCm, Intel and
# other DRM GPUs, Ascend NPUs. Without any of them no torch build sees an accelerator.
_ACCELERATOR_NODES = ("/dev/nvidia*", "/dev/dxg", "/dev/kfd", "/dev/dri/renderD*", "/dev/davinci*")


def accelerator_device_nodes() -> list[str]:
    """The accelerator device nodes of this machine (empty: CPU only, known without torch)."""
    return sorted(p for pattern in _ACCELERATOR_NODES for p in glob.glob(pattern))


def _runs_on_cpu(device: DeviceKind) -> bool:
    """Whether launch.device means CPU ranks on this machine (`auto` without an accelerator)."""
    if device is DeviceKind.auto:
        if not accelerator_device_nodes():
            return True  # `fsdprun config` stays torch-free on CPU machines
        from fsdprun.device import resolve_device_kind  # imports torch (~1.5 s): only here

        return resolve_device_kind(device.value) == "cpu"
    return device is DeviceKind.cpu


def _data_errors(cfg: RecipeConfig) -> list[str]:
    d = cfg.data
    errors = []
    if not 0 <= d.val_fraction < 1:
        errors.append(f"data.val_fraction must be in [0, 1) (got {d.val_fraction})")
    if d.source is DataSource.synthetic:
        if d.paths or d.val_paths:
            errors.append(
                "data.paths/data.val_paths are set but data.source is synthetic; set data.source "
                "to tokens or text"
            )
        return errors
    if not d.paths:
        errors.append(f"data.source is {d.source.value} but data.paths is empty; list the files")
    if d.val_paths and d.val_fraction:
        errors.append("set data.val_paths or data.val_fraction, not both")
    if cfg.eval.every_steps and not (d.val_paths or d.val_fraction):
        errors.append(
            f"eval.every_steps is {cfg.eval.every_steps} but there is no validation data; set "
            "data.val_paths or data.val_fraction (or eval.every_steps=0)"
        )
    if errors:
        return errors
    # The files themselves: headers and sizes only (milliseconds). Imported here because the
    # data package imports this module (and torch), which `fsdprun config` of a synthetic
    # recipe need not load.
    from fsdprun.data.preflight import check_data

    return check_data(cfg)


# --------------------------------------------------------------------------------------------
# Writing


def config_to_dict(cfg: RecipeConfig) -> dict[str, Any]:
    """Plain nested dict (enums as their values), for YAML, JSON and manifests."""

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return {
        s.name: {f.name: plain(getattr(getattr(cfg, s.name), f.name))
                 for f in dataclasses.fields(getattr(cfg, s.name))}
        for s in dataclasses.fields(cfg)
    }  # fmt: skip


def dump_config(cfg: RecipeConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def explain(resolved: ResolvedRecipe) -> str:
    """The resolved recipe as YAML with, after each key, the layer that set it."""
    data = config_to_dict(resolved.config)
    lines = []
    for section, body in data.items():
        lines.append(f"{section}:")
        for key, value in body.items():
            text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
            text = text[1:-1]  # drop the braces of the flow mapping
            lines.append(f"  {text:<44} # {resolved.provenance[f'{section}.{key}']}")
    return "\n".join(lines) + "\n"


def _type_name(f: dataclasses.Field) -> str:
    """A schema field's type as a recipe writer reads it: `int or null`, `enum` (its values are
    listed in the meaning), `list[str]`."""
    # Annotations are strings here (`from __future__ import annotations`): name the enums.
    parts = [p.strip() for p in str(f.type).split("|")]
    names = ["null" if p == "None" else "enum" if isinstance(globals().get(p), enum.EnumMeta) else p
             for p in parts]  # fmt: skip
    return " or ".join(names)


def recipe_reference() -> str:
    """The recipe reference as a Markdown table (every key, its type, its default, what it
    does); docs/recipes.md embeds it (scripts/update_docs.py) and a test keeps the two equal."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    defaults = config_to_dict(RecipeConfig())
    for key, f in schema_fields().items():
        section, leaf = key.split(".")
        default = defaults[section][leaf]
        text = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        choices = ""
        if isinstance(f.default, enum.Enum):
            choices = " One of: " + ", ".join(f"`{m.value}`" for m in type(f.default)) + "."
        rows.append(f"| `{key}` | {_type_name(f)} | `{text}` | {f.metadata['help']}{choices} |")
    return "\n".join(rows) + "\n"
