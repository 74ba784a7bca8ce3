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


_SIZE = r"([\d.]+) (bytes|KiB|MiB|GiB|TiB)"
_UNITS = {"bytes": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 2**10}
#: PyTorch's CUDA OOM message (c10's caching allocator): what was asked, the device's capacity and free memory,
#: every other process that holds memory on it, this process's share, and its reserved-but-unallocated cache
_CUDA_OOM = re.compile(r"Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capac(?:i)?ty of " + _SIZE +
                       r" of which " + _SIZE + r" is free\.")
_OTHER_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")
_THIS_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use")
_UNALLOCATED = re.compile(r"and " + _SIZE + r" is reserved by PyTorch but unallocated")


def _gib(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit]


def cuda_oom_facts(text: str) -> dict:
    """The numbers of the first PyTorch CUDA OOM message in `text`, in GiB ({} when there is none): asked, gpu,
    capacity, free, this_process, other_processes (how many) and other_processes_gib, unallocated (reserved by
    PyTorch, not allocated)."""
    m = _CUDA_OOM.search(text)
    if m is None:
        return {}
    rest = text[m.end():m.end() + 4000]  # this message's own lines, not a later traceback's
    end = re.search(r"If reserved but unallocated|See documentation|\n\S*Error", rest)
    rest = rest[:end.start()] if end else rest
    others = {pid: _gib(n, u) for pid, n, u in _OTHER_PROCESS.findall(rest)}
    facts = {"asked_gib": _gib(*m.group(1, 2)), "gpu": int(m.group(3)), "capacity_gib": _gib(*m.group(4, 5)),
             "free_gib": _gib(*m.group(6, 7)), "other_processes": len(others),
             "other_processes_gib": sum(others.values())}
    if (t := _THIS_PROCESS.search(rest)) is not None:
        facts["this_process_gib"] = _gib(*t.groups())
    if (u := _UNALLOCATED.search(rest)) is not None:
        facts["unallocated_gib"] = _gib(*u.groups())
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in facts.items()}


def _oom_context(facts: dict, train_env: bool = True) -> tuple[str, str]:
    """What the OOM message's numbers add to RF03: (more of `what`, a fix that comes before the batch-size one).
    `train_env`: the OOM is a train worker's, whose allocator --train-env-vars configures."""
    if not facts:
        return "", ""
    what = (f"; GPU {facts['gpu']}: {facts['asked_gib']:g} GiB asked, {facts['free_gib']:g} of "
            f"{facts['capacity_gib']:g} GiB free")
    if "this_process_gib" in facts:
        what += f", this process holds {facts['this_process_gib']:g} GiB"
    fix = ""
    shared = facts["other_processes_gib"]
    if facts["other_processes"] and shared >= max(1.0, 0.1 * facts["capacity_gib"]):
        n = facts["other_processes"]
        what += (f", {n} other process{'es hold' if n > 1 else ' holds'} {shared:g} GiB (this run's colocated "
                 "rollout engine, if any, holds little then: it releases its memory before each train step)")
        fix = ("the GPU is shared: stop the other processes on it or give this run GPUs of its own "
               "(CUDA_VISIBLE_DEVICES); otherwise ")
    unallocated = facts.get("unallocated_gib", 0.0)
    if train_env and (unallocated >= max(1.0, facts["asked_gib"]) or
                      (unallocated >= 1.0 and unallocated + facts["free_gib"] >= facts["asked_gib"])):
        fix += (f"{unallocated:g} GiB are reserved by PyTorch but unallocated (fragmentation): try --train-env-vars "
                "'{\"PYTORCH_CUDA_ALLOC_CONF\": \"expandable_segments:True\"}'; or ")
    return what, fix


#: the rollout client's EngineError for an engine's failed answer (engine/rollout/client.py)
_ENGINE_ANSWERED = re.compile(r"/generate → HTTP 5\d\d")


def _builtin_engine_oom(d: Diagnosis, oom: dict, cfg) -> Diagnosis:
    """RF11 for the built-in engine, which has no --sglang-mem-fraction-static (refused with it): its memory is
    the batch's KV cache, which --sglang-max-running-requests and --sglang-max-total-tokens bound."""
    rows = cfg.sglang_args.get("max-running-requests", 256) if cfg is not None else 256
    more, first = _oom_context(oom, train_env=False)
    return Diagnosis(
        code="RF11", severity="error",
        what=f"the built-in rollout engine ran out of GPU memory while generating{more}",
        fix=f"{first}a smaller batch for the engine: --sglang-max-running-requests {max(1, int(rows) // 2)} (now "
            f"{rows}) or a --sglang-max-total-tokens cap; colocated runs also need the trainer's share",
        facts={**oom, "line": d.facts["line"], "max_running_requests": rows})


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
    (engine.rollout.diagnose.scan_engine_log: RF11, RF08); so is an out-of-memory an engine answered a /generate
    with (HTTP 5xx: the built-in engine's OOM reaches the flow that way). Any other out-of-memory is the
    trainer's (RF03).
    """
    from engine.rollout.diagnose import scan_engine_log

    mem = cfg.sglang_args.get("mem-fraction-static") if cfg is not None else None
    engine = scan_engine_log(text, mem_fraction_static=float(mem) if mem is not None else None)
    illegal = bool(_ILLEGAL.search(text))
    answered = bool(_OOM.search(text) and _ENGINE_ANSWERED.search(text))
    if answered and not illegal and (cfg is None or cfg.rollout_engine == "builtin"):
        engine = [_builtin_engine_oom(d, cuda_oom_facts(text), cfg) if d.code == "RF11" else d for d in engine]
    # a plain OOM is the trainer's
    out: list[Diagnosis] = [d for d in engine if illegal or answered or d.code == "RF08"]
    if _OOM.search(text) and not illegal and not answered:
        facts = cuda_oom_facts(text)
        more, first = _oom_context(facts)
        if cfg is not None:
            facts.update({"max_tokens_per_gpu": cfg.max_tokens_per_gpu, "micro_batch_size": cfg.micro_batch_size,
                          "use_dynamic_batch_size": cfg.use_dynamic_batch_size,
                          "rollout_max_response_len": cfg.rollout_max_response_len})
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
        out.append(Diagnosis(code="RF03", severity="error", what=what + more, fix=first + fix, facts=facts))
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
