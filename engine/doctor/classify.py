"""Runtime classifiers: an exception (or an engine's log text) → the catalog diagnosis that explains it.

`classify_exception` is applied by the flow to whatever a stage raised; it walks the exception chain and the
rendered traceback, so a RayTaskError wrapping a CUDA OOM is still recognised. Unrecognised failures give [].
"""
from __future__ import annotations

import re
import traceback

from engine.diagnosis import Diagnosis, DiagnosisError

_OOM = re.compile(r"(CUDA out of memory|OutOfMemoryError|DefaultCPUAllocator: can't allocate memory|"
                  r"out of memory)", re.I)
_ILLEGAL = re.compile(r"an illegal memory access was encountered", re.I)
_INDUCTOR = re.compile(r"JSONDecodeError", re.I)
_NAN = re.compile(r"\b(nan|inf)\b[^\n]{0,60}\b(loss|grad)|\b(loss|grad)[\w ]{0,40}(is|=|:)\s*(nan|inf)\b", re.I)


def _next(e: BaseException) -> BaseException | None:
    """The exception behind `e`: Ray's RayTaskError keeps the remote one in `.cause`."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)


def _text(exc: BaseException) -> str:
    parts, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append("".join(traceback.format_exception_only(type(e), e)))
        parts.append(str(getattr(e, "traceback_str", "") or ""))  # Ray's RayTaskError carries the remote traceback
        e = _next(e)
    return "\n".join(parts)


def classify_text(text: str, cfg=None) -> list[Diagnosis]:
    """Diagnoses for a log or traceback text; `cfg` (a RunConfig) adds the current values to the advice.

    An illegal memory access (the engine's OOM symptom) and bind failures are read as an engine log
    (engine.rollout.diagnose.scan_engine_log: RF11, RF08); any other out-of-memory is the trainer's (RF03).
    """
    from engine.rollout.diagnose import scan_engine_log

    mem = cfg.sglang_args.get("mem-fraction-static") if cfg is not None else None
    engine = scan_engine_log(text, mem_fraction_static=float(mem) if mem is not None else None)
    illegal = bool(_ILLEGAL.search(text))
    out: list[Diagnosis] = [d for d in engine if illegal or d.code == "RF08"]  # a plain OOM is the trainer's
    if _OOM.search(text) and not illegal:
        facts = {}
        if cfg is not None:
            facts = {"max_tokens_per_gpu": cfg.max_tokens_per_gpu, "micro_batch_size": cfg.micro_batch_size,
                     "use_dynamic_batch_size": cfg.use_dynamic_batch_size,
                     "rollout_max_response_len": cfg.rollout_max_response_len}
        if cfg is not None and cfg.use_dynamic_batch_size:
            safe = max(1, cfg.rollout_max_response_len // cfg.context_parallel_size)
            what = (f"out of memory while training with --max-tokens-per-gpu {cfg.max_tokens_per_gpu} "
                    f"(dynamic batch size)")
            fix = f"--max-tokens-per-gpu {safe} (rollout_max_response_len / cp_size) and raise it while memory allows"
        else:
            mbs = cfg.micro_batch_size if cfg is not None else "?"
            what = f"out of memory with --micro-batch-size {mbs} (static batches)"
            fix = "--use-dynamic-batch-size --max-tokens-per-gpu <rollout_max_response_len>, or a smaller " \
                  "--micro-batch-size"
        out.append(Diagnosis(code="RF03", severity="error", what=what, fix=fix, facts=facts))
    if _INDUCTOR.search(text) and re.search(r"inductor|torch[._]compile|_inductor|codecache", text, re.I):
        out.append(Diagnosis(
            code="RF12", severity="error",
            what="a JSONDecodeError inside torch.compile / inductor: processes are sharing one inductor cache",
            fix="keep TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 in the Ray workers' env (rollflow's default; check "
                "that your environment does not override it with 0)"))
    if re.search(r"Max retries exceeded with url: /get_model_info", text, re.I):
        out.append(Diagnosis(
            code="RF08", severity="error",
            what="a rollout engine could not be reached or could not bind its port (port collision between "
                 "servers on one machine)",
            fix="let rollflow allocate the ports (do not pass fixed --sglang-port values), or run fewer engines per "
                "node (e.g. a larger --rollout-num-gpus-per-engine)"))
    if _NAN.search(text) and "RF13" not in text:
        flag = "--no-check-for-nan-in-loss-and-grad"
        out.append(Diagnosis(
            code="RF13", severity="error",
            what="the log shows a NaN/Inf loss or gradient",
            fix=f"check the data and the learning rate (--lr{f' {cfg.lr:g}' if cfg is not None else ''}); "
                f"rollflow fails such a step naming its samples, or with {flag} skips and counts it (the cause "
                "stays unfixed)"))
    return out


def classify_exception(exc: BaseException, cfg=None) -> list[Diagnosis]:
    """The diagnoses an exception carries (DiagnosisError) or that its text matches."""
    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiagnosisError):
            return list(e.diagnoses)
        e = _next(e)
    return classify_text(_text(exc), cfg)
