"""gloo's connections ended at an abort (``actors/gloo_sockets.py``): a rank blocked in a gloo
sub-group collective whose peer is silent — alive, its connections open, never entering the
call: a frozen node, or a survivor that left the collective for a recovery — is released by
shutting its own connections down, and a peer's shutdown releases it too; either way the
process re-forms a group and goes on (no process restart). Without this, the blocked call
ends only at the collective timeout (60 s here: a release that failed shows as gloo's timeout
error, not as a slow pass). Three real gloo processes, no Ray."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import pytest

from trainmesh.actors.gloo_sockets import GlooSockets

TIMEOUT = timedelta(seconds=60)


def _store(rank: int, world: int, ports):
    """A TCPStore on an OS-chosen port (rank 0's, made before the groups form, as the rank
    worker does), its port passed to the others."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=TIMEOUT)
        for _ in range(world - 1):
            ports.put(store.port)
        return store
    return dist.TCPStore("127.0.0.1", ports.get(timeout=60), world, is_master=False, timeout=TIMEOUT)


def _rank(rank: int, ports, events, out) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    try:
        t = torch.ones(4)
        for phase in (0, 1):  # 0: rank 0 releases itself; 1: its peer releases it
            gloo = GlooSockets()
            store = _store(rank, 3, ports[phase])
            with gloo.opened():  # the default group and a mesh dimension's, as RankWorker forms them
                dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=TIMEOUT)
                sub = dist.new_group([0, 1], timeout=TIMEOUT)
            dist.all_reduce(t)
            if rank < 2:
                dist.all_reduce(t, group=sub)
            dist.barrier()
            if rank == 0:
                entering = threading.Event()
                times = {}

                def release(g=gloo, phase=phase, entering=entering, times=times):
                    entering.wait(60)
                    time.sleep(0.5)  # (the call below is blocked by then)
                    times["released"] = time.monotonic()
                    if phase == 0:  # silent peer: rank 0's own abort ends its call
                        out.put(("released", g.release()))
                    else:
                        events["release"].set()  # rank 1 shuts its side
                        events["released"].wait(60)

                helper = threading.Thread(target=release)
                helper.start()
                entering.set()
                start = time.monotonic()
                try:
                    dist.all_reduce(t, group=sub)
                    out.put((f"phase {phase}", "returned", 0.0, 0.0))
                except RuntimeError as err:
                    end = time.monotonic()
                    helper.join()
                    out.put((f"phase {phase}", str(err), times["released"] - start,
                             end - times["released"]))
                events[f"done{phase}"].set()
            elif rank == 1:
                if phase == 1:
                    events["release"].wait(60)
                    out.put(("peer released", gloo.release()))
                    events["released"].set()
                events[f"done{phase}"].wait(120)  # silent until rank 0 is out of its call
            dist.destroy_process_group()
            del store, sub
        # the same processes form a new group and compute (what a warm recovery does)
        store = _store(rank, 3, ports[2])
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
    out, ports = ctx.Queue(), [ctx.Queue() for _ in range(3)]
    events = {k: ctx.Event() for k in ("release", "released", "done0", "done1")}
    procs = [ctx.Process(target=_rank, args=(r, ports, events, out)) for r in range(3)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 240
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    got: dict[str, object] = {}
    while not out.empty():
        item = out.get()
        got[item[0]] = item[1:]
    assert not [k for k in got if k.startswith("error")], got
    assert [p.exitcode for p in procs] == [0, 0, 0], (got, [p.exitcode for p in procs])
    for phase in ("phase 0", "phase 1"):
        why, blocked_s, after_s = got[phase]
        # on the closed connection (not at the timeout), after being blocked half a second
        assert "Connection closed" in why and "Timed out" not in why, why
        assert blocked_s >= 0.4 and after_s < TIMEOUT.total_seconds() / 2, got[phase]
    assert got["released"][0] > 0 and got["peer released"][0] > 0, got
    assert [got[f"re-formed {r}"][0] for r in range(3)] == [[6.0, 6.0]] * 3, got


def test_only_connections_the_formation_opened_are_tracked_and_released():
    """A connection accepted on a server listening before (Ray's, an actor call arriving) and a
    listener opened inside (gloo's: shutting it makes gloo end the process) are left alone; a
    connection opened inside is shut down in both directions; a descriptor closed since is not
    touched though a new socket now holds its number; a formation still running when the
    release comes has its connections so far shut too."""
    gloo = GlooSockets()
    server = socket.create_server(("127.0.0.1", 0))
    opened = []
    try:
        with gloo.opened():
            listener = socket.create_server(("127.0.0.1", 0))  # (gloo's own listener)
            client = socket.create_connection(server.getsockname())  # (a group's connection)
            accepted, _ = server.accept()  # (Ray's server side)
            gone = socket.create_connection(server.getsockname())
            gone_peer, _ = server.accept()
        opened += [listener, client, accepted, gone, gone_peer]
        assert {client.fileno(), gone.fileno()} == set(gloo._held), gloo._held
        gone_fd = gone.fileno()
        gone.close()
        reused = socket.create_connection(server.getsockname())  # the lowest free number
        reused_peer, _ = server.accept()
        opened += [reused, reused_peer]
        assert reused.fileno() == gone_fd
        with gloo.opened():  # a formation the release interrupts
            late = socket.create_connection(server.getsockname())
            late_peer, _ = server.accept()
            opened += [late, late_peer]
            assert gloo.release() == 2 and len(gloo) == 2  # client and late, not reused
        for peer in (accepted, late_peer):  # the other end sees each connection end
            peer.settimeout(5)
            assert peer.recv(1) == b""
        with pytest.raises(OSError):
            client.send(b"x")
        reused.send(b"y")  # whatever holds the closed number is untouched
        reused_peer.settimeout(5)
        assert reused_peer.recv(1) == b"y"
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):  # still listening (accept waits, does not fail)
            listener.accept()
        gloo.forget()
        assert len(gloo) == 0
    finally:
        for s in (*opened, server):
            s.close()
