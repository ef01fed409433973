"""The rank process's garbage collector (actors/collector.py): imports frozen out of later
collections, and collections at the schedule's steps only, the same on every rank."""

from __future__ import annotations

import gc

import pytest

from trainmesh.actors.collector import FULL_EVERY, Collector, frozen_imports


@pytest.fixture
def collections():
    """The generations collected while the test runs (the test process's collector is
    restored after it)."""
    seen: list[int] = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    was_on = gc.isenabled()
    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        gc.enable() if was_on else gc.disable()


def test_imports_run_without_collections_and_are_frozen_after(collections):
    before = gc.get_freeze_count()
    with frozen_imports():
        assert not gc.isenabled()
        garbage = [[i] for i in range(50_000)]  # enough allocations to trip gen-0 collections
    assert gc.isenabled() and collections == []
    assert gc.get_freeze_count() >= before + len(garbage)  # out of every later collection


def test_collections_happen_at_the_schedule_steps_only(collections):
    c = Collector(every=3)
    assert not gc.isenabled()
    for step in range(1, 3 * FULL_EVERY + 1):
        [[i] for i in range(20_000)]  # would trip automatic collections
        c.after_step(step)
    # young generations at steps 3, 6, ...; every generation at one in FULL_EVERY
    assert collections == [2 if s % (3 * FULL_EVERY) == 0 else 1
                           for s in range(3, 3 * FULL_EVERY + 1, 3)]
    collections.clear()
    Collector(every=0).after_step(50)  # Python's own collection back
    assert gc.isenabled() and collections == []
