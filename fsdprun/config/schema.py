"""The recipe schema: one dataclass per recipe section, the enums of its choices, and every
field's help text (which feeds `fsdprun config --explain`, `--help` and docs/recipes.md).

Only data lives here: no loading (`load`), no checks (`validate`). OmegaConf reads these classes
as structured configs, so a wrong type or enum value is refused at merge time. Never imports
torch, nor any other fsdprun module but `rundir` (plain path names, which spells the metrics
file's default).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any

from fsdprun.rundir import DEFAULT_METRICS_FILE


def _f(default: Any, help: str, *, auto: bool = False, **kwargs: Any) -> Any:
    """A schema field with its help text (feeds `fsdprun config --explain` and docs/recipes.md);
    `auto`: its null means fsdprun decides, and `auto` is accepted as its spelling (AUTO)."""
    metadata = {"help": help, **({"auto": True} if auto else {})}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata, **kwargs)


# The spelling of null for the keys whose null lets fsdprun decide (`_f(..., auto=True)`), as
# `parallel.cp_impl` and the other enums spell their own `auto`: a recipe or an override may
# write either, the typed config holds None, and `fsdprun config` prints `auto`.
AUTO = "auto"


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


class Float8Filter(enum.Enum):
    default = "default"
    skip_small = "skip_small"


class CpImpl(enum.Enum):
    auto = "auto"
    alltoall = "alltoall"
    ring = "ring"


class PpSchedule(enum.Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"
    interleaved_zb = "interleaved_zb"


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
    chat = "chat"
    instruct = "instruct"
    hf_dataset = "hf_dataset"


class ChatTurns(enum.Enum):
    all = "all"
    last = "last"


class Truncate(enum.Enum):
    drop = "drop"
    truncate = "truncate"


class TokenDtype(enum.Enum):
    auto = "auto"
    uint16 = "uint16"
    uint32 = "uint32"


class ModelInit(enum.Enum):
    pretrained = "pretrained"
    random = "random"


class DeviceKind(enum.Enum):
    auto = "auto"
    accelerator = "accelerator"
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
        "architecture keys above are ignored. Relative to the recipe file that sets it. Or a "
        "Hugging Face Hub id (ORG/NAME), resolved to its snapshot in huggingface_hub's cache "
        "(downloaded by train/compare/tune when missing; docs/hub.md).",
    )
    init: ModelInit = _f(
        ModelInit.pretrained,
        "With model.hf_path: `pretrained` loads the folder's weights (each rank reads only its "
        "shard), `random` initializes them.",
    )
    trust_remote_code: bool = _f(
        False,
        "With model.hf_path: run the Python code a folder ships for its model (config.json's "
        "`auto_map`), as transformers' trust_remote_code does. Off: such a folder is refused "
        "before launch, naming its model type (a rank never asks on its terminal).",
    )
    moe_experts: int = _f(
        0,
        "The built-in Llama as a mixture of experts: each block's SwiGLU feed-forward becomes "
        "this many experts, stacked into [experts, rows, columns] parameters, and a linear "
        "router sends each token to model.moe_active of them (softmax, top-k: transformers' "
        "Qwen3-MoE routing; dropless, no capacity factor). The model.moe_* keys are its "
        "section; parallel.ep shards the experts. 0 = dense. Ignored with model.hf_path (its "
        "config.json says).",
    )
    moe_active: int = _f(2, "Experts each token passes through (top-k), <= model.moe_experts.")
    moe_ffn_dim: int | None = _f(None, "Hidden size of each expert's SwiGLU; null = model.ffn_dim.")
    moe_shared_ffn_dim: int = _f(
        0,
        "A shared expert: a dense SwiGLU of this hidden size that every token passes through, "
        "added to the routed experts' output (DeepSeek's); 0 = none.",
    )
    moe_norm_topk_prob: bool = _f(
        True,
        "Renormalize each token's top-k router probabilities to sum to 1 (transformers' "
        "norm_topk_prob; Mixtral always does).",
    )
    moe_aux_loss_coef: float = _f(
        0.0,
        "The router's load-balancing loss (transformers' load_balancing_loss_func over each "
        "micro-batch's tokens, padding excluded) times this coefficient, added to the loss; "
        "0 = off.",
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
        "`tensorwise` (one scale per tensor) or `rowwise` (one scale per row). Skips the "
        "output projection and Linears whose dims are not multiples of 16; weights, gradients "
        "and checkpoints stay in high precision.",
    )
    float8_all_gather: bool | None = _f(
        None,
        "tensorwise float8: all-gather the weights in float8 (1 byte a parameter) and "
        "precompute their scales after each optimizer step (true/false); `auto` (or null): on "
        "only where weights are gathered across ranks (a shard group, dp_shard, of more than 1 "
        "rank), since with nothing to gather it is pure overhead. The header says which was "
        "chosen and why.",
        auto=True,
    )
    float8_filter: Float8Filter = _f(
        Float8Filter.default,
        "Which Linears float8 converts: `default` (all but the output projection and dims not "
        "multiples of 16) or `skip_small` (also keep in high precision those too small to gain, "
        "by torchao's per-recipe size thresholds measured on an H100; torchtitan's "
        "auto_filter_small_kn). The header and `plan` list the Linears kept.",
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
        "inside groups), `none` (replicated across data-parallel ranks, DDP-like: under "
        "parallel.cp each copy is still sharded over its cp ranks, under parallel.tp split over "
        "its tp ranks; the header says what a rank holds). fsdp2: a 1-D or 2-D mesh plus "
        "reshard_after_forward; fsdp1: ShardingStrategy; ddp: ignored.",
    )
    shard_group_size: int | None = _f(
        None,
        "Data-parallel ranks per shard group for hybrid/hybrid_zero2 (must divide the "
        "data-parallel size, world size / (parallel.tp x parallel.cp)); null = one node's "
        "(shard inside a node, replicate across nodes). Under parallel.cp FSDP2 shards over "
        "these ranks x cp (2 at cp 2: groups of 4 ranks); under parallel.tp each parameter is "
        "split over the tp ranks besides.",
    )
    reshard_after_forward: bool | None = _f(
        None,
        "fsdp2 only: override what fsdp.sharding implies (true = free gathered parameters "
        "after forward, ZeRO-3; false = keep them until backward, ZeRO-2); `auto` (or null) = "
        "from fsdp.sharding.",
        auto=True,
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
class ParallelConfig:
    tp: int = _f(
        1,
        "Tensor-parallel degree: shard each block's matmuls over this many ranks (column-wise "
        "q/k/v and gate/up, row-wise o and down, sequence parallel on the norms, a vocab-sharded "
        "embedding and output with loss parallel), FSDP2 sharding over the other ranks. The mesh "
        "is [dp_replicate, dp_shard, tp] with tp the fastest dim (ranks inside a node); the "
        "data-parallel size is world size / tp. Must divide the heads, kv heads, ffn dim and "
        "train.seq_len (the vocab may shard unevenly); needs fsdp.engine=fsdp2 (no float8, LoRA, "
        "chunked loss, built-in Llama tied embeddings or cpu offload; compile per block, "
        "without activation checkpointing) and a model whose module layout its family's plan "
        "covers (not a mixture of experts). 1 = off. See docs/tensor-parallel.md.",
    )
    tp_across_nodes: bool = _f(
        False,
        "Allow a parallel.tp larger than launch.nproc_per_node (TP groups spanning nodes, whose "
        "per-layer collectives then cross the slower inter-node links); false = refused.",
    )
    cp: int = _f(
        1,
        "Context-parallel degree: split each sequence across this many ranks, which divides the "
        "activations by cp. The mesh is [dp_replicate, dp_shard, cp, tp]; FSDP2 shards the "
        "parameters over dp_shard x cp, so cp ranks hold no duplicate state; the data-parallel "
        "size is world size / (tp x cp). cp x tp must divide the world size and train.seq_len "
        "(and, for the all-to-all, cp the kv heads per TP rank); needs fsdp.engine=fsdp2 and "
        "the built-in Llama or an HF Llama folder (no other HF model types, LoRA, float8, "
        "compile or cpu offload yet). 1 = off. See docs/context-parallel.md.",
    )
    cp_impl: CpImpl = _f(
        CpImpl.auto,
        "How attention is computed across the split: `alltoall` (DeepSpeed-Ulysses: before "
        "attention each rank trades its sequence shard of all heads for the whole sequence of "
        "1/cp of the heads, and back after; needs the kv heads per TP rank divisible by cp), "
        "`ring` (ring attention: each rank's keys and values go round the cp group and every "
        "rank attends its own queries to each slice, exact block by block; any head count, no "
        "fused kernel; without tensor parallel), `auto` (alltoall when the heads divide, else "
        "ring).",
    )
    pp: int = _f(
        1,
        "Pipeline-parallel degree: split the model's layers into this many stages, the embedding "
        "on the first, the final norm, head and loss on the last, the blocks in between; a stage "
        "sends only its activations to the next, once per micro-batch. The mesh is [pp, "
        "dp_replicate, dp_shard, cp, tp] with pp outermost (stages across nodes, TP inside); "
        "FSDP2 shards each stage over its own data-parallel ranks, and the data-parallel size "
        "is world size / (pp x cp x tp). The pipeline's micro-batches are the step's "
        "gradient-accumulation micro-batches (global batch / (micro batch x dp)). Needs "
        "fsdp.engine=fsdp2, a family that declares its stages, untied embeddings, and at least "
        "one block per stage. 1 = off. See docs/pipeline-parallel.md.",
    )
    pp_schedule: PpSchedule = _f(
        PpSchedule.one_f_one_b,
        "The pipeline schedule (torch.distributed.pipelining): `gpipe` (every forward, then "
        "every backward: holds all micro-batches' activations), `1f1b` (one forward, one "
        "backward: stage s holds at most pp - s micro-batches' activations; needs micro-batches "
        ">= pp), `interleaved_1f1b` (parallel.pp_stages_per_rank stages per rank, looped: a "
        "smaller bubble for more sends; micro-batches a multiple of pp), `interleaved_zb` "
        "(interleaved zero bubble: each backward split into its input and weight gradients, the "
        "weight half filling the bubble). Refused where the installed torch lacks it.",
    )
    pp_stages_per_rank: int = _f(
        1,
        "Stages each pipeline rank holds (virtual stages): 1 for gpipe and 1f1b, >= 2 for the "
        "interleaved schedules, which place stage s on pp rank s mod pp. The model splits into "
        "pp x pp_stages_per_rank stages.",
    )
    pp_split: list[int] | None = _f(
        None,
        "Blocks per stage, first stage first (pp x pp_stages_per_rank counts, each >= 1, "
        "summing to the model's layers), e.g. [3, 5] for 8 layers on pp 2. null = balanced by "
        "training FLOPs: the head's matmul counts on the last stage, the embedding (a lookup) "
        "on none.",
    )
    ep: int = _f(
        1,
        "Expert-parallel degree: shard each mixture-of-experts layer's experts over this many "
        "ranks (experts / ep on each), taken from the data-parallel ranks (torchtitan's "
        "layout: the mesh is [dp_shard_mod_ep, ep]); each token is sent to its experts' ranks "
        "by an all-to-all and back, dropless. FSDP2 shards the attention and dense layers over "
        "all data-parallel ranks as before, each expert's weights over the dp_shard_mod_ep "
        "ranks, so expert state per rank is still experts x expert size / data-parallel ranks "
        "but a rank gathers only its own experts. Must divide the experts and the "
        "data-parallel ranks of a shard group (hybrid sharding: an ep group inside each); "
        "needs fsdp.engine=fsdp2, a model with experts (model.moe_experts, or an HF folder whose "
        "family declares them), and no tp or cp yet (under pp, each stage's experts over an "
        "ep group of its own ranks). 1 = off. See "
        "docs/expert-parallel.md.",
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
    cache_dir: str | None = _f(
        None,
        "Folder of torch's compile caches (TORCHINDUCTOR_CACHE_DIR: Inductor's FX graph cache, "
        "AOTAutograd's cache, and Triton's kernels under it unless TRITON_CACHE_DIR is set), "
        "set for the workers before anything compiles: a folder every node can reach lets a "
        "restart or a new job on fresh nodes reuse the compiled graphs. Relative to the recipe "
        "file that sets it (the working directory for command-line overrides); created if "
        "missing, refused before launch if it cannot be written. null = torch's default "
        "(TORCHINDUCTOR_CACHE_DIR if set, else /tmp/torchinductor_USER, which each node and "
        "container has to itself). The run's summary shows the compile time and the caches' "
        "hits and misses.",
    )


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "Peak learning rate of AdamW.")
    betas: list[float] = _f([0.9, 0.95], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    weight_decay: float = _f(0.1, "Decoupled weight decay.")
    implementation: OptimImpl = _f(
        OptimImpl.auto,
        "AdamW kernel: `auto` = fused on CUDA/XPU/NPU/CPU, foreach elsewhere and under fp16 "
        "with fsdp1/fsdp2 (torch's fused step fails with FSDP's sharded gradient scaler; "
        "`fused` is refused there); or force `fused`, `foreach`, `for_loop`.",
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


# The roles every chat template knows; data.roles maps others onto them.
CHAT_ROLES = ("system", "user", "assistant")


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
        "tokens), the path of a HuggingFace tokenizer.json or of a folder holding one (needs "
        "`pip install tokenizers`). chat data: a HuggingFace folder holding tokenizer.json and "
        "tokenizer_config.json with its `chat_template` (e.g. the model.hf_path folder); "
        "instruct data: any of these. A Hub id (ORG/NAME) names a folder of huggingface_hub's "
        "cache, as for model.hf_path.",
    )
    eos_token: str | None = _f(
        None,
        "The end-of-text token put after each document of `text` data and each instruct "
        "response: null = found in data.tokenizer's folder (tokenizer_config.json's eos_token, "
        "then config.json's or generation_config.json's eos_token_id), else the first of "
        "<|endoftext|>, <|end_of_text|>, </s>, <eos>, [SEP] in the vocabulary, else refused "
        "before launch; a token's spelling (e.g. `[EOS]`) names it; `none` puts no separator "
        "between documents, on purpose. `byte`: its end-of-text is id 256.",
    )
    # Fine-tuning examples (data.source chat, instruct, hf_dataset): see fsdprun/data/sft.py.
    roles: dict[str, str] = _f(
        {},
        "chat data: roles beyond system, user and assistant, each mapped to the role the chat "
        "template is given, e.g. {human: user, gpt: assistant}; a role mapped to itself "
        "(`{tool: tool}`) reaches the template as it is, as context. A role neither known nor "
        "mapped is refused, naming the file and line.",
    )
    max_line_bytes: int = _f(
        1 << 20,
        "Fine-tuning examples: the largest example read, in bytes of its .jsonl line (or of its "
        "text, for parquet and hf_dataset rows); a larger one is refused before it is tokenized, "
        "naming the file and line. 1 MiB is about 250k tokens, far beyond any train.seq_len; "
        "raise it for longer examples.",
    )
    chat_turns: ChatTurns = _f(
        ChatTurns.all,
        "chat data: which assistant turns train: `all` of them, or only the `last`; every other "
        "token (system, user, template markup) is context only.",
    )
    prompt_field: str = _f("prompt", "instruct data: the field holding each example's prompt.")
    response_field: str = _f(
        "response", "instruct data: the field holding each example's response (the trained part)."
    )
    template: str = _f(
        "### Instruction:\n{prompt}\n\n### Response:\n",
        "instruct data: the text before the response; `{prompt}` is replaced by the prompt. The "
        "response and end-of-text follow it.",
    )
    truncate: Truncate = _f(
        Truncate.drop,
        "Fine-tuning examples longer than train.seq_len + 1 tokens: `drop` them, or `truncate` "
        "them to that length; the counts are printed at start.",
    )
    pack: bool = _f(
        True,
        "Fine-tuning examples: pack several whole examples into each row (positions restart and "
        "no target crosses an example), or `false`: one example per row, padded. Padding never "
        "trains.",
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
    rdzv_timeout_s: int = _f(
        300,
        "Seconds to wait for all nodes to join the rendezvous (torchrun's --rdzv-conf "
        "join_timeout).",
    )
    rdzv_id: str = _f(
        "fsdprun",
        "The rendezvous' job id (torchrun --rdzv-id): the same on every node of a job; jobs that "
        "share an endpoint need different ones. Names the logs' folder too.",
    )
    rdzv_conf: dict[str, str] = _f(
        {},
        "More settings of torch's c10d rendezvous (torchrun --rdzv-conf KEY=VALUE,...): "
        "read_timeout, last_call_timeout, close_timeout, heartbeat_timeout (seconds), "
        "keep_alive_interval, keep_alive_max_attempt, is_host, store_type; join_timeout is "
        "launch.rdzv_timeout_s.",
    )
    monitor_interval_s: float = _f(
        0.1,
        "Seconds between the elastic agent's checks of its workers (torchrun --monitor-interval).",
    )
    role: str = _f("default", "The workers' role name (torchrun --role): prefixes teed lines.")
    log_dir: str | None = _f(
        None,
        "Folder for each rank's stdout.log and stderr.log, as torchrun --log-dir lays it out "
        "(LOG_DIR/<rdzv_id>_<random>/attempt_N/LOCAL_RANK/); null = RUN_DIR/logs.",
    )
    redirects: str = _f(
        "3",
        "Workers' streams into their log files only (torchrun --redirects): 0 none, 1 stdout, 2 "
        "stderr, 3 both; or per local rank, e.g. `0:3,1:0`. fsdprun's own report is printed by "
        "the launcher either way.",
    )
    tee: str = _f(
        "0",
        "Workers' streams into their log files and also on this console, each line prefixed "
        "[role rank] (torchrun --tee): values as for launch.redirects.",
    )
    local_ranks_filter: list[int] = _f(
        [],
        "Local ranks whose teed or unredirected lines reach the console (torchrun "
        "--local-ranks-filter); [] = every rank. The log files keep every rank's.",
    )
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
        "`auto` (cuda, then npu, then xpu, else cpu), `accelerator` (as auto, but a machine "
        "without cuda, npu or xpu is refused before launch: the recipes sized for GPUs say so; "
        "`launch.device=cpu` forces CPU), `cuda` (nccl), `cpu` (gloo), `npu` (hccl; needs "
        "torch_npu), `xpu` (xccl).",
    )
    device_memory_gb: float | None = _f(
        None,
        "Memory of one device in GB (10^9 bytes), for `fsdprun plan`'s fits / does not fit; "
        "null = unknown (or give --device-memory).",
    )


@dataclass
class OutputConfig:
    run_dir: str | None = _f(
        None,
        "Run directory; null = runs/<recipe>-<YYYYmmdd-HHMMSS> under the working dir "
        "(multi-node: runs/<recipe>-<launch.rdzv_id>, the same on every node).",
    )
    log_every: int = _f(10, "Log (and write metrics.jsonl) every this many steps.")
    metrics_file: str = _f(
        DEFAULT_METRICS_FILE,
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
        ["attention"],
        "Linear layers of the blocks that get adapters: the groups `attention` and `mlp` (the "
        "model family's attention and MLP projections, fused ones included: Phi-3's qkv_proj "
        "and gate_up_proj), names in either spelling (HF q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj = built-in wq, wk, wv, wo, w1, w3, w2) or module path "
        "patterns (`layers.*.attention.wq`). A target that matches no Linear is refused when "
        "the model is built.",
    )


# The knobs `fsdprun tune` may search (tune.space, --space): those that leave the training math
# unchanged (up to floating-point summation order; micro_batch_size moves with the accumulation
# derived from the global batch), and those that change the numerics (only with
# --allow-numerics).
TUNE_KNOBS = (
    "fsdp.engine", "fsdp.sharding", "fsdp.shard_group_size", "fsdp.wrap", "fsdp.min_num_params",
    "fsdp.reshard_after_forward", "fsdp.forward_prefetch", "fsdp.backward_prefetch",
    "fsdp.limit_all_gathers", "fsdp.use_orig_params", "fsdp.accumulate_unsharded",
    "fsdp.cpu_offload", "activation_checkpointing.mode", "activation_checkpointing.every_n",
    "compile.enabled", "compile.per_block", "compile.mode", "train.micro_batch_size",
    "train.loss", "train.loss_chunk_size", "optim.implementation", "precision.float8_all_gather",
    "parallel.cp", "parallel.pp", "parallel.pp_schedule", "parallel.ep",
)  # fmt: skip
TUNE_NUMERICS_KNOBS = ("precision.param_dtype", "precision.reduce_dtype", "precision.float8",
                       "precision.float8_filter")  # fmt: skip


@dataclass
class TuneConfig:
    space: dict[str, list[str]] = _f(
        {},
        "What `fsdprun tune` searches (training ignores this section): knob -> the values to "
        "try, e.g. `{train.micro_batch_size: [2, 4, 8], fsdp.engine: [fsdp2]}`. A knob is one "
        "that leaves the training math unchanged (fsdp.*, activation_checkpointing.*, "
        "compile.*, train.micro_batch_size, train.loss, train.loss_chunk_size, "
        "optim.implementation, precision.float8_all_gather, parallel.cp, parallel.pp, "
        "parallel.pp_schedule, parallel.ep) or, only with "
        "--allow-numerics, precision.param_dtype, reduce_dtype, float8 or float8_filter. The "
        "recipe's own value is always tried. On the command line "
        "`--space` wins: without `defaults` it replaces this space, with `--space defaults` it "
        "changes only the knobs it names.",
    )
    defaults: bool = _f(
        True,
        "`true`: tune.space changes the default space (narrows a knob to fewer values, widens "
        "it to more, adds a knob); `false`: tune searches tune.space's knobs only.",
    )


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
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
    tune: TuneConfig = field(default_factory=TuneConfig)

    @property
    def world_size(self) -> int:
        return self.launch.nproc_per_node * self.launch.nnodes


def schema_fields() -> dict[str, dataclasses.Field]:
    """Every leaf key of the schema as a dotted name, in declaration order."""
    out: dict[str, dataclasses.Field] = {}
    for section in dataclasses.fields(RecipeConfig):
        for f in dataclasses.fields(section.default_factory):
            out[f"{section.name}.{f.name}"] = f
    return out


@functools.cache
def auto_keys() -> tuple[str, ...]:
    """The keys whose null lets fsdprun decide, for which `auto` (AUTO) spells null."""
    return tuple(key for key, f in schema_fields().items() if f.metadata.get("auto"))


def from_auto(key: str, value: Any) -> Any:
    """A recipe value as the schema types it: AUTO is None for `auto_keys()`, else as given."""
    return None if value == AUTO and key in auto_keys() else value


def to_auto(key: str, value: Any) -> Any:
    """A typed value as a recipe writes it: None is AUTO for `auto_keys()`, else as given."""
    return AUTO if value is None and key in auto_keys() else value


SECTIONS = tuple(f.name for f in dataclasses.fields(RecipeConfig))
