"""The suite's two tiers. ``make test`` (everyday work, ≤ 5 minutes on 2 cores) runs every test
that starts no Ray but those marked ``full``, and those Ray tests marked ``everyday``, each
with the reason it is there: one real-rank parity case per axis (dp, tp + sp, pp interleaved,
zero-bubble, ep, cp, hybrid sharding, uneven dp), one recovery from a lost node, the demo
through the CLI. ``make test-all`` (CI) runs everything: every parity case, the fault matrix,
the tracking-server outages, submit, and the tests without Ray marked ``full``.
"""

from __future__ import annotations

import pytest


def everyday(why: str):
    """The mark of a Ray test that ``make test`` runs, saying why it is there."""
    if not why.strip():
        raise ValueError("an everyday test says why it is in `make test`")
    return pytest.mark.everyday(why)


def full(why: str):
    """The mark of a test that starts no Ray and still runs only in ``make test-all``, saying
    why (its cost beside what ``make test`` keeps of the same feature)."""
    if not why.strip():
        raise ValueError("a full-tier test says why it is left out of `make test`")
    return pytest.mark.full(why)


def cases(table, chosen: dict[str, str]) -> list:
    """``parametrize`` values for the keys of ``table``, the ``chosen`` ones marked everyday with
    their reasons."""
    unknown = set(chosen) - set(table)
    if unknown:
        raise KeyError(f"everyday cases not in the table: {sorted(unknown)}")
    return [pytest.param(c, marks=everyday(chosen[c])) if c in chosen else c for c in table]
