"""A checkpoint's files are written without torch's zip CRC32s: a process-wide option of torch's,
so turned off while any file is written and restored after the last."""

from __future__ import annotations

import contextlib
import threading

import torch

_crc = threading.Lock()
_crc_writers = [0, True]  # files being written under without_zip_crc; the option before the first


@contextlib.contextmanager
def without_zip_crc():
    """While a checkpoint file is written: ``torch.save`` (DCP's serialisation of each tensor)
    computes no zip CRC32 of its records. ``torch.load`` never checks them (measured, torch
    2.13: a flipped byte in a tensor's data loads silently), so they guarded nothing on the
    way back, and the pass cost more than the write itself (64 MiB to memory: 0.111 s with it,
    0.044 s without). A storage checkpoint's files are guarded by their sha256, kept in the
    manifest: taken as they are written (``_Digest``: a background save, a URI) or read back
    after a synchronous save (``save``; until then, and if a failure comes first, by size).
    (Python's ``zipfile`` and ``unzip -t`` reject records with CRC 0: DCP's shard files are not
    zips to them anyway.)

    The option is process-wide (torch has no per-call one): counted over the files being
    written from any thread, restored after the last unless someone else changed it
    meanwhile. Any other ``torch.save`` in the process while a checkpoint is written, a
    background save's whole write included, writes no CRCs either."""
    entered = False
    try:
        with _crc:
            if _crc_writers[0] == 0:
                _crc_writers[1] = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            _crc_writers[0] += 1
            entered = True
        yield
    finally:
        if entered:
            with _crc:
                _crc_writers[0] -= 1
                if _crc_writers[0] == 0 and torch.serialization.get_crc32_options() is False:
                    torch.serialization.set_crc32_options(_crc_writers[1])
