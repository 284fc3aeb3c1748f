"""Faults on purpose: steps that raise and requests that fail, chosen by number, for tests and drills.

``spark serve`` reads them from ``SPARK_FAULTS`` (``ServeConfig.faults``), e.g.
``step=3,7;request=5``: the 3rd and the 7th engine steps raise, as an out-of-memory
would, and every 5th request the core admits fails at its first result. What they
hit ends with an error in its API's shape; every other request finishes, and the
pages come back.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Faults:
    steps: frozenset[int] = frozenset()  # launches (counted from 1) that raise
    every_nth_request: int = 0  # admissions (counted from 1) of which every nth fails; 0: none

    @property
    def any(self) -> bool:
        return bool(self.steps or self.every_nth_request)

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        """``"step=3,7;request=5"`` (either part may be left out; "" is no faults).

        Raises:
            ValueError: the spec is not of that form.
        """
        steps, every = frozenset(), 0
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            key, _, value = part.partition("=")
            try:
                numbers = [int(v) for v in value.split(",")]
            except ValueError:
                raise ValueError(f"faults: {part!r} is not NAME=NUMBER[,NUMBER...]") from None
            if any(n < 1 for n in numbers):
                raise ValueError(f"faults: {part!r}: numbers count from 1")
            if key.strip() == "step":
                steps = frozenset(numbers)
            elif key.strip() == "request" and len(numbers) == 1:
                every = numbers[0]
            else:
                raise ValueError(f"faults: {part!r}: expected step=N[,N...] or request=N")
        return cls(steps, every)


class InjectedFault(RuntimeError):
    """A step that was told to fail."""
