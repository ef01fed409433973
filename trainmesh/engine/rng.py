"""Each rank's random streams, saved and restored with its checkpoints and snapshots.

A rank has two streams:

- torch's global generators (the CPU one and, on a GPU, the device's): what dropout inside
  attention and ``F.dropout`` draw from. Distinct on every rank, tensor-parallel peers
  included, since their heads (and under sequence parallel their tokens) differ.
- the *replica* stream, one ``torch.Generator`` shared by the tensor-parallel peers: residual
  dropout on the activations tensor parallel replicates (no sequence parallel) must drop the
  same elements on every peer, or the replicas diverge (``models/llama/model.py``).

At a run's start each stream is seeded from ``training.seed``, the step and the rank's
coordinates (``seeded``). A checkpoint or snapshot holds every rank's states keyed by its
coordinates and the mesh (``job_states``); a restore onto the same mesh sets them exactly, so a
run interrupted and resumed draws what the uninterrupted run drew. On another mesh the saved
states belong to coordinates that no longer exist: each rank's are derived from the step and
its new coordinates, the same way as at a start.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass

import torch

from trainmesh.checkpoint.rng_states import ORDER, coords_key


def derived_seed(seed: int, step: int, coords: dict[str, int], stream: str) -> int:
    """A 63-bit seed for ``stream`` of the rank at ``coords`` from ``step`` on."""
    key = json.dumps([seed, step, stream, [coords.get(a, 0) for a in ORDER]]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


@dataclass
class RankStreams:
    """The streams of the rank at ``coords`` of a mesh of ``layout`` (``ParallelDims.as_dict``)."""

    seed: int
    coords: dict[str, int]
    layout: dict[str, int]
    device: torch.device

    def __post_init__(self) -> None:
        self.replica = torch.Generator()  # on the host: its seeds need no device sync

    def seeded(self, step: int) -> None:
        """Both streams from ``training.seed``, ``step`` and the coordinates (tensor-parallel
        peers share the replica stream: it leaves the tp coordinate out)."""
        torch.manual_seed(derived_seed(self.seed, step, self.coords, "rank"))
        shared = {a: c for a, c in self.coords.items() if a != "tp"}
        self.replica.manual_seed(derived_seed(self.seed, step, shared, "replica"))

    def state(self) -> dict:
        """This rank's states, to go into a checkpoint or snapshot (``job_states``)."""
        device = (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        return {"coords": coords_key(self.coords), "layout": dict(self.layout),
                "cpu": _b64(torch.random.get_rng_state()),
                "device": None if device is None else _b64(device),
                "replica": _b64(self.replica.get_state())}

    def restore(self, saved: bytes | None, step: int) -> bool:
        """This rank's states from ``saved`` (``job_states``) when it was taken on this mesh;
        else derived from ``step`` (``seeded``). Returns whether they were restored exactly."""
        mine = None
        if saved:
            got = json.loads(saved)
            if got.get("layout") == self.layout:
                mine = got.get("ranks", {}).get(coords_key(self.coords))
        if mine is None:
            self.seeded(step)
            return False
        torch.random.set_rng_state(_tensor(mine["cpu"]))
        if self.device.type == "cuda" and mine.get("device"):
            torch.cuda.set_rng_state(_tensor(mine["device"]), self.device)
        elif self.device.type == "cuda":  # taken on CPU ranks: the device's stream derived
            torch.cuda.manual_seed(derived_seed(self.seed, step, self.coords, "rank"))
        self.replica.set_state(_tensor(mine["replica"]))
        return True


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
