"""How many tokens to draft each round: a fixed γ, or one chosen from what the decoder observes.

With per-draft acceptance α, a round with γ drafts yields E(γ) = (1 - α^(γ+1)) / (1 - α) tokens
(Leviathan et al. 2023) and costs γ draft steps plus one target call over γ+1 tokens, but never fewer
than two: the target re-feeds the token before a lone one (see slot.Rows), so a round without drafts
costs as much as a round with one in target rows (on a GPU every target call computes max γ + 1 rows);
greedy, those rows check free guesses, which make a round without drafts worth 1 + the guesses that hold.
What a round at γ costs, in target calls without drafts, is timed (`Costs`). AdaptiveGamma picks the
γ (0 = target only) with the most tokens per unit of cost. While it sits at 0 it still drafts one token
now and then (a probe) so it notices when the draft starts agreeing again: first after PROBE_EVERY rounds (a seeded
request's fresh policy: MAX_PROBE_EVERY), and each probe
after which it still does not draft, rejected or held, doubles the wait up to MAX_PROBE_EVERY, but for one that holds
where the draft had been failing (α below ½), which brings the next after PROBE_EVERY. A probe costs a cold draft
call that catches up on the tokens the draft missed, plus a 2-token target call: with a probe every 8 rounds a draft that
never agrees (α 0.02) decoded at 0.94x target-only, with the wait growing to 32 at 0.98x. Greedy on the demo pair, where
the draft agrees in patches, caps of 8, 16 and 32 measured alike. Under a JSON schema there (2 busy CPU cores, medians)
a probe cost 2.6 rounds without drafts (its draft call read ~27 missed tokens, each row a mask) and held 79% of the time,
yet a round at γ 1 cost 1.8 of them for 1.8 tokens: auto stayed at 0 after most probes. Held probes left the wait as it
was and the cap was 32: probes took 7-10% of auto's time under the schema and under T 0.8 + repetition 1.1. Counting
held probes and capping at 128, they took ~3%; auto/target-only, medians of 21 interleaved runs (load 9-14, ±0.1 run
to run): schema 0.95 -> 0.98, T 0.8 + repetition 1.1 0.91 -> 0.93, greedy plain 1.26 -> 1.35.
But a draft that agrees again after a long bad stretch is then noticed late: its first probe that holds leaves α low
(0.15 after 1000 rounds of rejected drafts), so several must hold before auto drafts, and doubled, each came
MAX_PROBE_EVERY rounds after the last: at a draft step of 0.3 target calls auto drafted again 262-374 rounds after the
draft began to agree (tests/test_policy.py; 40-56 when held probes left the wait as it was and the cap was 32).
A probe that holds where the draft had been failing is news, so the next one comes after PROBE_EVERY: 22-134 rounds.
No probe comes while no γ would pay were every draft accepted (its cost above its γ + 1 tokens): no α a probe could show
makes auto draft then. The demo pair under T 0.8 + repetition 1.1 on 2 cores at load 8 priced a round at γ 1 at 4.7
rounds without drafts, yet probed about once a request (a catch-up on the prompt and the tokens since: 3.6-3.9 rounds).
Simulated (independent acceptance, a draft step 0.3 target calls and a further row 0.03, 128 switch points), the 300
rounds after α went from 0.05 to 0.8 yielded 1.33 tokens a target call instead of 1.03 (1.35 before held probes doubled
the wait); where probes hold at a rate drafting does not pay for (3 times in 10, at 0.3 a step) it costs 25 probes a
1000 rounds instead of 8, 0.963x target-only instead of 0.987x (a probe's catch-up priced at 1.6 target calls).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque

PROBE_EVERY = 8
MAX_PROBE_EVERY = 128
# Weight of the past in the estimate of α. Greedy agreement may come in runs (stretches of text both
# models find predictable), where a fast average follows them within a few rounds, or as coin flips
# (acceptance independent from round to round), where a fast average only chases noise. On an earlier
# demo pair, A/B in one process: greedy auto 2.79x at 0.7 vs 2.59x at 0.9. But with independent
# acceptance (benchmarks/policy_sim.py; the random-weight layer pairs of the GPU runs accept so) 0.7
# left auto 1-11% behind the best fixed γ, where choosing between 0.7 and 0.95 came within 0.4-3%. So
# greedy keeps both estimates and uses the one that has predicted the recent rounds better (the higher
# log-likelihood of their accepted counts, averaged with ESTIMATE_SCORE_DECAY); on today's demo pair the
# two predict alike and auto decoded as fast as with 0.7 alone (1.67x both, medians of 14 interleaved
# runs). Sampled acceptance is closer to coin flips: at temperature 1.0, 2.00x at 0.7 vs 2.19x at 0.9
# (fixed γ = 4: 2.45x, 2.17x).
GREEDY_DECAYS = (0.7, 0.95)
SAMPLING_DECAYS = (0.9,)
ESTIMATE_SCORE_DECAY = 0.97
PRIOR_EXTRA_TOKEN = 0.05  # the prior's cost of one more row in a target call, per draft
# What a call costs besides reading its weights (Python, onnxruntime's dispatch, sampling and penalties on the host),
# as the weight bytes it could have read meanwhile: the prior a seeded sampled request prices rounds by, never timed
# (PriorCosts), takes a draft step for (draft bytes + this) / (target bytes + this) of a target call. Tiny models pay
# their calls' overhead, real-size ones read their weights. Sampled at T 0.8 on 2 CPU cores (2026-11-27): a draft step
# of the demo pair (0.7 MB of weights against 16.5 MB, a ratio of 0.04) cost 0.46-0.55 target calls at γ 1-4 idle and
# ~0.7 with its catch-ups at load 9, priced 0.68 (at 16 MiB, 0.51, seeded auto drafted at γ 1 where α was 0.62-0.66, at
# 0.83x target-only; at 32, 0.99x, load 6); priced by the ratio, it drafted at γ 3-4 where α was 0.41, at 0.73-0.75x.
# A 46M-parameter fp32 layer pair's (30 MB against 170, a ratio of 0.18) cost 0.12-0.36 (load 9), priced 0.31: seeded
# auto kept its speed-up there (1.77x target-only, 1.81x by the ratio, α 0.75). On an H100 a TinyLlama-sized pair's
# (0.44 GB against 2.07) cost 0.13-0.20 greedy and 0.29-0.60 sampled, priced 0.22 (0.21 by the ratio). A constant, not
# a measurement, so that a seed reproduces across processes and machines: a cost timed at compile time and kept in the
# manifest would too, but it is the compile machine's, under its load then, and older bundles lack it. (vLLM drafts a
# fixed number of tokens; llama.cpp and transformers' assisted generation adapt to acceptance alone.)
CALL_OVERHEAD_BYTES = 32 << 20
# Each γ's cost (0's included: the unit) is the median of the last FIRST_ROUNDS rounds timed at it; until then a γ ≥ 1
# is priced as if untimed. One sample alone, taken whole as the first of an average was, priced a γ for good: a first
# round without drafts 17 times the median (sampling and penalties on the demo pair, load 4) made every γ look cheaper
# than γ 0; a first round at γ 1 18 times the unit (load 9) priced out γ 1 and every untimed γ above it, and auto never
# timed γ 1 again (a probe's round catches up, untimed). The median of the last few, where a slow average (0.95, each
# sample clipped at 3 times the estimate) took ~20 rounds, follows the machine within 3 rounds when a spell makes every
# call 2-3 times as slow (2 busy cores: a round without drafts took 0.55-1.6 ms within one run): a round at γ is priced
# in the unit of its spell.
FIRST_ROUNDS = 5
# Rounds after which a unit not timed since is timed afresh (FIRST_ROUNDS rounds without drafts): auto drafting on never
# times it otherwise, and a unit whose first rounds all fell in a slow spell (~32 ms against ~0.6, load 9) priced every
# γ cheap, so auto drafted at γ 8 under a JSON schema where target-only was faster. A γ ≥ 1 left untimed is not timed
# afresh so: that would draft at each again, at the prior's price, every STALE_ROUNDS rounds auto sits at γ 0.
STALE_ROUNDS = 256
# A γ ≥ 1 priced out of reach (its cost above the γ + 1 tokens it could yield) is timed afresh so, the wait doubling
# each time it is priced out again, up to MAX_STALE_ROUNDS: while every γ is priced out no probe comes
# (_drafting_could_pay) and nothing else times them, so a spell in which drafting looked dear (a cold draft priced γ 1
# at 3.9-11.3 rounds without drafts right after long stretches at γ 0) left auto at γ 0 for the decoder's life. Only
# the lowest such γ goes stale (the one below it timed within reach): dropped together, every γ fell back to the prior
# at once, and auto drafted at each to time it again (43 rounds of 1 + 3 γ units each where a draft step cost 3).
# Simulated (a draft that agrees, its step 3 target calls, 50,000 rounds), re-timing γ 1 took 3.1 rounds in 1000,
# 0.993x target-only (a cap of 1024: 5.9, 0.987x; 4096: 1.7, 0.996x), and once a step cost 0.1 auto drafted again
# 304-1139 rounds later (never before). A γ timed within reach, yet too dear for the α of its time, held auto as surely:
# no round times it while auto drafts below it (a draft step of 0.9 target calls in a spell priced γ 1 at 1.9 units for
# ~1.4 tokens, and auto stayed at γ 0; further steps of 1.2 priced γ 2 at 2.5, and auto stayed at γ 1, every γ above
# priced from it). Such a γ is timed afresh after MAX_STALE_ROUNDS rounds at the γ below it, a wait that stays (it may
# as well be within reach when timed again): once no round at it or above has been timed for as long and the last was at
# the γ below. Judged by its own rounds alone, a γ that auto left for a higher one that pays more was dropped too,
# whenever a round came at the γ below (the unit timed afresh, every STALE_ROUNDS rounds), and its prior's price drew
# auto down to time it and each γ on the way back up (tests/test_policy.py). Simulated (steps of 0.1 from round 1000, a
# catch-up 3 steps; 6000 rounds, 4 seeds): at α 0.5 0.98-1.00x target-only became 1.25-1.28x, at α 0.8 0.99x became
# 1.89-1.92x (the best fixed γ: 1.21x, 1.68x); where no γ pays (α 0.3-0.6, steps of 0.3-0.7, 50,000 rounds), 0.1-0.8%
# slower, re-timing γ 1 and γ 2 (each re-timed at the prior's price draws auto on to the next): the demo pair under T
# 0.8 + repetition 1.1 drafted twice as many rounds and decoded 0.94-1.01x as fast as before (medians of 5 interleaved
# A/Bs, 2 cores at load 2-11).
MAX_STALE_ROUNDS = 2048
# Rounds after the unit was last timed within which a round at γ ≥ 1 is priced in it: each γ's cost is a ratio to the
# unit of its time, since the γ 0 auto sits at keeps being timed while a γ it does not draft at is not, and rounds at γ
# timed in seconds, divided by a unit timed later, cost what the machine's speed was at two moments: four auto decoders
# in one process (the demo pair under T 0.8 + repetition 1.1, 2 cores at load 7-8) priced a round at γ 1 at 1.96, 3.32,
# 3.97 and 5.11 rounds without drafts, and one drafted in ~6,600 of ~10,000 rounds, another in ~500. Later rounds at γ,
# in a unit that may be of another spell, price nothing (a round is ~1 ms here, a spell lasts many).
FRESH_ROUNDS = 32
# A γ ≥ 1 priced out whose target calls alone cost SPELL times the cheapest those at it or above cost when priced (their
# median over FIRST_ROUNDS, in units) was timed in a slow spell, not found dear: it is timed afresh after FRESH_ROUNDS
# rounds, not STALE_ROUNDS. While auto drafts only a request's last round (no room for drafts) times the unit, so rounds
# in a spell 3 times as slow were priced in the unit of the fast stretch before, and auto sat at γ 0 for 256-2048
# rounds (benchmarks/policy_sim.py, whose docstring has the figures: at α 0.8, 1.42x target-only became 1.82x, the best
# fixed γ 2.00x). Only the first time out of reach since it was within reach (its wait not yet doubled): a target call
# dear for good (a grammar's masks, 4.3 units for a round at γ 1) or a floor timed in a fast spell re-times it once,
# then it waits as after a first wait of STALE_ROUNDS. Pairing each round with a round without drafts beside it instead
# (each ~1 ms on the demo pair) priced γ by noise: 0.83-0.91x main's speed under T 0.8 + repetition 1.1.
# A γ within reach timed in a spell (γ 4 at 4.47 units, for up to 5 tokens) held auto at the γ below for
# MAX_STALE_ROUNDS rounds: where its target calls cost SPELL times those of the γ below, timed since, it is timed afresh
# after FRESH_ROUNDS rounds at the γ below. Compared with the γ below, not with the cheapest ever (a call priced in a unit
# timed in a slow spell cost a third of a unit, and every later γ looked timed in a spell) nor with the unit (a call of
# many rows may cost SPELL units for good): either re-timed a γ within reach every few dozen rounds for good
# (tests/test_policy.py). One more row costs far less than twice (Costs), so a γ timed beside the γ below waits
# MAX_STALE_ROUNDS again. policy_sim, medians of 9 seeds: at α 0.8/0.95 1.83x/2.65x became 1.93x/3.05x, unchanged
# without spells; the demo pair as fast as without it (0.91-1.04x where an A/A gave 0.96-1.04x: 6 runs of 40
# interleaved repetitions, greedy, 2 CPU cores at load 4-7).
SPELL = 2.0


def prior_draft_cost(draft_bytes: int, target_bytes: int) -> float:
    """A draft step's cost in target calls by the prior of a seeded sampled request (CALL_OVERHEAD_BYTES)."""
    return (draft_bytes + CALL_OVERHEAD_BYTES) / (target_bytes + CALL_OVERHEAD_BYTES)


def expected_tokens_per_call(alpha: float, gamma: int) -> float:
    """τ = (1 − α^(γ+1)) / (1 − α): Leviathan et al.'s closed form when every draft token is accepted
    independently with probability α; γ + 1 at α = 1. (AdaptiveGamma.choose sums it term by term; the compiler's γ
    recommendation and distillation use it, through specbuild.acceptance.)"""
    return gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = gamma

    def choose(self, limit: int) -> int:
        return min(self.gamma, limit)

    def observe(self, drafted: int, accepted: int, draft_seconds: float, target_seconds: float,
                catching_up: bool = False, held: int | None = None, timed: bool = True) -> None:
        pass


class Costs:
    """Running estimates of what a round costs at each γ, in units of a target call without drafts:
    whole rounds (draft calls plus the target call) timed at that γ, the median of the last FIRST_ROUNDS, each priced in
    the unit timed in the FRESH_ROUNDS rounds before it; for a γ not yet timed so the nearest timed one below it plus
    prior_step per further draft (the weight-byte ratio, plus a row).

    Measured per γ, because a round's cost is neither linear in γ nor split well between draft and
    target: on the demo pair a round's first draft step took 0.17 ms and each further one 0.05; the target
    call after drafting ran 0.11 ms slower than the same two rows without drafts; a 3-row target call
    cost what a 2-row one did and a 5-row one 27% more. The model before this one (1 + γ·c + (γ−1)·κ, c
    the average draft step, κ each further target row measured against a call without drafts) priced γ 2
    above γ 1 although γ 2 was 8% faster. Costs describe the machine and what a request's calls do (penalties,
    a grammar's masks: decode._kind), not the text, so one set per kind is shared by every slot of a decoder; a
    lock keeps concurrent requests' updates whole."""

    def __init__(self, max_gamma: int, draft_cost: float):
        self.lock = threading.Lock()
        self.prior_step = draft_cost + PRIOR_EXTRA_TOKEN  # a further draft, until timed: the weight-byte ratio
        # γ 0's seconds (the unit), then each γ's cost in units; None until FIRST_ROUNDS are timed.
        self.rounds: list[float | None] = [None] * (max_gamma + 1)
        self.last: list[deque[float]] = [deque(maxlen=FIRST_ROUNDS) for _ in range(max_gamma + 1)]  # their samples
        self.observed = 0  # rounds timed
        self.timed_at = [0] * (max_gamma + 1)  # self.observed when a round at each γ was last timed
        self.stale_after = [STALE_ROUNDS] * (max_gamma + 1)  # rounds untimed after which each γ's cost may be dropped
        # each γ's last FIRST_ROUNDS target calls, in units (SPELL)
        self.calls: list[deque[float]] = [deque(maxlen=FIRST_ROUNDS) for _ in range(max_gamma + 1)]
        self.calls_floor = [math.inf] * (max_gamma + 1)  # each γ's cheapest median of them when priced (SPELL)
        self.calls_median = [1.0] * (max_gamma + 1)  # each γ's median of them when last priced (the unit's: 1)

    def costs(self, limit: int) -> list[float]:
        """The cost of a round at γ = 0 … limit."""
        table = [1.0]
        for gamma in range(1, limit + 1):
            timed = self.rounds[gamma]
            table.append(timed if timed is not None else table[-1] + self.prior_step)
        return table

    def cost(self, gamma: int) -> float:
        return self.costs(gamma)[gamma]

    @property
    def unit_fresh(self) -> bool:
        """Whether the unit was timed in the FRESH_ROUNDS rounds before: a round at γ ≥ 1 is priced only in such a unit."""
        return self.observed - self.timed_at[0] <= FRESH_ROUNDS

    @property
    def unit_untimed(self) -> bool:
        """Whether the unit lacks its FIRST_ROUNDS samples, first or again after STALE_ROUNDS rounds untimed:
        AdaptiveGamma times them first, since every cost is priced in it. The target call of a round with drafts stood
        in for it before, but computes more rows and, under a grammar, builds a mask on the host for each (4.3x a round
        without drafts, the demo pair under a JSON schema, load 6): priced in it every γ looked cheap, and auto drafted
        on without ever timing γ 0."""
        return self.rounds[0] is None

    def _stale(self, gamma: int) -> bool:
        """Whether γ's cost is dropped, to be timed afresh: the unit untimed for stale_after[0] rounds, or, once the γ
        below it is timed within reach, a γ ≥ 1 priced out of reach and untimed for stale_after[γ] rounds, or one within
        reach where no round at it or above has been timed for MAX_STALE_ROUNDS rounds (FRESH_ROUNDS where its target
        calls cost SPELL times those of the γ below) and the round before was timed at the γ below."""
        if self.observed - self.timed_at[gamma] <= FRESH_ROUNDS:  # every wait below is at least as long
            return False
        if not gamma:
            return self.observed - self.timed_at[0] > self.stale_after[0]
        below, timed = 1.0 if gamma == 1 else self.rounds[gamma - 1], self.rounds[gamma]
        if timed is None or below is None or below > gamma:
            return False
        if timed > gamma + 1:
            return self.observed - self.timed_at[gamma] > self.stale_after[gamma]
        wait = FRESH_ROUNDS if self.calls_median[gamma] >= SPELL * self.calls_median[gamma - 1] else MAX_STALE_ROUNDS
        return self.observed - max(self.timed_at[gamma:]) > wait and self.timed_at[gamma - 1] == self.observed - 1

    def observe(self, drafted: int, draft_seconds: float, target_seconds: float, catching_up: bool) -> None:
        with self.lock:
            self.observed += 1
            for gamma in range(len(self.rounds)):
                if self._stale(gamma):
                    # priced out, and out of reach when timed again, it waits longer; dropped within reach, it waits
                    # STALE_ROUNDS first if priced out then, as any γ. A wait of FRESH_ROUNDS (SPELL) stands for the
                    # first STALE_ROUNDS: doubled from 32 it came back to STALE_ROUNDS, which reads as never doubled,
                    # and a target call dear for good was timed afresh after 32, 64 and 128 rounds over and over
                    if gamma and self.cost(gamma) > gamma + 1:
                        self.stale_after[gamma] = min(2 * max(self.stale_after[gamma], STALE_ROUNDS), MAX_STALE_ROUNDS)
                    self.rounds[gamma] = None
                    self.last[gamma].clear()
                    self.calls[gamma].clear()
            seconds = draft_seconds + target_seconds
            if drafted:
                # a catching-up draft also read tokens it had missed: not a round of γ; or no unit of its time
                if catching_up or self.rounds[0] is None or not self.unit_fresh:
                    return
                seconds /= self.rounds[0]
                self.calls[drafted].append(target_seconds / self.rounds[0])
            self.timed_at[drafted] = self.observed
            last = self.last[drafted]
            last.append(seconds)
            if len(last) == FIRST_ROUNDS:
                self.rounds[drafted] = cost = statistics.median(last)
                if drafted:
                    self.calls_median[drafted] = call = statistics.median(self.calls[drafted])
                    if cost <= drafted + 1:  # within reach: out of it later, it waits anew
                        self.stale_after[drafted] = STALE_ROUNDS
                    elif (self.stale_after[drafted] == STALE_ROUNDS
                          and call >= SPELL * min(self.calls_floor[drafted:])):  # priced in a slow spell
                        self.stale_after[drafted] = FRESH_ROUNDS
                    self.calls_floor[drafted] = min(self.calls_floor[drafted], call)


class PriorCosts(Costs):
    """Round costs from the prior alone, never timed: a seeded sampled request under auto γ prices rounds so,
    and keeps its own α (a fresh AdaptiveGamma), so that the γ of each round, and with it which random
    number judges which draft, follows from its seed alone: the request reproduces, as at a fixed γ. Its draft_cost
    is prior_draft_cost's, the call's overhead included: nothing corrects it. Costs' own prior, the weight ratio, only
    decides which γ a timed policy drafts at to time it, where a price too low costs a few rounds and finds the γs
    that pay (a greedy draft step of the demo pair cost 0.33 target calls at γ 4, its first 0.43)."""

    def observe(self, drafted: int, draft_seconds: float, target_seconds: float, catching_up: bool) -> None:
        pass

    @property
    def unit_untimed(self) -> bool:
        return False  # never timed: its costs are the prior's, in no unit timed


class AlphaEstimate:
    """α as a running average of accepted drafts with one decay, and how well it has predicted the rounds
    it saw (the average log-likelihood of their accepted counts before each was added)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.successes, self.failures = 1.2, 0.8  # prior α = 0.6: try speculation first
        self.score = 0.0

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def observe(self, drafted: int, accepted: int) -> None:
        """Drafts are accepted as a run: `accepted` successes, then one failure unless all were accepted."""
        failed = accepted < drafted
        a = min(max(self.alpha, 0.01), 0.99)
        self.score = ESTIMATE_SCORE_DECAY * self.score + accepted * math.log(a) + failed * math.log(1 - a)
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + failed


class AdaptiveGamma:
    """Keeps running estimates of α across requests (a warm decoder starts from what it learned; a seeded
    sampled request gets a fresh one over PriorCosts, decode.SpeculativeDecoder._policy), one per
    decay in alpha_decays, uses the one that predicted the recent rounds best, and reads the costs from
    `costs`. Its α and probing follow one stream of text: a decoder keeps one per slot (and decoding
    mode), used by one request at a time, while the costs are shared."""

    def __init__(self, max_gamma: int, draft_cost: float, alpha_decays: tuple[float, ...] = GREEDY_DECAYS,
                 costs: Costs | None = None, probe_every: int = PROBE_EVERY):
        """probe_every: the rounds at γ 0 before the first probe (PROBE_EVERY again once it drafts)."""
        self.max_gamma = max_gamma
        self.estimates = [AlphaEstimate(decay) for decay in alpha_decays]
        self.costs = costs or Costs(max_gamma, draft_cost)
        # Free guesses that held per round (decode._speculate: greedy auto checks them in rounds without
        # drafts, and counts in rounds with drafts how many would have held): what γ 0 yields beyond its token.
        self.held, self.guessed_rounds = 0.0, 1.0
        self.rounds_at_zero = 0  # since speculation stopped or the last probe
        self.probe_every = probe_every
        self.probing = False
        self.probed = False  # the last round was a probe: choose tells whether it led to drafting
        self.news = False  # that probe held where the draft had been failing (α below ½)

    @property
    def estimate(self) -> AlphaEstimate:
        return max(self.estimates, key=lambda e: e.score)  # the first (fastest) on a tie

    @property
    def alpha(self) -> float:
        return self.estimate.alpha

    def choose(self, limit: int) -> int:
        a = min(self.alpha, 0.999)
        with self.costs.lock:  # one consistent view of the costs
            if self.costs.unit_untimed:  # every cost is priced in it: timed first (Costs.unit_untimed)
                return 0
            costs = self.costs.costs(min(self.max_gamma, limit))
            unit_fresh = self.costs.unit_fresh  # always under PriorCosts, which counts no rounds
        # γ 0 yields its token and the guesses that hold; γ ≥ 1, expected_tokens_per_call summed term by term (a call
        # per γ took 1-2 µs of the ~8 that choose and observe took a round, against ~0.6 ms for a round at γ 0).
        best, most = 0, 1 + self.held / self.guessed_rounds
        tokens = term = 1.0
        for gamma in range(1, len(costs)):
            term *= a
            tokens += term
            if tokens / costs[gamma] > most:
                best, most = gamma, tokens / costs[gamma]
        probed, self.probed = self.probed, False
        if best > 0:
            self.rounds_at_zero, self.probe_every = 0, PROBE_EVERY
            # A γ not timed yet, drafted at while no unit is fresh, went untimed and kept the prior's price until the unit
            # went stale (STALE_ROUNDS): auto drafted for ~250 rounds at a γ whose rounds cost 4 units. A round without
            # drafts times the unit first (another slot timing γ meanwhile only spares it).
            if not unit_fresh and self.costs.rounds[best] is None:
                return 0
        elif limit > 0:
            if probed and self.news:  # the draft may agree again: the next probe confirms it soon
                self.probe_every = PROBE_EVERY
            elif probed:  # the probe paid its catch-up for nothing, rejected, or held where drafting does not pay
                self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            self.rounds_at_zero += 1
            if self.rounds_at_zero >= self.probe_every and _drafting_could_pay(costs, most):
                self.rounds_at_zero, self.probing = 0, True
                return 1
        return best

    def observe(self, drafted: int, accepted: int, draft_seconds: float, target_seconds: float,
                catching_up: bool = False, held: int | None = None, timed: bool = True) -> None:
        """catching_up: the draft's first call also read tokens it had missed (the prompt, or rounds
        without drafts), so its time says little about a draft step. held: how many free guesses the
        target accepted, or would have (None: not counted). timed False: the round's times say nothing of
        its cost (a CUDA graph warmed up or captured in it: slot.unsteady_calls)."""
        if held is not None:  # guesses hold in runs (repeated text): the fastest average
            decay = self.estimates[0].decay
            self.held = decay * self.held + held
            self.guessed_rounds = decay * self.guessed_rounds + 1
        self.news = self.probing and accepted == drafted and self.alpha < 0.5
        self.probed, self.probing = self.probing, False
        if drafted:
            for estimate in self.estimates:
                estimate.observe(drafted, accepted)
        if timed:
            self.costs.observe(drafted, draft_seconds, target_seconds, catching_up)


def _drafting_could_pay(costs: list[float], most: float) -> bool:
    """Whether some γ would beat γ 0 were every draft accepted: if not, no α a probe could show makes auto draft."""
    return any((gamma + 1) / cost > most for gamma, cost in enumerate(costs) if gamma)
