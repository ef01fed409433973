"""Experiment tracking behind one small interface: MLflow, or nothing at all.

The controller holds a Tracker and calls it unconditionally; ``NullTracker`` stands in where
nothing is tracked, so no ``if tracking_enabled`` is scattered through the loop.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Tracker(Protocol):
    run_id: str | None
    uri: str | None

    def opened(self) -> str | None: ...
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_dict(self, obj: Any, artifact_file: str) -> None: ...
    def log_artifact(self, path: str | Path) -> None: ...
    def event(self, kind: str, **fields: Any) -> None: ...
    def finish(self, status: str) -> None: ...


class NullTracker:
    run_id = None
    uri = None

    def opened(self) -> None:
        return None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def event(self, kind: str, **fields: Any) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


def open_tracker(uri: str | None, experiment: str, run_name: str, run_id: str | None,
                 on_warning: Callable[[str], None], artifact_dir: str | Path | None = None,
                 backlog_dir: str | Path | None = None, backlog_in_memory: int = 10_000) -> Tracker:
    """The MLflow run at ``uri`` (re-opened by ``run_id`` after a restart), or the null tracker
    where nothing is tracked (no ``uri``). ``artifact_dir``: where a new experiment in the
    run's own sqlite store (beside ``artifact_dir``) keeps its artifacts; MLflow's own default
    is ``./mlruns`` of whatever directory the job was started from. ``backlog_dir``,
    ``backlog_in_memory``: where metrics spill while the server is away (``MlflowTracker``)."""
    if not uri:
        return NullTracker()
    return MlflowTracker(uri, experiment, run_name, run_id=run_id, on_warning=on_warning,
                         artifact_dir=artifact_dir, backlog_dir=backlog_dir,
                         backlog_in_memory=backlog_in_memory)


def resolve_tracking_uri(spec_uri: str | None, env_uri: str | None, output_dir: str | Path) -> str:
    """The spec's URI wins, then ``MLFLOW_TRACKING_URI``, then sqlite in the output directory."""
    if spec_uri:
        return spec_uri
    if env_uri:
        return env_uri
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class MlflowTracker:
    """One MLflow run, created or (after a restart) re-opened by id.

    Nothing here waits for the server: every call is queued in order and a sender thread
    delivers it, so a step never waits for MLflow. A lost tracking server never stops
    training: while it does not answer, calls are buffered (metrics keep the time they were
    logged at) and retried every ``retry_interval_s``, with one warning when it goes and one
    when it comes back. While it keeps up, what is queued goes out at most once every
    ``send_interval_s`` (the steps of that time in one request: per-step requests cost the
    controller's host, and the server, a request per step). ``finish`` sends what is left at
    once and waits up to ``flush_timeout_s`` for the backlog.
    The backlog is bounded in memory: past ``backlog_in_memory`` metric values (a server away,
    or slower than the steps), the metrics logged next go to a file in ``backlog_dir``
    (``mlflow-backlog-RUN_ID.jsonl``, a line a step) instead, replayed in order from it when the
    server is back (the file is removed once it is all sent; left in place, with a warning, if
    the run ends first).
    MLflow's own HTTP retries (minutes of back-off per call) are turned down for this process
    unless the environment sets them, so a step is never held up by more than one timeout.
    """

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None = None,
                 retry_interval_s: float = 5.0, flush_timeout_s: float = 120.0,
                 send_interval_s: float = 1.0,
                 on_warning: Callable[[str], None] | None = None,
                 artifact_dir: str | Path | None = None,
                 backlog_dir: str | Path | None = None, backlog_in_memory: int = 10_000):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri, self.run_id = uri, run_id
        self.artifact_dir = artifact_dir
        self._on_warning = on_warning
        self.retry_interval_s, self.flush_timeout_s = retry_interval_s, flush_timeout_s
        self.send_interval_s = send_interval_s
        self._pending: deque[tuple[str, Callable[[], object] | _Metrics | _Spill]] = deque()
        self.backlog_dir, self.backlog_in_memory = backlog_dir, backlog_in_memory
        self._lock = threading.Lock()  # the metrics in memory and the spill file
        self._in_memory = 0  # metric values queued in memory
        self._spill: _Spill | None = None  # while set, new metrics go to its file
        self._down_since: float | None = None
        self._events: list[dict[str, Any]] = []
        self._wake, self._closing = threading.Event(), False
        self._finishing = threading.Event()  # cuts the wait between sends short
        # The run opens in the sender thread (importing MLflow and creating a store take
        # seconds: they overlap the ranks' start); calls queue meanwhile. ``opened`` waits.
        self._opened, self._open_error = threading.Event(), None
        self._sender = threading.Thread(target=self._send_loop, args=(experiment, run_name),
                                        name="mlflow-sender", daemon=True)
        self._sender.start()

    def opened(self) -> str | None:
        """Wait until the run is open; returns why it cannot be (naming the fix), or None."""
        self._opened.wait()
        return self._open_error

    def _open(self, experiment: str, run_name: str) -> None:
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
            if self.run_id is not None:
                self.run_id = self.client.get_run(self.run_id).info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                exp = self.client.get_experiment_by_name(experiment)
                where = None  # the run's own store's artifacts beside it, not in the CWD
                if self.artifact_dir is not None and _store_beside(self.uri, self.artifact_dir):
                    where = Path(self.artifact_dir).resolve().as_uri()
                exp_id = exp.experiment_id if exp else self.client.create_experiment(
                    experiment, artifact_location=where)
                self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        except Exception as err:  # noqa: BLE001 - any failure here means no run to log to
            self._open_error = (f"tracking.uri: cannot open an MLflow run at {self.uri} "
                                f"({_short(err)}); start the tracking server, fix the URI, or set "
                                "tracking.enabled=false")
        finally:
            self._opened.set()

    # -- the queue -----------------------------------------------------------------------------
    def _submit(self, what: str, call: Callable[[], object]) -> None:
        self._pending.append((what, call))
        self._wake.set()

    def _send_loop(self, experiment: str, run_name: str) -> None:
        """The sender thread: open the run, then deliver what is queued; after a failure wait
        ``retry_interval_s`` (``finish`` cuts the first wait short); end once closing and
        nothing is left (or at once if the run could not be opened)."""
        self._open(experiment, run_name)
        if self._open_error is not None:
            return
        while True:
            delivered = self._drain()
            if self._closing and delivered:
                return
            if delivered:  # the next send_interval_s's calls go out together
                self._finishing.wait(self.send_interval_s)
            self._wake.wait(None if delivered else self.retry_interval_s)
            self._wake.clear()

    def _drain(self) -> bool:
        """Send queued calls in order; False when the server is (still) unreachable. Metrics
        queued one after another go in one request (up to MLflow's ``log_batch`` limit), so the
        sender keeps up with steps faster than a request and a backlog clears in a few calls."""
        while self._pending:
            what, call = self._pending[0]
            n = 1
            if isinstance(call, _Spill):
                if not self._replay(call):
                    return False
                self._sent(1)
                continue
            if isinstance(call, _Metrics):
                batch = list(call.batch)
                while n < len(self._pending) and isinstance(self._pending[n][1], _Metrics) and \
                        len(batch) + len(self._pending[n][1].batch) <= _BATCH_LIMIT:
                    batch += self._pending[n][1].batch
                    n += 1
                call = functools.partial(self.client.log_batch, self.run_id, metrics=batch)
            try:
                call()
            except Exception as err:  # noqa: BLE001 - classified below
                if _rejected(err):  # the server answered "no": retrying cannot help
                    self._warn(f"MLflow rejected {what}" + (f" and {n - 1} more" if n > 1 else "")
                               + f": {_short(err)}")
                    self._sent(n)
                    continue
                self._went_down(err)
                return False
            self._sent(n)
            self._came_back()
        return True

    def _sent(self, n: int) -> None:
        """The first ``n`` queued calls are done with (sent or refused)."""
        with self._lock:
            for _ in range(n):
                _, call = self._pending.popleft()
                if isinstance(call, _Metrics):
                    self._in_memory -= len(call.batch)

    def _went_down(self, err: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._warn(f"MLflow tracking server at {self.uri} is unreachable ({_short(err)}); "
                       "training goes on, metrics are buffered and retried every "
                       f"{self.retry_interval_s:.0f} s")

    def _came_back(self) -> None:
        if self._down_since is not None:  # said at once: the backlog may take a while
            self._warn(f"MLflow tracking server at {self.uri} is back after "
                       f"{time.monotonic() - self._down_since:.0f} s; sending the "
                       f"{len(self._pending)} calls buffered meanwhile")
            self._down_since = None

    def _replay(self, spill: _Spill) -> bool:
        """Send the spilled metrics in order, ``_BATCH_LIMIT`` at a time; once the file is all
        sent (and nothing more is being spilled to it) it is removed. False: the server is
        (still) unreachable."""
        from mlflow.entities import Metric

        while True:
            with self._lock:
                rows, end = spill.read(_BATCH_LIMIT)
                if not rows:
                    spill.close()
                    self._spill = None
                    return True
            batch = [Metric(*m) for row in rows for m in row]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as err:  # noqa: BLE001 - as in _drain
                if not _rejected(err):
                    self._went_down(err)
                    return False
                self._warn(f"MLflow rejected {len(batch)} spilled metrics: {_short(err)}")
            spill.offset = end
            self._came_back()

    def _warn(self, text: str) -> None:
        log.warning(text)
        if self._on_warning is not None:
            self._on_warning(text)

    # -- the Tracker interface -----------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        def call():
            from mlflow.entities import Param

            existing = self.client.get_run(self.run_id).data.params
            items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items() if k not in existing]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i:i + 100])

        self._submit("params", call)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)  # when it happened, not when the server got it
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        with self._lock:
            if (self._spill is None and self.backlog_dir and self.run_id is not None
                    and self._in_memory + len(batch) > self.backlog_in_memory):
                self._spill = _Spill(Path(self.backlog_dir) / f"mlflow-backlog-{self.run_id}.jsonl")
                self._pending.append((f"metrics spilled to {self._spill.path}", self._spill))
                self._warn(f"MLflow backlog past {self.backlog_in_memory} metric values in "
                           f"memory: the next ones go to {self._spill.path} until the server "
                           "is back")
            if self._spill is not None:
                self._spill.append(batch)
                return
            self._in_memory += len(batch)
            self._submit(f"metrics of step {step}", _Metrics(batch))

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self._submit(artifact_file, lambda: self.client.log_dict(self.run_id, obj, artifact_file))

    def log_artifact(self, path: str | Path) -> None:
        self._submit(str(path), lambda: self.client.log_artifact(self.run_id, str(path)))

    def event(self, kind: str, **fields: Any) -> None:
        """A job event (start, checkpoint, resume, ...): kept in ``events.json`` and as a tag."""
        self._events.append({"time": time.time(), "kind": kind, **fields})
        value = json.dumps(self._events[-1])
        self._submit(f"event {kind}", lambda: self.client.set_tag(self.run_id, "trainmesh.last_event", value))

    def finish(self, status: str) -> None:
        if self._events:
            events = list(self._events)
            self._submit("events.json", lambda: self.client.log_dict(self.run_id, events, "events.json"))
        self._submit("run status", lambda: self.client.set_terminated(self.run_id, status=status))
        self._closing = True
        self._finishing.set()
        self._wake.set()
        self._sender.join(self.flush_timeout_s)
        if self._sender.is_alive():
            spill = self._spill
            kept = f" (the spilled metrics stay in {spill.path})" if spill is not None else ""
            self._warn(f"MLflow tracking server at {self.uri} did not come back within "
                       f"{self.flush_timeout_s:.0f} s; {len(self._pending)} buffered calls were "
                       f"not sent{kept}")


_BATCH_LIMIT = 1000  # metrics in one MLflow log_batch request


def _store_beside(uri: str, artifact_dir: str | Path) -> bool:
    """Whether ``uri`` is a run's own sqlite store, in the directory that holds
    ``artifact_dir`` (the default: ``OUTPUT/mlflow.db``). A store shared by runs keeps the
    artifact location MLflow or its owner gave it: an experiment's location is set once, when
    it is created, and one run's directory is no place for every later run's artifacts."""
    if not uri.startswith("sqlite:///"):
        return False
    return Path(uri[len("sqlite:///"):]).resolve().parent == Path(artifact_dir).resolve().parent


class _Metrics:
    """Queued metrics of one step (sent with the metrics queued after them, see ``_drain``)."""

    def __init__(self, batch: list) -> None:
        self.batch = batch


class _Spill:
    """The metrics logged while the backlog in memory is full: a JSON line a step (each metric
    as key, value, timestamp, step), appended by the training thread and read from ``offset``
    by the sender (both under the tracker's lock)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def append(self, batch: list) -> None:
        self._file.seek(0, os.SEEK_END)
        self._file.write(json.dumps([[m.key, m.value, m.timestamp, m.step] for m in batch]) + "\n")
        self._file.flush()

    def read(self, most: int) -> tuple[list[list], int]:
        """The steps (each a list of metrics as written) from ``offset`` holding at most
        ``most`` metrics (at least one step), and the offset after them."""
        self._file.seek(self.offset)
        rows, count, end = [], 0, self.offset
        while line := self._file.readline():
            row = json.loads(line)
            if rows and count + len(row) > most:
                break
            rows.append(row)
            count, end = count + len(row), self._file.tell()
        return rows, end

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def _rejected(err: Exception) -> bool:
    """The server answered and refused (4xx): not a reason to wait for it."""
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(err, RestException):
        return 400 <= err.get_http_status_code() < 500
    return isinstance(err, MlflowException) and 400 <= err.get_http_status_code() < 500 and \
        "Max retries" not in str(err) and "Connection" not in str(err)


def _short(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:200]
