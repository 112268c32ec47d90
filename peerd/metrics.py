"""Every Prometheus metric the daemon exports, in one registry per daemon.

A registry per daemon (not the global one) so several daemons can live in one process in tests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics

# Counters' *_created series only clutter dashboards.
disable_created_metrics()

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
