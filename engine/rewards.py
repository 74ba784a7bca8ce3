"""Reward functions: built-in (exact match, math, F1) and custom (`module:function` or `file.py:function`).

A reward function that raises marks its sample FAILED with the reason; it never crashes the run.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from engine.doctor.diagnosis import ConfigError, Diagnosis
from engine.samples import Sample, Status


def _norm(text: str) -> str:
    return " ".join(str(text).strip().split())


def exact_match(response: str, label: Any) -> float:
    return float(_norm(response) == _norm(label))


_BOXED = re.compile(r"\\boxed\{")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth, out = starts[-1], 1, []
    while i < len(text):
        c = text[i]
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return "".join(out)
        out.append(c)
        i += 1
    return None


def _math_normalize(s: str) -> str:
    s = s.strip().strip("$").replace(" ", "").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "").rstrip(".")
    return s


def math_equal(a: str, b: str, timeout_s: float = 2.0) -> bool:
    """String-equal after normalisation, else numerically/symbolically equal via sympy (bounded by a timeout)."""
    na, nb = _math_normalize(a), _math_normalize(b)
    if na == nb:
        return True
    try:
        return float(na) == float(nb)
    except ValueError:
        pass
    return _sympy_equal(na, nb, timeout_s)


def _sympy_equal(a: str, b: str, timeout_s: float) -> bool:
    import concurrent.futures as cf

    def check() -> bool:
        import sympy
        from sympy.parsing.sympy_parser import parse_expr

        def parse(s: str):
            s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s).replace("^", "**")
            return parse_expr(s, evaluate=True)

        return bool(sympy.simplify(parse(a) - parse(b)) == 0)

    pool = cf.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(check).result(timeout=timeout_s)
    except Exception:  # unparsable or timed out: not equal
        return False
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def math_reward(response: str, label: Any) -> float:
    """Final \\boxed{} answer (else the last number in the response) compared with the label."""
    answer = extract_boxed(response)
    if answer is None:
        numbers = _NUMBER.findall(response)
        if not numbers:
            return 0.0
        answer = numbers[-1]
    return float(math_equal(answer, str(label)))


def f1_reward(response: str, label: Any) -> float:
    pred, gold = _norm(response).lower().split(), _norm(label).lower().split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold or common == 0:
        return float(pred == gold)
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


BUILTIN = {"exact_match": exact_match, "math": math_reward, "f1": f1_reward}


def load_custom(path: str) -> Callable:
    """`pkg.module:function` or `path/to/file.py:function`."""
    mod_name, sep, fn_name = path.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                    what=f"--custom-rm-path {path!r} is not module:function",
                                    fix="--custom-rm-path my_pkg.rewards:score (or path/to/file.py:score)"))
    try:
        if mod_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
            if spec is None or spec.loader is None or not Path(mod_name).is_file():
                raise FileNotFoundError(mod_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
        return getattr(module, fn_name)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                    what=f"--custom-rm-path {path!r} cannot be loaded: {type(e).__name__}: {e}",
                                    fix="check the module path (on PYTHONPATH) and the function name")) from None


def _call(fn: Callable, arg: Any) -> Any:
    out = fn(arg)
    if inspect.isawaitable(out):
        out = asyncio.run(out) if not _in_loop() else _run_in_thread(out)
    return out


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _run_in_thread(coro) -> Any:
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class RewardModel:
    """Scores groups of samples in place: sets `reward`, or FAILED status with the reason."""

    def __init__(self, rm_type: str | None, custom_rm_path: str | None, group_rm: bool = False):
        if custom_rm_path is None and rm_type is None:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error", what="no reward: --rm-type and "
                                        "--custom-rm-path are both unset", fix="--rm-type exact_match"))
        self.custom = load_custom(custom_rm_path) if custom_rm_path else None
        self.builtin = BUILTIN[rm_type] if rm_type and not custom_rm_path else None
        self.group_rm = group_rm

    def score_group(self, group: list[Sample]) -> None:
        live = [s for s in group if s.status not in (Status.FAILED, Status.ABORTED)]
        if self.custom is not None and self.group_rm:
            try:
                rewards = _call(self.custom, live)
                if len(rewards) != len(live):
                    raise ValueError(f"returned {len(rewards)} rewards for {len(live)} samples")
                for s, r in zip(live, rewards):
                    s.reward = r
            except Exception as e:  # one bad group must not crash the run
                for s in live:
                    self._fail(s, e)
            return
        for s in live:
            try:
                s.reward = _call(self.custom, s) if self.custom else self.builtin(s.response, s.label)
            except Exception as e:
                self._fail(s, e)

    @staticmethod
    def _fail(s: Sample, e: Exception) -> None:
        s.status, s.reward = Status.FAILED, 0.0
        s.metadata["failure"] = f"reward: {type(e).__name__}: {e}"
