"""A constrained request in the step loop (issue 21): every chunk of it that samples carries its
matcher's mask, the matcher sees each collected token in order, and the pipelined step planned before
its last token is known leaves it out (the mask of a token depends on the token before)."""

from __future__ import annotations

from spark.core.core import Core
from spark.core.events import Failed
from spark.core.grammar import GrammarSpec
from spark.engine.sampling import SamplingParams
from tests.core.test_scheduler import drive, make


class RecordingMatcher:
    def __init__(self, refuse_after: int | None = None):
        self.accepted: list[int] = []
        self.masks = 0
        self.refuse_after = refuse_after

    def mask(self) -> bytes:
        self.masks += 1
        return b"\xff" * 125  # all 1000 tokens allowed

    def accept(self, token_id: int) -> bool:
        if self.refuse_after is not None and len(self.accepted) >= self.refuse_after:
            return False
        self.accepted.append(token_id)
        return True


class Grammars:
    def __init__(self, **kw):
        self.kw, self.made = kw, []

    def matcher(self, spec: GrammarSpec):
        if spec.source == "bad":
            raise ValueError("no such grammar")
        self.made.append(RecordingMatcher(**self.kw))
        return self.made[-1]


def _core(depth: int, **kw) -> tuple[Core, Grammars]:
    core, _ = make("fifo", num_pages=256, page_size=4, depth=depth)
    core.grammars = Grammars(**kw)
    return core, core.grammars


def test_a_constrained_row_carries_its_mask_and_never_has_two_tokens_in_flight():
    core, grammars = _core(depth=2)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    core.submit("json", list(range(1, 10)), params, 0.0, grammar=GrammarSpec("json_schema", "{}"))
    core.submit("free", list(range(1, 10)), params, 0.0)
    in_flight: list[int] = []

    def watch(plan, _running):
        masked = [c for c in plan if c.seq_id == "json" and c.token_mask is not None]
        assert all(c.token_mask is None for c in plan if c.seq_id == "free")
        in_flight.append(len(masked))

    outputs, reasons = drive(core, on_plan=watch)
    matcher = grammars.made[0]
    assert matcher.accepted == outputs["json"] and len(outputs["json"]) == 12 == len(outputs["free"])
    assert matcher.masks == 12  # one per sampled token
    assert all(a + b <= 1 for a, b in zip(in_flight, in_flight[1:]))  # never in two consecutive (pipelined) steps


def test_a_token_the_grammar_refuses_ends_the_constraint_and_a_bad_grammar_fails_at_once():
    """A refused token means the engine did not apply the mask (a replaying double): the request goes on
    unconstrained, so that the checks after generation (tool_choice) still answer for it."""
    core, grammars = _core(depth=1, refuse_after=3)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    core.submit("strict", [1, 2, 3], params, 0.0, grammar=GrammarSpec("json_schema", "{}"))
    core.submit("broken", [1, 2, 3], params, 0.0, grammar=GrammarSpec("json_schema", "bad"))
    outputs, reasons = drive(core)
    assert reasons == {"strict": "length", "broken": "error"} and "broken" not in outputs
    assert len(outputs["strict"]) == 12 and grammars.made[0].masks == 4  # 3 accepted, the 4th refused
    assert not core._matchers
    assert core.scheduler.allocator.num_used == 0
