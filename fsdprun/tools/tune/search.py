"""The search of `fsdprun tune`: successive halving (the rounds, their cost and the cut to the
budget), the rounds run interleaved with each trial's timeout, the statistics of a round and the
decision rule (a gain counts only beyond the measured noise), the selection from the trial log
and the Pareto front of memory and tokens/s.

Never imports the report, nor the training loop or the launcher; `select` is a pure function of
the trial log (fsdprun status uses it too).
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from fsdprun.report.metrics import percentile
from fsdprun.tools.tune.trials import Round, loss_problem, run_trial, trial_id

if TYPE_CHECKING:
    from fsdprun.tools.tune.space import Candidate


ETA = 3  # successive halving keeps the best 1/ETA of each round; steps double
DEFAULT_STEPS = 4  # measured steps per trial in the first round
DEFAULT_REPEATS = 2  # trials per finalist in the last round
DEFAULT_FINALISTS = 2  # challengers that reach the last round beside the baseline
FIRST_TRIAL_TIMEOUT_S = 1200.0  # before any trial has finished, nothing to scale from
MIN_TIMEOUT_S = 300.0  # then 4x the expected trial time, at least this (x2 with compile)


# ---------------------------------------------------------------------------------------------
# The schedule


def halving_schedule(
    num_candidates: int, *, steps: int, finalists: int, repeats: int, eta: int = ETA
) -> list[Round]:
    """Successive halving: all candidates for `steps` measured steps, then the best 1/eta (at
    least the baseline and `finalists` challengers) for twice the steps, ..., the last round with
    `repeats` trials of each."""
    rounds, n, s = [], num_candidates, steps
    while True:
        final = n <= finalists + 1
        rounds.append(Round(len(rounds), n, s, repeats if final else 1))
        if final:
            return rounds
        n, s = max(finalists + 1, math.ceil(n / eta)), s * 2


def schedule_cost_s(rounds: list[Round], *, overhead_s: float, step_s: float) -> float:
    """Estimated seconds of a schedule: each trial its start-up and warm-up (`overhead_s`) plus
    its measured steps."""
    return sum(r.num_candidates * r.repeats * (overhead_s + r.measured_steps * step_s)
               for r in rounds)  # fmt: skip


def fit_to_budget(
    num_candidates: int, budget_s: float, *, overhead_s: float, step_s: float, steps: int,
    finalists: int, repeats: int,
) -> int:  # fmt: skip
    """The most candidates (the baseline included; at least 2 when there are 2) whose whole
    schedule the budget covers."""
    for n in range(num_candidates, 2, -1):
        rounds = halving_schedule(n, steps=steps, finalists=finalists, repeats=repeats)
        if schedule_cost_s(rounds, overhead_s=overhead_s, step_s=step_s) <= budget_s:
            return n
    return min(num_candidates, 2)


# ---------------------------------------------------------------------------------------------
# Selection


@dataclass
class Stats:
    median: float
    q1: float
    q3: float
    num_trials: int
    num_steps: int

    @property
    def spread(self) -> float:
        """Half the interquartile range, relative to the median."""
        return (self.q3 - self.q1) / 2 / self.median if self.median else math.nan

    @property
    def median_error(self) -> float:
        """Standard error of the median, relative to it: 1.2533 sigma / sqrt(n), sigma estimated
        robustly as IQR / 1.349 (so one slow step does not inflate it). It shrinks as a trial
        measures more steps, as the step-to-step spread does not."""
        sigma = (self.q3 - self.q1) / 1.349
        return 1.2533 * sigma / math.sqrt(self.num_steps) / self.median if self.median else math.nan


def noise_of(candidate: Stats, baseline: Stats) -> float:
    """The measured noise of a gain: two standard errors of the difference of the two medians
    (about 95% confidence), relative to the baseline's median."""
    return 2 * math.hypot(candidate.median_error * candidate.median / baseline.median,
                          baseline.median_error)  # fmt: skip


def step_rates(record: dict[str, Any]) -> list[float]:
    return [record["tokens_per_step"] / t for t in record.get("step_times_s", []) if t > 0]


def round_stats(records: list[dict[str, Any]], cand_id: str, round_index: int) -> Stats | None:
    """Tokens/s of one candidate in one round: every measured step of its good trials."""
    mine = [r for r in records if r["candidate"] == cand_id and r["round"] == round_index
            and r["status"] == "ok"]  # fmt: skip
    samples = [x for r in mine for x in step_rates(r)]
    if not samples:
        return None
    return Stats(percentile(samples, 50), percentile(samples, 25), percentile(samples, 75),
                 len(mine), len(samples))  # fmt: skip


@dataclass
class Ranked:
    candidate: str
    round: int | None  # the round it is compared at (highest with the baseline)
    stats: Stats | None
    baseline: Stats | None
    gain: float | None  # median / baseline median - 1


@dataclass
class Selection:
    winner: str  # a candidate id; "c0" = the baseline stays
    ranking: list[Ranked]
    beats_noise: bool
    gain: float | None
    noise: float | None  # the baseline's relative spread at the compared round
    verdict: str


def select(records: list[dict[str, Any]], baseline: str = "c0") -> Selection:
    """The winner from the trial log alone (deterministic): each candidate is compared with the
    baseline at the highest round both have good trials in; ranked by that round, then median
    tokens/s, then id. The top challenger wins only if its gain exceeds the measured noise
    (`noise_of`: two standard errors of the difference of the medians)."""
    ids = sorted({r["candidate"] for r in records}, key=lambda c: int(c[1:]))
    ranking = []
    for cid in ids:
        rounds = sorted({r["round"] for r in records if r["candidate"] == cid}, reverse=True)
        best = None
        for ri in rounds:
            mine, base = round_stats(records, cid, ri), round_stats(records, baseline, ri)
            if mine is not None and base is not None:
                best = Ranked(cid, ri, mine, base, mine.median / base.median - 1)
                break
        if best is None:
            mine = next((s for ri in rounds if (s := round_stats(records, cid, ri))), None)
            best = Ranked(cid, None, mine, None, None)
        ranking.append(best)

    def key(r: Ranked) -> tuple:
        return (r.round is None, -(r.round or 0), -(r.stats.median if r.stats else -1),
                int(r.candidate[1:]))  # fmt: skip

    ranking.sort(key=key)
    labels = {r["candidate"]: r.get("label", r["candidate"]) for r in records}
    top = next((r for r in ranking if r.round is not None), None)
    if top is None:
        # The starting recipe never ran (out of memory, say): any candidate that ran is better.
        ran = next((r for r in ranking if r.stats is not None and r.candidate != baseline), None)
        if ran is None:
            return Selection(baseline, ranking, False, None, None,
                             "no trial succeeded: the starting recipe stays")  # fmt: skip
        return Selection(ran.candidate, ranking, True, None, None,
                         f"no trial of the starting recipe succeeded; {ran.candidate} "
                         f"({labels[ran.candidate]}) is the fastest that ran")  # fmt: skip
    noise = noise_of(top.stats, top.baseline)
    if top.candidate == baseline:
        return Selection(baseline, ranking, False, 0.0, noise,
                         "the starting recipe is the fastest: it stays")  # fmt: skip
    if not top.gain > noise:
        return Selection(
            baseline, ranking, False, top.gain, noise,
            f"{top.candidate} ({labels[top.candidate]}) is {top.gain:+.1%} but within the "
            f"measured noise (±{noise:.1%}): the starting recipe stays",
        )  # fmt: skip
    return Selection(top.candidate, ranking, True, top.gain, noise,
                     f"{top.candidate} ({labels[top.candidate]}) beats the starting recipe by "
                     f"{top.gain:+.1%}, more than the measured noise (±{noise:.1%})")  # fmt: skip


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Ids of the (id, peak bytes, tokens/s) points no other point beats on both (less memory
    and more tokens/s)."""
    front = []
    for pid, mem, tps in points:
        if not any((m <= mem and t >= tps) and (m < mem or t > tps) for _, m, t in points):
            front.append(pid)
    return front


# ---------------------------------------------------------------------------------------------
# The rounds


def _search(
    args, log, order, *, warmup, rtol, started, say, leader=None
) -> tuple[str | None, dict]:
    """Run the rounds. Returns why the search stopped early (the budget) or None, and the
    candidates the budget left out of the first round (id -> reason)."""
    records = log.records
    base = order[0]

    def elapsed() -> float:
        return time.perf_counter() - started

    def costs() -> tuple[float, float] | None:
        """Median start-up + warm-up seconds of a trial, and median seconds of a measured step."""
        ok = [r for r in records if r["status"] == "ok"]
        if not ok:
            return None
        overhead = percentile([r["wall_s"] - sum(r["step_times_s"]) for r in ok], 50)
        return overhead, percentile([t for r in ok for t in r["step_times_s"]], 50)

    def estimate(steps: int) -> float | None:
        c = costs()
        return None if c is None else c[0] + steps * c[1]

    def timeout(steps: int, cand: Candidate) -> float:
        est = estimate(steps)
        # Generous: a slow candidate is not a hung one (compile's first steps take minutes).
        compiled = 2 if cand.knobs.get("compile.enabled") == "true" else 1
        limit = args.trial_timeout_s or (
            FIRST_TRIAL_TIMEOUT_S if est is None else compiled * max(MIN_TIMEOUT_S, 4 * est)
        )  # fmt: skip
        # Never past the budget by more than one trial's length.
        return min(limit, max(args.budget_s - elapsed(), 0) + (est or limit))

    alive, left_out, fitted = list(order), {}, False
    for round_index in itertools.count():
        final = len(alive) <= args.finalists + 1
        rnd = Round(round_index, len(alive), args.steps * 2**round_index,
                    args.repeats if final else 1)  # fmt: skip
        say(f"round {rnd.index}: {rnd.num_candidates} candidates x {rnd.repeats} trials of "
            f"{rnd.measured_steps} measured steps")  # fmt: skip
        rep = 0
        while rep < rnd.repeats:
            i = 0
            while i < len(alive):
                cand = alive[i]
                i += 1
                tid = trial_id(rnd.index, cand, rep)
                if log.get(tid) is None:
                    est = estimate(rnd.measured_steps)
                    if records and (
                        elapsed() >= args.budget_s
                        or (est is not None and elapsed() + est > args.budget_s)
                    ):
                        return (f"--budget {args.budget_s:.0f} s spent after {elapsed():.0f} s: "
                                f"{tid} and later trials not run"), left_out  # fmt: skip
                    _trial(args, log, cand, base, tid=tid, rnd=rnd, warmup=warmup, rtol=rtol,
                           timeout_s=timeout(rnd.measured_steps, cand), say=say,
                           leader=leader)  # fmt: skip
                if round_index == 0 and not final and not fitted and (c := costs()):
                    # Once one trial has run: as many candidates as the budget's schedule covers.
                    fitted = True
                    n = fit_to_budget(len(alive), args.budget_s - elapsed() + c[0] + c[1] * rnd.
                                      measured_steps, overhead_s=c[0], step_s=c[1],
                                      steps=args.steps, finalists=args.finalists,
                                      repeats=args.repeats)  # fmt: skip
                    if n < len(alive):
                        reason = f"not tried: --budget covers the schedule of {n} candidates"
                        left_out = {c.id: reason for c in alive[n:]}
                        alive = alive[:n]
                        say(f"  the budget covers {n} candidates: {len(left_out)} left out")
                        if len(alive) <= args.finalists + 1:
                            # Few enough for the last round: this one becomes it, with repeats.
                            final = True
                            rnd = Round(rnd.index, len(alive), rnd.measured_steps, args.repeats)
                            say(f"round {rnd.index} is the last: {rnd.num_candidates} candidates "
                                f"x {rnd.repeats} trials")  # fmt: skip
            rep += 1
        if final:
            return None, left_out
        scores = {c.id: round_stats(records, c.id, rnd.index) for c in alive}
        challengers = sorted((c for c in alive[1:] if scores[c.id] is not None),
                             key=lambda c: (-scores[c.id].median, c.index))  # fmt: skip
        keep = max(args.finalists, math.ceil(len(alive) / ETA) - 1)
        alive = [base, *challengers[:keep]]
        if len(alive) == 1:
            return None, left_out
    raise AssertionError("unreachable")


def _trial(args, log, cand, base, *, tid, rnd, warmup, rtol, timeout_s, say, leader) -> None:
    """Run one trial (on every node, through `leader`, when there are several), check its
    losses against the baseline's of the same round, log it."""
    records = log.records
    overrides = [*args.overrides, *args.launch_overrides]
    if leader is None:
        rec = run_trial(args.recipe, overrides, cand, tid=tid, round_=rnd, warmup=warmup,
                        out_dir=args.out_dir, timeout_s=timeout_s)  # fmt: skip
    else:
        doc = {"tid": tid, "candidate": cand.id, "overrides": cand.overrides,
               "round": asdict(rnd), "warmup": warmup, "timeout_s": timeout_s}  # fmt: skip
        rec = leader.run(doc, lambda t: run_trial(
            args.recipe, [*overrides, f"launch.rdzv_endpoint={t['endpoint']}"], cand, tid=tid,
            round_=rnd, warmup=warmup, out_dir=args.out_dir, timeout_s=timeout_s,
            multi_node=True,
        ))  # fmt: skip
    ref = next((r for r in records if r["candidate"] == base.id and r["round"] == rnd.index
                and r["status"] == "ok"), None)  # fmt: skip
    if rec["status"] == "ok" and ref is not None and cand is not base:
        rec["loss_checked"] = not cand.numerics
        problem = loss_problem(rec["losses"], ref["losses"], rtol)
        if problem and not cand.numerics:
            rec["status"], rec["reason"] = "loss", problem
    rec["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    log.add(rec)
    extra = f": {rec['reason']}" if rec.get("reason") else ""
    say(f"  {tid} {cand.label}: {rec['status']} ({rec['wall_s']:.1f} s){extra}")
