"""Sharding rules: what `fsdp.sharding` means once fsdp2's reshard_after_forward override is
applied, how many ranks share one copy of the model state (the shard group: one dimension of the
device mesh, the replicas being the other), the backward prefetch depth, which combinations
each engine accepts, and the device mesh's named dimensions with tensor parallelism.

The mesh, outermost dim first: `dp_replicate` (hybrid sharding's replicas), `dp_shard` (FSDP's
shard groups), `cp` (context parallel: the ranks that split one sequence), `tp` (tensor
parallel, innermost: consecutive ranks, so a TP group sits inside a node on the fastest links).
FSDP2 shards parameters over `dp_shard x cp` (torchtitan's choice): the cp ranks read the same
samples but hold different tokens, so their gradients are partial sums that the reduce-scatter
adds up, and they need not keep duplicate copies of the state. Pipeline parallel would be one
more dim outside `dp_replicate`. Without TP and CP (`parallel.tp: 1`, `parallel.cp: 1`) the mesh
is what it always was: 1-D for full/grad_op, `replicate x shard` otherwise.

The engines, `fsdprun plan` and the recipe checks (`fsdprun.config.validate`) all read these,
so a rule changes in one place. Plain functions of the recipe: never imports torch, nor any
fsdprun module other than the config schema.
"""

from __future__ import annotations

from fsdprun.config.schema import (
    CheckpointMode,
    CpImpl,
    Engine,
    FsdpConfig,
    RecipeConfig,
    Sharding,
)

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


# The mesh's dim names, outermost first (see the module docstring).
MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


def tp_degree(cfg: RecipeConfig) -> int:
    """parallel.tp: ranks per tensor-parallel group (1 = off)."""
    return cfg.parallel.tp


def cp_degree(cfg: RecipeConfig) -> int:
    """parallel.cp: ranks that split one sequence (1 = off)."""
    return cfg.parallel.cp


def dp_size(cfg: RecipeConfig, world_size: int | None = None) -> int:
    """Data-parallel ranks: the world size over tp x cp (each TP x CP group reads one share of
    the batch)."""
    ws = world_size if world_size is not None else cfg.world_size
    return ws // (max(tp_degree(cfg), 1) * max(cp_degree(cfg), 1))


def dp_rank(rank: int, tp: int, cp: int = 1) -> int:
    """The data-parallel rank of global `rank`: cp and tp are the innermost mesh dims, so the
    ranks of one TP x CP group are consecutive and share it."""
    return rank // (tp * cp)


def fsdp_shards(cfg: RecipeConfig, world_size: int | None = None) -> int:
    """Ranks FSDP shards one copy of the model state over: the shard group times cp (FSDP2
    shards over dp_shard x cp)."""
    return shard_group_size(cfg, world_size) * max(cp_degree(cfg), 1)


def shard_group_size(cfg: RecipeConfig, world_size: int | None = None) -> int:
    """Data-parallel ranks that share one copy of the model state under the effective sharding
    (with TP each of them holds 1/tp of that copy's tensors besides)."""
    dp = dp_size(cfg, world_size)
    sharding = effective_sharding(cfg.fsdp)
    if cfg.fsdp.engine is Engine.ddp or sharding is Sharding.none:
        return 1
    if sharding in (Sharding.hybrid, Sharding.hybrid_zero2):
        per_node = max(cfg.launch.nproc_per_node // (tp_degree(cfg) * cp_degree(cfg)), 1)
        return cfg.fsdp.shard_group_size or min(per_node, dp)
    return dp


def mesh_dims(cfg: RecipeConfig, world_size: int | None = None) -> list[tuple[str, int]]:
    """The device mesh as (dim name, size), outermost first, as the fsdp2 engine builds it.

    parallel.tp or parallel.cp > 1: `dp_shard [x cp] [x tp]` for full/grad_op,
    `dp_replicate x dp_shard [x cp] [x tp]` for the hybrid modes and none (a dim of size 1 of
    cp or tp is left out). Without either: `dp` alone for full/grad_op (a 1-D mesh, unnamed in
    torch), `replicate x shard` otherwise (the names checkpoints of earlier versions recorded).
    """
    ws = world_size if world_size is not None else cfg.world_size
    tp, cp, group = tp_degree(cfg), cp_degree(cfg), shard_group_size(cfg, ws)
    one_d = effective_sharding(cfg.fsdp) in (Sharding.full, Sharding.grad_op)
    if tp == 1 and cp == 1:
        return [("dp", ws)] if one_d else [("replicate", ws // group), ("shard", group)]
    dp = dp_size(cfg, ws)
    dims = [("dp_shard", dp)] if one_d else [("dp_replicate", dp // group), ("dp_shard", group)]
    return [*dims, *([("cp", cp)] if cp > 1 else []), *([("tp", tp)] if tp > 1 else [])]


def tp_errors(
    cfg: RecipeConfig, *, world_size: int, shape: dict[str, int] | None, tied: bool
) -> list[str]:
    """What parallel.tp refuses, one message per problem.

    Args:
        shape: the model's heads, kv heads and ffn dim by the keys that set them (None:
            unknown, e.g. an unreadable model.hf_path, which is refused on its own). Not the
            vocab: it shards unevenly (`fsdprun.config.validate._tp_shape`).
        tied: the built-in Llama ties its embedding to its output projection (HF folders'
            ties: `fsdprun.engines.tp.apply_tp`).
    """
    tp = tp_degree(cfg)
    if tp < 1:
        return [f"parallel.tp must be >= 1 (got {tp})"]
    if tp == 1:
        return []
    errors = []
    per_node = cfg.launch.nproc_per_node
    if world_size % tp:
        # Then tp does not divide launch.nproc_per_node either (a factor of the world): one
        # message for the one fact.
        errors.append(
            f"parallel.tp ({tp}) must divide the world size ({world_size}); the data-parallel "
            f"size is world size / tp: run on a multiple of {tp} ranks or choose a parallel.tp "
            f"that divides {world_size}"
        )
    elif tp > per_node and not cfg.parallel.tp_across_nodes:
        errors.append(
            f"parallel.tp ({tp}) exceeds launch.nproc_per_node ({per_node}): TP groups would "
            "span nodes; lower parallel.tp or set parallel.tp_across_nodes=true"
        )
    elif tp <= per_node and per_node % tp:
        errors.append(
            f"parallel.tp ({tp}) must divide launch.nproc_per_node ({per_node}), so that no TP "
            "group straddles two nodes"
        )
    for key, value in (shape or {}).items():
        if value % tp:
            errors.append(
                f"parallel.tp ({tp}) does not divide the model's {key} ({value}); choose a tp "
                f"that divides it"
            )
    if cfg.train.seq_len % tp:
        errors.append(
            f"parallel.tp ({tp}) does not divide train.seq_len ({cfg.train.seq_len}): sequence "
            "parallel shards the activations between blocks on the sequence"
        )
    refused = (
        (
            cfg.fsdp.engine is not Engine.fsdp2,
            f"fsdp.engine={cfg.fsdp.engine.value} cannot shard DTensor (tensor-parallel) "
            "parameters; use fsdp.engine=fsdp2",
        ),
        (
            cfg.precision.float8.value != "off",
            f"precision.float8={cfg.precision.float8.value} needs torchao's float8 TP styles, "
            "which fsdprun does not apply; set precision.float8=off",
        ),
        (
            cfg.lora.rank > 0,
            f"lora.rank={cfg.lora.rank}: LoRA's adapted layers are not nn.Linear, which the "
            "column/row-wise plans shard; set lora.rank=0 or parallel.tp=1",
        ),
        (
            cfg.train.loss.value == "chunked",
            "train.loss=chunked: under TP the loss is computed on vocab-sharded logits (loss "
            "parallel), so the whole logits never exist anyway; set train.loss=plain",
        ),
        (
            tied,
            "model.tie_embeddings=true: the built-in Llama's tied embedding and output are not "
            "verified under tensor parallel (HF folders' are); set model.tie_embeddings=false",
        ),
        (
            cfg.compile.enabled and cfg.activation_checkpointing.mode is not CheckpointMode.none,
            f"compile.enabled=true and activation_checkpointing.mode="
            f"{cfg.activation_checkpointing.mode.value}: torch 2.13's compiled checkpoint of a "
            "tensor-parallel block fails in its first forward (AOTAutograd saves a DeviceMesh "
            "for backward); set activation_checkpointing.mode=none or compile.enabled=false",
        ),
        (
            cfg.compile.enabled and not cfg.compile.per_block,
            "compile.per_block=false: fsdprun checks per-block compile of tensor-parallel "
            "models only; set compile.per_block=true",
        ),
        (
            cfg.fsdp.cpu_offload,
            "fsdp.cpu_offload=true: FSDP2's offload of tensor-parallel (2-D) parameters is "
            "not supported by fsdprun; set fsdp.cpu_offload=false or parallel.tp=1",
        ),
    )
    errors += [f"parallel.tp={tp} with {why}" for refuse, why in refused if refuse]
    return errors


def cp_impl(cfg: RecipeConfig, kv_heads: int | None = None) -> str:
    """The attention parallel.cp_impl resolves to: `auto` takes `alltoall` where parallel.cp
    divides the kv heads per TP rank (`kv_heads`: the model's, None when not known), else
    `ring`."""
    if cfg.parallel.cp_impl is not CpImpl.auto:
        return cfg.parallel.cp_impl.value
    tp = max(tp_degree(cfg), 1)
    divides = kv_heads is None or (kv_heads % tp == 0 and (kv_heads // tp) % cp_degree(cfg) == 0)
    return "alltoall" if divides else "ring"


def cp_errors(
    cfg: RecipeConfig,
    *,
    world_size: int,
    kv_heads: int | None,
    unverified: str | None = None,
    attention_dropout: float = 0.0,
) -> list[str]:
    """What parallel.cp refuses, one message per problem.

    Args:
        kv_heads: the model's kv heads (None: unknown, e.g. an unreadable model.hf_path, which
            is refused on its own).
        unverified: the model, when its attention has not been verified under context
            parallel (an HF folder of another model_type than llama), as messages name it.
        attention_dropout: the model's (an HF folder's attention_dropout), which the ring
            does not apply.
    """
    cp, tp = cp_degree(cfg), max(tp_degree(cfg), 1)
    if cp < 1:
        return [f"parallel.cp must be >= 1 (got {cp})"]
    if cp == 1:
        return []
    errors = []
    if world_size % (cp * tp):
        what = f"parallel.cp ({cp})" if tp == 1 else f"parallel.cp x parallel.tp ({cp} x {tp})"
        errors.append(
            f"{what} must divide the world size ({world_size}); the data-parallel size is world "
            f"size / {'cp' if tp == 1 else '(cp x tp)'}: run on a multiple of {cp * tp} ranks "
            f"or choose a parallel.cp that divides {world_size // tp if tp > 1 else world_size}"
        )
    if cfg.train.seq_len % cp:
        errors.append(
            f"parallel.cp ({cp}) does not divide train.seq_len ({cfg.train.seq_len}): each rank "
            f"holds seq_len / cp tokens of every row; choose a cp that divides it"
        )
    elif tp > 1 and cfg.train.seq_len % (cp * tp):
        errors.append(
            f"parallel.cp x parallel.tp ({cp} x {tp}) does not divide train.seq_len "
            f"({cfg.train.seq_len}): sequence parallel shards each cp rank's seq_len / cp tokens "
            "over tp; choose degrees whose product divides it"
        )
    impl = cp_impl(cfg, kv_heads)
    ring = "parallel.cp_impl=ring" + (
        " (what auto takes for these heads)" if cfg.parallel.cp_impl is CpImpl.auto else ""
    )
    if impl == "alltoall" and kv_heads is not None and kv_heads % tp == 0 and (kv_heads // tp) % cp:
        per_tp = "" if tp == 1 else f" / parallel.tp ({tp}) = {kv_heads // tp} per TP rank"
        errors.append(
            f"parallel.cp ({cp}) does not divide the model's kv heads ({kv_heads}, model."
            f"n_kv_heads{per_tp}): the all-to-all gives each rank kv heads / cp of them; choose "
            "a cp that divides it, or parallel.cp_impl=ring (or auto), which needs no such division"
        )
    refused = (
        (
            cfg.fsdp.engine is not Engine.fsdp2,
            f"fsdp.engine={cfg.fsdp.engine.value}: context parallel shards parameters over "
            "dp_shard x cp with FSDP2; use fsdp.engine=fsdp2",
        ),
        (
            unverified is not None,
            f"{unverified}: its attention has not been verified under context parallel (the "
            "built-in Llama's and HF Llama folders' are); set parallel.cp=1",
        ),
        (
            tp > 1 and cfg.model.hf_path is not None,
            f"parallel.tp={tp} and model.hf_path: cp x tp is verified for the built-in Llama "
            "only; set parallel.tp=1 or parallel.cp=1",
        ),
        (cfg.lora.rank > 0, f"lora.rank={cfg.lora.rank}: not verified under context parallel; "
                            "set lora.rank=0"),
        (
            cfg.precision.float8.value != "off",
            f"precision.float8={cfg.precision.float8.value}: not verified under context "
            "parallel; set precision.float8=off",
        ),
        (
            cfg.compile.enabled,
            "compile.enabled=true: compiled blocks with the all-to-all inside have not been "
            "verified; set compile.enabled=false",
        ),
        (
            impl == "ring" and tp > 1,
            f"parallel.tp={tp} and parallel.cp_impl=ring (what {cfg.parallel.cp_impl.value} "
            "takes for these heads): the ring is verified without tensor parallel only; set "
            "parallel.tp=1, or a cp that divides the kv heads per TP rank (all-to-all)",
        ),
        (
            impl == "ring" and attention_dropout > 0,
            f"{ring} and the model's attention dropout {attention_dropout:g} (its config.json's "
            "attention_dropout): the ring applies no dropout; set it to 0 in config.json, or "
            "a cp that divides the kv heads (all-to-all)",
        ),
        (
            cfg.fsdp.cpu_offload,
            "fsdp.cpu_offload=true: not verified under context parallel; set "
            "fsdp.cpu_offload=false",
        ),
    )  # fmt: skip
    errors += [f"parallel.cp={cp} with {why}" for refuse, why in refused if refuse]
    return errors


def sharding_errors(
    fsdp: FsdpConfig, *, world_size: int, nproc_per_node: int, tp: int = 1, cp: int = 1
) -> list[str]:
    """What the engine and mesh refuse in the `fsdp:` section, one message per problem (`tp`,
    `cp`: parallel.tp and parallel.cp, whose groups the shard groups are made of)."""
    errors = []
    value = str(fsdp.backward_prefetch)
    if value not in BACKWARD_PREFETCH_MODES and not (value.isdigit() and int(value) >= 1):
        errors.append(
            f"fsdp.backward_prefetch: '{value}' is not valid; use pre, post, none or a depth >= 1"
        )
    if fsdp.engine is not Engine.fsdp2 and fsdp.reshard_after_forward is not None:
        errors.append(
            f"fsdp.reshard_after_forward is an fsdp2 knob; with fsdp.engine={fsdp.engine.value} "
            "set fsdp.sharding (full = reshard, grad_op = keep) instead"
        )
    # With TP or CP, shard groups are counted in data-parallel ranks (world size / (tp x cp)).
    what = "the world size" if tp * cp == 1 else (
        "the data-parallel size (world size / parallel.tp)" if cp == 1
        else "the data-parallel size (world size / (parallel.tp x parallel.cp))")  # fmt: skip
    dp, per_node = world_size // (tp * cp), max(nproc_per_node // (tp * cp), 1)
    if fsdp.shard_group_size is not None:
        if fsdp.shard_group_size < 1 or dp % fsdp.shard_group_size:
            errors.append(
                f"fsdp.shard_group_size ({fsdp.shard_group_size}) must divide {what} ({dp})"
            )
    elif fsdp.sharding in (Sharding.hybrid, Sharding.hybrid_zero2) and dp % min(per_node, dp):
        errors.append(
            f"fsdp.sharding={fsdp.sharding.value}: launch.nproc_per_node ({nproc_per_node}) "
            f"must divide the world size ({world_size}); set fsdp.shard_group_size"
        )
    if fsdp.engine is Engine.ddp and fsdp.cpu_offload:
        errors.append("fsdp.cpu_offload needs a sharding engine; use fsdp.engine=fsdp1 or fsdp2")
    return errors
