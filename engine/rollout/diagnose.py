"""Runtime diagnoses of the rollout stage, as pure functions of what was observed (RF08, RF10, RF11).

- RF10: the share of samples that ran to `rollout_max_response_len` is above `--rollout-max-truncated-share`:
  generation is not stopping (no stop token configured, or the wrong one).
- RF11: an engine log says "an illegal memory access was encountered" (SGLang's usual symptom of running out of GPU
  memory) or CUDA out of memory: lower `--sglang-mem-fraction-static`, from the value in use.
- RF08: an engine did not answer `/health_generate` in time, or its log says its port was taken.
"""
from __future__ import annotations

import re

from engine.diagnosis import Diagnosis

#: SGLang's own default when --mem-fraction-static is not given depends on the GPU and the TP size; ~0.88 on 80 GB.
SGLANG_MEM_FRACTION_HINT = 0.88


def truncation_diagnosis(truncated: int, total: int, *, max_response_len: int, stop_token_ids: list[int],
                         stop: list[str], threshold: float) -> Diagnosis | None:
    """RF10 when truncated/total > threshold (threshold ≥ 1 never fires)."""
    if total == 0 or truncated / total <= threshold:
        return None
    share = truncated / total
    return Diagnosis(
        code="RF10", severity="error",
        what=f"{truncated} of {total} samples ({share:.0%}) ran to --rollout-max-response-len {max_response_len} "
             f"without stopping (threshold {threshold:.0%}); the engines stop on token ids {stop_token_ids} and "
             f"strings {stop}",
        fix="set the model's end-of-turn token: --rollout-stop-token-ids <id> (or --rollout-stop '<text>'); if "
            "responses are really that long raise --rollout-max-response-len; --rollout-max-truncated-share 1 "
            "turns this check off",
        facts={"truncated": truncated, "total": total, "share": share, "stop_token_ids": stop_token_ids,
               "stop": stop, "max_response_len": max_response_len})


_ILLEGAL = re.compile(r"illegal memory access", re.I)
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.I)
# uvicorn, torch.distributed (errno 98) and SGLang say the first; `rollflow serve` (the built-in engine launched
# as a command) checks first and says the second
_ADDR = re.compile(r"address already in use|port \d+ on \S+ is already in use", re.I)


def scan_engine_log(text: str, *, mem_fraction_static: float | None, ports: list[int] | None = None,
                    log_path: str | None = None) -> list[Diagnosis]:
    """Known fatal errors in an engine's log, each as a diagnosis with the fix."""
    where = f" ({log_path})" if log_path else ""
    out: list[Diagnosis] = []
    current = f"{mem_fraction_static}" if mem_fraction_static is not None else \
        f"SGLang's default (≈{SGLANG_MEM_FRACTION_HINT} on large GPUs)"
    lower = round((mem_fraction_static or SGLANG_MEM_FRACTION_HINT) - 0.1, 2)
    line = _first_line(text, _ILLEGAL) or _first_line(text, _OOM)
    if line:
        out.append(Diagnosis(
            code="RF11", severity="error",
            what=f"the rollout engine failed with {line!r}{where}; this is usually the engine running out of GPU "
                 f"memory, with --sglang-mem-fraction-static = {current}",
            fix=f"--sglang-mem-fraction-static {lower} (lower it until the error goes away; colocated runs need "
                "room for the trainer too)",
            facts={"line": line, "mem_fraction_static": mem_fraction_static, "suggested": lower}))
    line = _first_line(text, _ADDR)
    if line:
        out.append(Diagnosis(
            code="RF08", severity="error",
            what=f"the rollout engine could not bind a port: {line!r}{where}; ports given to it: {ports}",
            fix="another process took the port between the allocator's check and the bind: rerun; if it repeats, "
                "run fewer engines per node (larger --rollout-num-gpus-per-engine)",
            facts={"line": line, "ports": ports}))
    return out


def _first_line(text: str, pattern: re.Pattern) -> str | None:
    for line in text.splitlines():
        if pattern.search(line):
            return line.strip()[:300]
    return None


def health_timeout(url: str, port: int, seconds: float, log_tail: str) -> Diagnosis:
    """RF08's runtime half: an engine that never answered its health check."""
    return Diagnosis(
        code="RF08", severity="error",
        what=f"the rollout engine at {url} (port {port}) did not answer /health_generate within {seconds:.0f}s; "
             f"last log lines:\n{log_tail[-2000:]}",
        fix="read the log above; when several engines share a node, run fewer per node (larger "
            "--rollout-num-gpus-per-engine) or give them more time (--rollout-engine-start-timeout)",
        facts={"url": url, "port": port, "seconds": seconds})
