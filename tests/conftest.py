"""Shared fixtures. Everything listens on loopback; clusters are shared and always shut down."""

from __future__ import annotations

import os

# Before anything imports ray or torch.distributed (see ENVIRONMENT.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance on 127.0.0.1 for the whole session (4 logical CPUs so that
    4-rank jobs fit on a 2-core machine)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()
