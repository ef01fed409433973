"""gloo's connections ended at an abort (``actors/gloo_sockets.py``): a rank blocked in a gloo
sub-group collective whose peer is silent — alive, its connections open, never entering the
call: a frozen node, or a survivor that left the collective for a recovery — is released by
shutting its own connections down, and a peer's shutdown releases it too; either way the
process re-forms a group and goes on (no process restart). Without this, the blocked call
ends only at the collective timeout (set to 5 minutes here, so a release that failed shows as
a timeout error, not as a slow pass). Three real gloo processes, no Ray."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import traceback
from datetime import timedelta

import pytest

from trainmesh.actors.gloo_sockets import GlooSockets

TIMEOUT = timedelta(minutes=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _form(rank: int, world: int, port: int, gloo: GlooSockets):
    import torch.distributed as dist

    with gloo.opened():  # as RankWorker forms its groups: the default one and a mesh dimension's
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        sub = dist.new_group([0, 1], timeout=TIMEOUT)
    return store, sub


def _rank(rank: int, ports: list[int], events, out) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    try:
        t = torch.ones(4)
        for phase, port in enumerate(ports[:2]):  # 0: rank 0 releases itself; 1: its peer does
            gloo = GlooSockets()
            store, sub = _form(rank, 3, port, gloo)
            dist.all_reduce(t)
            if rank < 2:
                dist.all_reduce(t, group=sub)
            dist.barrier()
            if rank == 0:
                if phase == 0:  # silent peer: rank 0's own abort ends its call
                    threading.Timer(0.5, lambda g=gloo: out.put(("released", g.release()))).start()
                else:
                    events["blocked"].set()  # (about to block: rank 1 releases its side)
                try:
                    dist.all_reduce(t, group=sub)
                    out.put((f"phase {phase}", "returned"))
                except RuntimeError as err:
                    out.put((f"phase {phase}", str(err)))
                events[f"done{phase}"].set()
            elif rank == 1:
                if phase == 1:
                    events["blocked"].wait(60)
                    out.put(("peer released", gloo.release()))
                events[f"done{phase}"].wait(TIMEOUT.total_seconds())  # silent until rank 0 is out
            dist.destroy_process_group()
            del store, sub
        # the same processes form a new group and compute (what a warm recovery does)
        store = dist.TCPStore("127.0.0.1", ports[2], 3, is_master=rank == 0, timeout=TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=TIMEOUT)
        x = torch.full((2,), float(rank + 1))
        dist.all_reduce(x)
        out.put((f"re-formed {rank}", x.tolist()))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test
        out.put((f"error {rank}", traceback.format_exc()))


@pytest.mark.timeout(300)
def test_a_rank_blocked_on_a_silent_peer_is_released_by_its_abort_and_its_peers():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    events = {k: ctx.Event() for k in ("blocked", "done0", "done1")}
    ports = [_free_port() for _ in range(3)]
    procs = [ctx.Process(target=_rank, args=(r, ports, events, out)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(280)
    got: dict[str, object] = {}
    while not out.empty():
        k, v = out.get()
        got[k] = v
    assert not [k for k in got if k.startswith("error")], got
    assert [p.exitcode for p in procs] == [0, 0, 0], (got, [p.exitcode for p in procs])
    # the blocked call raised on the closed connection, not at the timeout
    for phase in ("phase 0", "phase 1"):
        assert "Connection closed" in got[phase] and "Timed out" not in got[phase], got[phase]
    assert got["released"] > 0 and got["peer released"] > 0, got
    assert [got[f"re-formed {r}"] for r in range(3)] == [[6.0, 6.0]] * 3, got


def test_only_connections_the_formation_opened_are_tracked_and_released():
    """A connection accepted on a server listening before (Ray's, an actor call arriving) and a
    listener opened inside (gloo's: shutting it makes gloo end the process) are left alone; a
    connection opened inside is shut down in both directions; a descriptor closed since is not
    touched, whatever now holds its number."""
    gloo = GlooSockets()
    server = socket.create_server(("127.0.0.1", 0))
    try:
        with gloo.opened():
            listener = socket.create_server(("127.0.0.1", 0))  # (gloo's own listener)
            client = socket.create_connection(server.getsockname())  # (a group's connection)
            accepted, _ = server.accept()  # (Ray's server side)
            gone = socket.create_connection(server.getsockname())
            gone_peer, _ = server.accept()
        held = dict(gloo._held)
        assert client.fileno() in held and gone.fileno() in held, held
        assert accepted.fileno() not in held and listener.fileno() not in held, held
        gone_fd = gone.fileno()
        gone.close()
        reused = socket.create_connection(server.getsockname())  # may take the closed number
        reused_peer, _ = server.accept()
        assert gloo.release() == 1 and len(gloo) == 2
        accepted.settimeout(5)
        assert accepted.recv(1) == b""  # the peer sees the connection end
        with pytest.raises(OSError):
            client.send(b"x")
        reused.send(b"y")  # whatever holds the closed number is untouched
        assert reused_peer.recv(1) == b"y", (gone_fd, reused.fileno())
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):  # still listening (accept waits, does not fail)
            listener.accept()
        gloo.forget()
        assert len(gloo) == 0
        for s in (listener, client, accepted, gone_peer, reused, reused_peer):
            s.close()
    finally:
        server.close()
