"""One engine per rank: rank 0 leads (the core plans for it), the other ranks follow its steps.

Under tensor parallelism every rank holds a slice of the model and runs the same forward
(``spark.engine.parallel``). Only rank 0 hosts the scheduler and the core; they drive a
``Leader``, which is the ``StepEngine`` the core knows, so nothing above the engine sees the
ranks. The leader tells its followers each call that changes an engine (the step's plan,
grammar masks, sequences forgotten, graphs to capture) before making it on its own
engine; each follower makes the same calls on its engine, in the same order, and so
launches the same collectives. Nothing comes back: every rank gets the same logits and
samples the same tokens, so each follower's sequences stay the leader's.

    core --launch(plan)--> Leader --tell--> follow(): engine.launch(plan)   (ranks 1..N-1)
                              '--> engine.launch(plan)                      (rank 0)

The calls that queue no device work (``collect``, sequences added or forgotten outside a
plan) ride along with the next one that does, so that a step costs one message.

Processes: ``start_followers`` spawns ranks 1..N-1 on this host, then ``lead`` makes this
process rank 0. Under ``torchrun`` every rank is started for us: rank 0 runs ``spark serve``
and leads, the others run ``follow_main`` (``spark serve`` does, seeing ``RANK`` > 0); the
rendezvous is torchrun's either way (``MASTER_ADDR``/``MASTER_PORT``), so the same code runs
across nodes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from typing import Hashable, Mapping, Sequence

from spark.core.grammar import PackedMask
from spark.core.page_allocator import PageAllocator
from spark.core.plan import StepPlan, TokenOutput
from spark.engine import parallel
from spark.engine.engine import Engine

log = logging.getLogger("spark.ranks")

# The engine calls a follower replays; any other name in a message is refused.
_REPLAYED = frozenset({"add_sequence", "remove_sequence", "reset_computed", "launch", "collect", "sample_late",
                       "enable_cuda_graphs", "capture_next_graph"})
_CLOSE = "close"


class Leader:
    """Rank 0's engine: a ``StepEngine`` that tells its followers each call before it makes it.

    Sequence ids travel pickled, so they must come back equal (strings, ints, tuples of them).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tp = engine.tp
        self._calls: list[tuple[str, tuple]] = []  # told with the next call that queues device work

    # -- what the layers above read --------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def device(self):
        return self.engine.device

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_pages(self) -> int:
        return self.engine.num_pages

    @property
    def page_size(self) -> int:
        return self.engine.page_size

    @property
    def num_inflight(self) -> int:
        return self.engine.num_inflight

    def new_page_allocator(self) -> PageAllocator:
        return self.engine.new_page_allocator()

    def num_uncomputed(self, seq_id: Hashable) -> int:
        return self.engine.num_uncomputed(seq_id)

    def num_computed(self, seq_id: Hashable) -> int:
        return self.engine.num_computed(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.engine.num_tokens(seq_id)

    def graph_progress(self) -> tuple[int, int]:
        return self.engine.graph_progress()

    # -- what changes an engine: every rank's --------------------------------------------------
    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int], params) -> None:
        self._calls.append(("add_sequence", (seq_id, tuple(prompt_ids), params)))
        self.engine.add_sequence(seq_id, prompt_ids, params)

    def remove_sequence(self, seq_id: Hashable) -> None:
        self._calls.append(("remove_sequence", (seq_id,)))
        self.engine.remove_sequence(seq_id)

    def reset_computed(self, seq_id: Hashable, to: int = 0) -> None:
        self._calls.append(("reset_computed", (seq_id, to)))
        self.engine.reset_computed(seq_id, to)

    def launch(self, plan: StepPlan) -> None:
        self._tell("launch", plan)
        self.engine.launch(plan)

    def collect(self) -> list[TokenOutput]:
        self._calls.append(("collect", ()))
        return self.engine.collect()

    def step(self, plan: StepPlan) -> list[TokenOutput]:
        """``Engine.step``: launch, then collect."""
        if self.engine.num_inflight:
            raise RuntimeError("step() while launched steps are not collected; use launch()/collect()")
        self.launch(plan)
        return self.collect()

    def sample_late(self, masks: Mapping[Hashable, PackedMask]) -> None:
        self._tell("sample_late", dict(masks))
        self.engine.sample_late(masks)

    def enable_cuda_graphs(self, max_batch_size: int, verify_rows: int = 0, max_step_tokens: int | None = None) -> bool:
        self._tell("enable_cuda_graphs", max_batch_size, verify_rows, max_step_tokens)
        return self.engine.enable_cuda_graphs(max_batch_size, verify_rows, max_step_tokens)

    def capture_next_graph(self) -> bool:
        self._tell("capture_next_graph")  # the followers capture beside it: warm-up runs run the collectives
        return self.engine.capture_next_graph()

    def close(self) -> None:
        """Close every rank's engine; the followers then leave the group and exit."""
        if self.engine.model is not None:
            self._calls.append((_CLOSE, ()))
            self._send()
            self.engine.close()

    def _tell(self, name: str, *args) -> None:
        self._calls.append((name, args))
        self._send()

    def _send(self) -> None:
        calls, self._calls = self._calls, []
        self.tp.tell(calls)


def follow(engine: Engine) -> None:
    """A follower's loop: make the calls rank 0 tells, in its order, until it says close.

    A call that raises here raised on rank 0 too (the same call on the same state): rank 0's
    caller handles it, and this rank goes on with the next.
    """
    while True:
        for name, args in engine.tp.hear():
            if name == _CLOSE:
                engine.close()
                return
            if name not in _REPLAYED:
                raise RuntimeError(f"rank {engine.tp.rank}: rank 0 told an unknown call {name!r}")
            try:
                getattr(engine, name)(*args)
            except Exception as exc:  # noqa: BLE001 - mirrored: rank 0's caller sees the same
                log.warning("rank %d: %s raised %s (as it should have on rank 0)", engine.tp.rank, name, exc)


def lead(model: str | None, *, world_size: int, **load_kwargs) -> Leader:
    """Join the group as rank 0, tell every follower what to load, load this rank's slice.

    The followers are already started (``start_followers``, or by torchrun).
    """
    tp = parallel.join(0, world_size, load_kwargs.get("device"))
    tp.tell((model, load_kwargs))
    return Leader(Engine.load(model, tp=tp, **load_kwargs))


def follow_main(rank: int, world_size: int, device: str | None, parent_pid: int | None = None,
                env: Mapping[str, str] | None = None, cpu_threads: int | None = None) -> None:
    """A follower rank's whole life: join, load what rank 0 says, follow until rank 0 closes.

    Args:
      device: "cpu" or "cuda" (the group's backend; a GPU rank takes ``cuda:<LOCAL_RANK>``).
      parent_pid: exit when this process is gone (a follower ``start_followers`` spawned).
      env: the rendezvous (``MASTER_ADDR``, ``MASTER_PORT``), set before joining.
      cpu_threads: torch's intra-op threads, when it runs on the CPU (ranks on one host share its cores).
    """
    os.environ.update(env or {})
    if cpu_threads is not None:
        from spark.engine.device import use_cpu_threads

        use_cpu_threads(device, cpu_threads)
    if parent_pid is not None:
        threading.Thread(target=_exit_with, args=(parent_pid,), name="spark-rank-parent", daemon=True).start()
    tp = parallel.join(rank, world_size, device)
    try:
        model, load_kwargs = tp.hear()
        load_kwargs = {**load_kwargs, "progress": False}
        follow(Engine.load(model, tp=tp, **load_kwargs))
    finally:
        parallel.leave()


def _exit_with(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


class Followers:
    """Ranks 1..N-1, spawned on this host; ``env`` is the rendezvous rank 0 joins with."""

    def __init__(self, processes: list, env: dict[str, str]):
        self.processes, self.env = processes, env

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for them to exit (rank 0 closed them), killing the ones that do not."""
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def start_followers(world_size: int, device: str | None, *, cpu_threads: int | None = None) -> Followers:
    """Spawn ranks 1..``world_size - 1`` on this host; they wait for rank 0 (``lead``, with ``env``
    set in its process) to tell them what to load."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(parallel.free_port())}
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    processes = []
    for rank in range(1, world_size):
        p = ctx.Process(target=follow_main, args=(rank, world_size, device, os.getpid(), env, cpu_threads),
                        name=f"spark-rank-{rank}", daemon=True)
        p.start()
        processes.append(p)
    return Followers(processes, env)


def started_by_torchrun() -> bool:
    """Whether torchrun (or another launcher) started this process as one rank of a group."""
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ


def follows_torchrun(world_size: int, device: str | None) -> bool:
    """``spark serve`` under torchrun: a rank > 0 follows rank 0 here (no server of its own) and returns
    True once rank 0 closed it; rank 0, and a process torchrun did not start, return False at once.

    Raises:
        ValueError: torchrun started another number of ranks than ``world_size``.
    """
    if not started_by_torchrun():
        return False
    rank, size = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    if size != world_size:
        raise ValueError(f"--world-size {world_size}, but torchrun started {size} ranks; give --world-size {size}")
    if rank == 0:
        return False
    follow_main(rank, world_size, device)
    return True
