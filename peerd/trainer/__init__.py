"""Daemon side of the trainer API (sessions, arena steps, state snapshots); never imports torch."""

from .service import Session, TrainerService, layout_hash, parse_layout

__all__ = ["Session", "TrainerService", "layout_hash", "parse_layout"]
