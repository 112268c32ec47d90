"""The sans-I/O cores, named once: tests/test_core_contract.py checks each follows the core contract, and
tests/test_layering.py that each one's module is sans-I/O (docs/architecture.md)."""

from __future__ import annotations

# (module, class): every sans-I/O core that holds protocol state.
CORES: tuple[tuple[str, str], ...] = (
    ("peerd.wire.replay", "ReplayWindow"),
    ("peerd.wire.seal", "Sealer"),
    ("peerd.wire.seal", "Opener"),
    ("peerd.transport.core", "TransportCore"),
    ("peerd.transport.pacing", "Pacer"),
    ("peerd.transport.rto", "RtoEstimator"),
    ("peerd.transport.qdelay", "QueueDelay"),
    ("peerd.transport.guard", "AuthLimiter"),
    ("peerd.transport.guard", "AmplificationGuard"),
    ("peerd.dht.core", "DhtCore"),
    ("peerd.dht.lookup", "Lookup"),
    ("peerd.allreduce.group", "GroupAverage"),
    ("peerd.allreduce.host", "AveragingHost"),
    ("peerd.allreduce.held", "HeldData"),
    ("peerd.allreduce.liveness", "SilenceWatch"),
    ("peerd.nat.punch", "Puncher"),
    ("peerd.nat.reach", "Reach"),
    ("peerd.nat.relay", "RelayServer"),
    ("peerd.nat.relay", "RelayClient"),
    ("peerd.linkcap.core", "BudgetPacer"),
    ("peerd.linkcap.core", "LinkCap"),
    ("peerd.moshpit.rounds", "RoundMachine"),
    ("peerd.moshpit.matchmaking", "Matchmaker"),
    ("peerd.moshpit.sticky", "StickyGroups"),
    ("peerd.trainer.agreement", "OuterAgreement"),
    ("peerd.statesync.choice", "SnapshotChoice"),
    ("peerd.nat.paths", "Paths"),
    ("peerd.transport.receive", "ReceivePolicy"),
    ("peerd.deadlines", "DeadlineTuner"),
)
