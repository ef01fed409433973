"""The file of a checkpoint (and the record of a snapshot) that holds every rank's random
streams (``engine/rng.py``), keyed by the rank's mesh coordinates. JSON; no torch here: the
controller writes it."""

from __future__ import annotations

import json

ORDER = ("pp", "dp", "cp", "tp")  # the coordinates, in the mesh's order


def coords_key(coords: dict[str, int]) -> str:
    return ".".join(f"{a}{coords.get(a, 0)}" for a in ORDER)


def job_states(states: list[dict]) -> bytes:
    """Every rank's ``RankStreams.state``, as one file of a checkpoint (JSON)."""
    layouts = {json.dumps(s["layout"], sort_keys=True) for s in states}
    if len(layouts) != 1:
        raise ValueError(f"RNG states of {len(layouts)} meshes in one save")
    return json.dumps({"layout": states[0]["layout"],
                       "ranks": {s["coords"]: {k: s[k] for k in ("cpu", "device", "replica")}
                                 for s in states}}, sort_keys=True).encode()


