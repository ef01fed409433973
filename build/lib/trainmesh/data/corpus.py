"""A tiny synthetic corpus the project generates itself, so the demo downloads nothing.

Sentences come from a small grammar with strong regularities (agreement, fixed word order,
a closed vocabulary), so a small model visibly learns: loss falls from ln(257) ≈ 5.5 nats
towards ~1 within a few hundred steps.
"""

from __future__ import annotations

import random

_SUBJECTS = ["the cat", "the dog", "a bird", "the old man", "my sister", "the robot", "a fox",
             "the teacher", "our neighbour", "the small child"]
_VERBS = ["sees", "likes", "follows", "finds", "paints", "helps", "watches", "greets"]
_OBJECTS = ["the red ball", "a green tree", "the river", "a quiet house", "the blue sky",
            "an open door", "the tall tower", "a warm fire"]
_PLACES = ["in the park", "at night", "by the sea", "after school", "in the morning",
           "near the hill"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.5:
        s += f" {rng.choice(_PLACES)}"
    return s[0].upper() + s[1:] + "."


def documents(num_docs: int = 400, seed: int = 1234) -> list[str]:
    """``num_docs`` short paragraphs, identical for the same seed on every machine."""
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(3, 8))) for _ in range(num_docs)]
