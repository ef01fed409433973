"""The controller's side of checkpoints: where they go, when a save counts, background saves.

The ranks write a save's files under the step's own directory and the manifest, written last,
commits it (``checkpoint/manifest.py``: no rename, so any fsspec filesystem, object stores
included). A save counts only once its manifest is committed, and that happens only after
every rank has written its part: at once for a synchronous save; for a background one, after the first step
at which every rank reports its write done (or when the controller has to wait: before the
next save, at the end, before a resize). A background save that fails, or that a failure
interrupts, is dropped and the previous checkpoint stays the newest.

A synchronous save's manifest first holds its files' sizes: the ranks take the sha256s after
the write, while training goes on, and they are written into the manifest at the first step
at which every rank reports them (or when the controller has to wait, as above: a resize's own
save included). A failure meanwhile leaves that checkpoint published, checked by sizes only.
Such a save prunes older checkpoints (``checkpoint.keep_last``) only once its digests are in:
the newest checkpoint that has them is never pruned for one that does not yet.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainmesh.checkpoint.manifest import CheckpointStore, IncompleteCheckpoint, is_uri
from trainmesh.checkpoint.rng_states import job_states
from trainmesh.spec.job import JobSpec

RNG_FILE = "rng_states.json"  # every rank's random streams (``engine/rng.py``)


@dataclasses.dataclass
class _Pending:
    step: int
    directory: str  # where the ranks write it: the step's own
    meta: dict[str, Any]
    background: bool
    t0: float  # when the save began
    blocked_s: float = 0.0  # how long training waited for it
    steps_during: int = 0  # training steps run while it was being written
    committed: str | None = None  # published already (a synchronous save): its digests pending


def step_meta(eff: JobSpec, dims, step: int, losses: list[float], recoveries: list[dict],
              run_id: str | None) -> dict[str, Any]:
    """What a step's manifest records besides its files: the mesh, the data position, the
    losses so far, the MLflow run, the effective spec and the recoveries."""
    import json

    tr = eff.training
    return {"mesh": dims.as_dict(), "losses": list(losses),
            "data_position": {"seed": tr.seed, "step": step,
                              "samples_consumed": step * tr.global_batch_size},
            "mlflow_run_id": run_id, "spec": json.loads(eff.model_dump_json()),
            "recoveries": list(recoveries)}


class Checkpointer:
    def __init__(self, spec: JobSpec, out: Path, on_warning: Callable[[str], None]):
        root = spec.checkpoint.dir or out / "checkpoints"
        if not is_uri(str(root)):
            root = Path(root).resolve()
        self.store = CheckpointStore(root)
        self.cfg = spec.checkpoint
        self._warn = on_warning
        self.pending: _Pending | None = None
        self.steps: list[int] = []  # committed steps this job knows of
        # called with (step, blocked s, written after s, tracker) when a save is committed
        self.on_commit: Callable[[int, float, float, Any], None] | None = None

    def start(self) -> None:
        """At the job's start: what interrupted saves of earlier runs left is removed."""
        gone = self.store.cleanup()
        if gone:
            self._warn(f"checkpoint.dir: removed {len(gone)} interrupted save(s) older than the "
                       f"newest checkpoint (e.g. {self.store.uri(gone[0])})")

    def save(self, group, step: int, meta: dict[str, Any], tracker, background: bool) -> None:
        """Collective over ``group``; in the background the commit comes later (``poll``). A
        step whose checkpoint is there and verifies already is not saved again."""
        self.settle(group, tracker)
        t0 = time.perf_counter()
        directory = self.store.prepare(step)
        if directory is None:  # the same step saved before (a resumed run): that copy stays
            if step not in self.steps:
                self.steps.append(step)
            tracker.event("checkpoint", step=step, path=self.store.uri(self.store.step_dir(step)),
                          kept=True, background=background)
            return
        states = group.save(self.store.uri(directory), background)
        self.store.write_bytes(directory, RNG_FILE, job_states(states))
        self.pending = _Pending(step, directory, {"step": step, **meta}, background, t0,
                                blocked_s=time.perf_counter() - t0)
        if not background:
            self._commit(group, tracker)

    @property
    def writing(self) -> bool:
        """A background save is in flight, not yet committed (a segment of steps ends once it
        is written everywhere: ``RankWorker.train_segment``)."""
        return self.pending is not None and self.pending.background and not self.pending.committed

    def poll(self, group, statuses: list[str | None], tracker) -> None:
        """After a step (``statuses``: each rank's background save): commit the save in
        flight once every rank is done with it, drop it if any rank failed."""
        if self.pending is not None:
            self.pending.steps_during += 1
            self._resolve(group, statuses, tracker)

    def settle(self, group, tracker) -> None:
        """Wait for the background save in flight (if any) and commit or drop it."""
        if self.pending is None:
            return
        t0 = time.perf_counter()
        statuses = group.wait_save()
        self.pending.blocked_s += time.perf_counter() - t0
        self._resolve(group, statuses, tracker)
        if self.pending is not None:  # still running after the wait: give up on it
            self._drop(f"not finished in time: {statuses}", tracker)

    def _resolve(self, group, statuses: list[str | None], tracker) -> None:
        if all(s == "done" for s in statuses):
            if self.pending.committed:
                self._digested(group, tracker)
            else:
                self._commit(group, tracker)
        elif failed := [s for s in statuses if s is not None and s.startswith("failed")]:
            self._drop(failed[0], tracker)

    def forget(self) -> None:
        """A failure interrupted the job: the save in flight never counts (its directory,
        without a manifest, is cleared when that step is saved again, or by ``cleanup`` once a
        newer checkpoint is committed); a synchronous save whose digests were still being
        taken stays committed, checked by sizes only."""
        self.pending = None

    def _commit(self, group, tracker) -> None:
        """The manifest from the digests the ranks computed of what they wrote (a synchronous
        save's: their sizes, the digests to follow, ``_digested``)."""
        p = self.pending
        files = group.saved_files()
        try:
            final = self.store.commit(p.directory, p.meta, files)
        except IncompleteCheckpoint as err:
            self._drop(f"{err}; set checkpoint.dir to storage every node mounts", tracker)
            return
        self.pending = None
        lacking = any(v.get("sha256") is None for v in files.values())
        if lacking:
            self.pending = dataclasses.replace(p, committed=final)
        if p.step not in self.steps:
            self.steps.append(p.step)
        # one still without its digests does not push an older one that has them out
        # (``_digested`` prunes)
        pruned = self._housekeeping(prune=not lacking)
        tracker.event("checkpoint", step=p.step, path=self.store.uri(final), pruned=pruned,
                      background=p.background, blocked_s=round(p.blocked_s, 4),
                      total_s=round(time.perf_counter() - p.t0, 4), steps_during=p.steps_during)
        tracker.log_metrics({"checkpoint_blocked_s": p.blocked_s}, step=p.step)
        if self.on_commit is not None:
            # a synchronous save has no write going on after it: nothing to wait for later
            write_s = time.perf_counter() - p.t0 if p.background else 0.0
            self.on_commit(p.step, p.blocked_s, write_s, tracker)

    def _digested(self, group, tracker) -> None:
        """A synchronous save's digests, taken by the ranks since, into its manifest."""
        p, self.pending = self.pending, None
        lacking = self.store.add_digests(p.committed, group.saved_files())  # (None: gone since)
        if lacking:
            self._warn(f"checkpoint of step {p.step}: {lacking} file(s) without a digest; they "
                       "are checked by size only")
        pruned = self._housekeeping(prune=True)
        tracker.event("checkpoint-digests", step=p.step, lacking=lacking, pruned=pruned,
                      total_s=round(time.perf_counter() - p.t0, 4), steps_during=p.steps_during)

    def _housekeeping(self, prune: bool) -> list[int]:
        """After a commit: older checkpoints pruned (``keep_last``, when ``prune``) and what
        interrupted saves left removed, from one look at what verifies. A store that fails to
        answer skips it (with a warning): nothing is deleted on a guess."""
        try:
            verified = self.store.verified_steps(strict=True)
            pruned = self.store.prune(self.cfg.keep_last, verified) if prune else []
            self.store.cleanup(verified=verified)
        except OSError as err:
            self._warn(f"checkpoint.dir: pruning and clean-up skipped this time, the store did "
                       f"not answer ({str(err)[:200]})")
            return []
        return pruned

    def _drop(self, why: str, tracker) -> None:
        p, self.pending = self.pending, None
        if p.committed:  # published already: it stays, without the digests that failed
            self._warn(f"checkpoint of step {p.step}: its digests were not taken ({why[:300]}); "
                       "its files are checked by size only")
            tracker.event("checkpoint-digests", step=p.step, error=why[-2000:])
            return
        self._warn(f"checkpoint of step {p.step} was not saved ({why[:300]}); the previous "
                   "one stays the newest")
        tracker.event("checkpoint-failed", step=p.step, error=why[-2000:])
        self.store.discard(p.directory)

    def check_shared(self, group) -> None:
        """Refuse storage the ranks' nodes do not share with the controller (a node-local
        ``checkpoint.dir`` on a multi-node cluster: each node would write its own part): a
        probe is written here once and read back from every node."""
        import uuid

        from trainmesh.controller.elastic import JobFailed

        token = uuid.uuid4().hex
        name = f".probe-{token}"
        self.store.write_bytes(self.store.root, name, token.encode())
        try:
            seen = group.readable_on_every_node(self.store.uri(f"{self.store.root}/{name}"), token)
        finally:
            self.store.fs.rm(f"{self.store.root}/{name}")
        blind = sorted(n for n, ok in seen.items() if not ok)
        if blind:
            raise JobFailed(
                f"checkpoint.dir: {self.store.root_uri} is not shared by the job's nodes: "
                f"{len(blind)} of {len(seen)} node(s) cannot read a file written there from the "
                "controller's node, so each node would hold only its own part of every "
                "checkpoint; set checkpoint.dir to storage every node mounts (NFS, a "
                "ReadWriteMany volume) or an object store URI (s3://, gs://)")

    # -- resume ----------------------------------------------------------------------------
    def latest(self, group=None, start: bool = True) -> tuple[str, dict[str, Any]] | None:
        """The newest intact checkpoint (and its manifest); none at the job's ``start`` under
        ``checkpoint.resume: never`` (which refuses a directory holding an earlier run's:
        ``controller/preflight.py``), so every recovery of such a run still restores its own.
        Here only its files' presence and sizes are checked; with ``group`` the ranks check
        the sha256 of every file, each a share, in parallel, and a corrupt one is skipped for
        the one before it."""
        if start and self.cfg.resume != "auto":
            return None
        for d, meta in self.store.intact(hashes=False):
            if group is None:
                return d, meta
            bad = group.bad_files(self.store.uri(d), meta.get("files", {}))
            if not bad:
                return d, meta
            aside = self.store.quarantine(d)
            self._warn(f"checkpoint {self.store.uri(d)} is corrupt ({len(bad)} file(s), e.g. "
                       f"{bad[0]}); moved to {self.store.uri(aside)}, restoring the one before it")
        return None

    def restored(self, directory: str) -> tuple[str, bytes | None]:
        """After choosing ``directory``: the URI the ranks load from, and the RNG state."""
        self.steps = self.store.complete_steps()
        return self.store.uri(directory), self.store.read_bytes(directory, RNG_FILE)

    def published(self) -> list[str]:
        return [self.store.uri(self.store.step_dir(s)) for s in self.steps if self.store.exists(s)]
