"""Several decoding runs stepped in turn, so that the configurations compared on one question meet the same
moments of the machine.

On a shared CPU the speed drifts over seconds: consecutive replay records share a slow or fast spell (their
step times correlate 0.5-0.6 at lag 1 and still ~0.2 ten records apart on the development VM), so a
configuration timed one whole answer after another measures the spell it happened to fall in as much as its
own cost, and 40 questions leave a ratio of two configurations a few per cent off (the HumanEval replay of
docs/reports/lockstep.md). Taking one step of each in turn puts every configuration into every
spell alike; each run counts only its own time (``MedusaDecoder.generate_steps``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


def lockstep(runs: Mapping[K, Generator[None, None, R]], seed: str, on_done: Callable[[K, R], None]) -> None:
    """Advance every run by one step per round, in an order shuffled afresh each round (seeded by ``seed``:
    no run always follows the same neighbour), until all have finished; ``on_done(key, result)`` is called as
    each finishes, with the generator's return value, so a finished run is kept even if a later one fails."""
    live = dict(runs)
    order = random.Random(seed)
    while live:
        keys = list(live)
        order.shuffle(keys)
        for key in keys:
            try:
                next(live[key])
            except StopIteration as done:
                del live[key]
                on_done(key, done.value)
