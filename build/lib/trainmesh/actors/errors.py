"""What the worker group raises that the controller recovers from (no Ray or torch needed to
catch them)."""

from __future__ import annotations


class PlacementTimeout(RuntimeError):
    """The cluster could not place the ranks' bundles in time."""


class HangDetected(RuntimeError):
    """Ranks stopped making progress inside a call; their nodes' actors have been killed."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks
