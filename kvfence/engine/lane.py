"""The prefill lane: a prefill step that runs off the engine thread while decode steps go on (colocated overlap).

On a CPU, a step of one 200-token prefill and a few decode rows makes every decode row wait for the prefill's
matmuls, and both threads of a 2-core step wait on each other at every operator. With the lane, the engine
thread launches the prefill plan here (its own torch thread), runs decode-only steps on the other core
meanwhile, and lands the prefill's result between two of them (kvfence/engine/llm_engine.py, "Overlap").

Boundary: a lane runs plans; it never touches the pool, the scheduler or a request. Everything before and after
the forward pass (I1 checks, holds, stamping, postprocessing) stays on the engine thread. One plan at a time.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from kvfence.engine.plan import Plan, StepResult


class Runs(Protocol):
    def run(self, plan: Plan, threads: int | None = None) -> StepResult: ...


class Lane(Protocol):
    def launch(self, plan: Plan) -> None:
        """Start running `plan`; the lane must be idle."""

    def done(self) -> bool:
        """True once the launched plan has run (or failed); `land` then returns without waiting."""

    def land(self) -> StepResult:
        """Wait for the launched plan and return its result (or raise what it raised); the lane is idle after."""


class ThreadLane:
    """The lane on one worker thread, with `threads` torch threads of its own."""

    def __init__(self, runner: Runs, threads: int = 1) -> None:
        self._runner, self._threads = runner, threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfence-prefill")
        self._future: Future[StepResult] | None = None

    def launch(self, plan: Plan) -> None:
        assert self._future is None, "the prefill lane runs one plan at a time"
        self._future = self._executor.submit(self._runner.run, plan, self._threads)

    def done(self) -> bool:
        return self._future is not None and self._future.done()

    def land(self) -> StepResult:
        assert self._future is not None, "nothing launched on the prefill lane"
        future, self._future = self._future, None
        return future.result()
