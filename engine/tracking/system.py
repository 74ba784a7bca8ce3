"""System metrics for MLflow: CPU and memory of this node (psutil), and every GPU NVML can see.

Names follow MLflow's own system metrics (`system/cpu_utilization_percentage`, `system/gpu_0_utilization_percentage`,
…) so the MLflow UI shows them in its System metrics tab. Their step is whole seconds since the MLflow run was
created (not a rollout id), so a resumed run continues the same time axis. The sampler only appends to the
tracker's buffer; the driver's next flush sends the points (a sample never waits on MLflow).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("rollflow.tracking")


def host_metrics(psutil: Any) -> dict[str, float]:
    """CPU utilisation since the previous call, and system memory in use."""
    vm = psutil.virtual_memory()
    return {"system/cpu_utilization_percentage": float(psutil.cpu_percent(interval=None)),
            "system/system_memory_usage_megabytes": (vm.total - vm.available) / 2**20,
            "system/system_memory_usage_percentage": float(vm.percent)}


def gpu_metrics(nvml: Any, count: int) -> dict[str, float]:
    """Utilisation and memory of GPUs 0..count-1 through an NVML binding (`pynvml` from nvidia-ml-py)."""
    out = {}
    for i in range(count):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        out[f"system/gpu_{i}_utilization_percentage"] = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        out[f"system/gpu_{i}_memory_usage_megabytes"] = mem.used / 2**20
        out[f"system/gpu_{i}_memory_usage_percentage"] = 100.0 * mem.used / max(mem.total, 1)
    return out


def _nvml() -> tuple[Any, int]:
    """(pynvml, GPU count), or (None, 0) where there is no NVIDIA driver (CPU machines)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return None, 0


class SystemSampler:
    """A daemon thread that samples every `interval` seconds into `tracker` until `stop()`."""

    def __init__(self, tracker, interval: float):
        self.tracker, self.interval = tracker, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollflow-system-metrics", daemon=True)
        self._gpus: tuple[Any, int] = (None, 0)
        self.errors = 0

    def start(self) -> "SystemSampler":
        self._thread.start()
        return self

    def sample(self) -> dict[str, float]:
        import psutil

        nvml, n = self._gpus
        return {**host_metrics(psutil), **(gpu_metrics(nvml, n) if nvml else {})}

    def _loop(self) -> None:
        import psutil

        psutil.cpu_percent(interval=None)  # the first call only sets the reference point
        self._gpus = _nvml()
        while not self._stop.wait(self.interval):
            try:
                t0 = self.tracker.run_start_s or self.tracker.created_s
                self.tracker.log_metrics(self.sample(), step=int(time.time() - t0), flush=False)
            except Exception as e:  # a failed sample is skipped (said once); the next one tries again
                self.errors += 1
                if self.errors == 1:
                    log.warning("system metrics sample failed (%s: %s); skipped", type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
