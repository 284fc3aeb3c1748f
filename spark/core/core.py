"""The step loop, written once: admit -> schedule -> launch -> collect -> update.

``Core`` is synchronous and owns no thread: the actor host calls ``step`` in a busy
loop (in a thread beside the HTTP loop, or in the engine process), offline
``generate`` calls it until every prompt is done, and the tests call it on a fake
clock. Requests come in with ``submit`` and leave with ``cancel``; each ``step``
returns what happened as ``Opened`` / ``TokenBatch`` / ``Failed`` events.

Up to ``depth`` planned steps are launched at once: step N+1 is planned and launched
while the device runs step N, and N's tokens are read back only then. The scheduler
counts a planned step as done; what only the result can say (an end, the step's
time) is accounted when it is collected.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Hashable, Sequence

import attrs

from spark.core.events import CoreMetrics, Event, Failed, Opened, PrefixHit, StepShape, TokenBatch
from spark.core.faults import Faults, InjectedFault
from spark.core.grammar import Grammars, GrammarSpec, Matcher
from spark.core.interfaces import StepEngine
from spark.core.plan import Chunk, NewSequence, StepPlan, StepResult
from spark.core.scheduler import PrefixPin, Scheduler, SeqState
from spark.core.speculation import SpecConfig, Speculator

log = logging.getLogger("spark.core")

# Steps launched at once: the one the device runs and the one the host prepared behind it.
DEFAULT_DEPTH = 2


@attrs.frozen
class _Launched:
    chunks: tuple[Chunk, ...]
    at: float  # when it was launched
    error: str | None  # the launch raised
    prompt_marks: tuple[tuple[Hashable, int, int], ...] = ()  # (seq, tokens computed after it, epoch): prefills
    masked_later: tuple[Hashable, ...] = ()  # constrained rows whose masks it waits for (``sample_late``)
    speculated: tuple[tuple[Hashable, int], ...] = ()  # (seq, tokens drafted): decodes of speculating sequences
    traced: dict | None = None  # its shape and the policy's view when planned (``step_log`` only)



@attrs.frozen
class _Submitted:
    """A request submitted and not yet admitted, as ``Core.submit`` took it."""

    new: NewSequence
    arrival: float
    pins: tuple[PrefixPin, ...]
    grammar: GrammarSpec | None
    speculate: bool
    tbt: float | None
    score_prompt: bool = False

class Core:
    """A ``Scheduler`` and the ``StepEngine`` it plans for, stepped by whoever drives it.

    Args:
        engine: computes the plans.
        scheduler: owns the queues, the pages and the policy.
        depth: steps launched at once (1: no overlap of host and device).
        clock: seconds, for arrivals, deadlines and step times (a fake one in simulations).
        faults: steps to raise and requests to fail on purpose (``spark.core.faults``).
        grammars: builds the matchers of constrained requests (``spark.core.grammar``); None: a
            request with a grammar fails.
        speculation: how requests speculate (``spark.core.speculation``); None: none does.
        step_log: diagnostics: called with one dict per collected step (its shape, the context its
            rows attend to, what the policy predicted, the seconds it took); None: off.
    """

    def __init__(self, engine: StepEngine, scheduler: Scheduler, *, depth: int = DEFAULT_DEPTH,
                 clock: Callable[[], float] = time.perf_counter, faults: Faults = Faults(),
                 grammars: Grammars | None = None, speculation: SpecConfig | None = None,
                 step_log: Callable[[dict], None] | None = None):
        self.engine, self.scheduler = engine, scheduler
        self.step_log = step_log
        self.grammars = grammars
        self.speculator = Speculator(speculation) if speculation is not None else None
        self._matchers: dict[Hashable, Matcher] = {}
        self._sampling: dict[Hashable, int] = {}  # constrained: tokens launched, not yet collected
        self.faults = faults
        self._launches = 0
        self._admissions = 0
        self._doomed: set[Hashable] = set()  # requests a fault fails at their first result
        self.depth = max(1, depth)
        self.clock = clock
        self._pending: dict[Hashable, _Submitted] = {}  # submitted, not admitted
        self._active: set[Hashable] = set()  # admitted, not ended
        self._added: list[NewSequence] = []  # to register with the engine in the next plan
        self._removed: list[Hashable] = []  # the engine must forget
        self._reset: list[Hashable] = []  # preempted: the engine must recompute
        self._inflight: deque[_Launched] = deque()
        self._last_done = clock()
        self._queue_times: list[float] = []
        self._steps: list[StepShape] = []
        self._reported = (0, 0, 0)  # prefix cache totals at the last metrics snapshot
        self._reported_spec = (0, 0, 0, 0)  # speculation totals then

    # -- requests ---------------------------------------------------------
    def submit(self, request_id: Hashable, prompt_ids: Sequence[int], params, arrival: float | None = None,
               pins: Sequence[PrefixPin] = (), grammar: GrammarSpec | None = None, speculate: bool = True,
               tbt: float | None = None, score_prompt: bool = False) -> None:
        """Queue a request; it is admitted (``Opened``) when the batch has room. ``pins``: prefixes of
        it to keep cached for a while after it ends (prefix caching only); ``grammar``: what its
        output must follow; ``speculate``: False opts it out of speculation (a constrained request
        never speculates: its masks follow one token at a time); ``tbt``: its time-between-tokens
        target in seconds, for SLAI (None: the server's); ``score_prompt``: its params ask for
        prompt logprobs, so its prompt is computed whole (no cached prefix: each position is scored)."""
        arrival = self.clock() if arrival is None else arrival
        self._pending[request_id] = _Submitted(NewSequence(request_id, tuple(prompt_ids), params), arrival,
                                               tuple(pins), grammar, speculate, tbt, score_prompt)

    def cancel(self, request_id: Hashable) -> None:
        """End a request wherever it is (its pages are free for the next plan); unknown ids are ignored."""
        if self._pending.pop(request_id, None) is None and request_id in self._active:
            self._end(request_id, kept=True)

    def unpin(self, key: Hashable) -> None:
        """End the pin under ``key`` now (a stored Response was deleted); unknown keys are ignored."""
        self.scheduler.allocator.unpin(key)

    @property
    def busy(self) -> bool:
        """Whether a ``step`` has anything to do (telling the engine of ended requests included)."""
        return bool(self._pending or self._active or self._inflight or self._removed)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # -- the loop ---------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit, plan and launch up to ``depth`` steps, collect the oldest when it is due.

        A launch or a collect that raises fails only the requests of that step.
        """
        events: list[Event] = []
        self._admit(events)
        # Drafts need every token on the host: while sequences speculate, nothing is planned behind
        # a step in flight.
        depth = 1 if self._speculating() else self.depth
        launched = False
        while len(self._inflight) < depth and not self._blocked():
            if not self._launch_next(events):
                break
            launched = True
        if self._inflight and (len(self._inflight) >= depth or not launched or self._blocked()):
            self._collect_oldest(events)
        elif not self._inflight:
            self._unblock(events)
            self._flush_removals()
        return events

    def drain(self) -> list[Event]:
        """Collect every launched step (the engine may be closed after)."""
        events: list[Event] = []
        while self._inflight:
            self._collect_oldest(events)
        return events

    def metrics(self) -> CoreMetrics:
        """The gauges now, and the observations since the last call (which are then forgotten)."""
        s = self.scheduler
        totals = (s.prefix_queried, s.prefix_hit, s.allocator.evictions)
        queried, hit, evicted = (now - before for now, before in zip(totals, self._reported))
        self._reported = totals
        spec = ()
        if self.speculator is not None:
            c = self.speculator.counts
            now_spec = (c.drafted, c.accepted, c.steps, c.tokens)
            spec = tuple(now - before for now, before in zip(now_spec, self._reported_spec))
            self._reported_spec = now_spec
        snapshot = CoreMetrics(
            kv_pages_used=s.allocator.num_used, kv_pages_total=s.allocator.num_total,
            requests_running=len(s.running), requests_waiting=len(self._pending) + len(s.waiting),
            queue_times=tuple(self._queue_times), steps=tuple(self._steps),
            prefix_cached_pages=s.allocator.num_cached, prefix_queried_tokens=queried, prefix_hit_tokens=hit,
            prefix_evictions=evicted, prefix_pinned_pages=s.allocator.num_pinned, speculation=spec,
        )
        self._queue_times.clear()
        self._steps.clear()
        return snapshot

    # -- the parts --------------------------------------------------------
    def _admit(self, events: list[Event]) -> None:
        while self._pending and self.scheduler.has_room():
            request_id = next(iter(self._pending))
            sub = self._pending.pop(request_id)
            new, grammar = sub.new, sub.grammar
            if grammar is not None:
                failure = self._start_grammar(request_id, grammar)
                if failure is not None:
                    events += [Opened(request_id), Failed(request_id, failure)]
                    continue
            self._active.add(request_id)
            self._admissions += 1
            if self.faults.every_nth_request and self._admissions % self.faults.every_nth_request == 0:
                self._doomed.add(request_id)
            self._added.append(new)
            if self.speculator is not None and sub.speculate and grammar is None:
                self.speculator.start(request_id, new.prompt_ids)
            n = len(new.prompt_ids)
            self.scheduler.add(SeqState(request_id, n, sub.arrival, prompt_len=n, prompt_ids=new.prompt_ids,
                                        pins=sub.pins, tbt=sub.tbt, reuse_prefix=not sub.score_prompt))
            events.append(Opened(request_id))

    def _start_grammar(self, request_id: Hashable, grammar: GrammarSpec) -> str | None:
        """A matcher for the request; the reason it cannot have one, if so."""
        if self.grammars is None:
            return "this engine cannot constrain its output (no grammar backend)"
        try:
            self._matchers[request_id] = self.grammars.matcher(grammar)
        except Exception as exc:
            log.warning("grammar of %s failed: %s", request_id, exc)
            return f"the grammar failed: {exc}"
        return None

    def _masked(self, chunks: list[Chunk]) -> tuple[list[Chunk], tuple[Hashable, ...]]:
        """Put each constrained sequence's mask on its chunk that samples; when its last token is still
        being sampled, say ``mask_later`` instead (the rows named second): their masks are filled once
        that token is collected (``_sample_late``), while the device runs this step's forward."""
        out, later, now = list(chunks), [], []
        for row, chunk in enumerate(chunks):
            if chunk.seq_id in self._matchers:
                seq = self.scheduler.seq(chunk.seq_id)
                if seq.num_computed == seq.num_tokens - 1:  # the chunk reached its last token: it samples
                    if self._sampling.get(chunk.seq_id):
                        out[row] = attrs.evolve(chunk, mask_later=True)
                        later.append(chunk.seq_id)
                    else:
                        now.append(row)
                    self._sampling[chunk.seq_id] = self._sampling.get(chunk.seq_id, 0) + 1
        if now:
            masks = self.grammars.masks([self._matchers[chunks[row].seq_id] for row in now])
            for row, mask in zip(now, masks):  # (a chunk is a value: its mask as bytes, once per request)
                out[row] = attrs.evolve(chunks[row], token_mask=bytes(mask))
        return out, tuple(later)

    def _blocked(self) -> bool:
        """Nothing may launch behind the newest step: it waits for its late masks, or its speculating
        sequences' next drafts need its tokens."""
        return bool(self._inflight and (self._inflight[-1].masked_later or self._inflight[-1].speculated))

    def _sample_late(self, events: list[Event]) -> None:
        """The step that waits for masks is the oldest now (the tokens its masks depend on are all
        collected): fill them in one call and let the engine sample. A grammar that fails there fails
        its requests; an engine that fails to sample drops the step, which then fails as a whole."""
        step = self._inflight[0]
        self._inflight[0] = attrs.evolve(step, masked_later=())
        late = [seq_id for seq_id in step.masked_later if seq_id in self._matchers]
        try:
            masks = dict(zip(late, self.grammars.masks([self._matchers[s] for s in late]))) if late else {}
        except Exception as exc:
            log.warning("grammar masks failed: %s", exc)
            masks = {}
            for seq_id in late:
                self._end(seq_id)
                events.append(Failed(seq_id, f"the grammar failed: {exc}"))
        try:
            self.engine.sample_late(masks)
        except Exception as exc:
            self._inflight[0] = attrs.evolve(step, masked_later=(), error=step_failure(exc))

    def _launch_next(self, events: list[Event]) -> bool:
        """Plan one step and launch it; False when there is nothing to plan."""
        now = self.clock()
        chunks = self.scheduler.schedule(now)
        self._reset.extend(self.scheduler.preempted)
        if not chunks:
            return False
        later = ()
        if self._matchers:
            chunks, later = self._masked(chunks)
        speculated = ()
        if not self._inflight and self._speculating():
            chunks, speculated = self._speculate(chunks)
        for seq_id in self.scheduler.started_now:  # their first chunk
            seq = self.scheduler.seq(seq_id)
            self._queue_times.append(now - seq.arrival)
            if seq.cached_tokens:
                events.append(PrefixHit(seq_id, seq.cached_tokens))
        plan = StepPlan(tuple(chunks), tuple(self._added), tuple(self._removed), tuple(self._reset),
                        tuple(self.scheduler.prefix_hits))
        marks = ()
        if self.scheduler.prefix_caching:
            seqs = [self.scheduler.seq(c.seq_id) for c in chunks]
            marks = tuple((s.request_id, s.num_computed, s.epoch)
                          for s, c in zip(seqs, chunks) if s.num_computed - c.num_tokens < s.prompt_len)
        self._added, self._removed, self._reset = [], [], []
        traced = self._trace_plan(chunks, now) if self.step_log else None
        at = self.clock()
        self._launches += 1
        try:
            if self._launches in self.faults.steps:
                raise InjectedFault(f"step {self._launches} was told to fail (faults)")
            self.engine.launch(plan)
            error = None
        except Exception as exc:
            error, later = step_failure(exc), ()
        self._inflight.append(_Launched(plan.chunks, at, error, marks, later, speculated, traced))
        return True

    def _trace_plan(self, chunks: list[Chunk], now: float) -> dict:
        """A planned step as ``step_log`` sees it: decode rows and the context they read, prompt tokens
        and the context their chunks attend to, and the policy's prediction of its time."""
        rows = ctx = prefill = attended = 0
        for chunk in chunks:
            computed = self.scheduler.seq(chunk.seq_id).num_computed  # (the step counted as done)
            if chunk.decodes:
                rows, ctx = rows + 1, ctx + computed
            else:
                prefill += chunk.num_tokens
                attended += chunk.num_tokens * (computed - chunk.num_tokens) + chunk.num_tokens * (chunk.num_tokens + 1) // 2
        record = {"planned": now, "rows": rows, "ctx": ctx, "prefill": prefill, "attended": attended,
                  "waiting": len(self.scheduler.waiting)}
        record.update(self.scheduler.policy.last_plan or {})
        return record

    def _speculating(self) -> bool:
        return self.speculator is not None and self.speculator.on(len(self.scheduler.running))

    def _speculate(self, chunks: list[Chunk]) -> tuple[list[Chunk], tuple[tuple[Hashable, int], ...]]:
        """Draft after the speculating decodes (every token known: nothing is in flight), growing their
        chunks and pages; the verify chunks go after the plain decodes (the attention kernels take a
        step's single-token rows first)."""
        decodes, verifies, rest, speculated = [], [], [], []
        limit_of = self.engine.max_model_len
        for chunk in chunks:
            seq = self.scheduler.seq(chunk.seq_id)
            if chunk.num_tokens != 1 or chunk.seq_id not in self.speculator or seq.num_computed != seq.num_tokens - 1:
                (decodes if chunk.num_tokens == 1 else rest).append(chunk)
                continue
            # the draft's positions stay inside the context; ``seq`` counts the token being sampled
            draft = self.speculator.draft(chunk.seq_id, limit_of - seq.num_tokens)
            if draft:
                table, n = self.scheduler.speculate(chunk.seq_id, len(draft))
                draft = draft[:n]
            if draft:
                verifies.append(attrs.evolve(chunk, num_tokens=1 + len(draft), block_table=table, draft=draft))
            else:
                decodes.append(chunk)
            speculated.append((chunk.seq_id, len(draft)))
        return decodes + verifies + rest, tuple(speculated)

    def _collect_oldest(self, events: list[Event]) -> None:
        step = self._inflight.popleft()
        outputs, error = [], step.error
        if error is None:
            try:
                outputs = self.engine.collect()
            except Exception as exc:
                error = step_failure(exc)
        done = self.clock()
        # The device time of a pipelined step: from when it could start (launched, and the
        # one before it done) to its end.
        seconds, self._last_done = done - max(step.at, self._last_done), done
        if step.traced is not None:
            self.step_log({**step.traced, "launched": step.at, "done": done, "seconds": seconds,
                           "sampled": len(outputs)})
        self._account(step.chunks, StepResult(tuple(outputs), seconds, error), done, events, step.prompt_marks,
                      step.speculated)
        if self._inflight and self._inflight[0].masked_later:
            self._sample_late(events)

    def _account(self, chunks: tuple[Chunk, ...], result: StepResult, now: float, events: list[Event],
                 marks: tuple = (), speculated: tuple = ()) -> None:
        if result.error is not None:
            self.scheduler.allocator.forget_cached()  # the pages this step was to fill hold no known prefix
            for c in chunks:
                if c.seq_id in self._active:  # (an earlier failed step may have ended it)
                    self._end(c.seq_id)
                    events.append(Failed(c.seq_id, result.error))
            return
        self.scheduler.on_step_done(chunks, (o.seq_id for o in result.outputs), now, result.seconds)
        for seq_id, computed, epoch in marks:
            if seq_id in self._active:
                self.scheduler.register_computed(seq_id, computed, epoch)
        self._observe(chunks, result)
        if self._doomed:  # only with faults configured: no pass over the outputs otherwise
            for doomed in [o.seq_id for o in result.outputs if o.seq_id in self._doomed]:
                self._doomed.discard(doomed)
                if doomed in self._active:
                    self._end(doomed)
                    events.append(Failed(doomed, "the request was told to fail (faults)"))
        if self._matchers:
            self._advance_grammars(chunks, result.outputs, events)
        outputs = tuple(o for o in result.outputs if o.seq_id in self._active)  # not cancelled meanwhile
        if self.scheduler.prefix_caching:  # the generated tokens, for the pages they fill
            for out in outputs:
                self.scheduler.seq(out.seq_id).output_ids.append(out.token_id)
        if self.speculator:
            self._settle_speculation(outputs, speculated)
        for out in outputs:
            if out.finish_reason is not None:
                # the engine forgot it already; only the pages and our records remain
                self.scheduler.finish(out.seq_id, now)
                self._matchers.pop(out.seq_id, None)
                self._sampling.pop(out.seq_id, None)
                self._active.discard(out.seq_id)
                if self.speculator is not None:
                    self.speculator.forget(out.seq_id)
        if outputs:
            events.append(TokenBatch(outputs, now))

    def _settle_speculation(self, outputs: tuple, speculated: tuple) -> None:
        """Feed the tokens to the drafts; roll back what the verify chunks drafted and did not emit."""
        emitted: dict[Hashable, list[int]] = {}
        ended = set()
        for out in outputs:
            if out.seq_id in self.speculator:
                emitted.setdefault(out.seq_id, []).append(out.token_id)
                if out.finish_reason is not None:
                    ended.add(out.seq_id)
        for seq_id, tokens in emitted.items():
            self.speculator.extend(seq_id, tokens)
        for seq_id, drafted in speculated:
            if seq_id not in self._active:
                continue  # cancelled meanwhile: its pages are gone
            got = len(emitted.get(seq_id, ()))
            self.speculator.observe(seq_id, drafted, got)
            if drafted and seq_id not in ended:  # (an ended one's pages all go)
                self.scheduler.rollback(seq_id, drafted + 1 - got)

    def _advance_grammars(self, chunks, outputs, events: list[Event]) -> None:
        for chunk in chunks:
            if (chunk.token_mask is not None or chunk.mask_later) and chunk.seq_id in self._sampling:
                self._sampling[chunk.seq_id] -= 1
                if not self._sampling[chunk.seq_id]:
                    del self._sampling[chunk.seq_id]
        taken = [out for out in outputs if out.seq_id in self._matchers and out.seq_id in self._active]
        if not taken:
            return
        accepted = self.grammars.accept([self._matchers[out.seq_id] for out in taken], [out.token_id for out in taken])
        for out, ok in zip(taken, accepted):
            if not ok:
                # Only an engine that does not apply masks (a replaying double) or a bug gets here: the
                # request goes on unconstrained, and what checks its output after (tool_choice) still does.
                log.warning("request %s sampled token %d, which its grammar forbids: no longer constrained",
                            out.seq_id, out.token_id)
                del self._matchers[out.seq_id]

    def _observe(self, chunks: tuple[Chunk, ...], result: StepResult) -> None:
        """The step's time and shape. A pipelined plan names sequences that ended one step
        before; the engine skips them, so only rows that gave a token count."""
        sampled = {o.seq_id for o in result.outputs}
        rows = sum(1 for c in chunks if c.decodes and c.seq_id in sampled)
        prefill = sum(c.num_tokens for c in chunks if not c.decodes)
        if rows or prefill:
            self._steps.append(StepShape(result.seconds, rows, prefill))

    def _flush_removals(self) -> None:
        """Nothing runs: tell the engine now of the requests that ended, rather than with a next plan
        that may be long in coming (an idle engine holds no ended sequence)."""
        if not self._removed:
            return
        plan = StepPlan((), removed=tuple(self._removed))
        self._removed = []
        try:
            self.engine.launch(plan)
            self.engine.collect()
        except Exception as exc:
            step_failure(exc)

    def _unblock(self, events: list[Event]) -> None:
        """Nothing could be planned: free the pages stalled prefills hold, and fail a head that can never fit."""
        released, head = self.scheduler.release_stalled()
        self._reset.extend(released)
        if head is None:
            return
        self._end(head.request_id)
        if head.num_tokens > head.prompt_len:
            # it generated until its tokens filled the whole pool: that is its length limit
            events.append(Failed(head.request_id, "the KV cache is full", reason="length"))
        else:
            log.warning("request %s does not fit in the KV cache", head.request_id)
            events.append(Failed(head.request_id, "the request does not fit in the KV cache"))

    def _end(self, request_id: Hashable, *, kept: bool = False) -> None:
        """End a request the engine did not end; ``kept``: its computed prefix stays cached (a cancel)."""
        self.scheduler.finish(request_id, self.clock() if kept else None)
        self._matchers.pop(request_id, None)
        self._sampling.pop(request_id, None)
        self._active.discard(request_id)
        self._doomed.discard(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        unregistered = [n for n in self._added if n.seq_id == request_id]
        if unregistered:  # the engine never saw it: nothing to forget
            self._added.remove(unregistered[0])
        else:
            self._removed.append(request_id)


def step_failure(exc: Exception) -> str:
    """Log a step that raised; the error its requests end with (the engine's failure, not the server's)."""
    log.exception("engine step failed")
    return f"engine step failed: {type(exc).__name__}: {exc}"
