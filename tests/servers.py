"""Real servers for tests, on 127.0.0.1 only: an MLflow tracking server that can be stopped
and started again on the same port and store, an S3 endpoint (moto's server), a Ray head with
its dashboard/job API, and a simulated multi-node Ray cluster."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


# The in-memory checkpoint tier (checkpoint/memory_fs.py, controller/memory_tier.py) meeting node losses
MEMORY_ARGS = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
               "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=auto",
               "runtime.cpus_per_rank=0.5", "checkpoint.in_memory.every=1", "elastic.max_restarts=4",
               "tracking.enabled=false",
               # their recoveries keep survivors and start no rank: ready processes (tested in
               # test_fault_matrix.py) would only share the 2 cores with the ranks
               "elastic.ready_ranks_per_node=0"]


@contextlib.contextmanager
def simulated_cluster(nodes: int, num_cpus: float, num_gpus: int):
    """``ray.cluster_utils.Cluster``: a head (1 CPU, no GPU) and ``nodes`` nodes advertising
    ``num_gpus`` GPUs each, this process connected; shut down on exit. Its GCS checks its
    nodes every second (Ray's default: every 3 s, dead after 5 misses), so a node a test
    removes is seen dead in ~3 s, not ~15; a refused check counts, a slow one has Ray's 10 s.
    No log monitor: nothing reads the workers' logs here (``log_to_driver=False``)."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "include_log_monitor": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=num_cpus, num_gpus=num_gpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def process_parents() -> dict[int, tuple[int, bytes]]:
    """Every process on this machine: pid -> (parent pid, command line), from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                table[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
            except (OSError, ValueError):
                pass
    return table


def descendants(pid: int) -> set[int]:
    """The processes started, directly or not, by ``pid``."""
    parent = {p: pp for p, (pp, _) in process_parents().items()}
    tree, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree, grew = tree | more, bool(more)
    return tree - {pid}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """This process's environment with ``variables`` set, restored on the way out."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (held together while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s: {log.read_text()[-2000:]}")


class MlflowServer:
    """``mlflow server`` on loopback, one worker, sqlite store under ``root``."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    def start(self, timeout_s: float = 90) -> None:
        log = self.root / "server.log"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _wait_http(f"{self.uri}/health", timeout_s, self.proc, log)

    def stop(self) -> None:
        """Kill the server and everything it started (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


class S3Server:
    """An S3 endpoint on loopback: moto's server (the emulator s3fs's own tests run against),
    reached over HTTP by s3fs as a real store is — the product's code path unchanged. Clients
    find it through the standard variables (``env``: AWS credentials, any value; fsspec's
    ``FSSPEC_S3_ENDPOINT_URL``, read by s3fs in every process that has it)."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "trainmesh-test", "AWS_SECRET_ACCESS_KEY": "trainmesh-test",
                    "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": self.uri}
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    def start(self, timeout_s: float = 60) -> None:
        log = self.root / "s3.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait_http(f"{self.uri}/moto-api/", timeout_s, self.proc, log)

    @contextlib.contextmanager
    def client_env(self):
        """This process as a client of the endpoint: its variables set, and fsspec's config
        read from them again (fsspec reads its ``FSSPEC_*`` variables once, at import);
        both restored afterwards."""
        import fsspec.config

        conf = {k: dict(v) for k, v in fsspec.config.conf.items()}
        with environment(self.env):
            fsspec.config.set_conf_env(fsspec.config.conf)
            try:
                yield
            finally:
                fsspec.config.conf.clear()
                fsspec.config.conf.update(conf)

    def filesystem(self):
        """An s3fs filesystem on this endpoint (a fresh instance: fsspec caches them)."""
        import s3fs

        return s3fs.S3FileSystem(key=self.env["AWS_ACCESS_KEY_ID"],
                                 secret=self.env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_url=self.uri, skip_instance_cache=True)

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        import uuid

        name = f"trainmesh-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


class RayHead:
    """``ray start --head`` on loopback with the dashboard (job API) on 127.0.0.1."""

    def __init__(self, root: Path, num_cpus: int = 4):
        self.root, self.num_cpus = root, num_cpus
        # The node's dashboard agent serves the job API's agent; Ray's default port for it
        # (52365) is taken by whichever Ray node on this machine started first (a simulated
        # cluster's, a local instance's), and then no job is ever accepted ("No available agent")
        self.port, self.dashboard_port, self.agent_port, self.client_port = free_ports(4)
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        # Started by its full path with the venv NOT on PATH (no `trainmesh` or `python` of
        # the venv there), as a user who never activated it would: jobs must still run.
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != BIN]
        self.env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo",
                    "PATH": os.pathsep.join(path)}
        self.env.pop("RAY_ADDRESS", None)
        # Every process of this head inherits the marker, so stop() can find its workers too.
        self.marker = f"TRAINMESH_TEST_RAY_HEAD={root}"
        self.env["TRAINMESH_TEST_RAY_HEAD"] = str(root)
        # Token authentication with this user's default token (~/.ray/auth_token, the one Ray
        # uses for local clusters and caches per process): clients need RAY_AUTH_MODE=token.
        self.auth = {"RAY_AUTH_MODE": "token"}
        self.env.update(self.auth)
        for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            self.env.pop(k, None)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], check=True,
                       env=self.env, capture_output=True, timeout=60)
        started = subprocess.run(
            [str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
             "--port", str(self.port), "--dashboard-host", "127.0.0.1",
             "--dashboard-port", str(self.dashboard_port), "--num-cpus", str(self.num_cpus),
             "--dashboard-agent-listen-port", str(self.agent_port),
             "--ray-client-server-port", str(self.client_port),
             "--temp-dir", str(self.root), "--disable-usage-stats"],
            env=self.env, capture_output=True, text=True, timeout=180)
        if started.returncode != 0:  # (what Ray said: a failed start is otherwise a bare status)
            raise RuntimeError(f"ray start --head exited {started.returncode}:\n"
                               f"{started.stdout[-3000:]}\n{started.stderr[-3000:]}")
        self._wait_for_job_agent()

    def _wait_for_job_agent(self, timeout_s: float = 180) -> None:
        """The job API answers before the node's job agent registers ("No available agent"):
        wait until a trivial job is accepted and finishes."""
        from ray.job_submission import JobSubmissionClient

        with self.client_env():
            client = JobSubmissionClient(self.address)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    job = client.submit_job(entrypoint="true")
                    break
                except RuntimeError as err:
                    if time.monotonic() > deadline:
                        logs = sorted(self.root.glob("session_*/logs/dashboard_agent*"))
                        tail = logs[-1].read_text()[-2000:] if logs else "(no agent log)"
                        raise TimeoutError(f"Ray job agent not ready: {err}\n{tail}") from None
                    time.sleep(1.0)
            while str(client.get_job_status(job)).split(".")[-1] not in ("SUCCEEDED", "FAILED", "STOPPED"):
                time.sleep(0.5)

    @contextlib.contextmanager
    def client_env(self):
        """This process as a client of the head (its auth settings), restored afterwards. Ray
        reads ``RAY_AUTH_MODE`` once per process, at its first use of its config (where
        nothing here started a local instance, which turns token mode on, a process that
        touched Ray before still says "disabled"): read again on the way in and out, with
        Ray's own helper."""
        from ray._private.authentication_test_utils import reset_auth_token_state

        with environment(self.auth):
            reset_auth_token_state()
            try:
                yield
            finally:
                reset_auth_token_state()

    def stop(self) -> None:
        """End this head's processes only (``ray stop`` would end every Ray on the machine):
        those whose command line names its temp dir or whose environment carries its marker,
        and everything they started (the agents retitle themselves, which can hide both)."""
        tree = set(self._pids())
        for pid in list(tree):
            tree |= descendants(pid)
        for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 1.0)):  # (a test's head:
            # nothing of it is kept, so what has not left after a second is killed)
            pids = sorted((tree & set(process_parents())) | set(self._pids()))
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self._pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        if not os.environ.get("TRAINMESH_KEEP_TEST_LOGS"):
            shutil.rmtree(self.root, ignore_errors=True)

    def _pids(self) -> list[int]:
        mine = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                env = (entry / "environ").read_bytes()
            except OSError:
                continue
            if str(self.root) in cmd or self.marker.encode() in env:
                mine.append(int(entry.name))
        return [p for p in mine if p != os.getpid()]


def rank_pids_under(raylet: int) -> list[int]:
    """The job's rank processes a raylet started: rank actors, and the seats of ready processes
    that became ranks (``actors/ready.py``; one not taken is a ``ReadyRank`` without a seat)."""
    return [p for p, (pp, cmd) in process_parents().items()
            if pp == raylet and cmd.startswith((b"ray::RankWorker", b"ray::FaultyRank", b"ray::Seat"))]


def remove_node_hard(cluster, node_id: str) -> None:
    """End a simulated node as a machine's loss would: its raylet, and everything it started
    (rank processes, idle workers, its dashboard and runtime-env agents, which a real node's
    end takes with it; left behind, the agents spin for minutes looking for their raylet)."""
    import os
    import signal

    [node] = [n for n in cluster.worker_nodes if n.node_id == node_id]
    doomed = descendants(node.all_processes["raylet"][0].process.pid)
    try:
        cluster.remove_node(node, allow_graceful=False)
    finally:  # (also when that fails: none is left behind, stopped or spinning)
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def job_in_background(spec, environ: dict[str, str], **run_args):
    """``run_job`` in a thread (Ray adds and removes nodes from the main thread only): the
    thread, and a dict that receives ``summary`` or ``error``; ``run_args``: ``run_job``'s
    other arguments (e.g. ``testing.faults.fault_run``'s)."""
    import threading

    from trainmesh.controller.launch import run_job

    box: dict = {}

    def job():
        try:
            box["summary"] = run_job(spec, environ=environ, show_progress=False, **run_args)
        except Exception as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    return thread, box


def run_losing_nodes(cluster, out, args: list[str], faults: list[str], remove: bool = True,
                     job_env: dict[str, str] | None = None) -> dict:
    """Run a job (``args`` over-riding ``load_spec``'s defaults, output in ``out``; ``job_env``:
    variables for its processes); once every fault (``wait@rank=R,...``: that rank stops there)
    has fired, remove the nodes of those ranks at once, hard (unless not ``remove``: the faults
    act alone). Returns the summary, with the spec under ``spec``."""
    import json
    import time

    from trainmesh.cli.loading import load_spec
    from trainmesh.testing.faults import fault_run

    markers = [out / f"fired-{i}" for i in range(len(faults))]
    env = ";".join(f"{f},marker={m}" for f, m in zip(faults, markers, strict=True))
    spec = load_spec(None, [*args, f"runtime.output_dir={out / 'out'}"])
    run_args = fault_run(env)
    run_args["job_env"] = {**(job_env or {}), **run_args["job_env"]}
    thread, box = job_in_background(spec, {}, **run_args)
    removed = False
    while thread.is_alive():
        if not removed and all(m.exists() and m.read_text() for m in markers):
            for node in {json.loads(m.read_text())["node"] for m in markers} if remove else ():
                remove_node_hard(cluster, node)
            removed = True
        time.sleep(0.1)
    assert "error" not in box, box.get("error")
    assert removed, "the faults never fired"
    box["summary"]["spec"] = spec
    return box["summary"]


def assert_reference_losses(summary: dict, out) -> None:
    """A run's losses are the single-process model's (rtol 1e-4)."""
    import torch
    from reference import reference_run

    ref, _ = reference_run(summary["spec"], str(out / "out" / "data" / "tiny-corpus"),
                           steps=summary["steps_done"])
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref), rtol=1e-4, atol=0)
