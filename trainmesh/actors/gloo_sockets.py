"""gloo's connections, so that an abort can end them.

gloo has no abort (torch 2.13: ``ProcessGroupGloo.abort`` does nothing): a rank blocked in a
gloo collective whose peer froze, or left that collective for a recovery, waits until the
collective timeout. Destroying the group does not help while the blocked call holds it, and a
peer blocked on a sub-group with this rank is released only by this process's death. Shutting
the group's TCP connections down (``shutdown``, not ``close``: gloo keeps owning the
descriptors and closes them when the group is destroyed) ends a blocked receive on both ends at
once: this rank's call raises ("Connection closed by peer"), and so does every peer's call that
waits on this rank (measured, torch 2.13: within a millisecond of the shutdown, against the
peer's death or the timeout before). The process stays usable: its groups are destroyed and new
ones formed (warm recovery). A write to a shut connection fails with EPIPE, which Python's
default SIGPIPE handling (ignored) turns into an error gloo reports, not a signal.

Which sockets are gloo's: the TCP connections opened while a group forms (``opened``: the rank
does nothing else then — the default group, the mesh's groups and the background save's, formed
together), minus listening sockets (gloo's listener must stay: its failed accept ends the
process) and minus connections accepted on a server that was listening before (Ray's, an actor
call arriving meanwhile). A connection Ray itself happened to open in that window (a reconnect
to the GCS) would be shut at an abort too: it reconnects, as after any network error. NCCL's
communicators have their own abort: only gloo groups are tracked (on a GPU job: the background
save's group). With ``TORCH_GLOO_LAZY_INIT=1`` gloo connects at a group's first use instead and
nothing is tracked: a rank stuck then is killed after the controller's grace, as before."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

FD_DIR = "/proc/self/fd"  # Linux: the process's descriptors (elsewhere nothing is tracked)


def _tcp() -> dict[int, tuple[int, int, bool]]:
    """This process's TCP sockets: {fd: (inode, local port, listening)}."""
    out: dict[int, tuple[int, int, bool]] = {}
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return out
    for name in names:
        fd = int(name)
        try:
            if not os.readlink(f"{FD_DIR}/{name}").startswith("socket:"):
                continue
            inode = os.fstat(fd).st_ino
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                out[fd] = (inode, s.getsockname()[1],
                           bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)))
        except OSError:
            pass
        finally:
            s.detach()  # the descriptor stays its owner's
    return out


def _new_connections(before: dict, after: dict) -> dict[int, int]:
    """{fd: inode} of the connections in ``after`` that ``before`` lacks, except listeners and
    those accepted on a server listening in ``before``."""
    servers = {port for _, port, listening in before.values() if listening}
    return {fd: inode for fd, (inode, port, listening) in after.items()
            if (fd not in before or before[fd][0] != inode) and not listening
            and port not in servers}


class GlooSockets:
    """The connections of this process's gloo groups (``opened`` around their formation),
    shut down by ``release`` at an abort and forgotten once the groups are destroyed. Safe to
    release from another thread while a formation runs (its connections so far are shut too)."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # fd: the socket's inode when its group opened it
        self._forming: dict | None = None  # the sockets before the formation now running
        self._lock = threading.Lock()

    @contextmanager
    def opened(self) -> Iterator[None]:
        """Track the connections the enclosed group formation opens."""
        before = _tcp()
        with self._lock:
            self._forming = before
        try:
            yield
        finally:
            new = _new_connections(before, _tcp())
            with self._lock:
                self._held.update(new)
                self._forming = None

    def release(self) -> int:
        """Shut every tracked connection down (both directions), and those of a formation still
        running; returns how many. A descriptor closed since is left alone, whatever now holds
        its number (the check and the shutdown act on a duplicate: no race)."""
        with self._lock:
            held = dict(self._held)
            if self._forming is not None:
                held.update(_new_connections(self._forming, _tcp()))
        n = 0
        for fd, inode in held.items():
            try:
                dup = os.dup(fd)
            except OSError:  # closed since
                continue
            try:
                if os.fstat(dup).st_ino != inode:
                    continue
                s = socket.socket(fileno=dup)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                except OSError:  # not connected any more: nothing to end
                    pass
                finally:
                    s.detach()
            finally:
                os.close(dup)  # (the connection stays open on the owner's descriptor)
        return n

    def forget(self) -> None:
        """The groups were destroyed (their descriptors closed)."""
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
