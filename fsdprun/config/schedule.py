"""Pipeline schedule arithmetic, torch-free: torch's schedule class of each
parallel.pp_schedule, blocks per stage, the bubble and the micro-batches a pipeline rank holds
in flight. `config.layout` refuses layouts with it; plan and `engines.pp` count and build
with it.
"""

from __future__ import annotations

from fsdprun.config.model_facts import ModelFacts
from fsdprun.config.schema import PpSchedule

# The pipeline schedules (parallel.pp_schedule): torch.distributed.pipelining's class of each,
# and whether it places several stages on a rank (looped: stage s on pp rank s mod pp).
PP_SCHEDULES = {
    PpSchedule.gpipe: ("ScheduleGPipe", False),
    PpSchedule.one_f_one_b: ("Schedule1F1B", False),
    PpSchedule.interleaved_1f1b: ("ScheduleInterleaved1F1B", True),
    PpSchedule.interleaved_zb: ("ScheduleInterleavedZeroBubble", True),
}


def pp_blocks(
    num_layers: int, num_stages: int, *, head_cost: float = 0.0, split: list[int] | None = None
) -> list[int]:
    """Blocks per pipeline stage, first stage first: `split` as the recipe gives it
    (parallel.pp_split), or balanced: contiguous stages whose largest cost is least, a block
    costing 1 and the last stage's head `head_cost` more (its matmul FLOPs in blocks, as
    `head_blocks` counts them); the embedding (a lookup) costs nothing. Among equal costs the
    last stage takes the most blocks; the others share the rest evenly, the later ones taking
    the remainder (stage 0 holds the most micro-batches of activations under 1F1B).
    `layout_errors` refuses a split that leaves a stage without a block."""
    if split is not None:
        return list(split)
    if num_stages <= 1:
        return [num_layers]
    best: tuple[float, list[int]] | None = None
    for last in range(num_layers - num_stages + 1, 0, -1):
        rest, others = num_layers - last, num_stages - 1
        base, extra = divmod(rest, others)
        counts = [base] * (others - extra) + [base + 1] * extra + [last]
        cost = max(max(counts[:-1]), last + head_cost)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, counts)
    assert best is not None, (num_layers, num_stages)
    return best[1]


def head_blocks(facts: ModelFacts | None, seq_len: int) -> float:
    """The output head's training FLOPs in decoder blocks' (6 vocab x dim against 6 x a block's
    matmul weights + 12 x its attention width x seq_len, `fsdprun.models.llama`'s count): what
    the last stage carries besides its blocks. 0 where the facts do not say."""
    if facts is None or None in (facts.dim, facts.n_heads, facts.ffn_dim, facts.vocab_size):
        return 0.0
    head_dim = facts.head_dim or facts.dim // facts.n_heads
    width, kv = facts.n_heads * head_dim, (facts.n_kv_heads or facts.n_heads) * head_dim
    block = 6 * (2 * facts.dim * width + 2 * facts.dim * kv + 3 * facts.dim * facts.ffn_dim)
    return 6 * facts.vocab_size * facts.dim / (block + 12 * width * seq_len)


def bubble_fraction(
    schedule: PpSchedule, pp: int, micro_batches: int, stages_per_rank: int = 1
) -> float:
    """The share of a step a pipeline rank idles in the schedule's bubble, for equal stages:
    (pp - 1) / (micro-batches + pp - 1) for gpipe and 1f1b (the fill and the drain, one stage's
    forward and backward each); the interleaved schedules' fill and drain are one virtual
    stage's, 1 / stages_per_rank as long: (pp - 1) / (v x micro-batches + pp - 1); zero bubble
    fills them with the weight gradients, and the fill left is the forward's and the input
    gradients' share (torch's ZB1P: about 1/3 of interleaved 1F1B's). 0 without pp."""
    if pp <= 1:
        return 0.0
    v = stages_per_rank if PP_SCHEDULES[schedule][1] else 1
    bubble = (pp - 1) / (v * micro_batches + pp - 1)
    return bubble / 3 if schedule is PpSchedule.interleaved_zb else bubble


def in_flight(
    schedule: PpSchedule, pp: int, micro_batches: int, stages_per_rank: int = 1, rank: int = 0
) -> float:
    """The most micro-batches whose activations pipeline rank `rank` holds at once, in
    micro-batches through all of its layers: gpipe every one (all forwards come first), 1f1b
    pp - rank (its warm-up forwards, then one backward frees one as one forward adds one); the
    interleaved schedule's warm-up is torch's ((v - 1) x the micro-batches of a round +
    2 (pp - 1 - rank) + 1 forwards of one virtual stage, a v-th of the rank's layers each).
    0 without pp."""
    if pp <= 1:
        return 0.0
    if schedule is PpSchedule.gpipe:
        return float(micro_batches)
    if not PP_SCHEDULES[schedule][1]:
        return float(min(pp - rank, micro_batches))
    v = stages_per_rank
    per_round = micro_batches // max(1, micro_batches // pp)
    held = min((v - 1) * per_round + 2 * (pp - 1 - rank) + 1, micro_batches * v)
    return held / v
