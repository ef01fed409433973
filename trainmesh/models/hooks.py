"""What a model family adds to the step that trains it, so that the step knows no family.

A model supplies its :class:`ModelHooks` (``Llama.step_hooks``): the step calls
``before_microbatch(weight)`` when a microbatch's share of the step's loss changes (an
auxiliary loss, such as MoE's balancing loss or a multi-token prediction loss, takes the same
share), and ``after_update()`` after the optimizer step (router biases move; it returns
statistics per block for the run's metrics), and ``losses()`` once a step (the auxiliary
losses to log beside the loss). A family without one leaves it None."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelHooks:
    before_microbatch: Callable[[float], None] | None = None
    after_update: Callable[[], dict] | None = None
    # the step's auxiliary losses by name (this rank's microbatches, weighted as the loss is:
    # averaged over the replicas as the loss is), taken once per step
    losses: Callable[[], dict[str, float]] | None = None

    def then_after_update(self, more: Callable[[], None]) -> ModelHooks:
        """These hooks with ``more`` run after the optimizer step, before ``after_update``."""
        after = self.after_update

        def run() -> dict:
            more()
            return after() if after is not None else {}
        return ModelHooks(self.before_microbatch, run, self.losses)
