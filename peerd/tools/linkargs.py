"""The link lab's command-line options (--link, --link-loss, --link-queue-ms) for the benches and demos that run
peers on shaped, lossy links in network namespaces (root). Parsing imports nothing of the lab until --link is given."""

from __future__ import annotations

import argparse


def _link_rate(text: str) -> str:
    from .lab.links import parse_rate

    try:
        parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_link_arguments(lab: argparse._ArgumentGroup, *, daemon_loss: bool = True) -> None:
    """--link / --link-loss / --link-queue-ms into ``lab`` (a parser's lab option group); ``daemon_loss``: the
    command also has --loss (drops in the daemon), which the help then mentions."""
    lab.add_argument("--link", type=_link_rate, metavar="RATE",
                     help="run each peer in its own network namespace on a link shaped at RATE both ways "
                          "(tc tbf; 100mbit, 1gbit, 500kbit); needs root, ip, tc, nft and ethtool")
    lab.add_argument("--link-loss", type=float, default=0.0, metavar="P",
                     help="with --link: the kernel drops P of each peer's incoming packets at random, every "
                          "protocol (nftables)" + ("; --loss then drops in the daemon on top, independently"
                                                   if daemon_loss else "") + " (default 0)")
    lab.add_argument("--link-queue-ms", type=float, default=20.0, metavar="MS",
                     help="with --link: each tbf queues MS milliseconds of the rate before it drops (default 20; "
                          "1-5 is a shallow switch buffer or a policer)")


def check_link_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not 0.0 <= args.link_loss < 1.0:
        parser.error("--link-loss must be in [0, 1)")
    if args.link_loss and not args.link:
        parser.error("--link-loss needs --link RATE")
    if not 0.0 < args.link_queue_ms <= 10_000:
        parser.error("--link-queue-ms must be in (0, 10000]")
    if args.link_queue_ms != 20.0 and not args.link:
        parser.error("--link-queue-ms needs --link RATE")
    if args.link and getattr(args, "mtu", 0) > 1472:
        parser.error("--mtu above 1472 is refused with --link: nothing may rely on IP fragmentation")
    if args.link:
        from .lab.links import lab_unavailable

        why = lab_unavailable()
        if why:
            parser.error(f"--link: {why}")
