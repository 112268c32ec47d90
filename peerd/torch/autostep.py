"""``compression``, ``average_params_every`` and ``bucket_mb`` "auto" inside peerd.torch.Optimizer: measure the
first steps, choose (peerd.torch.auto, peerd.torch.autobucket), apply the choice, and agree on the period and the
buckets with the run's other members."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..localsock.client import DaemonError
from . import autobucket
from .auto import (
    AGREE_STEP,
    Choice,
    Measured,
    agreed_period,
    announced_periods,
    applied_period,
    choose,
    fp32_transfer_s,
    proposal_key,
    proposal_subkey,
)

log = logging.getLogger("peerd.torch")

AUTO_STEP = 5  # compression="auto": steps measured in float32 before the codec is chosen (at this step count)


def clean_round(reply: dict[str, Any]) -> bool:
    """Whether a step's round left this replica on the group's common result: it averaged, and every range of the
    others' shards arrived (``complete``, repairs included). A round that lost reduce-scatter data still counts (the
    lost contribution lowers a range's weight alike for every member), one that kept own values for a range does
    not, nor one that failed or found no group."""
    return reply.get("outcome") == "averaged" and reply.get("complete") is True


class AutoSteps:
    """The auto choice's part of peerd.torch.Optimizer (a mixin: it uses the optimizer's session and fields)."""

    auto: Choice | None
    auto_proposed: int | None
    average_params_every: int
    compression: str | None
    codec_options: dict[str, Any]
    elems: int
    step_count: int
    run_key: str
    peer_id: str
    session: int
    _auto_probe: list[tuple[float, float, int, int]] | None
    _auto_clean: bool
    _auto_codec: bool
    _auto_every: bool
    _client: Any
    _overlap: Any  # peerd.torch.overlap.Overlap, or None
    _bucket_trial: autobucket.BucketTrial | None  # bucket_mb="auto" with overlap
    _bucket_t0: float | None  # when the last step() began (the trial times steps from one to the next)

    connect: Callable[[], None]
    flush: Callable[[], None]  # overlap: every bucket still out comes back (else nothing)

    def _auto_step(self, reply: dict[str, Any], compute_s: float | None) -> None:
        """compression or average_params_every "auto": measure this step; at AUTO_STEP choose (every member at the
        same step count), and reopen the session in the chosen codec. The choice and its reason go in every reply
        from then on."""
        if self._auto_probe is not None:
            if not clean_round(reply):
                self._auto_clean = False
            if reply["outcome"] == "averaged" and compute_s is not None and reply.get("seconds", 0) > 0:
                self._auto_probe.append((compute_s, float(reply["seconds"]), int(reply.get("bytes_sent", 0)),
                                         int(reply["group_size"])))
            if self.step_count >= AUTO_STEP:
                self._auto_choose()
        if self.auto_proposed is not None and self.step_count >= AGREE_STEP:
            self._agree_period()
        if self.auto is not None:
            reply["auto"] = self._auto_fields()

    def _auto_fields(self) -> dict[str, Any]:
        """The auto choice as the step reply and `peerd status` show it (``applied``: what it set)."""
        trial = self._bucket_trial
        applied = [name for name, on in (("compression", self._auto_codec), ("average_every", self._auto_every),
                                         ("bucket_mb", trial is not None)) if on]
        if self.auto is not None:
            codec, every, reasons = self.auto.compression, self.auto.average_every, list(self.auto.reasons[:2])
        else:  # only the buckets are auto
            codec, every = self.compression or "fp32", self.average_params_every
            reasons = [f"{codec}: set by the caller", f"parameters every {every} steps: set by the caller"]
        if self._overlap is None:
            bucket_mb, why = 0.0, "no buckets: a synchronous step averages the whole gradient"
        else:
            bucket_mb = autobucket.mb_of(self._overlap.bucket_elems)
            why = trial.reason if trial is not None else f"buckets of {bucket_mb:g} MB: set by the caller"
        return {"compression": codec, "average_every": every, "bucket_mb": bucket_mb,
                "reason": "; ".join((*reasons, why))[:1000], "applied": ",".join(applied)}

    def _auto_choose(self, codec: str | None = None, every: int | None = None) -> None:
        """Choose (or take ``codec`` and ``every``, a donor's choice), apply what is "auto" (the codec: switch the
        session's if it changed; the parameter-averaging period) and report it."""
        probe, self._auto_probe = self._auto_probe or [], None

        def median(xs: list[float]) -> float | None:
            return sorted(xs)[len(xs) // 2] if xs else None

        # the rate a round moved the vector at, its fixed costs included: what a step pays per byte
        rates = [fp32_transfer_s(1.0, self.elems, g) / sec for _, sec, _, g in probe if g > 1]
        measured = Measured(link_bps=median(rates), compute_s=median([c for c, *_ in probe]),
                            params=self.elems, peers=max([g for *_, g in probe], default=1))
        choice = choose(measured)
        codec_why, every_why, bucket_why = choice.reasons
        chosen = codec if codec is not None else choice.compression
        if not self._auto_codec:
            chosen, codec_why = self.compression or "fp32", f"{self.compression or 'fp32'}: set by the caller"
        elif codec is not None and codec != choice.compression:
            codec_why = f"{codec}: the swarm's choice, taken over with its state"
        k = self.average_params_every
        if not self._auto_every:
            every_why = f"parameters every {k} steps: set by the caller"
        elif every is not None:
            k, every_why = every, f"parameters every {every} steps: the swarm's choice, taken over with its state"
        else:
            own, why = applied_period(choice, clean=self._auto_clean and bool(probe))
            self.auto_proposed = own  # announced now, agreed at AGREE_STEP; the default period until then
            self._announce(own)
            every_why = f"{why}; proposed, until the swarm agrees at step {AGREE_STEP}"
        self.average_params_every = k
        choice = Choice(chosen, k, choice.bucket_mb, "; ".join((codec_why, every_why, bucket_why)),
                        choice.fp32_transfer_s, (codec_why, every_why, bucket_why))
        self.auto = choice
        log.info("auto: %s", choice.reason)
        if not self._auto_codec or choice.compression == "fp32":
            self._report_auto()
        else:
            self.compression = choice.compression
            self.codec_options = {"compression": choice.compression}
            self.flush()  # overlap: this step's buckets come back in the old session first (else nothing)
            for attempt in range(40):  # the daemon releases the old session when it sees the connection close
                try:
                    self.connect()
                    break
                except DaemonError as e:
                    if "declare the same compression" not in str(e) or attempt == 39:
                        raise
                    time.sleep(0.05)
            self._report_auto()

    def _announce(self, period: int) -> None:
        """Announce the period this member proposes to the run's other members (the daemon's DHT)."""
        assert self._client is not None
        try:
            self._client.call("dht_put", key=proposal_key(self.run_key), value=str(period),
                              subkey=proposal_subkey(self.peer_id, self.session), ttl=3600)
        except DaemonError as e:  # a daemon without a swarm: the members that read the others still agree
            log.info("announcing the proposed period failed: %s", e)

    def _agree_period(self) -> None:
        """Apply the period the run's members agree on: the least announced (peerd.torch.auto.agreed_period)."""
        assert self.auto is not None and self.auto_proposed is not None and self._client is not None
        own, self.auto_proposed = self.auto_proposed, None
        k, why = agreed_period(own, announced_periods(self._others_announced(proposal_key(self.run_key))))
        self.average_params_every = k
        codec_why, _, bucket_why = self.auto.reasons
        reasons = (codec_why, why, bucket_why)
        self.auto = Choice(self.auto.compression, k, self.auto.bucket_mb, "; ".join(reasons),
                           self.auto.fp32_transfer_s, reasons)
        log.info("auto: %s", why)
        self._report_auto()

    def _report_auto(self) -> None:
        """Tell the daemon the auto choice, for `peerd status` (an older daemon ignores it)."""
        if self.auto is None and self._bucket_trial is None:
            return
        try:
            self._call("trainer_report", auto=self._auto_fields())
        except DaemonError as e:
            log.info("reporting the auto choice failed: %s", e)

    def _bucket_time(self, t0: float) -> None:
        """bucket_mb="auto": the step about to finish took from the last ``step()`` to this one (``t0``)."""
        if self._bucket_trial is not None and self._bucket_trial.agreed is None and self._bucket_t0 is not None:
            self._bucket_trial.record(self.step_count, t0 - self._bucket_t0)
        self._bucket_t0 = t0

    def _bucket_step(self, reply: dict[str, Any]) -> None:
        """bucket_mb="auto", after a step: propose at DECIDE_AT, agree at AGREE_AT, and cut the next step as every
        member of the run does (peerd.torch.autobucket); the choice and why go in the reply."""
        trial = self._bucket_trial
        if trial is None:
            return
        step = self.step_count  # the next step's number
        if trial.agreed is None and step >= autobucket.AGREE_AT:
            trial.agree(self._announced_sizes(trial))
            log.info("auto: %s", trial.reason)
            self._report_auto()
        elif trial.agreed is None and step >= autobucket.DECIDE_AT and not trial.decided:
            proposal = trial.propose()
            log.info("auto: %s", trial.reason)
            if proposal is not None:
                self._announce_size(proposal)
        elems = trial.plan_at(step)
        if elems != self._overlap.bucket_elems:
            self._overlap.replan(elems)  # (the buckets still out come back first)
        reply["auto"] = self._auto_fields()

    def _announce_size(self, elems: int) -> None:
        """Announce the bucket size this member proposes to the run's other members (the daemon's DHT)."""
        assert self._client is not None
        try:
            self._client.call("dht_put", key=autobucket.proposal_key(self.run_key), value=str(elems),
                              subkey=proposal_subkey(self.peer_id, self.session), ttl=3600)
        except DaemonError as e:  # a daemon without a swarm: the members that read the others still agree
            log.info("announcing the proposed bucket size failed: %s", e)

    def _announced_sizes(self, trial: autobucket.BucketTrial) -> list[int]:
        """The bucket sizes the run's members announced (a failed read: none; this member's own counts anyway)."""
        return autobucket.announced_sizes(self._others_announced(autobucket.proposal_key(self.run_key)),
                                          (trial.large, trial.small))

    def _others_announced(self, key: str) -> list[object]:
        """The values the run's other members announced under ``key`` (this session's own left out: it counts
        its own proposal itself); none where the read fails (a daemon without a swarm)."""
        assert self._client is not None
        own = proposal_subkey(self.peer_id, self.session)
        try:
            got = self._client.call("dht_get", key=key)["values"]
        except DaemonError as e:
            log.info("reading the run's proposals under %s failed: %s", key, e)
            return []
        return [r.get("value") for r in got if isinstance(r, dict) and r.get("subkey") not in (own, own.encode())]
