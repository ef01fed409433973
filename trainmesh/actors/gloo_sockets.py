"""gloo's connections, so that an abort can end them.

gloo has no abort (torch 2.13: ``ProcessGroupGloo.abort`` does nothing): a rank blocked in a
gloo collective whose peer froze, or left that collective for a recovery, waits until the
collective timeout. Destroying the group does not help while the blocked call holds it, and a
peer blocked on a sub-group with this rank is released only by this process's death. Shutting
the group's TCP connections down (``shutdown``, not ``close``: gloo keeps owning the
descriptors and closes them when the group is destroyed) ends a blocked receive on both ends at
once: this rank's call raises, and so does every peer's call that waits on this rank (measured,
torch 2.13: 1 ms after the shutdown, against the peer's death or the timeout before). The
process stays usable: its groups are destroyed and new ones formed (warm recovery).

Which sockets are gloo's: those a group's formation opened in this process (``opened``), minus
listening ones (gloo's listener must stay: shutting it makes its accept fail, and gloo then ends
the process) and minus connections accepted on a server that was already listening (Ray's own,
e.g. an actor call arriving meanwhile). NCCL's communicators have their own abort; only gloo
groups are tracked (on a GPU job: the background save's group)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

FD_DIR = "/proc/self/fd"  # Linux: the process's descriptors (elsewhere nothing is tracked)


def _tcp() -> dict[int, tuple[str, int, bool]]:
    """This process's TCP sockets: {fd: (its socket:[inode] link, local port, listening)}."""
    out: dict[int, tuple[str, int, bool]] = {}
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return out
    for name in names:
        fd = int(name)
        try:
            link = os.readlink(f"{FD_DIR}/{name}")
            if not link.startswith("socket:"):
                continue
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                out[fd] = (link, s.getsockname()[1],
                           bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)))
        except OSError:
            pass
        finally:
            s.detach()  # the descriptor stays its owner's
    return out


class GlooSockets:
    """The connections of this process's gloo groups (``opened`` around their formation),
    shut down by ``release`` at an abort and forgotten once the groups are destroyed."""

    def __init__(self) -> None:
        self._held: dict[int, str] = {}  # fd: its socket:[inode] link when the group opened it

    @contextmanager
    def opened(self) -> Iterator[None]:
        """Track the connections the enclosed group formation opens."""
        before = _tcp()
        servers = {port for _, port, listening in before.values() if listening}
        try:
            yield
        finally:
            for fd, (link, port, listening) in _tcp().items():
                new = fd not in before or before[fd][0] != link
                if new and not listening and port not in servers:
                    self._held[fd] = link

    def release(self) -> int:
        """Shut every tracked connection down (both directions); returns how many. One whose
        descriptor was closed since (its number maybe reused) is left alone."""
        n = 0
        for fd, link in self._held.items():
            try:
                if os.readlink(f"{FD_DIR}/{fd}") != link:
                    continue
                s = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:  # not connected any more: nothing to end
                pass
            finally:
                s.detach()
        return n

    def forget(self) -> None:
        """The groups were destroyed (their descriptors closed)."""
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
