"""How many tokens to draft each round: a fixed γ, or one chosen from what the decoder observes.

With per-draft acceptance α, a round with γ drafts yields E(γ) = (1 - α^(γ+1)) / (1 - α) tokens
(Leviathan et al. 2023) and costs γ draft steps plus one target call over γ+1 tokens, but never fewer
than two: the target re-feeds the token before a lone one (see slot.Rows), so a round without drafts
costs as much as a round with one in target rows (on a GPU every target call computes max γ + 1 rows).
Greedy, those rows check free guesses instead: the first of a chain, worth 1 + how often it holds, or the chain of
FREE_GUESSES, whose further rows are priced apart (Costs.chain) and checked where what they yield pays for them.
What a round at γ costs, in target calls without drafts, is timed (`Costs`). AdaptiveGamma picks the
γ (0 = target only) with the most tokens per unit of cost, and the rounds at γ 0 up to the next probe at once (STRETCH).

While it sits at 0 it still drafts one token now and then (a probe) so it notices when the draft starts agreeing again:
first after PROBE_EVERY rounds (a seeded request's fresh policy: MAX_PROBE_EVERY), and each probe after which it still
does not draft, rejected or held, doubles the wait up to MAX_PROBE_EVERY. A probe costs a cold draft call that catches
up on the tokens the draft missed, plus a 2-token target call: with a probe every 8 rounds a draft that never agrees
(α 0.02) decoded at 0.94x target-only, with the wait growing to 32 at 0.98x. Under a JSON schema on the demo pair a
probe cost 2.6 rounds without drafts and held 79% of the time, yet a round at γ 1 cost 1.8 of them for 1.8 tokens: with
held probes leaving the wait as it was and a cap of 32, probes took 7-10% of auto's time there and under T 0.8 +
repetition 1.1; counting held probes and capping at 128, ~3% (auto/target-only, medians of 21 interleaved runs, load
9-14: schema 0.95 -> 0.98, T 0.8 + repetition 1.1 0.91 -> 0.93, greedy plain 1.26 -> 1.35).
But a draft that agrees again after a long bad stretch is then noticed late: its first probe that holds leaves α low
(0.15 after 1000 rounds of rejected drafts), so several must hold before auto drafts, each MAX_PROBE_EVERY rounds after
the last: at a draft step of 0.3 target calls auto drafted again 262-374 rounds after the draft began to agree
(tests/test_policy.py). A probe that holds where the draft had been failing (α below FAILING) is news, so one more
comes after PROBE_EVERY rounds: 22-142. Only one: the wait is then as it was, since restarting it from PROBE_EVERY,
where 4 probes in 10 held and drafting did not pay (structured_alpha's tiny random pair, α 0.39), brought a probe every
~47 rounds, each a catch-up of ~3 rounds.
No probe comes while no γ would pay were every draft accepted (its cost above its γ + 1 tokens): no α a probe could show
makes auto draft then. The demo pair under T 0.8 + repetition 1.1 on 2 cores at load 8 priced a round at γ 1 at 4.7
rounds without drafts, yet probed about once a request (a catch-up on the prompt and the tokens since: 3.6-3.9 rounds).
What a catch-up costs is priced (Costs.draft_call: per call + per token read): once probes come MAX_PROBE_EVERY apart a
due one waits for a catch-up cheap enough (PROBE_SHARE), mostly a request's first round, up to MAX_PROBE_WAIT rounds
(a seeded request's policy waits for none: no later request of its own comes), and a round that would draft
after a stretch at γ 0 drafts only where drafting saves more over the room left than the catch-up costs.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from itertools import combinations

PROBE_EVERY = 8
MAX_PROBE_EVERY = 128
# Once probes come MAX_PROBE_EVERY apart (the draft keeps failing), a due probe waits until its draft call, the catch-up
# on every token since the draft last ran (Costs.draft_call), costs at most this share of the rounds at γ 0 since the
# last: mid-request that is the prompt and every token since, at a request's start the prompt alone. On the tiny random
# pair (no γ pays) a probe came every ~104 rounds, mid-request, ~3% of auto's time; with this, at requests' starts
# (fitted there in one process: a draft call 1.4 units + 0.056 a token; 17-59-token prompts) every ~360. Auto against
# target-only (benchmarks/auto_ab.py, medians over processes taking turns with two copies of the code before, 2 cores):
# 0.964x and 0.961x -> 0.987x (10 processes a side x 7 runs, load 2.6-3.8), 0.939x and 0.958x -> 0.989x (8 x 5, load
# 3.4-5.3).
PROBE_SHARE = 0.01
# But no longer than until this many rounds at γ 0 since the last probe: within one request the catch-up grows by a
# token a round, so where a token costs PROBE_SHARE of a round or more (the prior's 0.05 draft steps: from a step of
# 0.2; the tiny random pair's fit 0.056) no wait mid-request makes it cheap enough, and a request longer than the wait,
# or a seeded one (its own policy: no later request's start comes, PriorCosts.probe_wait), never probed again. Waiting
# so long mid-request costs about what probing every MAX_PROBE_EVERY did, a token's price a round for the catch-up on
# the tokens since (tiny pair: 1.4 + 0.056 x 1024 units every 1024 rounds, 5.7%; every 128, 6.7%), and notices a draft
# agreeing again later; above the ~360-600 rounds after which the tiny random pair's short requests brought their
# probes at a request's start.
MAX_PROBE_WAIT = 1024
# Free guesses a round without drafts checks at most (decode._speculate): on the demo pair, rounds of guesses alone (no
# draft model) decoded at 1.48x target-only with 1 guess, 1.54x with 2 and 4, and 1.26x with 8 (on the CPU every row
# costs ~9% of a call). Odd: the round's token and its guesses then fill an even call (slot.NEVER_ALONE), where 4
# guesses computed 6 rows, the 6th re-fed for evenness alone. Greedy on the demo pair (8 prompts x 128 tokens, auto held
# at γ 0) 5 made 464 target calls of 2302 rows where 4 made 488 of 2440, and auto decoded 1.037x and 1.066x as fast
# (medians of two sets of 30 interleaved runs in one process, 2 cores at load 2-3 and 4; faster in 26 and 21 of them).
FREE_GUESSES = 5
# Rounds at γ 0 that choose gives at once, observed together at the next choose (but a round whose guesses stop or start
# holding in a run ends them): on the decoding thread, between target calls, choose and observe took ~20 µs a round
# (~2 µs in a loop) where the tiny random pair's target-only round took ~125 µs (2 cores at load 4). Auto there without
# guesses or probes decoded at 0.92-0.93x target-only, 0.97-0.98x with choose and observe left out, and 0.96-0.98x
# choosing STRETCH rounds at once (medians of 25 interleaved runs, load 2-5). Its rounds' observations are kept for the
# next choose, which observes them first: what each teaches, it teaches in the same order.
STRETCH = 16
# α below which the draft is failing, so that a probe that holds is news. Simulated (draft steps of 0.65 target calls,
# catch-ups of 3; α 0.2-0.5, where no γ pays): below ½, 9.5-11.8 probes a 1000 rounds, below ¼ 8.0-9.0 (the floor,
# 1000 / MAX_PROBE_EVERY: 7.8), and a draft agreeing again after 1000 bad rounds drafted as soon (22-142 rounds after;
# below 0.15, 142-262). At α 0.4, where held probes are common, below ½ 1.4 times the floor's probes, below ¼ 1.08
# (tests/test_policy.py).
FAILING = 0.25
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
# A draft call's cost grows with the tokens it reads: one that catches up (a probe, the first round with drafts after a
# stretch at γ 0 or a forced run) reads every token since the draft last ran. Costs fits a call's cost in units as
# per-call + per-token from the rounds whose draft made one call (γ 1: probes, where they catch up on 20-200 tokens,
# and rounds at γ 1). Every sample is clipped at 3 times the price of a call like it (Costs.observe), as a preempted
# call would be; the first CATCH_UP_SAMPLES wait until there are that many, priced meanwhile by their medians
# (median_fit), and each is then clipped at 3 times what the other four price it at (Costs._clips). Taken whole before
# there was a price to clip them against, a call preempted on 2 busy cores (10-100 times as slow) among them priced
# calls by a mean it dominated for thousands of rounds: where the draft kept failing (a draft call 1.3 units, a
# request's start every 200 rounds), due probes waited up to MAX_PROBE_WAIT rounds for a start cheap enough until round
# 6,600-29,200; clipped so, they come as where none was preempted (tests/test_policy.py). Until the samples' token
# counts spread CATCH_UP_SPREAD or more (their weighted deviation), a token is priced at CATCH_UP_TOKEN of prior_step
# and the call at the samples' (weighted) mean less that (prior_step before any sample). Measured one call at a time
# (2 CPU cores, load 1): the tiny random pair's draft 62-74 µs for 1-8 tokens, 108 for 32, 173 for 64, 373 for 128
# (~2.5 µs a token, 0.04 of a call; its round without drafts ~165 µs); the demo pair's 157-168 µs for 1-2, 536 for 32,
# 1047 for 64, 2015 for 128 (~15 µs a token, 0.1 of a call). Each sample counts CATCH_UP_DECAY of the one before.
CATCH_UP_TOKEN = 0.05
CATCH_UP_SAMPLES = 5
CATCH_UP_SPREAD = 8
CATCH_UP_DECAY = 0.95
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
# (AdaptiveGamma.choose) and nothing else times them, so a spell in which drafting looked dear (a cold draft priced γ 1
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

    def choose(self, limit: int, behind: int = 0, room: int | None = None) -> int:
        return min(self.gamma, limit)

    def observe(self, drafted: int, accepted: int, draft_seconds: float, target_seconds: float,
                catching_up: bool = False, held: int | None = None, timed: bool = True, chained: bool = False,
                seen: int | None = None, read: int = 0) -> None:
        pass


def median_fit(samples: list[tuple[int, float]], token: float) -> tuple[float, float]:
    """A draft call's cost fitted to (tokens read, cost) samples by medians (Theil-Sen's): each token at the median
    slope between samples CATCH_UP_SPREAD tokens apart or more (`token` where none are), the call at the median of
    what the samples cost besides."""
    slopes = [(cost - other) / (read - fewer) for (read, cost), (fewer, other) in combinations(samples, 2)
              if abs(read - fewer) >= CATCH_UP_SPREAD]
    token = max(statistics.median(slopes), 0.0) if slopes else token
    return max(statistics.median(cost - token * read for read, cost in samples), 0.0), token


class Costs:
    """Running estimates of what a round costs at each γ, in units of a target call without drafts (two rows; one that
    checks a chain of guesses is priced apart, `chain`):
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

    # The rounds at γ 0 a due probe waits at most for a cheap catch-up (AdaptiveGamma._choose): a decoder's policies
    # outlive their requests, so the next request's start, where the draft has its prompt alone to read, may come first.
    probe_wait = MAX_PROBE_WAIT

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
        # A round at γ 0 whose target call checked a chain of free guesses, more rows than the unit's two, priced apart:
        # priced as a round without drafts, whatever its guesses, the unit hid that rounds with the first alone cost
        # less (on the tiny random pair a round of 6 rows among rounds of 2 cost ~22% more, and its guesses held 0.14
        # tokens a round: auto decoded at 0.83x target-only). The cheapest of its last FIRST_ROUNDS in units: a call
        # preempted takes ~5 ms where one takes ~1 (20-40% of them on the demo pair, 2 cores at load 3-5), and the
        # median priced 6 rows at 3-6 units, the cheapest at 1.2-1.5 (1.3-1.4 in calls timed alone). None until timed,
        # or once chain_stale_after rounds passed without one, a wait that doubles up to MAX_STALE_ROUNDS while no chain
        # is chosen for what it yields.
        self.chain: float | None = None
        self.chains: deque[float] = deque(maxlen=FIRST_ROUNDS)
        self.chain_timed_at = 0
        self.chain_stale_after = STALE_ROUNDS
        # The costs of γ ≥ 1, kept between the rounds that change them (rounds at γ 0, auto's most, leave them as they
        # are): the costs table, a count of its changes (AdaptiveGamma.choose plans anew after one), and the first round
        # at which one may be dropped.
        self.table: list[float] = []
        self.version = 0
        self.due = math.inf
        # A one-call draft's cost in units against the tokens it read (CATCH_UP_TOKEN): decayed sums of the samples'
        # weight, tokens, tokens², cost and tokens × cost, and the samples not yet in them, (tokens, cost). Each list is
        # replaced, never changed: AdaptiveGamma.choose prices catch-ups (draft_call) without the lock.
        self.reads = [0.0] * 5
        self.unfitted: list[tuple[int, float]] = []
        self._priced()

    def costs(self, limit: int) -> list[float]:
        """The cost of a round at γ = 0 … limit."""
        return self.table[:limit + 1]

    def cost(self, gamma: int) -> float:
        return self.table[gamma]

    def draft_call(self, tokens: int) -> tuple[float, float]:
        """A draft call that reads `tokens` tokens: its cost in units, and what each token it reads adds to it (the
        fit of CATCH_UP_TOKEN, the prior's where it lacks samples)."""
        weight, x, xx, y, xy = self.reads
        token = self.prior_step * CATCH_UP_TOKEN
        if not weight:
            unfitted = self.unfitted  # read once: another request's observe may fit them meanwhile
            call, token = median_fit(unfitted, token) if unfitted else (self.prior_step, token)
            return call + token * tokens, token
        spread = weight * xx - x * x
        if spread >= (CATCH_UP_SPREAD * weight) ** 2:
            token = max((weight * xy - x * y) / spread, 0.0)
        return max((y - token * x) / weight, 0.0) + token * tokens, token

    def _clips(self) -> list[float]:
        """What each unfitted sample is clipped at: 3 times the fit's price of a call like it; each of the first
        CATCH_UP_SAMPLES, 3 times what the others price it at (median_fit), whose medians a preempted one among them
        moves little. Its own among them, a preempted call that read the most set the median slope (4 of the 7 pairs
        of reads 2, 2, 2, 20, 200 far enough apart); the prior's token price in their stead clipped the first
        catch-up of a draft dearer a token than the prior (0.1 of a unit, the prior 0.0175: 200 tokens to 0.59 of
        its cost, and a 500-token one priced at 0.58 of its cost after the 5th sample, 0.89 after the 20th)."""
        if self.reads[0]:
            return [3 * self.draft_call(read)[0] for read, _ in self.unfitted]
        token, samples = self.prior_step * CATCH_UP_TOKEN, self.unfitted
        fits = [median_fit(samples[:i] + samples[i + 1:], token) for i in range(len(samples))]
        return [3 * (call + slope * read) for (read, _), (call, slope) in zip(samples, fits)]

    def _priced(self) -> None:
        """After a cost changed or was dropped: the table, and the first round at which observe may drop one (_stale,
        the chain's chain_stale_after). Each wait counts from the last round timed at it, or at γ or above: later rounds
        there only make the waits longer."""
        table = [1.0]
        for timed in self.rounds[1:]:
            table.append(timed if timed is not None else table[-1] + self.prior_step)
        if table != self.table:  # a due check that dropped nothing leaves the plans as they were
            self.table, self.version = table, self.version + 1
        due = self.timed_at[0] + self.stale_after[0]
        if self.chain is not None:
            due = min(due, self.chain_timed_at + self.chain_stale_after)
        for gamma in range(1, len(self.rounds)):
            if (after := self._drop_after(gamma)) is not None:
                due = min(due, after)
        self.due = due + 1

    def _drop_after(self, gamma: int) -> int | None:
        """The round after which γ ≥ 1 may be dropped (_stale), None while it may not: it waits for the γ below to be
        priced within reach, which prices anew (counted due, a γ timed above one dropped or never timed — probes catch
        up: they time none — was due at every round from then on). Priced out of reach, stale_after[γ] rounds after it
        was timed; within reach, MAX_STALE_ROUNDS (FRESH_ROUNDS in a SPELL) after a round at it or above was."""
        below, timed = 1.0 if gamma == 1 else self.rounds[gamma - 1], self.rounds[gamma]
        if timed is None or below is None or below > gamma:
            return None
        if timed > gamma + 1:
            return self.timed_at[gamma] + self.stale_after[gamma]
        spell = self.calls_median[gamma] >= SPELL * self.calls_median[gamma - 1]
        return max(self.timed_at[gamma:]) + (FRESH_ROUNDS if spell else MAX_STALE_ROUNDS)

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
        after = self._drop_after(gamma)
        if after is None or self.observed <= after:
            return False
        timed = self.rounds[gamma]
        assert timed is not None  # _drop_after: priced
        return timed > gamma + 1 or self.timed_at[gamma - 1] == self.observed - 1

    def observe(self, drafted: int, draft_seconds: float, target_seconds: float, catching_up: bool,
                chained: bool = False, read: int = 0) -> None:
        """chained: a round without drafts whose target call checked a chain of free guesses. read: the tokens the
        round's first draft call read (0: not told)."""
        with self.lock:
            self.observed = observed = self.observed + 1
            if observed >= self.due:
                if self.chain is not None and observed - self.chain_timed_at > self.chain_stale_after:
                    self.chain, self.chain_stale_after = None, min(2 * self.chain_stale_after, MAX_STALE_ROUNDS)
                    self.chains.clear()
                for gamma in range(len(self.rounds)):
                    if self._stale(gamma):
                        # priced out, and out of reach when timed again, it waits longer; dropped within reach, it
                        # waits STALE_ROUNDS first if priced out then, as any γ. A wait of FRESH_ROUNDS (SPELL) stands
                        # for the first STALE_ROUNDS: doubled from 32 it came back to STALE_ROUNDS, which reads as
                        # never doubled, and a target call dear for good was timed afresh after 32, 64 and 128 rounds
                        # over and over
                        if gamma and self.cost(gamma) > gamma + 1:
                            self.stale_after[gamma] = min(2 * max(self.stale_after[gamma], STALE_ROUNDS),
                                                          MAX_STALE_ROUNDS)
                        self.rounds[gamma] = None
                        self.last[gamma].clear()
                        self.calls[gamma].clear()
                self._priced()
            seconds = draft_seconds + target_seconds
            if not (drafted or chained):  # the unit: auto's most rounds, kept short
                self.timed_at[0] = observed
                last = self.last[0]
                last.append(seconds)
                if len(last) == FIRST_ROUNDS:
                    self.rounds[0] = statistics.median(last)
                return
            unit = self.rounds[0]
            if unit is None or not self.unit_fresh:  # no unit of its time
                return
            if drafted == 1 and read:  # one draft call: a sample of draft_call, clipped as a preempted call would be
                self.unfitted = [*self.unfitted, (read, draft_seconds / unit)]
                if self.reads[0] or len(self.unfitted) == CATCH_UP_SAMPLES:
                    for (tokens, cost), clip in zip(self.unfitted, self._clips()):
                        cost = min(cost, clip)
                        sample = 1.0, tokens, tokens * tokens, cost, tokens * cost
                        self.reads = [CATCH_UP_DECAY * old + new for old, new in zip(self.reads, sample)]
                    self.unfitted = []
            if drafted and catching_up:  # its draft also read tokens it had missed: not a round of γ
                return
            if chained:
                if self.chain is not None:  # chosen for what it yields, not to time it: it pays
                    self.chain_stale_after = STALE_ROUNDS
                self.chain_timed_at = observed
                self.chains.append(seconds / unit)
                if len(self.chains) == FIRST_ROUNDS:
                    self.chain = min(self.chains)
                    self.due = min(self.due, observed + self.chain_stale_after + 1)
                return
            self.calls[drafted].append(target_seconds / unit)
            self.timed_at[drafted] = observed
            last = self.last[drafted]
            last.append(seconds / unit)
            if len(last) == FIRST_ROUNDS:
                self.rounds[drafted] = cost = statistics.median(last)
                self.calls_median[drafted] = call = statistics.median(self.calls[drafted])
                if cost <= drafted + 1:  # within reach: out of it later, it waits anew
                    self.stale_after[drafted] = STALE_ROUNDS
                elif (self.stale_after[drafted] == STALE_ROUNDS
                      and call >= SPELL * min(self.calls_floor[drafted:])):  # priced in a slow spell
                    self.stale_after[drafted] = FRESH_ROUNDS
                self.calls_floor[drafted] = min(self.calls_floor[drafted], call)
                self._priced()


class PriorCosts(Costs):
    """Round costs from the prior alone, never timed: a seeded sampled request under auto γ prices rounds so,
    and keeps its own α (a fresh AdaptiveGamma), so that the γ of each round, and with it which random
    number judges which draft, follows from its seed alone: the request reproduces, as at a fixed γ. Its draft_cost
    is prior_draft_cost's, the call's overhead included: nothing corrects it. Costs' own prior, the weight ratio, only
    decides which γ a timed policy drafts at to time it, where a price too low costs a few rounds and finds the γs
    that pay (a greedy draft step of the demo pair cost 0.33 target calls at γ 4, its first 0.43)."""

    # a seeded request's policy is its own: a due probe waiting for a later request's start would wait for good
    probe_wait = MAX_PROBE_EVERY

    def observe(self, drafted: int, draft_seconds: float, target_seconds: float, catching_up: bool,
                chained: bool = False, read: int = 0) -> None:
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
        # Free guesses (decode._speculate: greedy auto checks them in rounds without drafts, and counts how many of a
        # chain would have held, as far as the round's tokens tell): how often the first held, per round, and the
        # guesses after a first that held, counted as drafts are (those that held, then the one that did not). What γ 0
        # yields beyond its token with the first alone, and with a chain. A round that checks the first alone tells of
        # the second too (its token), so the chain's worth is not its count up to 2: so counted, auto kept to the first
        # alone on the demo pair, where its chains held ~1.4 tokens a round.
        self.first, self.guessed_rounds = 0.0, 1.0
        self.further_held, self.further_missed = 0.0, 1.0
        self.held_decay = min(alpha_decays)  # guesses hold in runs (repeated text): the fastest average
        self.chain = True  # whether the round at γ 0 that choose gave checks a chain of guesses, or the first alone
        self.rounds_at_zero = 0  # since speculation stopped or the last probe
        self.probe_every = probe_every
        self.probing = False
        self.probed = False  # the last round was a probe: choose tells whether it led to drafting
        self.news = False  # that probe held where the draft had been failing (α below FAILING)
        self.drafted_rounds = 0  # rounds observed with drafts: α changes with them alone
        self.planned: tuple[int, int, int] | None = None  # the costs' version, drafted_rounds and γ limit of self.plan
        self.plan = 0, 0.0, 0.0  # _plan's
        self.stretch = 0  # further rounds at γ 0 that choose gave at once (STRETCH)
        self.behind = 0  # the draft's catch-up at the last choose: a shorter one starts a request, and ends a stretch
        self.pending: list[tuple] | None = None  # their rounds, observed at the next choose (None: none given)

    @property
    def estimate(self) -> AlphaEstimate:
        return max(self.estimates, key=lambda e: e.score)  # the first (fastest) on a tie

    @property
    def alpha(self) -> float:
        return self.estimate.alpha

    def choose(self, limit: int, behind: int = 0, room: int | None = None) -> int:
        """behind: the tokens the draft's first call would read, were it called (1-2 after a round with drafts, more
        where it catches up); room: the tokens the request may generate after this round's (None: no end in sight)."""
        if self.stretch and behind >= self.behind:
            self.behind = behind
            self.stretch -= 1
            self.rounds_at_zero += 1
            return 0
        self.behind, self.stretch = behind, 0
        if self.pending is not None:
            pending, self.pending = self.pending, None
            for args in pending:
                self.observe(*args)
        return self._choose(limit, behind, room)

    def _choose(self, limit: int, behind: int = 0, room: int | None = None) -> int:
        # a probe chosen but never observed (a RequestError, a stream closed between choose and observe) is over: the
        # next round observed is no probe
        self.probing = False
        costs = self.costs
        with costs.lock:  # one consistent view of the costs
            if costs.unit_untimed:  # every cost is priced in it: timed first (Costs.unit_untimed)
                self.chain = False
                return 0
            planned = costs.version, self.drafted_rounds, min(self.max_gamma, limit)
            if planned != self.planned:  # neither α nor a cost changed (auto at γ 0): drafting yields what it did
                self.planned, self.plan = planned, self._plan(costs.costs(planned[2]))
            chain = costs.chain or 1.0  # untimed: priced as the unit, so that a chain times it
            priceable = costs.unit_fresh or costs.rounds[self.plan[0]] is not None  # a round at the best γ (below)
        # γ 0 yields its token and the guesses that hold: the first's, or a chain's of FREE_GUESSES
        first = self.first / self.guessed_rounds
        further = expected_tokens_per_call(self.further_held / (self.further_held + self.further_missed),
                                           FREE_GUESSES - 1)
        chained = (1 + first * further) / chain
        self.chain = chained >= 1 + first
        most = max(chained, 1 + first)
        best, rate, ceiling = self.plan
        probed, self.probed = self.probed, False
        if rate > most:
            self.rounds_at_zero, self.probe_every = 0, PROBE_EVERY
            # A γ not timed yet, drafted at while no unit is fresh, went untimed and kept the prior's price until the unit
            # went stale (STALE_ROUNDS): auto drafted for ~250 rounds at a γ whose rounds cost 4 units. A round without
            # drafts times the unit first (another slot timing γ meanwhile only spares it). Always fresh under
            # PriorCosts, which counts no rounds.
            if not priceable:
                self.chain = False  # a round of the unit's two rows
                return 0
            # A round that catches up reads behind - 2 more tokens than one after drafting: worth it where drafting
            # saves more over the room left, each token costing 1 / most units at γ 0 and 1 / rate drafting.
            if behind > 2 and room is not None and (costs.draft_call(behind)[1] * (behind - 2)
                                                    > room * (1 / most - 1 / rate)):
                self.stretch = max(min(STRETCH, room) - 1, 0)
                self.pending = [] if self.stretch else None
                return 0
            return best
        if limit > 0:
            if probed and self.news:  # the draft may agree again: the next probe confirms it soon
                self.rounds_at_zero = max(self.probe_every - PROBE_EVERY, 0)
            elif probed:  # the probe paid its catch-up for nothing, rejected, or held where drafting does not pay
                self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            self.rounds_at_zero += 1
            # No probe while no γ would beat γ 0 were every draft accepted: no α a probe could show makes auto draft.
            due = self.rounds_at_zero >= self.probe_every and ceiling > most
            if due and (self.probe_every < MAX_PROBE_EVERY or self.rounds_at_zero >= costs.probe_wait
                        or costs.draft_call(behind)[0] <= PROBE_SHARE * self.rounds_at_zero):
                self.rounds_at_zero, self.probing = 0, True
                return 1
            # the rounds up to the next probe's, which is chosen in full; a due one waits for a cheaper catch-up
            self.stretch = min(STRETCH, (costs.probe_wait if due else self.probe_every) - self.rounds_at_zero
                               if ceiling > most else STRETCH) - 1
            self.pending = [] if self.stretch else None
        return 0

    def _plan(self, costs: list[float]) -> tuple[int, float, float]:
        """The γ ≥ 1 that yields the most tokens a unit of cost, that many (0 for none), and the most any would were
        every draft accepted; expected_tokens_per_call summed term by term."""
        a = min(self.alpha, 0.999)
        best, most = 0, 0.0
        tokens = term = 1.0
        for gamma in range(1, len(costs)):
            term *= a
            tokens += term
            if tokens / costs[gamma] > most:
                best, most = gamma, tokens / costs[gamma]
        return best, most, max(((gamma + 1) / cost for gamma, cost in enumerate(costs) if gamma), default=0.0)

    def observe(self, drafted: int, accepted: int, draft_seconds: float, target_seconds: float,
                catching_up: bool = False, held: int | None = None, timed: bool = True, chained: bool = False,
                seen: int | None = None, read: int = 0) -> None:
        """catching_up: the draft's first call also read tokens it had missed (the prompt, or rounds
        without drafts), so its time says little about a draft step. held: how many leading free guesses of a chain
        the target accepted, or would have, of the `seen` its tokens tell of (None: no guesses; seen None: held + 1).
        timed False: the round's times say nothing of its cost (a CUDA graph warmed up or captured in it:
        slot.unsteady_calls). chained: a round without drafts whose target call checked more guesses than the first
        (Costs.chain)."""
        if self.pending is not None:
            self.pending.append((drafted, accepted, draft_seconds, target_seconds, catching_up, held, timed, chained,
                                 seen, read))
            if held is not None and (not held if self.chain else held == seen):
                self.stretch = 0  # guesses that stop or start holding in a run: chosen afresh at once
            return
        if held is not None:
            decay = self.held_decay
            self.first = decay * self.first + (held > 0)
            self.guessed_rounds = decay * self.guessed_rounds + 1
            if held:
                self.further_held = decay * self.further_held + held - 1
                self.further_missed = decay * self.further_missed + (seen is None or held < seen)
        self.news = self.probing and accepted == drafted and self.alpha < FAILING
        self.probed, self.probing = self.probing, False
        if drafted:
            self.drafted_rounds += 1
            for estimate in self.estimates:
                estimate.observe(drafted, accepted)
        if timed:
            self.costs.observe(drafted, draft_seconds, target_seconds, catching_up, chained, read)

