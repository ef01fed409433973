"""A problem with a job spec, as one line a person can act on: ``field.path: what is wrong; what
to do``. Spec loading, the rules for what a mesh can run and the pre-run checks all speak it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    path: str  # the field (or file, or flag) at fault
    what: str
    fix: str
    kind: str = ""  # a rule's family, e.g. "divisibility" (the planner's rejection reasons)

    def __str__(self) -> str:
        return f"{self.path}: {self.what}; {self.fix}"


class SpecError(ValueError):
    """One or more problems with a job spec."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))
