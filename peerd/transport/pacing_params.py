"""The pacer's parameters (transport/pacing.py's docstring says what each mechanism is for)."""

from __future__ import annotations

START_RATE = 2e6  # bytes/s (16 Mbit/s): low, so a thin link is not overrun 8x at the first average ...
START_DATAGRAM = 1200  # ... in datagrams of this size (1,667 a second); see start_rate
DEFAULT_RATE = START_RATE
MIN_RATE = 0.25e6
MAX_RATE = 20e9
BURST_S = 0.002  # a burst may run this far ahead of the average rate ...
CATCHUP_S = 0.008  # ... and this far for a sender the rate held back, whose wake-up came late (a loaded CPU:
# what it slept through past its time would otherwise be lost for good; 8 ms is under half the lab's queue)

MIN_SAMPLE_BYTES = 32 * 1200  # MIN_SAMPLE datagrams of the default payload
STARTUP_GROWTH = 2.0  # startup's step: an overshoot past the bottleneck is at most this much ...
STARTUP_PHASES = 2  # ... for a phase or two: a rate is raised after this many clean phases at it (a queue
# absorbs a first phase's overshoot: it looks clean)
PHASE_S = 0.05  # one phase of the cycle: two REPORT intervals (a phase needs a few REPORTs per destination)
PHASE_BYTES = 3 * MIN_SAMPLE_BYTES  # at least a report from each of three destinations
FAST_STARTUP_RATE = 40e6  # bytes/s: a startup phase above this rate (and its least judging lag) is shorter ...
FAST_STARTUP_MIN = 0.2  # ... in proportion, down to this fraction of PHASE_S (JUDGE_LAG_S)
JUDGE_LAG_S = 0.05  # a phase waits at least this long after it ended for its REPORTs (unless all are in) ...
MAX_JUDGE_LAG_S = 1.0  # ... and at most this long (a receiver that stopped reporting holds nothing up longer)
DELAY_K = 4.0  # the wait: the REPORT delay's smoothed mean plus this many smoothed deviations (as TCP's RTO)
DELAY_GAIN, DEV_GAIN = 0.125, 0.25  # the smoothing of both (RFC 6298's alpha and beta)
MAX_PENDING_REPORTS = 16  # REPORTs beyond a gap kept per destination (more: the gap is given up on)
EARLY_SAMPLE = 64  # datagrams reported of a phase before it may be judged early (congested) ...
EARLY_Z = 4.0  # ... when its loss is this many sigma above its floor
IDLE_S = 0.25  # a sender idle this long ended an average (or waited for data in one: aged by next to nothing)
MEMORY_HALF_LIFE_S = 60.0  # an idle sender's remembered rates lose half their excess over START_RATE this often
CYCLE = (1.1, 0.9, 0.98, 0.98, 0.98, 0.98)  # gains on btl: probe, drain, four cruise phases a little under
PROBE, DRAIN = 0, 1
PROBE_STEP = 0.02  # a clean probe raises btl this much at first, doubling with every clean probe in a row ...
MAX_PROBE_STEP = 0.08  # ... up to this (the overshoot a cruise phase then pays for), and after FAST_PROBES
FAST_PROBES = 5  # clean probes in a row (+28 % in all: the link got faster), then steps up to MAX_FAST_STEP
MAX_FAST_STEP = CYCLE[PROBE] - 1.0  # (a clean probe shows that much headroom, no more)
RESTART_PROBES = 8  # clean probes in a row (+77 % in all) before startup runs again from btl
MAX_CUT = 0.25  # one decrease goes at most this far below the phase's send rate
RECOVER_BELOW = 0.8  # btl under this fraction of what a clean phase of the cycle delivered lately ...
RECOVER_PROBE = 1.25  # ... probes at this gain, a clean one raising btl to what it sent (Judgement.recovering) ...
RECOVER_TO = 0.9  # ... up to this fraction of that delivered rate
CUT_MARGIN = 0.92  # congestion sets btl this far under what the congested phase delivered
PROBE_FAIL_CUT = 0.95  # a probe that overflowed the queue takes btl this much lower
LOSS_MARGIN = 0.005  # loss this far over the floor (plus Z sigma of both samples' noise) is congestion
Z = 2.0
STARTUP_MARGIN = 0.05  # in startup, floors rest on a few small phases: ask for more
STARTUP_Z = 3.0
PATH_MARGIN = 0.02  # one destination's share of a phase is a third of the sample (with 3 destinations), and
PATH_Z = 3.0  # there are as many chances of a false alarm as destinations: a cap needs clearer evidence
FLOOR_RATE = 0.85  # clean phases sent at most this fraction of a judged phase's rate give its floor
FLOOR_PHASES = 8  # pooled over at most this many
FLOOR_SAMPLE = 400  # datagrams: in the cycle a loss must stand THIN_Z sigma above a floor pooled from fewer
THIN_Z = 4.0
HISTORY = 32  # clean phases remembered (1.6 s)
MAX_PENDING = 64  # phases waiting for their judgement (more: the oldest go unjudged)
MIN_SAMPLE = 32  # datagrams: a phase (or a destination's share of one) with fewer says too little
# positions: a stream's first report comes this early, whatever the interval. Its arrival time is the path's base
# delay before this sender's queue filled: with a later first report (at MIN_SAMPLE) a sender that started above a
# thin link (START_RATE on 10 Mbit/s) first hears of its path with the queue full, takes that for the base, and
# never sees a queue again (tests/test_pacing.py's link under START_RATE).
FIRST_REPORT = 2
KERNEL_DROPS = 0.005  # receivers' kernel drops above this fraction of a phase's datagrams are congestion
HELD_BACK = 0.9  # a phase that sent under this fraction of its rate was held back (CPU), not paced
APP_LIMITED = 0.5  # a phase that used less of its rate than this raises nothing (a 64 KB part is 30 ms at
# 2 MB/s: a phase's own send rate is coarse at low rates)
PATH_PERSIST = 2  # judged phases in a row a destination must be clearly lossier than the rest to get a cap
PATH_GROWTH = 1.25  # a capped destination's cap grows this much per clean phase
LOG_HISTORY_S = 2.0
MAX_PATHS = 1024  # per-destination state kept (caps, send logs); the least recently used goes first
Q_HIGH = 0.006  # seconds of queue at a phase's end that say its rate is above what the uplink carries
# A probe whose queue ends above this found no headroom: at btl = the link, a phase at CYCLE[PROBE] queues its 10 %
# margin, 5 ms of a 50 ms phase; at 5 % under the link, 2.25 ms. (Judged against Q_HIGH, probes at the link's rate
# come back clean, btl creeps past the link and the queue cuts it back: more loss beyond random loss and less of
# the link used, in tests/test_pacing.py's swarm.)
Q_PROBE = 0.0035
# Loss above the floor at a rate carried lately is the link's, not an overflow, where the destinations' typical
# queue (their upper median) is under this: a queue overflows only once full, and one of a few ms is no full
# buffer. On a loaded machine receivers' samples read a few ms deep with no queue at all: excused only under
# Q_HIGH, a 5 % random loss cut one member after another down to 1-3 MB/s for 10-20 s a run, and every average
# waited for it (`peerd demo --model gpt --peers 4 --link 100mbit --link-loss 0.05`).
Q_EXCUSE = 2 * Q_HIGH
STARTUP_GROWTH_MIN = 0.2  # startup ends on a queue above Q_HIGH that grew this many seconds per second of the phase
PHASE_FILL = 0.75  # of PHASE_BYTES: what a startup phase or a probe must hold to prove its rate (a phase that sent
# under HELD_BACK of its rate proves nothing either)
Q_FLAT = 0.001  # a startup phase whose queue ended under this (and grew no faster than FLAT_GROWTH) had headroom:
FLAT_GROWTH = 0.02  # its rate doubles after it alone (an overshoot of x queues (x - 1) x 50 ms in one phase)
CPU_HELD = 2  # startup phases in a row held back under HELD_BACK with the queue flat: the rate goes to twice their fill
CPU_HELD_BYTES = 2 << 20  # ... or one such phase that sent this much (dozens of parts: its fill is no part's timing)
DRAINING = 0.03  # a deep queue shrinking faster than this (s/s) is not cut for: it drains at the rate sent
STANDING_KEEP = 0.7  # a queue still this deep after the cut its level caused, at a lower rate, did not drain: an offset
DEEP_PHASES = 2  # judged phases in a row with a queue above Q_HIGH before a cruise phase's rate is cut
Q_SPAN = 0.3  # a destination's queue growth is measured over samples this much of a phase apart at least
BASE_PLACED = 0.001  # seconds into a burst a datagram's modelled send time may be and still set the base delay
DELAY_MARGIN = 0.98  # a queue that grew sets btl this far under the rate the uplink carried (exact, unlike loss)
CARRIED_SLACK = 1.02  # a rate within this factor of what a recent phase delivered counts as carried before ...
# ... by one of the last this many judged clean phases (0.6 s). With all 32 kept, a shallow bottleneck that cross
# traffic halved would pass for the link losing at random for seconds; with fewer (8), a 0.3 s burst of random
# loss would cut. The price: a lasting step of random loss at a shallow queue costs a cut or two (virtual time,
# tests/test_pacing.py).
CARRIED_PHASES = 12


def start_rate(datagram: int) -> float:
    """Where a sender of ``datagram``-byte datagrams starts: START_RATE's datagrams a second, never fewer bytes than
    START_RATE (as TCP's initial window counts segments). A phase must hold MIN_SAMPLE datagrams to be judged: at
    START_RATE in 8 KB datagrams a 50 ms phase holds 12, so startup would stall there, about 0.4 s a doubling
    (`peerd bench allreduce --peers 4 --size 25000000 --mtu 8192`: the first average's time). Datagrams above
    1200 bytes are for LANs: on a 1500-byte path an 8 KB datagram travels as 6 IP fragments, lost whole with any
    one of them."""
    return START_RATE * max(1.0, datagram / START_DATAGRAM)
