"""A group of RankWorker actors placed by a placement group, one bundle per node."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainmesh.actors.errors import HangDetected, PlacementTimeout
from trainmesh.actors.progress import silence_after_s
from trainmesh.actors.rank_worker import RankWorker
from trainmesh.actors.ready import ReadyPool, Seat
from trainmesh.parallel.layout import Placement

# The rank actor's threads besides its main one, as its methods declare them:
# "control": calls that must not queue behind a step (abort, health checks).
# "memory": a peer's in-memory snapshot arriving or being read while this rank trains.
RANK_CONCURRENCY_GROUPS = {"control": 1, "memory": 1}
# How long a placement waits for the nodes holding ready processes before it takes any node
# (placing where resources are free takes milliseconds; longer, the preferred nodes lack them).
PREFER_S = 2.0
# How much longer than the collective timeout a formation waits for every rank to join: a new
# rank process starts first (imports, an accelerator context).
JOIN_MARGIN_S = 60.0


def gather(refs: list, timeout_s: float | None, poll_s: float = 0.5,
           tick: Callable[[], None] | None = None, read: list[float] | None = None) -> list:
    """Every result, in order; the first rank that fails raises within a poll — a dead rank's
    error is not waited for behind a survivor still blocked in a collective. ``tick``: called at
    every poll while results are missing (the controller's work during a segment of steps)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
        if left <= 0:
            raise GetTimeoutError(f"{len(pending)} of {len(refs)} rank(s) did not answer within "
                                  f"{timeout_s:.0f} s")
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
        cpu0 = time.thread_time()
        for ref, value in zip(done, ray.get(done), strict=True):  # raises any failure
            results[index[ref]] = value
        if read is not None:  # (this thread's CPU reading the answers: ``read[0]``)
            read[0] += time.thread_time() - cpu0
        if pending and tick is not None:
            tick()
    return results


def stalled(now: list[dict | None], running: set[int], quiet_s: float,
            silent_only: bool = False) -> list[int]:
    """Which of the ``running`` ranks are hung, from a look at their progress
    (``RankWorker.progress``; None: the rank has not answered its control path for ``quiet_s``,
    as a frozen process cannot): the silent ones; else, once every one of them has been in its phase for
    ``quiet_s`` or more (nobody moves: the others are waiting for someone in a collective), the
    ones furthest behind; else none (someone still works: a slow step is not a hung one).
    ``silent_only``: the silent ones alone — for calls whose progress is not counted (a build,
    a restore, a save: one long phase, however long its reads take)."""
    silent = sorted(r for r in running if now[r] is None)
    if silent or silent_only:
        return silent
    if not running or any(now[r]["idle_s"] < quiet_s for r in running):
        return []
    def key(s: dict) -> tuple:
        return s["step"], sum(s["counts"].values())
    least = min(key(now[r]) for r in running)
    return sorted(r for r in running if key(now[r]) == least)


def _look(seen: tuple[float, dict] | None, asked_at: float | None, t: float,
          quiet_s: float) -> dict | None:
    """A rank's last answer as of ``t`` (its phase older by the time since), or None while a
    question put to it ``quiet_s`` or more ago is unanswered (a busy process answers late, and
    a late answer counts; a frozen one never answers)."""
    if asked_at is not None and t - asked_at >= quiet_s:
        return None
    if seen is None:
        return {"step": -1, "counts": {}, "idle_s": 0.0}  # not heard from yet: not judged
    return {**seen[1], "idle_s": seen[1]["idle_s"] + t - seen[0]}


@ray.remote(num_cpus=0, max_retries=0)
def _sigkill(pids: list[int]) -> None:
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_processes(by_node: dict[str, list[int]], timeout_s: float = 2.0) -> None:
    """SIGKILL processes (node id → pids) from a task on each one's node; returns when done,
    or after ``timeout_s`` (the kill goes on meanwhile; a node that runs nothing at all is left
    to Ray's node failure detection, and its ranks' peers to the stuck-rank release)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    refs = [_sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(pids) for node, pids in by_node.items()]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def place(bundles, strategy: str, timeout_s: float, prefer: list[str] = (),
          avoid: set[str] = frozenset()) -> tuple[Any, dict[int, str]]:
    """A placement group of ``bundles``, placed within ``timeout_s``; and the node of each
    bundle. On the ``prefer`` nodes (Ray's ``ray.io/node-id`` label) where they can hold the
    bundles within PREFER_S, else wherever Ray finds room but on the ``avoid`` nodes (a job's
    dead ones: Ray may still count a machine that froze as alive, its accelerators free)."""
    if prefer and len(prefer) >= (len(bundles) if strategy == "STRICT_SPREAD" else 1):
        only = [{"ray.io/node-id": f"in({','.join(prefer)})"}] * len(bundles)
        pg = placement_group(list(bundles), strategy=strategy, bundle_label_selector=only)
        ready, _ = ray.wait([pg.ready()], timeout=min(PREFER_S, timeout_s))
        if ready:
            return pg, placement_group_table(pg)["bundles_to_node_id"]
        remove_placement_group(pg)
    kw = {"bundle_label_selector": [{"ray.io/node-id": f"!in({','.join(sorted(avoid))})"}]
          * len(bundles)} if avoid else {}
    pg = placement_group(list(bundles), strategy=strategy, **kw)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementTimeout(
            f"placement group {list(bundles)} ({strategy}) was not placed within "
            f"{timeout_s:.0f} s: the cluster lacks the resources; lower the "
            "parallel degrees or add nodes")
    return pg, placement_group_table(pg)["bundles_to_node_id"]


class WorkerGroup:
    """Starts one actor per rank and calls methods on all of them together. It owns the rank
    actors' lives: they are created here (``__init__``, ``reform``), re-formed here (``reform``)
    and ended only through ``end`` (``shutdown`` ends them all)."""

    def __init__(self, placement: Placement, env_vars: dict[str, str], ready_timeout_s: float,
                 cpu_threads: int = 1, ready: ReadyPool | None = None,
                 rank_cls: type[RankWorker] | None = None):
        self.placement = placement
        self._rank_cls = rank_cls or RankWorker  # a subclass adds methods (benches, tests)
        self._env_vars, self._ready_timeout_s, self._cpu_threads = env_vars, ready_timeout_s, cpu_threads
        self.ready = ready  # ready processes to take before starting new ones (actors/ready.py)
        self.from_ready: list[int] = []  # the ranks of the last (re)formation that took one
        self.ready_pids: list[int] = []  # ... their processes
        self.started: list[int] = []  # ... and the ranks that started a new process
        self.pgs: list = []  # the first group's, then one per re-form that needed new actors
        self._inflight: list = []  # the refs of the last call on every rank
        self.issued_cpu_s = 0.0  # this thread's CPU time once the last watched call was issued
        self.read_cpu_s = 0.0  # ... and what reading the last watched call's answers took of it
        world = len(placement.rank_bundle)
        pg, nodes = self._place(placement.bundles, placement.strategy,
                                self._preferred(placement.bundles))
        ranks = list(enumerate(placement.rank_bundle))
        self.workers, self.seats = (list(x) for x in zip(*self._actors(pg, ranks, world), strict=True))
        # each rank's reservation (placement group, bundle) and node: known without asking the
        # actor, so also once it has died; a new actor can take a dead one's reservation
        self.slots = [(pg, b) for _, b in ranks]
        self.nodes = [nodes[b] for _, b in ranks]
        self.procs: list[tuple[str, int] | None] = [None] * world  # (node, pid), once it has said

    def infos(self, timeout_s: float) -> list[dict]:
        """Per rank: node id, pid, ip (``RankWorker.node_info``); the pids are kept, so that a
        rank can be killed later even when it can no longer answer."""
        infos = self.call("node_info", timeout_s=timeout_s)
        self.procs = [(i["node_id"], i["pid"]) for i in infos]
        return infos

    def _preferred(self, bundles, avoid: set[str] = frozenset()) -> list[str]:
        """The nodes new ranks should go to: those holding ready processes that have the
        accelerators of the largest of ``bundles`` (none: any node)."""
        if self.ready is None:
            return []
        return sorted(self.ready.nodes(max(b.get("GPU", 0) for b in bundles)) - set(avoid))

    def _place(self, bundles, strategy: str, prefer: list[str] = (),
               avoid: set[str] = frozenset()) -> tuple[Any, dict[int, str]]:
        """``place``, the placement group kept with this group's."""
        pg, nodes = place(bundles, strategy, self._ready_timeout_s, prefer, avoid)
        self.pgs.append(pg)
        return pg, nodes

    def _actors(self, pg, ranks: list[tuple[int, int]], world: int) -> list[tuple]:
        """An actor for each (rank, bundle index of ``pg``), with its seat: a ready process on
        the bundle's node where the pool has one (its seat holds the reservation), else a new
        process holding the reservation itself (seat None)."""
        res = self.placement.resources_per_rank
        where = placement_group_table(pg)["bundles_to_node_id"] if self.ready else {}
        cls = ray.remote(concurrency_groups=RANK_CONCURRENCY_GROUPS)(self._rank_cls)
        seat_cls = ray.remote(Seat)
        out = []
        # the ready processes for every rank at once (each asked whether it lives, waited once)
        wanted = [rank for rank, b in ranks if self.ready and b in where]
        taken = dict(zip(wanted, self.ready.take_all([where[b] for _, b in ranks if b in where])
                         if wanted else [], strict=True))
        for rank, b in ranks:
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
            got = taken.get(rank)
            if got is not None:
                ready, pid = got
                seat = seat_cls.options(num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                                        scheduling_strategy=strategy).remote()
                # (runs once the seat is placed: the ref resolves to its accelerators)
                ready.adopt.remote(rank, world, self._cpu_threads, seat.accelerators.remote())
                out.append((ready, seat))
                self.from_ready.append(rank)
                self.ready_pids.append(pid)
                continue
            out.append((cls.options(num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                                    scheduling_strategy=strategy,
                                    runtime_env={"env_vars": self._env_vars},
                                    ).remote(rank, world, self._cpu_threads), None))
            self.started.append(rank)
        return out

    def reform(self, assignment: list[int | None], placement: Placement, timeout_s: float,
                refill: set[int] = frozenset(), avoid: set[str] = frozenset()) -> None:
        """Warm re-formation for a new plan: new rank r is old rank ``assignment[r]``'s actor,
        reset in place (same process); or, where that old rank is in ``refill`` (dead, its
        node alive), a new actor in the reservation it held; or, where it is None, a new actor
        in a reservation of this group's that no actor holds any more (not on a node in
        ``avoid``), else in a new placement group holding just the bundles such ranks need.
        Other old actors are ended."""
        old, old_slots, old_nodes, old_seats = self.workers, self.slots, self.nodes, self.seats
        old_procs = self.procs
        self.end([i for i in range(len(old)) if i not in assignment or i in refill])
        world = len(assignment)
        self.placement = placement
        self.from_ready, self.ready_pids, self.started = [], [], []
        new: dict[int, tuple[Any, tuple, str, Any]] = {}  # new rank: (actor, slot, node, seat)
        for r, o in enumerate(assignment):
            if o is not None:
                actor, seat = self._actors(old_slots[o][0], [(r, old_slots[o][1])], world)[0] \
                    if o in refill else (old[o], old_seats[o])
                new[r] = (actor, old_slots[o], old_nodes[o], seat)
        new_bundles = sorted({placement.rank_bundle[r] for r, o in enumerate(assignment) if o is None})
        kept_slots = {new[r][1] for r in new}
        for b in list(new_bundles):  # a reservation no actor holds any more, first
            ranks = [r for r, o in enumerate(assignment) if o is None and placement.rank_bundle[r] == b]
            found = self._free_slot(placement.bundles[b], kept_slots, avoid)
            if found is not None:
                slot, node = found
                kept_slots.add(slot)
                new_bundles.remove(b)
                for r, (actor, seat) in zip(ranks, self._actors(slot[0], [(r, slot[1]) for r in ranks],
                                                                world), strict=True):
                    new[r] = (actor, slot, node, seat)
        if new_bundles:
            index = {b: i for i, b in enumerate(new_bundles)}
            ranks = [(r, index[placement.rank_bundle[r]]) for r, o in enumerate(assignment) if o is None]
            strategy = placement.strategy if len(new_bundles) > 1 else "PACK"
            bundles = [placement.bundles[b] for b in new_bundles]
            pg, nodes = self._place(bundles, strategy, self._preferred(bundles, avoid | set(old_nodes)),
                                    avoid)
            for (r, b), (actor, seat) in zip(ranks, self._actors(pg, ranks, world), strict=True):
                new[r] = (actor, (pg, b), nodes[b], seat)
        self.workers, self.slots, self.nodes, self.seats = (
            list(x) for x in zip(*(new[r] for r in range(world)), strict=True))
        self.procs = [old_procs[o] if o is not None and o not in refill else None for o in assignment]
        ray.get([old[o].reset.remote(r, world) for r, o in enumerate(assignment)
                 if o is not None and o not in refill], timeout=timeout_s)
        self._release_unused_groups()

    def _release_unused_groups(self) -> None:
        """Remove the placement groups no rank holds a bundle of any more: kept, they would go
        on reserving accelerators nobody uses, and Ray re-places their bundles when a node
        dies, taking the nodes that join (a stand-in) and, while none is free, keeping the GCS
        busy retrying them (measured: ~40 s of a core over the fault matrix)."""
        held = {pg.id for pg, _ in self.slots}
        for pg in [pg for pg in self.pgs if pg.id not in held]:
            remove_placement_group(pg)
            self.pgs.remove(pg)

    def _free_slot(self, need: dict[str, float], taken: set, avoid: set[str]):
        """A bundle of this group's placement groups that no actor holds now, large enough for
        ``need`` and placed on a node not in ``avoid``, as ((pg, bundle), node): Ray re-places
        the bundles of a node that died on another node (a spare, often), so reusing them is
        what lets a recovery use that node at all (a new placement group would find it
        taken)."""
        for pg in self.pgs:
            where = placement_group_table(pg)["bundles_to_node_id"]
            for b, spec in enumerate(pg.bundle_specs):
                if ((pg, b) not in taken and where.get(b) and where[b] not in avoid
                        and all(spec.get(k, 0) >= v for k, v in need.items())):
                    return (pg, b), where[b]
        return None

    def release_stuck(self, wait_s: float, ranks: set[int] | None = None) -> list[int]:
        """After an abort: ranks (of ``ranks``, default all) whose last call has not returned
        within ``wait_s`` are stuck in something the abort did not release (a gloo group that
        connects lazily, a call that is not a collective; an aborted collective returns at
        once: ``actors/gloo_sockets.py``). They are killed — their processes' end releases
        whoever still waits on them — and returned; their nodes are fine and their
        reservations can be refilled (``reform``)."""
        refs = {ref: r for r, ref in enumerate(self._inflight) if ranks is None or r in ranks}
        if not refs:
            return []
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        stuck = sorted(refs[ref] for ref in pending)
        self._hand_off_memory(stuck, [t for t in range(len(self.workers)) if t not in stuck])
        self.end(stuck)
        self._inflight = []
        return stuck

    def _hand_off_memory(self, ranks: list[int], others: list[int], timeout_s: float = 10.0,
                         rounds: int = 3) -> None:
        """Before stuck ranks are killed: the in-memory snapshots each holds (its own and its
        buddies' copies) go to a rank of its node (whose node is fine) or else any other that
        takes them; its "memory" thread serves them while its main thread is stuck. Every
        stuck rank hands off at once, to takers spread over the candidates (one "memory" thread
        each: a taker shared by several would copy one after another), a round per hand-off
        that failed, to the next taker, at most ``rounds``."""
        takers = {}
        for i, r in enumerate(ranks):
            near = [t for t in others if self.nodes[t] == self.nodes[r]]
            far = [t for t in others if self.nodes[t] != self.nodes[r]]
            takers[r] = near[i % len(near):] + near[:i % len(near)] if near else []
            takers[r] += far[i % len(far):] + far[:i % len(far)] if far else []
        for _ in range(rounds):
            refs = {self.workers[r].memory_handoff.remote(self.workers[t.pop(0)]): r
                    for r, t in takers.items() if t}
            if not refs:
                return
            ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
            for ref, r in refs.items():
                try:
                    ray.get(ref, timeout=0)
                    del takers[r]
                except Exception:  # noqa: BLE001 - that one is gone too (or slow): the next
                    continue

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list:
        """Call ``method`` on every rank; results in rank order."""
        refs = self._inflight = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return gather(refs, timeout_s)

    def call_watched(self, method: str, *args: Any, timeout_s: float, hang_after_s: float | None,
                     poll_s: float = 1.0, silent_only: bool = False,
                     each: list[tuple] | None = None, tick: Callable[[], None] | None = None,
                     moved_at: Callable[[], float] | None = None) -> list:
        """``call`` (with ``each``: every rank's own arguments, in rank order), watching for
        hung ranks once nothing has moved for ``hang_after_s`` — since the call began, or since
        ``moved_at()`` (a segment of steps: when the last step was reported), so that a call
        making progress asks nobody anything. From ``silence_s`` before that bound (a few
        seconds, ``silence_after_s``) every ``poll_s`` each rank still in the call that has no
        question pending is asked for its progress out of band; once the bound has passed, a
        rank counts as hung (``stalled``) if a question put to it ``silence_s`` ago is
        unanswered (a frozen process never answers), or — unless ``silent_only`` — once every
        rank has been in its phase for half the bound, at least two polls (nobody moves: the
        others wait in a collective for the one furthest behind). So a frozen rank is found
        within a few polls of the bound. An answer that comes late still counts, so a busy
        rank, or a watcher that was itself held up, is not mistaken for a frozen one. Hung
        ranks' nodes — every actor in a hung rank's bundle — are killed and ``HangDetected``
        raised, well before the collective timeout would end the call. ``tick``: called at
        every poll while it runs."""
        assert each is None or not args, "the same arguments for every rank, or each its own"
        refs = self._inflight = [getattr(w, method).remote(*a) for w, a in zip(
            self.workers, each if each is not None else [args] * len(self.workers), strict=True)]
        self.issued_cpu_s = time.thread_time()  # (the controller's: when every call was out)
        read = [0.0]
        try:
            return self._watch(refs, method, read, timeout_s, hang_after_s, poll_s, silent_only,
                               tick, moved_at)
        finally:
            self.read_cpu_s = read[0]

    def _watch(self, refs: list, method: str, read: list[float], timeout_s: float,
               hang_after_s: float | None, poll_s: float, silent_only: bool,
               tick: Callable[[], None] | None, moved_at: Callable[[], float] | None) -> list:
        """``call_watched``'s wait for ``refs`` (its docstring)."""
        if hang_after_s is None:
            return gather(refs, timeout_s, tick=tick, read=read)
        t0 = time.monotonic()
        moved = moved_at or (lambda: t0)
        quiet_s = max(2 * poll_s, hang_after_s / 2)
        silence_s = silence_after_s(hang_after_s, poll_s, silent_only)
        seen: dict[int, tuple[float, dict]] = {}  # rank: (when its answer came, what it said)
        asked: dict[int, tuple[Any, float]] = {}  # rank: (its unanswered question, when asked)
        while True:
            try:  # a rank's failure first: it is the cause, those waiting on it are not hung
                # (one wait on every rank's call a poll: its cost grows with the ranks)
                return gather(refs, poll_s, poll_s=poll_s, tick=tick, read=read)
            except GetTimeoutError:
                if time.monotonic() - t0 > timeout_s:
                    raise
            t = time.monotonic()
            idle_s = t - moved()
            if idle_s < hang_after_s - silence_s:  # moving: nothing to ask
                seen.clear()
                asked.clear()
                continue
            finished = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            running = {r for r, ref in enumerate(refs) if ref not in finished}
            questions = {ref: r for r, (ref, _) in asked.items()}
            answered = ray.wait(list(questions), num_returns=len(questions),
                                timeout=0)[0] if questions else []
            for ref in answered:  # (the answers that came during the last poll)
                r = questions[ref]
                del asked[r]
                try:
                    seen[r] = (t, ray.get(ref))
                except ray.exceptions.RayError:
                    pass  # (a dead rank: its call fails, and the next gather raises that)
            asked.update({r: (self.workers[r].progress.remote(), t) for r in running - set(asked)})
            now = [_look(seen.get(r), asked[r][1] if r in asked else None, t, silence_s)
                   for r in range(len(refs))]
            hung = stalled(now, running, quiet_s, silent_only) if idle_s >= hang_after_s else []
            if hung:
                break
        nodes = {self.placement.rank_bundle[r] for r in hung}
        doomed = [r for r, b in enumerate(self.placement.rank_bundle) if b in nodes]
        self.end(doomed, frozen=True)
        silent = [r for r in hung if now[r] is None]
        what = (f"did not answer for {min(t - asked[r][1] for r in silent):.0f} s or more"
                if silent else "made no progress")
        what += f" (nothing moved for {t - moved():.0f} s)"
        raise HangDetected(
            f"rank(s) {hung} {what} in {method} (hang bound {hang_after_s:.3g} s; last seen: "
            f"{ {r: now[r] for r in hung} }); their node(s)' ranks {doomed} were killed", hung)

    def abort(self) -> list:
        """Every rank aborts its communicators at once, out of band (``RankWorker.abort``).
        Returns the calls' refs, in rank order: a dead rank's fails (on a node that is gone,
        only once Ray gives up on it, ~2 s here)."""
        return [w.abort.remote() for w in self.workers]

    def setup_process_group(self, device: str, timeout_s: float, margin_s: float = JOIN_MARGIN_S) -> str:
        """Every rank joins one default group (rank 0 hosts its store). Bounded: a rank that
        cannot answer (frozen, or on a machine that froze, which Ray has not called dead yet)
        fails the formation after ``timeout_s`` and ``margin_s`` (``GetTimeoutError``, which
        the controller recovers from) instead of blocking it; a live rank's own join gives up
        at ``timeout_s``."""
        bound_s = timeout_s + margin_s
        host, port = ray.get(self.workers[0].create_store.remote(timeout_s), timeout=bound_s)
        backends = self.call("init_process_group", host, port, device, timeout_s, timeout_s=bound_s)
        return backends[0]

    def end(self, ranks, frozen: bool = False) -> None:
        """End these ranks' actors (their processes with them): the one place a rank actor is
        killed. Its reservation stays with the group (``reform`` may refill it).

        ``frozen``: the ranks may not run at all (hung, SIGSTOPped). Ray's kill asks a process to
        exit and only SIGKILLs it after the raylet's ``kill_worker_timeout_milliseconds`` (5 s
        by default), and until the process is gone its sockets stay open: peers blocked on it
        in a gloo collective stay blocked and would be judged stuck themselves. So their
        processes are also SIGKILLed at once, from their own nodes (``kill_processes``)."""
        ranks = list(ranks)
        if frozen:
            by_node: dict[str, list[int]] = {}
            for node, pid in filter(None, (self.procs[r] for r in ranks)):
                by_node.setdefault(node, []).append(pid)
            kill_processes(by_node)
        for r in ranks:
            ray.kill(self.workers[r])
            if self.seats[r] is not None:  # its reservation, free for a refill
                ray.kill(self.seats[r])

    def shutdown(self) -> None:
        """End every rank and release the placement groups (safe to call twice)."""
        if not self.pgs:
            return
        try:
            self.call("shutdown", timeout_s=30)
        except Exception:  # noqa: BLE001 - best effort: dead ranks are killed below anyway
            pass
        self.end(range(len(self.workers)))
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []
