"""--use-pytorch-profiler and --record-memory-history on the train ranks (Megatron's and slime's flags).

Profiler: torch.profiler over the rollouts --profile-step-start ≤ rollout id < --profile-step-end, on the ranks of
--profile-ranks. One trace per rollout and target, in Chrome's trace format (gzip), openable in Perfetto
(ui.perfetto.dev), chrome://tracing or TensorBoard's profiler plugin. The targets (--profile-target):
- train_overall: everything the rank's process does from the rollout's set-up (its log-prob forwards) to the end
  of its last optimizer step, other threads included (e.g. a built-in engine served from this process);
- train_log_probs: the no-grad forwards before the steps (old log-probs, reference, values), when they run;
- train_actor: each optimizer step (forward, backward, optimizer; the critic's too), one trace per step.
torch.profiler runs one profile at a time, so train_overall is not combined with the others.

Memory history (--record-memory-history): from the worker's set-up on, every allocation with its stack. torch
(CUDA): the caching allocator's history; its snapshot (`torch.cuda.memory._dump_snapshot`, a pickle for
pytorch.org/memory_viz) is written after the rollout id --memory-snapshot-num-steps − 1 is trained, and on an
out-of-memory error. memray: the process's host allocations, its file closed at the same point.

Files go to the directory the driver names (<work_dir>/profile/ on the rank's own node); the driver logs each
path as it is written.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("rollflow")


class TrainProfiler:
    """One train rank's profiler and memory recorder (engine.train.worker.TrainWorker.profiler)."""

    def __init__(self, cfg: Any, *, rank: int, device: str, directory: str, memory_dir: str):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.dir = Path(directory)
        self.on = cfg.use_pytorch_profiler and rank in cfg.profile_ranks
        self.window = range(cfg.profile_step_start, cfg.profile_step_end)
        self.targets = set(cfg.profile_target)
        self.written: list[str] = []
        self._overall: tuple[Any, int] | None = None  # (profile, rollout id) while train_overall records
        self._memory_path: Path | None = None  # where the recording goes, while it records
        self._memray = None  # --memory-recorder memray's Tracker
        if cfg.record_memory_history:
            if cfg.memory_recorder == "memray":
                self._start_memray(Path(memory_dir))
            else:
                self._start_memory(Path(memory_dir))

    # ---- torch.profiler ----------------------------------------------------------------------------------------
    def _profile(self):
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # what slime records: shapes, Python stacks, memory, FLOPs of the matrix products
        return torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True,
                                      profile_memory=True, with_flops=True)

    def _wanted(self, target: str, rollout_id: int) -> bool:
        return self.on and target in self.targets and rollout_id in self.window

    def _export(self, prof: Any, target: str, name: str) -> None:
        """One profile's trace (.pt.trace.json.gz). No operator table: torch's key_averages costs 2–3× the export
        (~2 s for one step of the bundled model on the CPU), and the trace viewers aggregate the same."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{target}_{name}_rank{self.rank}.pt.trace.json.gz"
        t0 = time.perf_counter()
        prof.export_chrome_trace(str(path))
        self.written.append(str(path))
        log.info("train rank %d: %s profile of %s written to %s (%.1f s)", self.rank, target, name, path,
                 time.perf_counter() - t0)

    def begin(self, rollout_id: int) -> None:
        """The rollout's set-up starts: train_overall starts recording when the rollout is in the window (one left
        recording by a failed rollout is written out first, as far as it got)."""
        self._end_overall(suffix="_unfinished")
        if self._wanted("train_overall", rollout_id):
            prof = self._profile()
            prof.start()
            self._overall = (prof, rollout_id)

    def _end_overall(self, suffix: str = "") -> None:
        if self._overall is not None:
            prof, rid = self._overall
            self._overall = None
            prof.stop()
            self._export(prof, "train_overall", f"rollout{rid}{suffix}")

    @contextlib.contextmanager
    def region(self, target: str, rollout_id: int, name: str) -> Iterator[None]:
        """Record the block as `target`'s profile `name` when the rollout is in the window."""
        if not self._wanted(target, rollout_id):
            yield
            return
        prof = self._profile()
        prof.start()
        try:
            yield
        finally:
            prof.stop()
            self._export(prof, target, name)

    # ---- the CUDA caching allocator's history -------------------------------------------------------------------
    def _start_memory(self, directory: Path) -> None:
        import torch

        if self.device != "cuda":
            raise RuntimeError(f"--record-memory-history records the CUDA caching allocator's history; train rank "
                               f"{self.rank} runs on {self.device}. Drop the flag (CPU runs have no such allocator)")
        directory.mkdir(parents=True, exist_ok=True)
        self._memory_path = directory / f"rank{self.rank}_{self.cfg.memory_snapshot_path}"
        oom_path = f"{self._memory_path}.oom"
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")

        def on_oom(device, alloc, device_alloc, device_free):  # the allocator's callback, before the OOM raises
            torch.cuda.memory._dump_snapshot(oom_path)  # the history so far (none after the planned snapshot)
            log.error("train rank %d: out of memory (%d bytes asked); the allocator's history is in %s",
                      self.rank, alloc, oom_path)

        torch._C._cuda_attach_out_of_memory_observer(on_oom)
        log.info("train rank %d: recording the CUDA allocator's history (snapshot: %s)", self.rank,
                 self._memory_path)

    def _start_memray(self, directory: Path) -> None:
        """--memory-recorder memray: every host allocation of this process, with Python and native stacks."""
        import memray

        directory.mkdir(parents=True, exist_ok=True)
        name = self.cfg.memory_snapshot_path
        if name == type(self.cfg).model_fields["memory_snapshot_path"].default:
            name = "memray.bin"
        self._memory_path = directory / f"rank{self.rank}_{name}"
        self._memory_path.unlink(missing_ok=True)  # a resumed run's rank records afresh (memray will not overwrite)
        self._memray = memray.Tracker(file_name=str(self._memory_path), native_traces=True)
        self._memray.__enter__()
        log.info("train rank %d: memray records this process's allocations into %s", self.rank, self._memory_path)

    def _dump_memory(self, rollout_id: int) -> None:
        if self._memray is not None:
            self._memray.__exit__(None, None, None)
            self._memray = None
        else:
            import torch

            torch.cuda.memory._dump_snapshot(str(self._memory_path))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.written.append(str(self._memory_path))
        log.info("train rank %d: the %s history up to rollout %d written to %s", self.rank,
                 self.cfg.memory_recorder, rollout_id, self._memory_path)
        self._memory_path = None

    # ---- the end of a rollout's training ------------------------------------------------------------------------
    def end(self, rollout_id: int) -> list[str]:
        """After the rollout's last step: train_overall's profile and the memory snapshot when due. Returns the
        files written since the last call."""
        self._end_overall()
        n = self.cfg.memory_snapshot_num_steps
        if self._memory_path is not None and n is not None and rollout_id >= n - 1:
            self._dump_memory(rollout_id)
        out, self.written = self.written, []
        return out
