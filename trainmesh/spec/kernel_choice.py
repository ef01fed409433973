"""Which implementation each fused op runs: ``model.kernels`` and what ``auto`` means on a device.

``model.kernels`` is ``auto``, ``triton`` or ``torch`` (every op), or a mapping of some ops to
``triton`` | ``torch`` (the ops not named take ``auto``'s choice). ``auto`` takes, per device
class, what the GPU check kit measured fastest (``MEASURED``: forward + backward at model
shapes in bf16, with the date and device of the measurement) — against eager torch, or with
``model.compile`` against torch.compile of the reference (what the torch path then is); on a
device class without a measurement, and off CUDA, the torch references. So ``auto`` never
picks a path that was measured slower than the torch path it replaces (at the kit's shapes
and dtype). The kit prints a new entry for the device it ran on (``bench/kernels.py``).

Torch-free: the planner reads it too (which ops keep fewer activations, whether the loss
materialises the logits).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

OPS = ("rms_norm", "swiglu", "rope", "linear_cross_entropy")
IMPLS = ("triton", "torch")
MODES = ("auto", "triton", "torch")
# model.compile compiles the transformer blocks only: the loss after them runs eagerly.
OUTSIDE_BLOCKS = ("linear_cross_entropy",)
# A kernel is taken only when measured this much faster: the kit's timings of one op moved by
# up to 2× between runs on one GPU (RMSNorm on the H200, 2026-11-26); a tie stays on torch.
MARGIN = 1.05


@dataclass(frozen=True)
class Measurement:
    """One GPU check kit run: each op's speed-up over the torch reference (forward +
    backward, median), and where and when it was measured."""

    date: str
    device: str
    speedup: Mapping[str, float]  # op → eager torch's time / triton's time
    over_compiled: Mapping[str, float]  # op → torch.compile's time / triton's time

    def ratio(self, op: str, compiled: bool = False) -> float:
        """The torch path's time over triton's for ``op`` (0 when not measured)."""
        ratios = self.over_compiled if compiled and op not in OUTSIDE_BLOCKS else self.speedup
        return ratios.get(op, 0.0)

    def choice(self, compiled: bool = False) -> dict[str, str]:
        """The faster of triton and the torch path for every op (torch unless triton was
        measured at least ``MARGIN`` times faster)."""
        return {op: "triton" if self.ratio(op, compiled) >= MARGIN else "torch" for op in OPS}


MEASURED: dict[str, Measurement] = {
    # bench/history/journal.md, "GPU check kit on an H100, 2026-11-27": same shapes, with the rewritten
    # RoPE and fused loss (the entry before them, 2026-11-23: the loss at 0.32× eager, RoPE
    # 1.34×). Against torch.compile SwiGLU ties; the loss is judged against eager (it runs
    # after the compiled blocks).
    "h100": Measurement("2026-11-27", "one NVIDIA H100 80GB HBM3",
                        {"rms_norm": 4.07, "swiglu": 1.74, "rope": 4.94,
                         "linear_cross_entropy": 1.54},
                        {"rms_norm": 1.62, "swiglu": 1.00, "rope": 1.37,
                         "linear_cross_entropy": 0.95}),
    # bench/history/journal.md, "GPU check kit, 2026-11-26": same shapes; each ratio the median of
    # that day's three kernel runs (RoPE: its one run after the rewrite; RMSNorm's ratio to
    # torch.compile ranged 0.77-2.58 between runs). The fused loss, rewritten (rows streamed
    # in 32k blocks, chunks of 8× h), runs at 1.19× eager in 0.05× its memory.
    "h200": Measurement("2026-11-26", "one NVIDIA H200",
                        {"rms_norm": 6.47, "swiglu": 1.77, "rope": 5.36,
                         "linear_cross_entropy": 1.19},
                        {"rms_norm": 1.13, "swiglu": 1.00, "rope": 1.21,
                         "linear_cross_entropy": 0.96}),
}

# A CUDA device name (torch.cuda.get_device_name) or the planner's device name → its class: the
# model number as a whole word ("NVIDIA GH200" is not an H200, "RTX A1000" not an A100).
_CLASSES = {c: re.compile(rf"(?<![A-Z0-9]){c.upper()}(?![0-9])") for c in
            ("h100", "h200", "b200", "a100", "l40s")}


def device_class(name: str) -> str | None:
    """"NVIDIA H100 80GB HBM3" or "h100" → "h100"; None for a device not in the table's terms."""
    upper = name.upper()
    return next((c for c, pattern in _CLASSES.items() if pattern.search(upper)), None)


def kernel_problems(kernels: object) -> list[str]:
    """What is wrong with a ``model.kernels`` value (empty when it is valid)."""
    if isinstance(kernels, str):
        return [] if kernels in MODES else [f"{kernels!r}; use one of {', '.join(MODES)} or a "
                                            f"mapping of {', '.join(OPS)} to triton|torch"]
    if not isinstance(kernels, Mapping):
        return [f"{kernels!r}; use one of {', '.join(MODES)} or a mapping of ops to triton|torch"]
    out = [f"unknown op {op!r}; the ops are {', '.join(OPS)}" for op in kernels if op not in OPS]
    out += [f"{op}: {impl!r}; use triton or torch" for op, impl in kernels.items()
            if op in OPS and impl not in IMPLS]
    return out


def choose(kernels: str | Mapping[str, str], device_type: str, device_name: str = "",
           compiled: bool = False) -> dict[str, str]:
    """Each op's implementation on a device (``device_type`` cuda | cpu | …; ``device_name``:
    what identifies the GPU; ``compiled``: ``model.compile``, the torch path compiled)."""
    broken = kernel_problems(kernels)
    if broken:
        raise ValueError(f"model.kernels: {broken[0]}")
    auto = {op: "torch" for op in OPS}
    if device_type == "cuda":
        measured = MEASURED.get(device_class(device_name) or "")
        if measured is not None:
            auto = measured.choice(compiled)
    if isinstance(kernels, str):
        return auto if kernels == "auto" else {op: kernels for op in OPS}
    return {**auto, **kernels}


def key(choice: Mapping[str, str]) -> str:
    """A choice as one string: "torch" or "triton" when every op agrees, else
    "rms_norm=triton,swiglu=triton,rope=triton,linear_cross_entropy=torch"."""
    impls = {choice[op] for op in OPS}
    if len(impls) == 1:
        return impls.pop()
    return ",".join(f"{op}={choice[op]}" for op in OPS)


def parse_key(name: str) -> dict[str, str]:
    """``key``'s inverse."""
    if name in IMPLS:
        return {op: name for op in OPS}
    out = dict(part.split("=", 1) for part in name.split(","))
    if set(out) != set(OPS) or not set(out.values()) <= set(IMPLS):
        raise ValueError(f"kernel set {name!r}: give every op of {', '.join(OPS)} as triton|torch")
    return out


def fused_ops(kernels: str | Mapping[str, str], device_name: str,
              compiled: bool = False) -> frozenset[str]:
    """The ops that run as Triton kernels for the planner's ``device_name`` ("h100", "cpu" …)."""
    device_type = "cpu" if device_name == "cpu" else "cuda"
    return frozenset(op for op, impl in choose(kernels, device_type, device_name,
                                               compiled).items() if impl == "triton")
