"""The scheduler actor: admits requests, plans each engine step, routes its tokens.

It owns the ``SchedulerPolicy`` (and through it the KV page allocator). The
admission channel *is* the waiting queue: requests are taken from it only when
the batch has room, so its bound is the queue's bound and the ingress answers
503 at once when it is full. Cancellations come on their own channel and are
applied between steps, so a departed client's pages are back in the pool
within one step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import trio

from spark.actors.channels import take_waiting
from spark.actors.messages import (
    Failed, StepResult, StepWork, StreamOpen, Submission, TokenBatch,
)
from spark.actors.scheduler_policy import SchedulerPolicy, SeqState
from spark.engine.engine import ScheduledChunk, StepPlan
from spark.metrics import Metrics

log = logging.getLogger("spark.scheduler")

_MAX_EARLY_CANCELS = 10_000
# Steps kept in flight unless the config says: the one the engine runs, the one it has
# launched behind it, and one more that covers this event loop's delay in accounting a result.
DEFAULT_DEPTH = 3


class _State:
    def __init__(self, policy: SchedulerPolicy):
        self.policy = policy
        self.cancelled: OrderedDict[str, None] = OrderedDict()  # ids cancelled, not yet applied
        self.wake = trio.Event()
        self.added: list = []  # sequences to register with the engine in the next step
        self.removed: list[str] = []  # sequences the engine must forget
        self.reset: list[str] = []  # preempted sequences the engine must recompute
        self.active: set[str] = set()


async def run(
    policy: SchedulerPolicy,
    admissions: trio.MemoryReceiveChannel,
    cancels: trio.MemoryReceiveChannel,
    to_runner: trio.MemorySendChannel,
    from_runner: trio.MemoryReceiveChannel,
    to_streamer: trio.MemorySendChannel,
    metrics: Metrics,
    *,
    depth: int = 2,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Plan steps and route their tokens until cancelled.

    Up to ``depth`` planned steps are in flight: step N+1 is planned and sent
    while step N runs, so the runner (and the engine process behind it) has the
    next step queued the moment it finishes one, however busy this event loop
    is with HTTP. The policy counts a planned step as done; what only the result
    can say (an end, the step's time) is accounted when it comes.
    """
    state = _State(policy)
    metrics.kv_pages_total.set(policy.allocator.num_total)
    inflight: deque[list] = deque()  # the planned chunks of each step sent, oldest first
    async with admissions, cancels, to_runner, from_runner, to_streamer, trio.open_nursery() as nursery:
        nursery.start_soon(_listen_for_cancels, cancels, state)
        task_status.started()
        while True:
            # One turn of this loop waits at most once. Every await of a trio channel is a
            # checkpoint, and a checkpoint waits for every other runnable task: with
            # hundreds of streams writing their tokens that is milliseconds, which a step
            # per await would pay several times over. So results, admissions and plans are
            # taken and handed on without waiting while channels allow.
            for result in take_waiting(from_runner, [], limit=len(inflight)):
                await _account(state, inflight.popleft(), result, to_streamer, metrics)
            _apply_cancels(state)
            _update_gauges(state, metrics)
            await _admit(state, admissions, to_streamer, block=policy.num_active == 0 and not inflight)
            _apply_cancels(state)
            metrics.requests_waiting.set(admissions.statistics().current_buffer_used + len(policy.waiting))
            while len(inflight) < depth:
                now = trio.current_time()
                planned = policy.schedule(now)
                state.reset.extend(policy.preempted)
                if not planned:
                    break
                for p in planned:
                    if p.seq.started == now and p.num_tokens == p.seq.num_computed:  # its first chunk
                        metrics.queue_time.observe(now - p.seq.arrival)
                await _hand_on(to_runner, StepWork(
                    StepPlan(tuple(ScheduledChunk(p.seq.request_id, p.num_tokens, p.block_table) for p in planned)),
                    added=tuple(state.added), removed=tuple(state.removed), reset=tuple(state.reset),
                ))
                state.added.clear()
                state.removed.clear()
                state.reset.clear()
                inflight.append(planned)
                metrics.requests_running.set(len(planned))
            if not inflight:
                await _unblock(state, to_streamer)
                _update_gauges(state, metrics)
                continue
            result = await from_runner.receive()
            await _account(state, inflight.popleft(), result, to_streamer, metrics)
            _update_gauges(state, metrics)


async def _hand_on(channel: trio.MemorySendChannel, message) -> None:
    """Send ``message``, without a checkpoint when the channel has room."""
    try:
        channel.send_nowait(message)
    except trio.WouldBlock:
        await channel.send(message)


async def _listen_for_cancels(cancels: trio.MemoryReceiveChannel, state: _State) -> None:
    async for msg in cancels:
        remember_cancel(state.cancelled, msg.request_id)
        state.wake.set()


def remember_cancel(cancelled: OrderedDict, request_id: str) -> None:
    """Note a cancel that may name a request not taken from the queue yet: it is dropped
    when taken. Only the newest ``_MAX_EARLY_CANCELS`` are kept (most name requests that
    ended already)."""
    cancelled[request_id] = None
    while len(cancelled) > _MAX_EARLY_CANCELS:
        cancelled.popitem(last=False)


def _apply_cancels(state: _State) -> None:
    """End cancelled requests that are active; keep the others for when they are taken from the queue."""
    for request_id in [r for r in state.cancelled if r in state.active]:
        del state.cancelled[request_id]
        _end(state, request_id)


def _end(state: _State, request_id: str) -> None:
    state.policy.finish(request_id)
    state.active.discard(request_id)
    not_yet_added = [a for a in state.added if a[0] == request_id]
    if not_yet_added:  # the engine never saw it: nothing to forget
        state.added.remove(not_yet_added[0])
    else:
        state.removed.append(request_id)


def _update_gauges(state: _State, metrics: Metrics) -> None:
    metrics.kv_pages_used.set(state.policy.allocator.num_used)
    metrics.requests_running.set(len(state.policy.running))


async def _admit(state: _State, admissions, to_streamer, *, block: bool) -> None:
    """Take queued requests while the batch has room; wait for one when idle."""
    policy = state.policy
    while policy.has_room():
        if block:
            sub: Submission = await _receive_or_wake(admissions, state)
            block = False
            if sub is None:
                return
        else:
            try:
                sub = admissions.receive_nowait()
            except trio.WouldBlock:
                return
        req = sub.request
        if state.cancelled.pop(req.request_id, 1) is None:
            sub.out.close()
            continue  # its client left while it was queued
        state.active.add(req.request_id)
        state.added.append((req.request_id, req.prompt_ids, req.params))
        policy.add(SeqState(req.request_id, len(req.prompt_ids), sub.arrival, prompt_len=len(req.prompt_ids)))
        await _hand_on(to_streamer, StreamOpen(sub))


async def _receive_or_wake(admissions, state: _State):
    state.wake = trio.Event()
    return await admissions.receive()


async def _account(state: _State, planned, result: StepResult, to_streamer, metrics: Metrics) -> None:
    policy = state.policy
    now = trio.current_time()
    if result.error is not None:
        for p in planned:
            if p.seq.request_id in state.active:  # (an earlier failed step may have ended it)
                _end(state, p.seq.request_id)
                await _hand_on(to_streamer, Failed(p.seq.request_id, result.error))
        return
    policy.on_step_done(planned, (o.seq_id for o in result.outputs), now, result.seconds)
    _observe_step(planned, result, metrics)
    outputs = tuple(o for o in result.outputs if o.seq_id in state.active)  # not cancelled meanwhile
    for out in outputs:
        if out.finish_reason is not None:
            # the engine forgot it already; only the pages and our records remain
            policy.finish(out.seq_id)
            state.active.discard(out.seq_id)
    if outputs:
        await _hand_on(to_streamer, TokenBatch(outputs, now))


def _observe_step(planned, result: StepResult, metrics: Metrics) -> None:
    """Record the step's time and shape. A pipelined plan names sequences that ended one
    step before; the engine skips them, so only rows that gave a token count."""
    sampled = {o.seq_id for o in result.outputs}
    rows = sum(1 for p in planned if p.num_tokens == 1 and p.seq.request_id in sampled)
    prefill = sum(p.num_tokens for p in planned if p.num_tokens > 1)
    if rows or prefill:
        metrics.step_seconds.observe(result.seconds)
        metrics.step_decode_rows.observe(rows)
        metrics.step_prefill_tokens.observe(prefill)


async def _unblock(state: _State, to_streamer) -> None:
    """Nothing could be planned: no sequence runs and the head of the queue cannot get pages.

    Partial prefills of other waiting sequences hold the pages: release them;
    if the head still cannot start, it can never fit, and fails.
    """
    policy = state.policy
    if policy.running or not policy.waiting:
        await trio.sleep(0)  # (everything was cancelled) let the other tasks run
        return
    head = policy.waiting[0]
    for seq in list(policy.waiting)[1:]:
        if policy.allocator.has(seq.request_id):
            policy.allocator.free(seq.request_id)
            seq.num_computed = 0
            state.reset.append(seq.request_id)
    if policy.allocator.can_allocate(head.request_id, head.num_computed + 1):
        return
    _end(state, head.request_id)
    if head.num_tokens > head.prompt_len:
        # it generated until its tokens filled the whole pool: that is its length limit
        await to_streamer.send(Failed(head.request_id, "the KV cache is full", reason="length"))
    else:
        log.warning("request %s does not fit in the KV cache", head.request_id)
        await to_streamer.send(Failed(head.request_id, "the request does not fit in the KV cache"))
