"""The parallel layout of a run, decided once: every degree of the device mesh, the sizes derived
from them, the mesh's named dims, and every rule that refuses a layout (torchtitan's
`ParallelDims`).

The mesh, outermost dim first: `pp` (pipeline stages), `dp_replicate` (hybrid sharding's
replicas), `dp_shard` (FSDP's shard groups), `cp` (context parallel: the ranks that split one
sequence), `tp` (tensor parallel, innermost: consecutive ranks, so a TP group sits inside a node
on the fastest links). FSDP2 shards parameters over `dp_shard x cp` (torchtitan's choice): the
cp ranks read the same samples but hold different tokens, so their gradients are partial sums
that the reduce-scatter adds up, and they need not keep duplicate copies of the state. Expert
parallel (`ep`) has no dim of its own in the data: its groups are carved out of the
data-parallel ranks, as torchtitan's are, by splitting `dp_shard` into `dp_shard_mod_ep x ep`
(ep innermost of the two, so an ep group is consecutive ranks): the dense parameters are sharded
over both (the `dp_shard` FSDP always had), each expert's weights over `dp_shard_mod_ep` only,
and the experts themselves over `ep`. Every rank still reads its own rows. `pp` (parallel.pp)
splits the layers into stages (`pp_blocks`: which blocks each stage runs); its ranks are the
outermost dim, so a stage's data-parallel, cp and tp ranks are consecutive (a node) and only
activations cross between stages.
Without TP, CP, PP and EP the mesh is what it always was: 1-D for full/grad_op, `replicate x shard`
otherwise (the names checkpoints of earlier versions recorded).

Everything that needs a degree or a size asks a `Layout`: the recipe checks, plan, tune's space,
resume's re-fit, the engines' knob tables and builds, the worker. Nothing else does arithmetic on
`cfg.parallel.*`. The torch `DeviceMesh` is built from a Layout in one function
(`fsdprun.engines.mesh.build_device_mesh`). Torch-free: imports the schema, the model facts and
nothing above config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdprun.config.model_facts import ModelFacts
from fsdprun.config.schedule import PP_SCHEDULES, head_blocks, pp_blocks
from fsdprun.config.schema import (
    CheckpointMode,
    CpImpl,
    Engine,
    FsdpConfig,
    PpSchedule,
    RecipeConfig,
    Sharding,
)

# Every dim a mesh may have, outermost first (see the module docstring).
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
BACKWARD_PREFETCH_MODES = ("pre", "post", "none")
_HYBRID = (Sharding.hybrid, Sharding.hybrid_zero2)


def effective_sharding(fsdp: FsdpConfig) -> Sharding:
    """fsdp.sharding with fsdp2's reshard_after_forward override applied."""
    s, raf = fsdp.sharding, fsdp.reshard_after_forward
    if raf is None or fsdp.engine is not Engine.fsdp2:
        return s
    if raf is False:
        return {Sharding.full: Sharding.grad_op, Sharding.hybrid: Sharding.hybrid_zero2}.get(s, s)
    return {Sharding.grad_op: Sharding.full, Sharding.hybrid_zero2: Sharding.hybrid}.get(s, s)


def mesh_text(dims: list[tuple[str, int]] | list[list], joiner: str = " x ") -> str:
    """A mesh's dims as the header and inspect print them: `2 dp_shard x 2 tp`."""
    return joiner.join(f"{n} {name}" for name, n in dims)


@dataclass(frozen=True)
class Layout:
    """The degrees of a run at one world size, and what follows from them.

    Build it with `Layout.of(cfg)`; the degrees are the recipe's as given (a refused layout
    still has one, so that its refusals can be worded: `fits_world` says whether the sizes
    mean anything).
    """

    world_size: int
    nproc_per_node: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    engine: Engine = Engine.fsdp2
    sharding: Sharding = Sharding.full  # fsdp.sharding with fsdp2's reshard override applied
    shard_group_size: int | None = None  # fsdp.shard_group_size as the recipe gives it
    tp_across_nodes: bool = False
    pp_schedule: PpSchedule = PpSchedule.one_f_one_b
    pp_stages_per_rank: int = 1  # stages each pp rank holds (the interleaved schedules' > 1)

    @classmethod
    def of(cls, cfg: RecipeConfig, world_size: int | None = None) -> Layout:
        """The layout of recipe `cfg` at `world_size` (default: its launch.* world)."""
        return cls(
            world_size=world_size if world_size is not None else cfg.world_size,
            nproc_per_node=cfg.launch.nproc_per_node,
            tp=cfg.parallel.tp,
            cp=cfg.parallel.cp,
            pp=cfg.parallel.pp,
            pp_schedule=cfg.parallel.pp_schedule,
            pp_stages_per_rank=cfg.parallel.pp_stages_per_rank,
            ep=cfg.parallel.ep,
            engine=cfg.fsdp.engine,
            sharding=effective_sharding(cfg.fsdp),
            shard_group_size=cfg.fsdp.shard_group_size,
            tp_across_nodes=cfg.parallel.tp_across_nodes,
        )

    @property
    def fits_world(self) -> bool:
        """Whether every degree is >= 1 and their product divides the world size."""
        degrees = (self.pp, self.cp, self.tp)
        return min(degrees) >= 1 and self.world_size % (self.pp * self.cp * self.tp) == 0

    @property
    def row_group(self) -> int:
        """Ranks that read the same rows of the batch: a cp x tp group (cp and tp are the
        innermost dims, so they are consecutive ranks)."""
        return max(self.cp, 1) * max(self.tp, 1)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the world over pp x cp x tp (each cp x tp group of a stage
        reads one share of the batch)."""
        return self.world_size // (max(self.pp, 1) * self.row_group)

    def pp_rank(self, rank: int) -> int:
        """The pipeline rank (stage group) of global `rank`: pp is the outermost dim."""
        return rank // (self.world_size // max(self.pp, 1))

    @property
    def is_pp(self) -> bool:
        return self.pp > 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model splits into: pp x stages per rank (1 without pp)."""
        return self.pp * self.pp_stages_per_rank if self.is_pp else 1

    def local_stages(self, rank: int) -> list[int]:
        """The stages global `rank` runs (`pp_stages` of its pipeline rank)."""
        return self.pp_stages(self.pp_rank(rank))

    def pp_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` runs: stages r, r + pp, ... (torch's placement of
        looped schedules; one stage for gpipe and 1f1b)."""
        if not self.is_pp:
            return [0]
        return list(range(pp_rank, self.num_stages, self.pp))

    @property
    def is_tp(self) -> bool:
        return self.tp > 1

    @property
    def is_cp(self) -> bool:
        return self.cp > 1

    @property
    def is_ep(self) -> bool:
        return self.ep > 1

    @property
    def expert_shards(self) -> int:
        """Ranks FSDP shards each expert's weights over: the shard group over ep
        (`dp_shard_mod_ep`; with ep 1, the shard group times cp, as every parameter)."""
        if self.ep <= 1:
            return self.fsdp_shards
        return max(self.shard_group // self.ep, 1)

    @property
    def shard_group(self) -> int:
        """Data-parallel ranks that share one copy of the model state under the effective
        sharding: fsdp.shard_group_size, which counts data-parallel ranks (with cp, FSDP2
        shards over them x cp: `fsdp_shards`; with TP each holds 1/tp of the copy's tensors
        besides: `state_ranks`)."""
        if self.engine is Engine.ddp or self.sharding is Sharding.none:
            return 1
        if self.sharding in _HYBRID:
            # A node's ranks, within one pipeline stage's (pp is outermost).
            stage = self.world_size // max(self.pp, 1)
            per_node = max(min(self.nproc_per_node, stage) // self.row_group, 1)
            return self.shard_group_size or min(per_node, self.dp)
        return self.dp

    @property
    def dp_replicate(self) -> int:
        """Replicas of the model state: the data-parallel ranks over the shard group."""
        return self.dp // self.shard_group

    @property
    def fsdp_shards(self) -> int:
        """Ranks FSDP shards one copy of the model state over: the shard group times cp
        (FSDP2 shards over dp_shard x cp)."""
        return self.shard_group * max(self.cp, 1)

    @property
    def state_ranks(self) -> int:
        """Ranks one copy of the model state is split over: FSDP's (the shard group times cp)
        times tp, whose ranks each hold 1/tp of every split parameter. Under
        fsdp.sharding=none it is cp x tp: none replicates across data-parallel ranks only."""
        return self.fsdp_shards * max(self.tp, 1)

    @property
    def one_d(self) -> bool:
        """Whether FSDP's data-parallel dims are one (full and grad_op sharding)."""
        return self.sharding in (Sharding.full, Sharding.grad_op)

    @property
    def mesh_dims(self) -> list[tuple[str, int]]:
        """The device mesh as (dim name, size), outermost first, as the engines build it.

        parallel.tp, cp, pp or ep > 1: `[pp x] dp_shard [x cp] [x tp]` for full/grad_op,
        `[pp x] dp_replicate x dp_shard [x cp] [x tp]` for the hybrid modes and none (a dim of
        size 1 of pp, cp or tp is left out); parallel.ep > 1 splits dp_shard into
        `dp_shard_mod_ep x ep`. Without any: `dp` alone for full/grad_op (a 1-D mesh, unnamed in
        torch), `replicate x shard` otherwise (the names checkpoints of earlier versions
        recorded).
        """
        replicate, group = self.dp_replicate, self.shard_group
        if self.tp == 1 and self.cp == 1 and not self.is_pp and self.ep <= 1:
            if self.one_d:
                return [("dp", self.world_size)]
            return [("replicate", replicate), ("shard", group)]
        # parallel.ep: dp_shard split into dp_shard_mod_ep x ep (the module docstring).
        shard = ([("dp_shard_mod_ep", max(group // self.ep, 1)), ("ep", self.ep)]
                 if self.ep > 1 else [("dp_shard", group)])  # fmt: skip
        dims = shard if self.one_d else [("dp_replicate", replicate), *shard]
        return [*([("pp", self.pp)] if self.is_pp else []), *dims,
                *([("cp", self.cp)] if self.is_cp else []),
                *([("tp", self.tp)] if self.is_tp else [])]  # fmt: skip

    def describe(self) -> str:
        """The mesh in one line, as the run header prints it: `2 dp_shard x 2 tp`."""
        return mesh_text(self.mesh_dims)

    def refit(self, dim: str) -> int | None:
        """The largest divisor of this layout's `dim` degree ("tp", then "cp", then "pp", then
        "ep") that its world holds, where the degree itself does not (None: it fits). For
        `fsdprun resume` on another world: a divisor of a saved degree divides what the saved one
        divided (heads, ffn, vocab, train.seq_len, the experts) and asks no more of the layers and
        micro-batches (fewer stages). tp must divide a node's ranks (unless tp_across_nodes);
        cp x tp, then pp x cp x tp must divide the world; ep the shard group of data-parallel
        ranks."""

        def fits(n: int) -> bool:
            if dim == "tp":
                per_node = self.nproc_per_node
                within = per_node % n == 0 if n <= per_node else self.tp_across_nodes
                return self.world_size % n == 0 and within
            if dim == "pp":
                return self.world_size % (n * self.row_group) == 0
            if dim == "ep":
                return self.fits_world and self.shard_group % n == 0
            return self.world_size % (n * max(self.tp, 1)) == 0

        degree = getattr(self, dim)
        if degree <= 1 or fits(degree):
            return None
        return max(n for n in range(1, degree) if degree % n == 0 and fits(n))

    def at(self, **degrees: int) -> Layout:
        """This layout with other degrees (tp=, cp=, pp=, ep=), for plan's and tune's side-by-side
        columns and resume's re-fit."""
        return dataclasses.replace(self, **degrees)


def cp_impl(cfg: RecipeConfig, facts: ModelFacts | None) -> str:
    """The attention parallel.cp_impl resolves to: `auto` takes `alltoall` where parallel.cp
    divides the kv heads per TP rank (the model's, unknown when `facts` is None), else
    `ring`."""
    if cfg.parallel.cp_impl is not CpImpl.auto:
        return cfg.parallel.cp_impl.value
    kv_heads = facts.n_kv_heads if facts is not None else None
    tp, cp = max(cfg.parallel.tp, 1), cfg.parallel.cp
    divides = kv_heads is None or (kv_heads % tp == 0 and (kv_heads // tp) % cp == 0)
    return "alltoall" if divides else "ring"


def cp_chunks(seq: int, index: int, count: int, *, zigzag: bool = False) -> list[slice]:
    """The positions of a row of `seq` tokens that cp rank `index` of `count` holds, in order:
    slice `index` of `count` equal slices; or, `zigzag` (the ring's layout, `cp_zigzag`), chunks
    `index` and `2 count - 1 - index` of `2 count` equal chunks, so that under a causal mask
    every cp rank's queries see the same number of keys (rank 0 the first and the last chunk).

    Every rank's slice is consistent: the ranks' chunks together are the row, each token once,
    so sums over the ranks (losses, trained-token counts) are the row's. `seq` must divide by
    `count` (by `2 count` for `zigzag`; `layout_errors` refuses other lengths). The batch is
    cut by it (`fsdprun.data.Batch.sequence_shard`), and so is what a model reads of the
    whole row (`fsdprun.models.rope`)."""
    if not zigzag:
        return [slice(index * seq // count, (index + 1) * seq // count)]
    chunk = seq // (2 * count)
    return [slice(j * chunk, (j + 1) * chunk) for j in (index, 2 * count - 1 - index)]


def cp_zigzag(cfg: RecipeConfig, facts: ModelFacts | None) -> bool:
    """Whether each cp rank holds two zig-zag chunks of every row rather than one slice
    (`cp_chunks`): under the ring, which balances the causal work so
    (rank j would otherwise compute j + 1 of the cp blocks of its queries); the all-to-all's
    attention sees whole rows, the same work on every rank, and keeps consecutive slices."""
    return cfg.parallel.cp > 1 and cp_impl(cfg, facts) == "ring"


def layout_errors(
    cfg: RecipeConfig, facts: ModelFacts | None, *, world_size: int | None = None
) -> list[str]:
    """What the recipe's layout refuses at `world_size` (default: its launch.* world), one
    message per problem: the shard groups, tensor parallel, context parallel, pipeline
    parallel, expert parallel. `facts`: the model's (None: an unreadable model.hf_path, which
    is refused on its own)."""
    layout = Layout.of(cfg, world_size)
    ws = layout.world_size
    # The shard groups are counted in the data-parallel ranks of the degrees that fit (a
    # degree that does not is refused below, once).
    tp = layout.tp if layout.tp >= 1 and ws % layout.tp == 0 else 1
    cp = layout.cp if layout.cp >= 1 and ws % (layout.cp * tp) == 0 else 1
    pp = layout.pp if layout.pp >= 1 and ws % (layout.pp * cp * tp) == 0 else 1
    errors = _sharding_errors(cfg.fsdp, layout.at(tp=tp, cp=cp, pp=pp))
    errors += _tp_errors(cfg, layout, facts) + _cp_errors(cfg, layout, facts)
    errors += _pp_errors(cfg, layout.at(tp=tp, cp=cp), facts)
    return errors + _ep_errors(cfg, layout.at(tp=tp, cp=cp, pp=pp), facts)


def stage_blocks(cfg: RecipeConfig, facts: ModelFacts | None, num_layers: int) -> list[int]:
    """The recipe's blocks per stage for a model of `num_layers` blocks (`pp_blocks`)."""
    layout = Layout.of(cfg)
    return pp_blocks(num_layers, layout.num_stages, head_cost=head_blocks(facts, cfg.train.seq_len),
                     split=cfg.parallel.pp_split)  # fmt: skip


def _aux_words(cfg: RecipeConfig, facts: ModelFacts | None) -> tuple[str, str]:
    """How the user turned the router's auxiliary loss on, and how to turn it off: an HF
    folder's config.json, or the built-in MoE's model.moe_aux_loss_coef."""
    if facts is None or facts.hf:
        return ("config.json's output_router_logits: true",
                "output_router_logits to false in config.json")  # fmt: skip
    return f"model.moe_aux_loss_coef={cfg.model.moe_aux_loss_coef:g}", "model.moe_aux_loss_coef=0"


def _pp_errors(cfg: RecipeConfig, layout: Layout, facts: ModelFacts | None) -> list[str]:
    """What parallel.pp refuses, one message per problem: a degree the world or the layers
    cannot hold, a split or a schedule that does not fit the micro-batches, and what the
    pipeline does not carry (the family's stages, tied embeddings across the first and last
    stage, a router's auxiliary loss over every block, other engines)."""
    p, pp, ws = cfg.parallel, layout.pp, layout.world_size
    if pp < 1:
        return [f"parallel.pp must be >= 1 (got {pp})"]
    if p.pp_stages_per_rank < 1:
        return [f"parallel.pp_stages_per_rank must be >= 1 (got {p.pp_stages_per_rank})"]
    if pp == 1:
        return []
    errors = []
    inner = layout.row_group
    if ws % (pp * inner):
        what = "parallel.pp" if inner == 1 else "parallel.pp x parallel.cp x parallel.tp"
        errors.append(
            f"{what} ({pp * inner}) must divide the world size ({ws}); the data-parallel size "
            f"is world size / {'pp' if inner == 1 else '(pp x cp x tp)'}: run on a multiple of "
            f"{pp * inner} ranks or choose a parallel.pp that divides {ws // inner}"
        )
    looped = PP_SCHEDULES[p.pp_schedule][1]
    sched = f"parallel.pp_schedule={p.pp_schedule.value}"
    if looped and p.pp_stages_per_rank < 2:
        errors.append(
            f"{sched} places several stages on each rank: set parallel.pp_stages_per_rank "
            "to 2 or more"
        )
    if not looped and p.pp_stages_per_rank > 1:
        errors.append(
            f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} needs an interleaved schedule "
            f"({sched} runs one stage a rank); set parallel.pp_schedule=interleaved_1f1b or "
            "parallel.pp_stages_per_rank=1"
        )
    stages = pp * p.pp_stages_per_rank
    layers = facts.n_layers if facts is not None else None
    if p.pp_split is not None:
        if len(p.pp_split) != stages or min(p.pp_split) < 1:
            errors.append(
                f"parallel.pp_split ({p.pp_split}) must give each of the {stages} stages "
                "(parallel.pp x parallel.pp_stages_per_rank) its number of blocks, each >= 1"
            )
        elif layers is not None and sum(p.pp_split) != layers:
            errors.append(
                f"parallel.pp_split ({p.pp_split}) adds up to {sum(p.pp_split)} blocks; the "
                f"model has {layers}: give every block a stage"
            )
    elif layers is not None and stages > layers:
        errors.append(
            f"parallel.pp x parallel.pp_stages_per_rank ({stages} stages) exceeds the model's "
            f"{layers} layers, which would leave a stage without a block; lower parallel.pp"
        )
    t = cfg.train
    dp = layout.dp if layout.fits_world else 0
    if dp and t.global_batch_size % (t.micro_batch_size * dp) == 0:
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        if p.pp_schedule is PpSchedule.one_f_one_b and micro < pp:
            errors.append(
                f"{sched} needs at least parallel.pp ({pp}) micro-batches a step, got {micro} "
                f"(train.global_batch_size / (train.micro_batch_size x {dp} data-parallel "
                "ranks)): raise the global batch, lower the micro batch, or use gpipe"
            )
        if looped and micro % pp:
            errors.append(
                f"{sched} needs the micro-batches a step ({micro}) to be a multiple of "
                f"parallel.pp ({pp}): each round sends pp of them through the stages; change "
                "train.global_batch_size or train.micro_batch_size"
            )
    entry = facts.entry if facts is not None else None
    aux_key, aux_off = _aux_words(cfg, facts)
    refused = (
        (
            cfg.fsdp.engine is not Engine.fsdp2,
            f"fsdp.engine={cfg.fsdp.engine.value}: each stage is sharded with FSDP2 over its "
            "own data-parallel ranks; use fsdp.engine=fsdp2",
        ),
        (
            entry is not None and entry.stages is None,
            "a model whose family declares no pipeline stages (Family.stages in "
            "fsdprun/families.py: its embedding, blocks and head); set parallel.pp=1",
        ),
        (
            facts is not None and facts.tie_embeddings,
            "tied embeddings (model.tie_embeddings / config.json's tie_word_embeddings): the "
            "embedding lives on the first stage and the output on the last, and fsdprun does "
            "not sum one tensor's gradients across them; untie them or set parallel.pp=1",
        ),
        (
            facts is not None and facts.router_aux_loss,
            f"the router's auxiliary loss ({aux_key}): it is one function of every block's "
            f"router logits, which live on different stages; set {aux_off}, or parallel.pp=1",
        ),
        (
            cfg.compile.enabled and not cfg.compile.per_block,
            "compile.per_block=false: a stage runs part of the model, which whole-model "
            "compile does not see; set compile.per_block=true",
        ),
        (
            p.pp_schedule is PpSchedule.interleaved_zb,
            "parallel.pp_schedule=interleaved_zb: torch's zero-bubble weight pass "
            "(stage_backward_weight) does not give FSDP2-sharded stages the gradients one rank "
            "computes (measured on torch 2.13: step 1's gradient norm 19% off), and under "
            "FSDP2's own per-micro-batch reduction it fails; use interleaved_1f1b",
        ),
    )  # fmt: skip
    errors += [f"parallel.pp={pp} with {why}" for refuse, why in refused if refuse]
    return errors


def _tp_errors(cfg: RecipeConfig, layout: Layout, facts: ModelFacts | None) -> list[str]:
    """What parallel.tp refuses, one message per problem. The model's heads, kv heads and ffn
    must divide by it; not the vocab: DTensor shards the embedding's rows and the output's
    columns unevenly (rank 0 the ceil), and loss parallel masks the targets by each rank's own
    vocab range, so a vocab of 257 (the byte tokenizer's, the shipped demos') trains as on one
    rank at tp 2 (tests/test_tp.py, tests/test_matrix.py) and tp 4 (measured, with a resume and
    an export)."""
    tp, world_size = layout.tp, layout.world_size
    if tp < 1:
        return [f"parallel.tp must be >= 1 (got {tp})"]
    if tp == 1:
        return []
    errors = []
    per_node = layout.nproc_per_node
    if world_size % tp:
        # Then tp does not divide launch.nproc_per_node either (a factor of the world): one
        # message for the one fact.
        errors.append(
            f"parallel.tp ({tp}) must divide the world size ({world_size}); the data-parallel "
            f"size is world size / tp: run on a multiple of {tp} ranks or choose a parallel.tp "
            f"that divides {world_size}"
        )
    elif tp > per_node and not layout.tp_across_nodes:
        errors.append(
            f"parallel.tp ({tp}) exceeds launch.nproc_per_node ({per_node}): TP groups would "
            "span nodes; lower parallel.tp or set parallel.tp_across_nodes=true"
        )
    elif tp <= per_node and per_node % tp:
        errors.append(
            f"parallel.tp ({tp}) must divide launch.nproc_per_node ({per_node}), so that no TP "
            "group straddles two nodes"
        )
    for key, value in ((facts.tp_shape() if facts else None) or {}).items():
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
    # A tied embedding and output (the built-in Llama's, an HF folder's) are split alike, on
    # the vocab rows, and tied again by `engines.tp.apply_tp` (its layout check refuses a plan
    # that would split them apart; tests/test_composition.py trains the built-in's).
    refused = (
        (
            cfg.fsdp.engine is not Engine.fsdp2,
            f"fsdp.engine={cfg.fsdp.engine.value} cannot shard DTensor (tensor-parallel) "
            "parameters; use fsdp.engine=fsdp2",
        ),
        (
            cfg.precision.float8.value == "rowwise",
            "precision.float8=rowwise: torchao scales each token's row of a row-wise (input-"
            "split) Linear's input by the largest magnitude of this rank's shard of it (the "
            "row maximum DTensor computes is a partial one, which the cast reads locally), not "
            "of the whole row as one rank does (measured: gradients 3% off); use "
            "precision.float8=tensorwise",
        ),
        (
            cfg.train.loss.value == "chunked",
            "train.loss=chunked: under TP the loss is computed on vocab-sharded logits (loss "
            "parallel), so the whole logits never exist anyway; set train.loss=plain",
        ),
        (
            cfg.compile.enabled and cfg.activation_checkpointing.mode is not CheckpointMode.none,
            f"compile.enabled=true and activation_checkpointing.mode="
            f"{cfg.activation_checkpointing.mode.value}: torch 2.13's compiled checkpoint of a "
            "tensor-parallel block fails in its first forward (AOTAutograd saves a DeviceMesh "
            "for backward); set activation_checkpointing.mode=none or compile.enabled=false",
        ),
        (
            cfg.compile.enabled and facts is not None and facts.router_aux_loss,
            "compile.enabled=true and a mixture of experts' router auxiliary loss (config.json's "
            "output_router_logits): under tensor parallel torch 2.13's compiled blocks gave "
            "wrong gradients with it (the first gradient norm 0.761 where eager and one rank "
            "give 0.696; the cause was not found); set compile.enabled=false",
        ),
        (
            cfg.compile.enabled and not cfg.compile.per_block,
            "compile.per_block=false: fsdprun checks per-block compile of tensor-parallel "
            "models only; set compile.per_block=true",
        ),
    )
    errors += [f"parallel.tp={tp} with {why}" for refuse, why in refused if refuse]
    return errors


def _cp_errors(cfg: RecipeConfig, layout: Layout, facts: ModelFacts | None) -> list[str]:
    """What parallel.cp refuses, one message per problem: the kv heads come from `facts`
    (unknown when None), and so do whether the family declares its attention for context
    parallel (`Family.cp_attention`), its attention dropout, which the ring does not apply,
    and a router's auxiliary loss, which the cp ranks' slices cannot compute."""
    cp, tp, world_size = layout.cp, max(layout.tp, 1), layout.world_size
    if cp < 1:
        return [f"parallel.cp must be >= 1 (got {cp})"]
    if cp == 1:
        return []
    kv_heads = facts.n_kv_heads if facts is not None else None
    unverified = facts.cp_unverified() if facts is not None else None
    attention_dropout = facts.attention_dropout if facts is not None else 0.0
    router_aux = facts is not None and facts.router_aux_loss
    aux_key, aux_off = _aux_words(cfg, facts)
    errors = []
    if world_size % (cp * tp):
        what = f"parallel.cp ({cp})" if tp == 1 else f"parallel.cp x parallel.tp ({cp} x {tp})"
        # No cp > 1 fits where tp leaves fewer than 2 ranks (or does not divide the world).
        room = world_size // tp if world_size % tp == 0 else 0
        other = f"choose a parallel.cp that divides {room}" if room > 1 else "lower parallel.tp"
        errors.append(
            f"{what} must divide the world size ({world_size}); the data-parallel size is world "
            f"size / {'cp' if tp == 1 else '(cp x tp)'}: run on a multiple of {cp * tp} ranks "
            f"or {other}"
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
    impl = cp_impl(cfg, facts)
    # Worded by what the user typed: auto's choice is named as such, and the way out of a
    # ring the user named is the other implementation, not another cp alone.
    auto = cfg.parallel.cp_impl is CpImpl.auto
    ring = "parallel.cp_impl=ring" + (" (what auto takes for these heads)" if auto else "")
    alltoall = "a cp" if auto else "parallel.cp_impl=alltoall with a cp"
    if impl == "ring" and cfg.train.seq_len % cp == 0 and cfg.train.seq_len % (2 * cp):
        errors.append(
            f"parallel.cp={cp} with {ring}: 2 x parallel.cp ({2 * cp}) does not divide "
            f"train.seq_len ({cfg.train.seq_len}): the ring splits each row into 2 x cp chunks "
            "and gives cp rank j chunks j and 2 cp - 1 - j, so that every rank computes the same "
            "share of the causal attention; choose a train.seq_len that 2 x cp divides"
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
            f"{unverified}: context parallel replaces the attention call, which this family "
            "does not declare (cp_attention in fsdprun/families.py: how its attention takes "
            "its mask, windows and scores); set parallel.cp=1",
        ),
        (
            router_aux,
            f"the router's auxiliary loss ({aux_key}): its load-balancing term multiplies two "
            "per-expert means over the micro-batch's tokens, which the cp ranks hold in slices, "
            f"and fsdprun does not gather them; set {aux_off}, or parallel.cp=1",
        ),
        (
            cfg.precision.float8.value == "rowwise",
            "precision.float8=rowwise: its weight gradient's float8 operands are scaled per "
            "column over the tokens, which context parallel splits between ranks, and torchao's "
            "Float8Linear takes those scales from each rank's own tokens inside its backward (one "
            "rank would scale over them all); use precision.float8=tensorwise, whose scales "
            "fsdprun takes over the cp group",
        ),
        (
            impl == "ring" and attention_dropout > 0,
            f"{ring} and the model's attention dropout {attention_dropout:g} (its config.json's "
            "attention_dropout): the ring applies no dropout; set it to 0 in config.json, or "
            f"{alltoall} that divides the kv heads (all-to-all)",
        ),
        (
            # The all-to-all is a functional collective, which compiles inside the block.
            impl == "ring" and cfg.compile.enabled and cfg.compile.fullgraph,
            f"{ring} and compile.fullgraph=true: torch.compile cannot trace the ring's "
            "point-to-point sends (\"P2P compilation disabled for P2POp construction\"), so a "
            "compiled block breaks its graph at the ring; set compile.fullgraph=false, or "
            f"{alltoall} that divides the kv heads (all-to-all)",
        ),
    )  # fmt: skip
    errors += [f"parallel.cp={cp} with {why}" for refuse, why in refused if refuse]
    return errors


def _sharding_errors(fsdp: FsdpConfig, layout: Layout) -> list[str]:
    """What the engine and mesh refuse in the `fsdp:` section, one message per problem (the
    shard groups are made of `layout`'s data-parallel ranks)."""
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
    what = "the world size" if layout.row_group == 1 else (
        "the data-parallel size (world size / parallel.tp)" if layout.cp == 1
        else "the data-parallel size (world size / (parallel.tp x parallel.cp))")  # fmt: skip
    dp, per_node = layout.dp, max(layout.nproc_per_node // layout.row_group, 1)
    world_size, nproc_per_node = layout.world_size, layout.nproc_per_node
    if fsdp.shard_group_size is not None:
        if fsdp.shard_group_size < 1 or dp % fsdp.shard_group_size:
            errors.append(
                f"fsdp.shard_group_size ({fsdp.shard_group_size}) must divide {what} ({dp})"
            )
    elif fsdp.sharding in _HYBRID and dp % min(per_node, dp):
        errors.append(
            f"fsdp.sharding={fsdp.sharding.value}: launch.nproc_per_node ({nproc_per_node}) "
            f"must divide the world size ({world_size}); set fsdp.shard_group_size"
        )
    if fsdp.engine is Engine.ddp and fsdp.cpu_offload:
        errors.append("fsdp.cpu_offload needs a sharding engine; use fsdp.engine=fsdp1 or fsdp2")
    return errors


def _ep_errors(cfg: RecipeConfig, layout: Layout, facts: ModelFacts | None) -> list[str]:
    """What parallel.ep refuses, one message per problem: a model without experts (or whose
    family does not say where they live: `Family.experts`), an ep that does not divide the
    experts or the shard group of data-parallel ranks its groups are carved from, and each
    combination fsdprun has not made exact under it (`layout` has the tp and cp degrees that
    fit the world, the others refused once already)."""
    ep = layout.ep
    if ep < 1:
        return [f"parallel.ep must be >= 1 (got {ep})"]
    if ep == 1:
        return []
    errors = []
    experts = facts.num_experts if facts is not None else None
    key = "config.json's num_experts" if facts is not None and facts.hf else "model.moe_experts"
    if facts is not None and experts is None:
        model = (f"model.hf_path's model_type {facts.model_type!r}" if facts.hf
                 else "the built-in Llama with model.moe_experts=0")  # fmt: skip
        errors.append(
            f"parallel.ep={ep} with a dense model ({model}: no experts to shard); expert "
            "parallel shards a mixture of experts' experts; set parallel.ep=1"
        )
    elif facts is not None and facts.entry.experts is None:
        errors.append(
            f"parallel.ep={ep} with model.hf_path's model_type {facts.model_type!r}: its family "
            "does not declare where its experts live (experts in fsdprun/families.py), so the "
            "dispatch cannot take them over; set parallel.ep=1"
        )
    elif experts is not None and experts % ep:
        errors.append(
            f"parallel.ep ({ep}) does not divide the model's experts ({experts}, {key}): each "
            f"ep rank holds experts / ep of them; choose an ep that divides {experts}"
        )
    group = layout.shard_group
    if layout.fits_world and group % ep:
        what = "the data-parallel ranks" if layout.row_group == 1 else (
            "the data-parallel ranks (world size / (parallel.tp x parallel.cp))")  # fmt: skip
        if layout.sharding in _HYBRID or layout.sharding is Sharding.none:
            what = "the shard group (fsdp.shard_group_size, or one node's ranks)"
        errors.append(
            f"parallel.ep ({ep}) must divide {what} ({group}): the ep groups are carved out of "
            f"the ranks that shard the model; run on a multiple of {ep} ranks or choose an ep "
            f"that divides {group}"
        )
    refused = (
        (
            cfg.fsdp.engine is not Engine.fsdp2,
            f"fsdp.engine={cfg.fsdp.engine.value}: the experts are DTensors sharded over the ep "
            "mesh, which only FSDP2 shards further; use fsdp.engine=fsdp2",
        ),
        (
            layout.tp > 1,
            f"parallel.tp={layout.tp}: the tp ranks of a group hold the same tokens, and "
            "fsdprun dispatches every rank's tokens to the experts; the expert mesh is not "
            "composed with tp yet; set parallel.tp=1",
        ),
        (
            layout.cp > 1,
            f"parallel.cp={layout.cp}: the ep groups would be carved out of dp_shard x cp, "
            "which fsdprun's mesh does not split yet; set parallel.cp=1",
        ),
    )  # fmt: skip
    errors += [f"parallel.ep={ep} with {why}" for refuse, why in refused if refuse]
    return errors
