"""The controller's view of the rank actors: a WorkerGroup behind a narrow interface, the
placement it needs, and the live topology."""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable

from trainmesh.controller.elastic import JobFailed
from trainmesh.parallel.dims import ParallelDims
from trainmesh.parallel.layout import Placement, plan_placement
from trainmesh.planning.topology import Topology, topology_from_ray
from trainmesh.spec.job import ElasticConfig, JobSpec
from trainmesh.spec.validate import relay_problems

HANG_STEPS, HANG_FLOOR_S, MEASURED = 10.0, 60.0, 3
POLL_S = 1.0  # during a segment of steps: how often rank 0's reports and the cluster are read


def placement_for(spec: JobSpec, dims: ParallelDims, topo: Topology) -> Placement:
    """One bundle per node used (whole TP groups, largest nodes first): a GPU per rank on
    accelerator clusters, CPUs otherwise."""
    per_rank = {"CPU": spec.runtime.cpus_per_rank}
    if topo.device.name != "cpu":
        per_rank["GPU"] = 1.0
    return plan_placement(dims, topo.allocate(dims.tp, dims.world_size), per_rank)


def rank_threads(spec: JobSpec) -> int:
    return max(1, int(spec.runtime.cpus_per_rank))


def ready_pool(spec: JobSpec, env: dict[str, str], placement: Placement, accelerators: bool,
               nodes: int = 2, rank_cls=None):
    """The job's ready rank processes (``actors/ready.py``), or None when it keeps none:
    ``elastic.ready_ranks_per_node``, by default the most ranks ``placement`` puts on one node
    where ranks hold ``accelerators``, else 1 on a cluster of several ``nodes`` and none on one
    machine (its cores are the ranks', and it has no node to lose)."""
    from trainmesh.actors.ready import ReadyPool
    from trainmesh.actors.worker_group import RANK_CONCURRENCY_GROUPS

    n = spec.elastic.ready_ranks_per_node
    if n is None:
        n = max(Counter(placement.rank_bundle).values()) if accelerators else int(nodes > 1)
    return ReadyPool(n, env, rank_threads(spec), RANK_CONCURRENCY_GROUPS, rank_cls) if n else None


def hang_found_after_s(bound_s: float, poll_s: float = 1.0) -> float:
    """How long after the last step a frozen rank is called hung under a ``bound_s`` hang
    bound, at most: the bound (its silence judged from questions asked before it:
    ``WorkerGroup.call_watched``), the last step's report read up to a poll late, and a poll
    each for the question and the verdict."""
    return bound_s + 3 * poll_s


def hang_bound_s(cfg: ElasticConfig, recent_steps: list[float]) -> float | None:
    """How long a step may run before its stalled ranks count as hung: ``elastic.hang_timeout_s``
    when set, else HANG_STEPS × the median of the recent steps but at least HANG_FLOOR_S; None
    (only the collective timeout) until MEASURED steps have been timed."""
    if cfg.hang_timeout_s is not None:
        return cfg.hang_timeout_s
    if len(recent_steps) < MEASURED:
        return None
    return max(HANG_FLOOR_S, HANG_STEPS * statistics.median(recent_steps))


def liveness_bound_s(cfg: ElasticConfig, collective_timeout_s: float) -> float:
    """The hang bound of a call whose progress is not counted (a build, a restore, a save, an
    evaluation; the first MEASURED steps when ``elastic.hang_timeout_s`` is unset), where only
    silence counts (``WorkerGroup.call_watched``, ``silent_only``: a frozen process never
    answers its control path, a busy one answers however long its call takes):
    ``elastic.hang_timeout_s`` when set, else HANG_FLOOR_S — at most half the collective timeout,
    so that a frozen rank is found (~1.5 bounds) before its peers' collectives time out."""
    bound = cfg.hang_timeout_s if cfg.hang_timeout_s is not None else HANG_FLOOR_S
    return min(bound, collective_timeout_s / 2)


ANSWER_S = 0.5  # after a failure, how long a live rank may take to answer whether it lives


class RayWorkerGroup:
    """The real worker group behind the controller's narrow interface."""

    def __init__(self, spec: JobSpec, dims: ParallelDims, placement: Placement,
                 env: dict[str, str], ready=None, rank_cls=None):
        """``rank_cls``: the rank actor's class (default ``RankWorker``; a subclass adds
        methods: ``actors/rank_worker.py``)."""
        from trainmesh.actors.worker_group import WorkerGroup

        self.spec = spec
        self.timeout = spec.runtime.collective_timeout_s
        self.group = WorkerGroup(placement, env, ready_timeout_s=60,
                                 cpu_threads=rank_threads(spec), ready=ready, rank_cls=rank_cls)
        try:
            self.backend = self.group.setup_process_group(spec.runtime.device, self.timeout)
        except BaseException:  # its actors and placement group go with it
            self.group.shutdown()
            raise
        self._steps: list[float] = []  # recent step times, for the hang bound
        self._segment = 0  # segments of steps started (``train_segment``)
        # each rank's files of the last save, as its answers carried them (``saved_files``)
        self._files: list[dict | None] = [None] * self.group.world_size
        self._asked: tuple[float, dict] | None = None  # (when, refs) of the last "alive?"
        self._aborted: set[int] | None = None  # the ranks that answered the last abort
        # every rank's process answered since it started (its process group formed): a silent
        # one is not merely still starting
        self._formed = True

    def processes(self) -> dict[str, list[int]]:
        """The ranks of the last (re)formation that took a ready process ("ready", their pids
        "ready_pids") and those that started a new one ("started")."""
        return {"ready": list(self.group.from_ready), "ready_pids": list(self.group.ready_pids),
                "started": list(self.group.started)}

    @property
    def nodes(self) -> list[str]:
        """The node of each rank's actor (from its placement, so also a dead rank's)."""
        return list(self.group.nodes)

    def rank_infos(self) -> list[dict]:
        """Per rank: node id, pid, ip."""
        return self.group.infos(timeout_s=60)

    def alive_ranks(self, timeout_s: float) -> set[int]:
        """Ranks that answer on their control path within ``timeout_s`` (it never queues
        behind a step, so a live rank answers at once, busy or not) of being asked — by
        ``abort``, when it ran: the question then waits alongside the abort and the stuck
        ranks' grace, not after them, and only the ranks that aborted can be alive. A rank
        that does not answer — on a node that is gone but not yet known dead to Ray, or
        frozen — is not alive: it is killed, so that no later call waits on it."""
        import ray

        asked, refs = self._asked or (time.monotonic(), self._ask())
        aborted, self._asked, self._aborted = self._aborted, None, None
        if aborted is not None:  # those that answered the abort answered this before it
            refs = {ref: r for ref, r in refs.items() if r in aborted}
        left = max(0.0, asked + timeout_s - time.monotonic())
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=left)
        alive = set()
        for ref in ready:
            try:
                ray.get(ref)
                alive.add(refs[ref])
            except ray.exceptions.RayError:
                pass
        self.group.end(sorted(set(range(self.group.world_size)) - alive))
        return alive

    def _ask(self) -> dict:
        return {w.node_info.remote(): r for r, w in enumerate(self.group.workers)}

    def abort(self, answer_s: float = ANSWER_S, limit_s: float = 5.0) -> None:
        """A failure is known: every survivor aborts its communicators now (out of band),
        asked first whether it lives (``alive_ranks`` reads the answers). Returns once every
        rank that answers has aborted (at most ``limit_s``) and the rest are silent:
        ``answer_s`` after the questions are out, or 3 × the slowest answer when answers come
        slowly (a loaded host), or ``limit_s`` while none has answered. A silent rank is taken
        for gone (Ray fails a call to a rank on a lost node only ~2 s later here: waiting for
        that was most of a recovery's decision); were it
        alive after all, it is ended and its place refilled, as a stuck one's. While the group
        re-forms (new rank processes may still be starting) every rank gets ``limit_s``."""
        import ray

        if not self._formed:
            answer_s = limit_s

        asked, asks = time.monotonic(), self._ask()  # before the abort on the control path
        self._asked = (asked, asks)
        calls = {ref: ("ask", r) for ref, r in asks.items()}
        calls.update({ref: ("abort", r) for r, ref in enumerate(self.group.abort())})
        # (issuing two calls a rank takes milliseconds a rank on a loaded host: the window
        # opens when the last is out)
        issued = time.monotonic()
        answered, silent_or_done, aborted, slowest = set(), set(), set(), 0.0
        while True:
            open_ = set(range(self.group.world_size)) - silent_or_done
            unanswered = open_ - answered
            # until one rank has answered, silence says the host is slow, not that every node
            # is gone: wait the limit (128 ranks on 2 cores answered none within 0.5 s)
            wait = max(answer_s, 3 * slowest) if answered else limit_s
            deadline = max(issued + min(limit_s, wait) if unanswered else 0.0,
                           asked + limit_s if open_ & answered else 0.0)
            left = deadline - time.monotonic()
            refs = [ref for ref, (_, r) in calls.items() if r in open_]
            if not refs or left <= 0:
                break
            ready, _ = ray.wait(refs, num_returns=1, timeout=left)
            for ref in ready:
                kind, r = calls.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:  # dead: nothing more to wait for
                    silent_or_done.add(r)
                    continue
                if kind == "ask":
                    answered.add(r)
                    slowest = time.monotonic() - asked
                else:
                    aborted.add(r)
                    silent_or_done.add(r)
        self._aborted = aborted

    def release_stuck(self, wait_s: float) -> list[int]:
        """Ranks that aborted but are still stuck in the failed call ``wait_s`` after the
        abort, killed (the silent ones are not waited for: ``alive_ranks`` ends them)."""
        return self.group.release_stuck(wait_s, self._aborted)

    def reform(self, assignment: list[int | None], placement: Placement, timeout_s: float,
               refill: set[int] = frozenset(), avoid: set[str] = frozenset()) -> None:
        """Warm recovery or growth: kept old ranks take their new ranks in the same processes,
        new actors start in the reservations of ``refill`` ranks and where ``assignment`` has
        None (not on the nodes in ``avoid``); all join a new process group on a fresh port."""
        self._formed = False
        self._files = [None] * len(assignment)
        self.group.reform(assignment, placement, timeout_s, refill, avoid)
        self.backend = self.group.setup_process_group(self.spec.runtime.device, self.timeout)
        self._formed = True

    def build(self, spec_json: str, dims: ParallelDims, data_dir: str) -> None:
        d = {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "ep": dims.ep, "cp": dims.cp}
        # Each rank's node as the ranks' actors report it (a bundle placed after a re-form may
        # share a node with another), numbered by first appearance: ``Mesh.nodes``
        first: dict[str, int] = {}
        nodes = tuple(first.setdefault(n, len(first)) for n in self.group.nodes)
        spec = JobSpec.model_validate_json(spec_json)
        broken = relay_problems(spec, dims, None if spec.parallelism.ep_node_ranks else nodes)
        if broken:  # (before any rank builds: some would fail, the others wait on them)
            raise JobFailed(str(broken[0]))
        self.watched("build", spec_json, d, data_dir, nodes, timeout_s=self.timeout + 120)

    def train_step(self, measure_activations: bool = False) -> list[dict]:
        """One step on every rank, watched for hung ranks past ``hang_bound_s`` (by silence
        alone, ``liveness_bound_s``, until that has steps to go by)."""
        t0 = time.monotonic()
        bound = hang_bound_s(self.spec.elastic, self._steps)
        out = (self.group.call_watched("train_step", measure_activations, timeout_s=self.timeout * 2,
                                       hang_after_s=bound) if bound is not None else
               self.watched("train_step", measure_activations, timeout_s=self.timeout * 2))
        self._steps = [*self._steps[-19:], time.monotonic() - t0]
        self._heard(out)
        return out

    def train_segment(self, steps: int, until_s: float, on_step: Callable[[dict], None],
                      between: Callable[[], bool], save_pending: bool = False) -> list[dict]:
        """Up to ``steps`` steps on every rank with one call per rank (``RankWorker.train_segment``),
        watched for hung ranks as a step is (the bound applies to the silence, not to the
        segment). While it runs, at every poll (``POLL_S``): rank 0's stats of the steps it has
        finished are read (one call) and handed to ``on_step`` in order, all but its newest (the
        segment's last step is handed over with every rank's stats, by the caller); and
        ``between()`` is asked whether the segment should end at the next step boundary (then
        rank 0 is told, and every rank hears it in-band). Returns every rank's
        ``{"steps", "reported", "last"}``, rank 0's ``reported`` holding the steps not yet
        handed to ``on_step``."""
        import ray

        self._segment += 1
        segment, rank0 = self._segment, self.group.workers[0]
        state = {"handed": 0, "asking": None, "stopping": False, "step": None,
                 "moved": time.monotonic(), "asked": 0.0}

        def hand(rows: list[dict], keep_last: bool) -> None:
            if rows and rows[-1]["step"] != state["step"]:  # progress: the hang watch waits
                state["step"], state["moved"] = rows[-1]["step"], time.monotonic()
            new = rows[: len(rows) - 1] if keep_last else rows
            for row in new:
                on_step(row)
                self._steps = [*self._steps[-19:], row["wall_s"]]
            state["handed"] += len(new)

        def tick() -> None:
            asking = state["asking"]
            if asking is not None and ray.wait([asking], timeout=0)[0]:
                state["asking"] = None
                try:
                    hand(ray.get(asking), keep_last=True)
                except ray.exceptions.RayError:
                    pass  # (rank 0 died: the segment's call fails, and that is the failure)
            now = time.monotonic()
            if state["asking"] is None and now >= state["asked"] + POLL_S:
                state["asking"], state["asked"] = rank0.reports.remote(segment, state["handed"]), now
            if not state["stopping"] and between():
                state["stopping"] = True
                rank0.request_stop.remote(segment)

        bound = hang_bound_s(self.spec.elastic, self._steps)
        timeout_s = until_s + self.timeout * 2
        args = ("train_segment", segment, steps, until_s, save_pending)
        out = (self.group.call_watched(*args, timeout_s=timeout_s, hang_after_s=bound, tick=tick,
                                       poll_s=POLL_S, moved_at=lambda: state["moved"])
               if bound is not None else
               self.group.call_watched(*args, timeout_s=timeout_s, tick=tick, poll_s=POLL_S,
                                       hang_after_s=liveness_bound_s(self.spec.elastic, self.timeout),
                                       silent_only=True, moved_at=lambda: state["moved"]))
        reported = out[0]["reported"]
        hand(reported[state["handed"]:], keep_last=True)  # (the last: the caller's, whole)
        self._steps = [*self._steps[-19:], reported[-1]["wall_s"]]
        return self._heard([r["last"] for r in out])

    @property
    def issued_cpu_s(self) -> float:
        """The controller thread's CPU time once the last segment's calls were all issued."""
        return self.group.issued_cpu_s

    @property
    def read_cpu_s(self) -> float:
        """The controller thread's CPU time reading the last segment's answers."""
        return self.group.read_cpu_s

    def evaluate(self, batches: int) -> float:
        """The held-out loss (every rank computes it; all hold the same value)."""
        return self.watched("evaluate", batches, timeout_s=self.timeout * 2)[0]

    def reset_peak_memory(self) -> None:
        self.group.call("reset_peak_memory", timeout_s=self.timeout)

    def memory_reports(self) -> list[dict]:
        return self.group.call("memory_report", timeout_s=self.timeout)

    def save(self, directory: str, background: bool = False) -> list[dict]:
        """Collective save (in the background: returns once every rank has its shards in
        host memory); every rank's random streams (``engine/rng.py``). A synchronous save's
        answers carry the files' sizes, a later step's or ``wait_save``'s their digests
        (``saved_files`` then makes no call)."""
        out = self.watched("save", directory, background, timeout_s=self.timeout * 2)
        self._files = [a["files"] for a in out]
        return [a["rng"] for a in out]

    def wait_save(self) -> list[str | None]:
        """Every rank's background save, waited for: "done", "failed: ..." or None."""
        return [a["save"] for a in self._heard(
            self.watched("finish_save", self.timeout * 2, timeout_s=self.timeout * 3))]

    def _heard(self, answers: list[dict]) -> list[dict]:
        """Each rank's files of its last save, from answers that carry them once it is done
        (``RankWorker.save_report``)."""
        for r, a in enumerate(answers):
            if a.get("saved_files") is not None:
                self._files[r] = a["saved_files"]
        return answers

    def saved_files(self) -> dict:
        """{file: {"size", "sha256"}} over every rank's last save: as the ranks' answers
        carried them since it began, or (some rank's not yet heard) asked of every rank."""
        files = self._files
        if any(f is None for f in files):
            files = self._files = self.group.call("saved_files", timeout_s=self.timeout)
        return {k: v for d in files for k, v in d.items()}

    def bad_files(self, directory: str, files: dict) -> list[str]:
        """Each rank checks a share (by bytes) of a manifest's files, all at once; the bad
        ones."""
        from trainmesh.checkpoint.manifest import split_by_size

        shares = split_by_size(files, self.group.world_size)
        args = [(directory, share) for share in shares]
        return sorted(f for bad in self.watched("bad_files", each=args, timeout_s=self.timeout * 4)
                      for f in bad)

    def readable_on_every_node(self, path: str, token: str) -> dict[str, bool]:
        """Per node (its first rank asked): does it read ``token`` back from ``path``?"""
        import ray

        first: dict[str, int] = {}
        for r, info in enumerate(self.rank_infos()):
            first.setdefault(info["node_id"], r)
        refs = {n: self.group.workers[r].can_read.remote(path, token) for n, r in first.items()}
        return {n: ray.get(ref, timeout=self.timeout) for n, ref in refs.items()}

    def load(self, directory: str, step: int, rng: bytes | None) -> None:
        """Collective restore; ``rng``: every rank's random streams (put in the object store
        once, not sent once per rank)."""
        self.watched("load", directory, step, _shared(rng), timeout_s=self.timeout * 2)

    def memory_snapshot(self, directory: str, buddies: list[int | None], wait: bool = False) -> list[dict]:
        """In-memory snapshot on every rank; rank r's copy goes to rank ``buddies[r]``."""
        w = self.group.workers
        args = [(directory, None if b is None else w[b], wait) for b in buddies]
        return self.watched("memory_snapshot", each=args, timeout_s=self.timeout * 2)

    def memory_inventory(self) -> list[dict[str, list[str]]]:
        """Per rank: snapshot directory → the files it holds (its own and its replicas)."""
        return self.group.call("memory_inventory", timeout_s=self.timeout)

    def memory_load(self, directory: str, holders: dict[str, int], step: int, rng: bytes | None
                    ) -> list[dict]:
        """Collective restore from snapshot ``directory``; ``holders``: file → rank holding it.
        The map and the ranks' actor handles go to the object store once and every rank reads
        them from its node's copy: the calls carry references, not 2 × ranks handles each
        (ranks² in all, which the controller serialised one call at a time). Returns what each
        rank fetched (``RankWorker.memory_load``)."""
        return self.watched("memory_load", directory, _shared(holders), step, _shared(rng),
                     _shared(list(self.group.workers)), timeout_s=self.timeout * 2)

    def timelines(self) -> list[list]:
        return self.group.call("timeline", timeout_s=self.timeout)

    def shutdown(self) -> None:
        self.group.shutdown()

    def watched(self, method: str, *args, timeout_s: float, each: list[tuple] | None = None) -> list:
        """A collective call other than a timed step, watched for ranks that stop answering
        (``liveness_bound_s``): a rank frozen in a restore or a save is found in seconds, not
        at the call's bound (minutes: a multiple of the collective timeout)."""
        return self.group.call_watched(method, *args, timeout_s=timeout_s, each=each,
                                       hang_after_s=liveness_bound_s(self.spec.elastic, self.timeout),
                                       silent_only=True)


def live_topology(spec: JobSpec) -> Topology:
    device = "cpu" if spec.runtime.device == "cpu" else spec.topology.device
    topo = topology_from_ray(device, spec.runtime.cpus_per_rank)
    return topo.with_overrides(spec.topology.overrides()).with_host_memory(spec.topology.host_memory_gib)


def controller_node_id() -> str:
    """The node this process runs on ("" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def draining_nodes() -> dict[str, int]:
    """Nodes Ray is draining — a preemption or scale-down notice from the autoscaler, KubeRay
    or ``ray drain-node`` — with their deadlines (ms since the epoch; 0 when none). The ranks
    there still run; new work is no longer placed there. Empty when the GCS cannot say."""
    import ray

    if not ray.is_initialized():
        return {}
    try:
        return dict(_gcs_client().get_draining_nodes(timeout=5))
    except Exception:  # noqa: BLE001 - no answer is not a drain
        return {}


def _gcs_client():
    import ray

    return _gcs_client_at(ray.get_runtime_context().gcs_address)


@functools.cache
def _gcs_client_at(address: str):
    import ray

    # The GCS client Ray's own libraries (Serve) read draining nodes through; one per cluster
    # (a process may connect to another cluster later: tests do).
    return ray._raylet.GcsClient(address=address)


def _shared(value):
    """``value`` in Ray's object store, read by every rank from its node's copy."""
    import ray

    return None if value is None else ray.put(value)
