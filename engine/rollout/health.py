"""Health monitor (`--use-fault-tolerance`): restart a dead rollout engine and re-sync its weights.

A thread in the driver. It waits `--rollout-health-check-first-wait` seconds (engines warm up), then every
`--rollout-health-check-interval` seconds — or at once when the rollout loop reports a failed request — calls
`/health_generate` on every engine with a `--rollout-health-check-timeout` deadline. An engine that fails (or was
reported) is restarted on its bundle and given the current weights before it serves again
(EngineGroup.restart). A restart that fails is retried at the next check. Checks pause while a colocated run has
released the engines' memory, and wait for a weight sync in progress (the group's lock).
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("rollflow.rollout")


class HealthMonitor:
    def __init__(self, group, *, interval_s: float, timeout_s: float, first_wait_s: float):
        self.group, self.interval_s, self.timeout_s, self.first_wait_s = group, interval_s, timeout_s, first_wait_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="rollflow-health")
        self.restarts = 0
        self.errors: list[str] = []  # failed restarts, newest last

    def start(self) -> "HealthMonitor":
        self.group.monitor = self
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.group.failures.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=30)

    def _wait(self, seconds: float) -> None:
        """Sleep up to `seconds`; a reported failure (or stop) ends the wait early."""
        self.group.failures.wait(seconds)
        self.group.failures.clear()

    def check_once(self) -> None:
        for slot in list(self.group.slots):
            if self._stop.is_set() or self.group.released:
                return
            with self.group.lock:  # not during a weight sync
                if slot.serving and self.group.healthy(slot, self.timeout_s):
                    continue
                try:
                    self.group.restart(slot)
                    self.restarts += 1
                except Exception as e:  # try again at the next check
                    self.errors.append(f"engine {slot.index}: {type(e).__name__}: {e}")
                    log.error("restarting rollout engine %d failed: %s", slot.index, self.errors[-1])

    def _run(self) -> None:
        self._wait(self.first_wait_s)
        while not self._stop.is_set():
            self.check_once()
            self._wait(self.interval_s)
