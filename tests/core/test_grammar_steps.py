"""A constrained request in the step loop (issue 21): every chunk of it that samples carries its
matcher's mask, the matcher sees each collected token in order, and the pipelined step planned before
its last token is known carries ``mask_later``: its mask, which depends on that token, is filled once it is
collected and handed to the engine before it samples."""

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
        self.kw, self.made, self.batches = kw, [], []

    def matcher(self, spec: GrammarSpec):
        if spec.source == "bad":
            raise ValueError("no such grammar")
        self.made.append(RecordingMatcher(**self.kw))
        return self.made[-1]

    def masks(self, matchers):
        self.batches.append(len(matchers))
        return [m.mask() for m in matchers]

    def accept(self, matchers, token_ids):
        return [m.accept(t) for m, t in zip(matchers, token_ids)]


def _core(depth: int, **kw) -> tuple[Core, Grammars]:
    core, _ = make("fifo", num_pages=256, page_size=4, depth=depth)
    core.grammars = Grammars(**kw)
    return core, core.grammars


def test_a_constrained_row_stays_in_every_pipelined_step_with_its_mask_filled_late():
    """Depth 2: the step planned while the row's last token is still being sampled carries
    ``mask_later``; its mask is filled once that token is collected, before the engine samples (so the
    matcher has seen every token before each mask), and the row decodes in every step, not every other."""
    core, grammars = _core(depth=2)
    engine = core.engine
    params = SamplingParams(temperature=0.0, max_tokens=12)
    core.submit("json", list(range(1, 10)), params, 0.0, grammar=GrammarSpec("json_schema", "{}"))
    core.submit("free", list(range(1, 10)), params, 0.0)
    log: list[tuple] = []
    launch, sample_late = engine.launch, engine.sample_late

    def launched(plan):
        rows = {c.seq_id: c for c in plan.chunks}
        log.append(("launch", rows.get("json"), rows.get("free")))
        launch(plan)

    def sampled(masks):
        log.append(("sample_late", dict(masks), len(grammars.made[0].accepted)))
        sample_late(masks)

    engine.launch, engine.sample_late = launched, sampled
    outputs, reasons = drive(core)
    matcher = grammars.made[0]
    assert matcher.accepted == outputs["json"] and len(outputs["json"]) == 12 == len(outputs["free"])
    assert matcher.masks == 12  # one per sampled token
    launches = [entry for entry in log if entry[0] == "launch"]
    assert all(free is None or (free.token_mask is None and not free.mask_later) for _, _, free in launches)
    json_chunks = [c for _, c, _ in launches if c is not None]
    # in every step: 12 tokens, and one step planned past its end (the engine drops it)
    assert len(json_chunks) == len(launches) == 13
    assert json_chunks[0].token_mask is not None and not json_chunks[0].mask_later  # nothing in flight yet
    assert all(c.mask_later and c.token_mask is None for c in json_chunks[1:])
    late = [entry for entry in log if entry[0] == "sample_late"]
    # each late mask is filled once the token before it was accepted: after k tokens, for the (k+1)-th;
    # the step past the end gets none (the request ended: its matcher is gone)
    assert [set(masks) for _, masks, _ in late] == [{"json"}] * 11 + [set()]
    assert [accepted for _, _, accepted in late] == list(range(1, 13))
    assert all(entry[0] == "sample_late" for prev, entry in zip(log, log[1:]) if prev[0] == "launch" and prev[1]
               and prev[1].mask_later)  # nothing launches between a late launch and its masks
    assert grammars.batches and max(grammars.batches) == 1


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
