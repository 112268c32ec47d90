"""Every Prometheus metric the daemon exports, in one registry per daemon.

A registry per daemon (not the global one) so several daemons can live in one process in tests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics

# Counters' *_created series only clutter dashboards.
disable_created_metrics()

# Per-peer series are kept for the TOP_PEERS busiest peers (by bytes per second); the rest are summed into
# peer="other", so a swarm of any size costs at most TOP_PEERS + 1 series per per-peer metric and label value.
TOP_PEERS = 8
OTHER_PEER = "other"
PEER_LABEL_HEX = 16  # a peer label is the first 16 hex digits of its node id

RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.info = Info("peerd", "Version and identity of this daemon", registry=r)
        self.dht_peers = Gauge("peerd_dht_peers", "Contacts in the DHT routing table", registry=r)
        self.dht_records = Gauge("peerd_dht_records", "Records this node stores for the DHT", registry=r)
        self.datagrams_received = Counter(
            "peerd_datagrams_received_total", "Datagrams accepted, by message type", ["type"], registry=r
        )
        self.datagrams_sent = Counter(
            "peerd_datagrams_sent_total", "Datagrams sent, by message type", ["type"], registry=r
        )
        self.bytes_received = Counter(
            "peerd_udp_received_bytes_total", "UDP payload bytes received", registry=r
        )
        self.bytes_sent = Counter("peerd_udp_sent_bytes_total", "UDP payload bytes sent", registry=r)
        self.datagrams_dropped = Counter(
            "peerd_datagrams_dropped_total",
            "Datagrams dropped before use, by reason (auth, replay, malformed, version, identity, type, ...)",
            ["reason"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "peerd_rpc_seconds",
            "Time from first send of a request to its response, by request type",
            ["type"],
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.rpc_failures = Counter(
            "peerd_rpc_failures_total", "Requests that got no response after all retries", ["type"], registry=r
        )
        self.local_requests = Counter(
            "peerd_local_requests_total", "Requests on the local socket, by op and outcome", ["op", "outcome"],
            registry=r,
        )
        self.allreduce_seconds = Histogram(
            "peerd_allreduce_seconds", "Time one group average took at this node (after the handshake)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r,
        )
        self.allreduce_bytes_sent = Counter(
            "peerd_allreduce_bytes_sent_total", "UDP payload bytes sent for group averages", registry=r
        )
        self.allreduce_expected = Counter(
            "peerd_allreduce_datagrams_expected_total", "Tensor datagrams this node expected, by phase",
            ["phase"], registry=r,
        )
        self.allreduce_received = Counter(
            "peerd_allreduce_datagrams_received_total", "Tensor datagrams this node received, by phase",
            ["phase"], registry=r,
        )
        self.allreduce_dead = Counter(
            "peerd_allreduce_members_dead_total",
            "Members a group average stopped waiting for mid-average: their daemons did not answer PINGs", registry=r,
        )
        self.moshpit_rounds = Counter(
            "peerd_moshpit_rounds_total",
            "Moshpit rounds this node took part in, by outcome (averaged, alone, failed) and the run's codec",
            ["outcome", "codec"], registry=r,
        )
        self.moshpit_bytes_sent = Counter(
            "peerd_moshpit_bytes_sent_total",
            "UDP payload bytes this node sent for the group averages of Moshpit rounds, by the run's codec "
            "(fp32, fp16, bf16, int8, int4)", ["codec"], registry=r,
        )
        self.moshpit_group_size = Gauge(
            "peerd_moshpit_group_size", "Members of this node's group in its last Moshpit round (1: no group)",
            registry=r,
        )
        self.moshpit_led = Counter(
            "peerd_moshpit_led_total", "Moshpit rounds whose group this node led (closed and sent BEGIN for)",
            registry=r,
        )
        self.moshpit_round_seconds = Histogram(
            "peerd_moshpit_round_seconds", "Time one Moshpit round took at this node, matchmaking included",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120), registry=r,
        )
        # -- trainer sessions (peerd/trainer): what the local trainers report and how their steps went --
        self.trainer_loss = Gauge(
            "peerd_trainer_loss", "Training loss the local trainer reported for its latest step", registry=r
        )
        self.trainer_samples_per_second = Gauge(
            "peerd_trainer_samples_per_second", "Samples per second the local trainer reported", registry=r
        )
        self.trainer_steps = Counter(
            "peerd_trainer_steps_total", "Averaging requests of local trainers, by outcome (averaged, alone, failed)",
            ["outcome"], registry=r,
        )
        self.trainer_params_identical = Counter(
            "peerd_trainer_params_identical_total",
            "Parameter averages skipped because the check round found every member's parameters the same",
            registry=r,
        )
        self.trainer_params_close = Counter(
            "peerd_trainer_params_close_total",
            "Parameter averages skipped because the check round found this member's parameters nearer the group's "
            "average than the codec's rounding would move them",
            registry=r,
        )
        self.trainer_sessions = Gauge("peerd_trainer_sessions", "Trainer sessions open on this daemon", registry=r)
        self.trainer_step_seconds = Histogram(
            "peerd_trainer_step_seconds", "Time the daemon spent on one averaging request of a trainer",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r,
        )
        self.step_phase_seconds = Histogram(
            "peerd_step_phase_seconds",
            "Seconds one trainer step spent in each phase (peerd.localsock.phases: copy_in, daemon, matchmaking, "
            "members, transfer, agree, copy_out), as the trainer reported them with its next step",
            ["phase"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.trainer_group_size = Gauge(
            "peerd_trainer_group_size", "Members of the group that averaged the trainer's latest request", registry=r
        )
        self.trainer_received_fraction = Gauge(
            "peerd_trainer_received_fraction", "Fraction of tensor data that arrived in the latest average", registry=r
        )
        self.trainer_state_bytes_served = Counter(
            "peerd_trainer_state_bytes_served_total", "State-sync bytes this daemon served to joining peers",
            registry=r,
        )
        # -- hostile members and faults: what was refused, and background work that failed --
        self.background_errors = Counter(
            "peerd_background_errors_total",
            "Background tasks that failed (logged and counted, never fatal to the daemon), by task", ["task"],
            registry=r,
        )
        self.dht_store_refused = Counter(
            "peerd_dht_store_refused_total", "DHT records this node refused to store, by reason", ["reason"],
            registry=r,
        )
        self.ignored_records = Counter(
            "peerd_ignored_records_total",
            "Records read from the DHT and ignored (out of range, wrong layout, too far ahead), by kind and reason",
            ["kind", "reason"], registry=r,
        )
        self.contributions_refused = Counter(
            "peerd_contributions_refused_total",
            "Tensor contributions refused or limited by the shard owner (nonfinite, weight_capped, clipped, ...)",
            ["reason"], registry=r,
        )
        self.local_refused = Counter(
            "peerd_local_refused_total",
            "Local-socket connections or arenas refused (uid, unsealed arena, oversized reply), by reason",
            ["reason"], registry=r,
        )
        self.pacing_rate = Gauge(
            "peerd_pacing_rate_bytes", "The sender pacer's current rate, bytes per second (0 until the first REPORT)",
            registry=r,
        )
        self.pacing_changes = Counter(
            "peerd_pacing_changes_total", "The sender pacer's rate changes, by action (decrease: a cut for congestion; "
            "increase: a clean probe or startup step)", ["action"], registry=r,
        )
        self.trainer_state_fetches = Counter(
            "peerd_trainer_state_fetches_total", "State downloads for joining trainers, by outcome", ["outcome"],
            registry=r,
        )
        # -- per-peer network view (peerd/peers): the TOP_PEERS busiest peers, the rest as peer="other" --
        self.peer_send_rate = Gauge(
            "peerd_peer_send_bytes_per_second",
            "Bytes per second this node sent to a peer over the last few seconds (peer: the first 16 hex digits of "
            "its node id, or other: the rest summed; at most 9 series)", ["peer"], registry=r,
        )
        self.peer_receive_rate = Gauge(
            "peerd_peer_receive_bytes_per_second",
            "Bytes per second this node received from a peer over the last few seconds (at most 9 series)",
            ["peer"], registry=r,
        )
        self.peer_rtt = Gauge(
            "peerd_peer_rtt_seconds",
            "Round-trip time of requests answered by a peer on their first transmission, by stat (smoothed, p99; "
            "at most 16 series: no other)", ["peer", "stat"], registry=r,
        )
        self.peer_loss = Gauge(
            "peerd_peer_loss_ratio",
            "Fraction of a peer's averaging datagrams lost, by direction (out: this node's to it, from its REPORTs; "
            "in: its to this node; at most 16 series: no other)", ["peer", "direction"], registry=r,
        )
        self.peers_tracked = Gauge("peerd_peers_tracked", "Peers in this node's per-peer network view", registry=r)
        self.traffic_bytes = Counter(
            "peerd_traffic_bytes_total",
            "Bytes of datagrams this node sent (out) and opened (in), by kind (averaging, dht, state_sync, relay, "
            "other)", ["direction", "kind"], registry=r,
        )
        self.relayed_fraction = Gauge(
            "peerd_relayed_fraction", "Fraction of this node's traffic bytes that went over relayed paths",
            registry=r,
        )
        self.averages_received_fraction = Gauge(
            "peerd_averages_received_fraction",
            "Fraction of the tensor datagrams this node's group averages expected that arrived", registry=r,
        )
        self.step_network_share = Gauge(
            "peerd_step_network_share",
            "Share of the local trainers' step time spent waiting on the network (matchmaking, members, transfer, "
            "agree), as the trainers reported it", registry=r,
        )
        self.deadline_seconds = Gauge(
            "peerd_deadline_seconds",
            "Each self-tuned deadline as it stands (window: matchmaking; phase_silence: the quiet that ends an "
            "averaging phase; phase: its longest; step_wait: a trainer step's round; state_sync: a snapshot "
            "download; peerd status --json says which bound each is at)", ["deadline"], registry=r,
        )
        self.deadline_measured = Gauge(
            "peerd_deadline_measured",
            "The measurement behind each self-tuned deadline, in its unit (seconds; the measurement label names it)",
            ["deadline", "measurement"], registry=r,
        )
