"""The search of `fsdprun tune`: successive halving (the rounds, their cost and the cut to the
budget), the rounds run interleaved with each trial's timeout, the statistics of a round and the
decision rule (a gain counts only beyond the measured noise; within it, fewer knobs changed win),
the selection from the trial log, the confirmation of the winner against the starting recipe
after the search (interleaved pairs: the gain measured apart from the trials that chose it) and
the Pareto front of memory and tokens/s.

Never imports the report, nor the training loop or the launcher; `select` and `confirmation_of`
are pure functions of the trial log (fsdprun status uses `select` too).
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
# Pairs of the winner and the starting recipe run after the search: the fewest whose median is
# one of them (two would be their mean, so one disturbed pair would move it), and about what the
# last round of the default schedule costs (3 candidates x 2 trials).
DEFAULT_CONFIRM = 3
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


def schedule_cost_s(
    rounds: list[Round], *, overhead_s: float, step_s: float, confirm: int = 0
) -> float:
    """Estimated seconds of a schedule: each trial its start-up and warm-up (`overhead_s`) plus
    its measured steps; then `confirm` pairs of trials as long as the last round's."""
    trials = sum(r.num_candidates * r.repeats * (overhead_s + r.measured_steps * step_s)
                 for r in rounds)  # fmt: skip
    return trials + 2 * confirm * (overhead_s + rounds[-1].measured_steps * step_s)


def fit_to_budget(
    num_candidates: int, budget_s: float, *, overhead_s: float, step_s: float, steps: int,
    finalists: int, repeats: int, confirm: int = 0,
) -> int:  # fmt: skip
    """The most candidates (the baseline included; at least 2 when there are 2) whose whole
    schedule, the confirmation's `confirm` pairs included, the budget covers."""
    for n in range(num_candidates, 2, -1):
        rounds = halving_schedule(n, steps=steps, finalists=finalists, repeats=repeats)
        if schedule_cost_s(rounds, overhead_s=overhead_s, step_s=step_s,
                           confirm=confirm) <= budget_s:  # fmt: skip
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
    # A faster candidate within the noise of the winner that changes more knobs (the winner was
    # preferred to it), or None.
    passed_over: str | None = None


def select(records: list[dict[str, Any]], baseline: str = "c0") -> Selection:
    """The winner from the trial log alone (deterministic): each candidate is compared with the
    baseline at the highest round both have good trials in; ranked by that round, then median
    tokens/s, then id. The top challenger wins only if its gain exceeds the measured noise
    (`noise_of`: two standard errors of the difference of the medians). Of the challengers that
    beat the baseline so and whose medians are within the noise of the top one's (in its
    round), the one that changes the fewest knobs from the recipe wins (`_fewest_knobs`)."""
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
    knobs = {r["candidate"]: len(r.get("overrides") or ()) for r in records}
    pick = _fewest_knobs(ranking, top, knobs, baseline)
    pick_noise = noise_of(pick.stats, pick.baseline)
    verdict = (f"{pick.candidate} ({labels[pick.candidate]}) beats the starting recipe by "
               f"{pick.gain:+.1%}, more than the measured noise (±{pick_noise:.1%})")  # fmt: skip
    if pick is top:
        return Selection(top.candidate, ranking, True, top.gain, noise, verdict)
    between = noise_of(pick.stats, top.stats)
    n_pick, n_top = knobs[pick.candidate], knobs[top.candidate]
    verdict += (f"; preferred to the fastest, {top.candidate} ({labels[top.candidate]}, "
                f"{top.gain:+.1%}), as within the measured noise of it (±{between:.1%}) it "
                f"changes fewer knobs from the recipe ({n_pick} against {n_top})")  # fmt: skip
    return Selection(pick.candidate, ranking, True, pick.gain, pick_noise, verdict,
                     passed_over=top.candidate)  # fmt: skip


def _fewest_knobs(
    ranking: list[Ranked], top: Ranked, knobs: dict[str, int], baseline: str
) -> Ranked:
    """Of the challengers compared in `top`'s round that beat the baseline beyond the noise and
    whose medians are within the noise of `top`'s (`noise_of` against it), the one that changes
    the fewest knobs from the recipe, the fastest of those: a knob changed for a gain the trials
    cannot tell from the noise is a risk (memory, numerics, a slower machine) for nothing. The
    baseline, with none changed, is the case `select` decides before: `top` beats it."""
    rivals = [
        r for r in ranking
        if r.round == top.round and r.candidate != baseline
        and r.gain > noise_of(r.stats, r.baseline)
        and 1 - r.stats.median / top.stats.median <= noise_of(r.stats, top.stats)
    ]  # fmt: skip
    # `ranking` is by median within a round: min() keeps the fastest of the fewest.
    return min(rivals, key=lambda r: knobs.get(r.candidate, 0))


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


class _Clock:
    """The budget's arithmetic over the finished trials: time spent, a trial's expected length
    and its timeout."""

    def __init__(self, args, records: list[dict[str, Any]], started: float):
        self.args, self.records, self.started = args, records, started

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def costs(self) -> tuple[float, float] | None:
        """Median start-up + warm-up seconds of a trial, and median seconds of a measured step."""
        ok = [r for r in self.records if r["status"] == "ok"]
        if not ok:
            return None
        overhead = percentile([r["wall_s"] - sum(r["step_times_s"]) for r in ok], 50)
        return overhead, percentile([t for r in ok for t in r["step_times_s"]], 50)

    def estimate(self, steps: int) -> float | None:
        c = self.costs()
        return None if c is None else c[0] + steps * c[1]

    def spent(self, seconds: float | None) -> bool:
        """Whether the budget is spent, or would be by `seconds` more (None: not known yet).
        Never before the first trial: something is always measured."""
        return bool(self.records) and (
            self.elapsed() >= self.args.budget_s
            or (seconds is not None and self.elapsed() + seconds > self.args.budget_s)
        )  # fmt: skip

    def timeout(self, steps: int, cand: Candidate) -> float:
        est = self.estimate(steps)
        # Generous: a slow candidate is not a hung one (compile's first steps take minutes).
        compiled = 2 if cand.knobs.get("compile.enabled") == "true" else 1
        limit = self.args.trial_timeout_s or (
            FIRST_TRIAL_TIMEOUT_S if est is None else compiled * max(MIN_TIMEOUT_S, 4 * est)
        )  # fmt: skip
        # Never past the budget by more than one trial's length.
        return min(limit, max(self.args.budget_s - self.elapsed(), 0) + (est or limit))


def run_search(
    args, log, order, *, warmup, rtol, started, say, leader=None
) -> tuple[str | None, dict]:
    """Run the rounds. Returns why the search stopped early (the budget) or None, and the
    candidates the budget left out of the first round (id -> reason)."""
    records = log.records
    base = order[0]
    clock = _Clock(args, records, started)

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
                    if clock.spent(clock.estimate(rnd.measured_steps)):
                        return (f"--budget {args.budget_s:.0f} s spent after "
                                f"{clock.elapsed():.0f} s: {tid} and later trials not run"
                                ), left_out  # fmt: skip
                    _trial(args, log, cand, base, tid=tid, rnd=rnd, warmup=warmup, rtol=rtol,
                           timeout_s=clock.timeout(rnd.measured_steps, cand), say=say,
                           leader=leader)  # fmt: skip
                if round_index == 0 and not final and not fitted and (c := clock.costs()):
                    # Once one trial has run: as many candidates as the budget's schedule, the
                    # confirmation included, covers.
                    fitted = True
                    n = fit_to_budget(len(alive), args.budget_s - clock.elapsed() + c[0] + c[1] *
                                      rnd.measured_steps, overhead_s=c[0], step_s=c[1],
                                      steps=args.steps, finalists=args.finalists,
                                      repeats=args.repeats, confirm=args.confirm)  # fmt: skip
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


def _trial(
    args, log, cand, base, *, tid, rnd, warmup, rtol, timeout_s, say, leader, event="trial"
) -> None:
    """Run one trial (on every node, through `leader`, when there are several), check its
    losses against the baseline's of the same round, log it (as `event`: "confirm" for the
    confirmation's, which the selection never reads)."""
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
    rec["event"] = event
    rec["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    log.add(rec)
    extra = f": {rec['reason']}" if rec.get("reason") else ""
    say(f"  {tid} {cand.label}: {rec['status']} ({rec['wall_s']:.1f} s){extra}")


# ---------------------------------------------------------------------------------------------
# The confirmation


@dataclass
class Confirmation:
    """The winner and the starting recipe run again after the search, in interleaved pairs of
    trials as long as the last round's: the gain measured apart from the trials that chose the
    winner. Those overstate it: of several candidates within the noise of each other, the one
    whose trials ran luckiest wins, and its luck is counted in its gain."""

    winner: str
    pairs_asked: int
    measured_steps: int
    predicted: float | None  # the search's ratio (1 + its gain)
    # Each complete pair: its trial ids, each side's median tokens/s, winner / baseline.
    pairs: list[dict[str, Any]]
    ratio: float | None  # the median of the pairs' ratios
    low: float | None
    high: float | None
    failed: str | None  # a trial of the winner that did not end well: "id (status: reason)"
    stopped: str | None  # why pairs are missing (the budget), or None
    holds: bool  # the winner stays: no trial of it failed, and its measured ratio is above 1


def confirm_skipped(sel: Selection, pairs: int, baseline: str = "c0") -> str | None:
    """Why no confirmation runs after this selection, or None."""
    if sel.winner == baseline:
        return "the winner is the starting recipe"
    if sel.gain is None:
        return "no trial of the starting recipe succeeded to compare with"
    if pairs == 0:
        return "--confirm 0"
    return None


def pairs_text(n: int) -> str:
    return f"{n} interleaved pair" + ("" if n == 1 else "s")


def confirm_id(cand_id: str, pair: int) -> str:
    return f"confirm-{cand_id}-{pair}"


def confirm_order(winner: str, pair: int, baseline: str = "c0") -> tuple[str, str]:
    """The two trials of one pair, in the order they run: the baseline first in even pairs, the
    winner first in odd ones (B W W B B W ...), so a machine that drifts one way over the
    confirmation favours neither side over two pairs."""
    return (baseline, winner) if pair % 2 == 0 else (winner, baseline)


def confirmation_of(
    confirmations: list[dict[str, Any]], sel: Selection, *, pairs: int, measured_steps: int,
    stopped: str | None = None, baseline: str = "c0",
) -> Confirmation:  # fmt: skip
    """The measured ratio from the confirmation's trial records (a pure function of the log)."""
    by_id = {r["id"]: r for r in confirmations}

    def tokens_per_s(rec: dict[str, Any] | None) -> float | None:
        rates = step_rates(rec) if rec and rec["status"] == "ok" else []
        return percentile(rates, 50) if rates else None

    done, failed = [], None
    for k in range(pairs):
        w_rec = by_id.get(confirm_id(sel.winner, k))
        b_rec = by_id.get(confirm_id(baseline, k))
        if w_rec is not None and w_rec["status"] != "ok" and failed is None:
            why = f": {w_rec['reason']}" if w_rec.get("reason") else ""
            failed = f"{w_rec['id']} ({w_rec['status']}{why})"
        w, b = tokens_per_s(w_rec), tokens_per_s(b_rec)
        if w is not None and b is not None:
            done.append({"baseline": b_rec["id"], "winner": w_rec["id"],
                         "baseline_tokens_per_s": b, "winner_tokens_per_s": w,
                         "ratio": w / b})  # fmt: skip
    ratios = [d["ratio"] for d in done]
    ratio = percentile(ratios, 50) if ratios else None
    return Confirmation(
        winner=sel.winner, pairs_asked=pairs, measured_steps=measured_steps,
        predicted=None if sel.gain is None else 1 + sel.gain, pairs=done, ratio=ratio,
        low=min(ratios, default=None), high=max(ratios, default=None), failed=failed,
        stopped=stopped, holds=failed is None and (ratio is None or ratio > 1),
    )  # fmt: skip


def confirm_round(sel: Selection, steps: int, pairs: int) -> Round:
    """The confirmation's trials: as long as the winner's in the round it was chosen at (their
    records carry that round, for the loss check against the baseline's trials there)."""
    index = next(r.round for r in sel.ranking if r.candidate == sel.winner)
    return Round(index, 2, steps * 2**index, pairs)


def confirm_winner(
    args, log, sel: Selection, winner: Candidate, base: Candidate, *, warmup, rtol, started, say,
    leader=None,
) -> str | None:  # fmt: skip
    """Run the confirmation's pairs not logged yet (a rerun continues it). Returns why pairs are
    missing (the budget: no pair starts that the budget does not cover), or None. Stops at a
    trial of the winner that fails: the winner is then not kept (`Confirmation.holds`)."""
    rnd = confirm_round(sel, args.steps, args.confirm)
    clock = _Clock(args, log.records, started)
    cands = {winner.id: winner, base.id: base}
    say(f"confirmation: {pairs_text(args.confirm)} of {winner.id} ({winner.label}) and the "
        f"starting recipe, {rnd.measured_steps} measured steps each")  # fmt: skip
    for k in range(args.confirm):
        todo = [cid for cid in confirm_order(winner.id, k) if log.get(confirm_id(cid, k)) is None]
        est = clock.estimate(rnd.measured_steps)
        if todo and clock.spent(None if est is None else est * len(todo)):
            left = f"pair {k + 1}" if k + 1 == args.confirm else f"pairs {k + 1} to {args.confirm}"
            return (f"--budget {args.budget_s:.0f} s spent after {clock.elapsed():.0f} s: "
                    f"{left} not run")  # fmt: skip
        for cid in confirm_order(winner.id, k):
            tid = confirm_id(cid, k)
            if cid in todo:
                _trial(args, log, cands[cid], base, tid=tid, rnd=rnd, warmup=warmup, rtol=rtol,
                       timeout_s=clock.timeout(rnd.measured_steps, cands[cid]), say=say,
                       leader=leader, event="confirm")  # fmt: skip
            if cid == winner.id and log.get(tid)["status"] != "ok":
                return None  # the winner is not kept: no more of its trials to measure
    return None
