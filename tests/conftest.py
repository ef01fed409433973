"""Shared fixtures. Everything listens on loopback; clusters are shared and always shut down."""

from __future__ import annotations

import contextlib
import os

# Before anything imports ray or torch.distributed: Ray and gloo on loopback only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray's metrics pipeline off for every Ray process the tests start: on a simulated cluster whose
# nodes come and go, the GCS and the head's dashboard agent (OpenTelemetry ingestion) were
# measured taking 1.7 of the 2 cores after a few node removals, starving the ranks.
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)
# Triton kernels run in its interpreter on CPU; read when a kernel module is imported. The GPU
# module (marker gpu) needs TRITON_INTERPRET=0 in the environment to compile for real.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

LOCAL_RAY_FIXTURES = {"ray_local", "rank_pool"}
CLUSTER_FIXTURES = LOCAL_RAY_FIXTURES | {"gpu_cluster"}


def _group(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return marker.args[0] if marker.args else marker.kwargs.get("name")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups it names
def pytest_collection_modifyitems(config, items):
    """The order: the tests that start no Ray; the modules whose Ray lives only in processes of
    their own (marker ray_apart: a `ray start` head, `trainmesh run` subprocesses; they bound no
    time tightly), in a group of their own ("ray-apart"); then, in the group "ray", every other
    test that starts Ray (or bounds its own time, marker timed): first those on the shared local
    instance and its pool of rank actors (one after another, so that the instance and its
    actors serve all of them), the pipeline parity's 8-rank meshes first: the pool starts at its
    largest and every later mesh re-forms smaller in the same processes (growing would start
    all of them again); then the modules with clusters of their own (the fault matrix,
    simulated nodes: they end the local instance).

    Under `pytest -n 2 --dist loadgroup` (`make test`) xdist hands the Ray group, the largest
    unit, whole to one worker, which runs it in this order at full priority (two Ray streams
    on 2 cores at one priority starve each other's ranks into false hang verdicts); that
    worker asks for more only at its group's end. The other, at the lowest priority
    (``pytest_runtest_setup``), takes every other unit: the modules without Ray (planner,
    kernels in Triton's interpreter, schedules, specs, single-process references), on the
    cycles the parity modules' ranks leave idle while they wait on each other, and among them
    (xdist orders units by size) the ray-apart group, beside the last parity modules and the
    fault matrix's waits (on health checks, hang bounds, restarts) instead of after them. (The
    fault matrix first, with the tests without Ray beside it, was measured slower: the matrix
    took 255 s instead of 206-218.) With more workers the modules without Ray spread over the
    others."""
    for item in items:  # what starts Ray through a fixture is a cluster test (module marks: the rest)
        if CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.cluster)
        why = item.get_closest_marker("everyday")
        if why is not None and not (why.args and str(why.args[0]).strip()):
            raise pytest.UsageError(f"{item.nodeid}: an everyday test says why it is in `make test` "
                                    "(tests/tiers.py)")
        why = item.get_closest_marker("full")
        if why is not None and not (why.args and str(why.args[0]).strip()):
            raise pytest.UsageError(f"{item.nodeid}: a full-tier test says why it is left out of "
                                    "`make test` (tests/tiers.py)")
        if item.get_closest_marker("ray_apart"):
            item.add_marker(pytest.mark.xdist_group("ray-apart"))
        elif item.get_closest_marker("cluster") or item.get_closest_marker("timed"):
            item.add_marker(pytest.mark.xdist_group("ray"))
    shared = {item.module.__name__ for item in items if LOCAL_RAY_FIXTURES & set(item.fixturenames)}

    def order(item) -> tuple:
        module = item.module.__name__
        if _group(item) != "ray":
            return (0, _group(item) is not None)
        return (1, module not in shared, module != "test_pipeline_parity")

    items.sort(key=order)


def pytest_collection_finish(session):
    """What collection imported (torch, Ray, MLflow, the tests) lives as long as pytest: out of
    every later garbage collection of this process (as a rank's imports: actors/collector.py).
    Under xdist's loadgroup, the Ray tests must have reached their group (pytest-xdist 3.8
    groups through the node id, which pytest 9.2's structured ids no longer let it change:
    pyproject pins pytest below it), or two Ray streams would share the 2 cores."""
    import gc

    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if _group(i) and not i.nodeid.endswith("@" + _group(i))]
        if lost:
            raise pytest.UsageError(f"xdist's loadgroup did not group {lost[0]} (and {len(lost) - 1} "
                                    "more): use the pytest and pytest-xdist versions pyproject.toml names")

    gc.collect()
    gc.freeze()


_ROLE: list[str] = []  # this xdist worker's, once its first test decided it: "ray" | "lowered"


def pytest_runtest_setup(item):
    """Under loadgroup, the worker that does not run the Ray group runs at the lowest priority,
    and so do the processes its ray_apart modules start: its tests take the cycles the Ray
    tests' ranks leave idle (while they wait on each other, on a node's start, on a timeout)
    instead of slowing the ranks. On Linux that is the idle scheduling class (SCHED_IDLE:
    inherited by its children, run only on a core nothing else wants, preempted by any other
    process that wakes), not only nice 19: Ray runs its workers — the ranks — at nice 15
    (its ``worker_niceness``), where nice 19 still takes ~30% of a core they share (the
    pipeline-parity module took 72.1 s beside two nice-19 busy loops, 59.8 s alone, 59.6 s
    beside two SCHED_IDLE ones). A test that bounds its own time is not here (marker timed):
    in a stretch where the ranks keep both cores busy, this worker gets a minimal share
    (the idle class's weight, 3 against a nice-15 rank's 36)."""
    if getattr(item.config.option, "loadgroup", False) and not _ROLE:
        if _group(item) == "ray":
            _ROLE.append("ray")
        else:
            os.nice(19)  # (elsewhere, or where a sandbox refuses the class: the lowest weight only)
            with contextlib.suppress(AttributeError, OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            _ROLE.append("lowered")


RAY_APART_NICE = 5  # a ray_apart test's own niceness in the lowered worker, where the system allows


@pytest.fixture(autouse=True)
def _ray_apart_outside_the_idle_class(request):
    """A ``ray_apart`` test in the lowered worker runs in the normal scheduling class at nice 5
    (not the idle class, not nice 19), and so do the processes it starts: a Ray instance it
    starts (the demo's ``trainmesh run``, a ``ray start`` head) must come up within Ray's fixed
    30 s start-up timeout. In the idle class, beside ranks that keep both cores busy, it got no
    CPU at all; at nice 19 it still timed out in CI beside the 8-rank pipeline parity ("the
    current node timed out during startup"). Measured here beside eight busy loops at nice 15
    (the ranks' niceness): ``ray.init`` timed out at nice 19, took 15.9 s at nice 10, 8.8 s at
    nice 5 and 7.7 s at nice 0 (7.6 s on an idle machine). The ranks such a test's Ray starts
    run at Ray's worker niceness above that, at the bottom as before. Raising a priority needs
    the privilege (CI's root has it); without it the test stays at nice 19."""
    lowered = _ROLE == ["lowered"] and request.node.get_closest_marker("ray_apart") is not None
    if lowered:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, 0, RAY_APART_NICE)
    try:
        yield
    finally:
        if lowered:
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 19)
            with contextlib.suppress(AttributeError, OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def pytest_unconfigure(config):
    """... and back before the interpreter's end, whose last collection then frees them (frozen,
    Triton's bindings report them as leaked)."""
    import gc

    gc.unfreeze()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """An S3 endpoint on loopback (moto's server), for the session; its variables are set in
    this process (s3fs reads them here) and handed to jobs' processes by the tests."""
    from servers import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        with server.client_env():
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance on 127.0.0.1 shared by the modules that use it (8 logical CPUs:
    the rank pool's idle actors plus a 4-rank job fit; only running ranks use real cores)."""
    import ray

    ray.shutdown()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def gpu_cluster():
    """A simulated multi-node cluster: a head and 2 nodes advertising 4 GPUs each."""
    from servers import simulated_cluster

    with simulated_cluster(2, num_cpus=4, num_gpus=4) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def rank_pool(ray_local):
    """Rank actors shared by every multi-rank test on the local instance
    (``rank_pool.RankPool``); modules run largest mesh first."""
    from rank_pool import RankPool

    pool = RankPool()
    yield pool
    if ray_local.is_initialized():
        pool.close()
