"""Agent calls that can wait on the network, run off the caller's event loop: one worker thread per agent.

Why. Loading a remote agent makes UCX create its endpoint, and UCX's tcp transport connects with a
*blocking* ``connect()`` (``UCX_TCP_CONN_NB`` defaults to ``n``). When the peer's UCX port drops packets,
``add_remote_agent`` returns only when the kernel gives up its SYN retries (about 130 s with
``tcp_syn_retries=6``), and all that time the UCX worker's lock is held, so any other call on the same
agent (``progress``, ``send_notif``) spins on that lock. Measured across network namespaces; see
``tests/faults/test_blocked_ucx_port.py``.

So an agent owns a ``CallWorker``:

* one lock (re-entrant) serializes **every** call on the agent, whichever thread makes it: NIXL's Python
  layer is not thread-safe, and a call racing a stuck load would spin inside UCX instead of here;
* ``call`` runs a blocking call in the worker thread and awaits it with a deadline. Past the deadline the
  call is *abandoned*: the caller gets ``AgentStalled`` at once, the call is counted stuck while the thread
  is still inside it, and if it ever succeeds ``undo`` reverts it (in the worker, still holding the lock),
  so no caller ever uses a stuck call's result;
* while a call is stuck, new ``call``s are refused (``AgentBusy``) instead of queueing behind a call that
  may not return for minutes;
* ``hold`` (or ``held_call``, its generator-free form for the tick's frequent calls) is how every other
  call takes the lock: it waits at most ``grace_s`` counted from the start of
  the worker's current call, so a normal load (milliseconds) is waited for as before, and a stuck one makes
  callers fail fast with ``AgentBusy`` (or be skipped or deferred, as the agent decides: ``run_or_defer``).

The thread is a daemon: a call stuck in the kernel must not keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvwire.errors import AgentBusy, AgentStalled

log = logging.getLogger("kvwire.transport")

T = TypeVar("T")

DEFAULT_GRACE_S = 0.25  # a normal add_remote_agent takes 0.5-30 ms (nixl-on-cpu.md, nixl-faults.md)


@dataclass(eq=False)
class _Job(Generic[T]):
    fn: Callable[[], T]
    what: str
    undo: Callable[[T], None] | None = None
    future: concurrent.futures.Future[T] = field(default_factory=concurrent.futures.Future)
    started: float | None = None  # monotonic, once the worker holds the lock and runs it
    finished: bool = False
    abandoned: bool = False
    # Orders the worker's "finished" against the loop's "abandoned": exactly one side decides the result.
    guard: threading.Lock = field(default_factory=threading.Lock)


class CallWorker:
    """The lock of one agent and the thread that runs its calls which may wait on the network."""

    def __init__(self, name: str, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.name = name
        self.grace_s = grace_s
        self.lock = threading.RLock()
        self._queue: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: _Job[Any] | None = None
        self._stuck: _Job[Any] | None = None
        self._closed = False
        self.stuck_calls = 0  # calls that overran their deadline, since creation
        self.refused = 0  # calls refused (or skipped, or deferred) because the agent was held

    # -- the worker thread ---------------------------------------------------------------------------
    def _submit(self, job: _Job[Any]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"kvwire-agent:{self.name}", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.future.set_running_or_notify_cancel():  # False: cancelled while queued
                self._execute(job)

    def _execute(self, job: _Job[Any]) -> None:
        result: Any = None
        error: BaseException | None = None
        with self.lock:
            job.started = time.monotonic()
            self._current = job
            try:
                result = job.fn()
            except BaseException as exc:  # handed to whoever awaits the job, never lost here
                error = exc
            with job.guard:
                job.finished = True
                abandoned = job.abandoned
                was_stuck = self._stuck is job
                if was_stuck:
                    self._stuck = None  # the next load queues behind the undo below: this thread runs it
            if abandoned and error is None and job.undo is not None:
                self._undo(job, result)
            self._current = None
        if was_stuck:
            log.warning(
                "agent %s: the stuck %s returned after %.1f s (%s); the agent is usable again",
                self.name,
                job.what,
                time.monotonic() - (job.started or 0.0),
                "failed" if error is not None else "undone",
            )
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _undo(self, job: _Job[Any], result: Any) -> None:
        assert job.undo is not None
        try:
            job.undo(result)
        except Exception as exc:  # best effort: the abandoned call's caller is long gone
            log.warning("agent %s: undoing the abandoned %s failed: %s", self.name, job.what, exc)

    # -- the event loop's side -----------------------------------------------------------------------
    async def call(
        self, fn: Callable[[], T], timeout_s: float, what: str, undo: Callable[[T], None] | None = None
    ) -> T:
        """``fn()`` in the worker thread, awaited for at most ``timeout_s``; ``AgentStalled`` past it,
        ``AgentBusy`` at once while an earlier call is stuck.

        Cancelling the awaiting task abandons the call the same way (without counting it stuck)."""
        stuck = self._stuck
        if stuck is not None:
            self.refused += 1
            raise AgentBusy(f"{what} refused: agent {self.name} {self._describe(stuck)}")
        if self._closed:
            raise AgentBusy(f"{what} refused: agent {self.name} is closing")
        job: _Job[T] = _Job(fn, what, undo)
        self._submit(job)
        waiter = asyncio.wrap_future(job.future)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), max(timeout_s, 0.0))
        except TimeoutError:
            abandoned = self._abandon(job, stuck=True)
            if not abandoned and not job.future.cancelled():
                return await waiter  # it finished just now: its result stands
            # Nobody will read the waiter: cancelled, it is never given the late result, so no "exception
            # was never retrieved" is logged from a finalizer (in 3.11 that can run inside ast.parse and
            # break it).
            waiter.cancel()
            if not abandoned:
                raise AgentStalled(f"{what} on agent {self.name}: no time left to start it") from None
            raise AgentStalled(
                f"{what} on agent {self.name} did not return within {timeout_s:.3g} s (a peer whose "
                "UCX port drops packets); abandoned, the agent is held until it returns"
            ) from None
        except asyncio.CancelledError:
            self._abandon(job, stuck=False)
            waiter.cancel()
            raise

    def _abandon(self, job: _Job[Any], *, stuck: bool) -> bool:
        """Whether ``job`` was abandoned while running (False: never started, or already finished); if
        ``stuck``, it holds the agent from now on, until the worker sees it return."""
        if job.future.cancel():
            return False
        with job.guard:  # the worker marks it finished under the same lock: one side decides
            if job.finished:
                return False
            job.abandoned = True
            if stuck:
                self._stuck = job
                self.stuck_calls += 1
            return True

    def _describe(self, job: _Job[Any]) -> str:
        since = time.monotonic() - (job.started or time.monotonic())
        return f"is held by {job.what}, stuck for {since:.1f} s"

    def _wait_s(self) -> float:
        """How long a caller may wait for the lock: up to ``grace_s`` after the worker's call started."""
        job = self._current
        if job is None or job.started is None:
            return self.grace_s
        return max(0.0, job.started + self.grace_s - time.monotonic())

    @contextmanager
    def hold(self, what: str) -> Iterator[None]:
        """Hold the agent's lock for one call; ``AgentBusy`` when a long worker call holds it."""
        self._acquire(what)
        try:
            yield
        finally:
            self.lock.release()

    def held_call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` under the lock, as ``hold`` would run it, without a generator per call: the
        connector's tick makes these calls (progress, transfer polls) hundreds of times a second, and the
        two context managers cost more than NIXL's own call."""
        self._acquire(what)
        try:
            return fn(*args)
        finally:
            self.lock.release()

    def _acquire(self, what: str) -> None:
        # Uncontended (the usual case): no timeout to compute.
        if self.lock.acquire(blocking=False) or self.lock.acquire(timeout=self._wait_s()):
            return
        self.refused += 1
        job = self._current
        held = self._describe(job) if job is not None else "is held by another thread"
        raise AgentBusy(f"{what} refused: agent {self.name} {held}")

    def run_or_defer(self, fn: Callable[[], object], what: str) -> bool:
        """Run ``fn`` under the lock now, or (agent held) queue it to run in the worker after the call
        holding it; True when it ran now. For releases and removals, which must happen but need no answer."""
        try:
            with self.hold(what):
                fn()
                return True
        except AgentBusy:
            pass

        def deferred() -> None:
            try:
                fn()
            except Exception as exc:
                log.debug("agent %s: deferred %s failed: %s", self.name, what, exc)

        self._submit(_Job(deferred, what))
        return False

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds since the start of the call now stuck past its deadline; 0.0 when none is."""
        job = self._stuck
        if job is None or job.started is None:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - job.started)

    def close(self) -> None:
        """Let the thread end once what is queued (a deferred teardown included) has run; no wait."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)
