"""The engine thread: steps the engine while there is work, sleeps (bounded) when there is none."""

from __future__ import annotations

import logging
import threading

from kvwire.engine.engine import Engine

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, *, idle_wait_s: float = 1.0, poll_wait_s: float = 0.01) -> None:
        self.engine = engine
        # Only a backstop too: with nothing waiting and no block lent, only a new request, an abort, a
        # connector event or ``stop`` gives the engine work, and each of them wakes it. Waking 20 times a
        # second for nothing was most of what an idle colocated engine cost.
        self.idle_wait_s = idle_wait_s
        # The hooks wake the engine on every transfer event (``KVTransferHooks.bind``), so while the
        # connector holds blocks this is only a backstop; polling every half millisecond instead took
        # enough CPU on two cores to double the prefill time of the P the engine was waiting for.
        self.poll_wait_s = poll_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwire-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop stepping, then end every live request and close the connector."""
        self._stop.set()
        self.engine.wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                engine.step()
            except Exception:
                log.exception("engine step failed")
            lent = engine.scheduler.has_lent_blocks() or bool(engine.scheduler.waiting)
            engine.wait(self.poll_wait_s if lent else self.idle_wait_s)
