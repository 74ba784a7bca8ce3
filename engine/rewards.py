"""Reward functions: built-in (exact match, math, F1) and custom (`module:function` or `file.py:function`).

- exact_match: whitespace-normalised response == label.
- math: the last `\\boxed{…}` of the response (else its last number) against the label (its boxed answer when it
  has one): equal after slime's MATH normalisation (engine/math_grader.py), or numerically, or symbolically via
  sympy — in a separate process killed after the time limit (sympy's simplify can run for minutes on adversarial
  input; a thread cannot be stopped, a process can).
- f1: token-level F1 of response vs label after SQuAD's normalisation (lower case, no punctuation, no articles),
  with HotpotQA's rule for yes / no / noanswer labels, as slime's `f1`: {"score": F1, "precision": P, "recall": R}
  (the score is what trains; P and R are logged as rollout/reward_precision_mean, …).
- custom: `fn(sample) -> float | dict` (sync or async; the samples of a group are scored concurrently when async),
  or with `--group-rm` `fn(samples) -> list[float | dict]`; slime's `fn(args, sample)` / `fn(args, samples)` too
  (args: engine.rollout.hooks.HookArgs).

A reward function that raises, or returns something that is not a number (or a dict of numbers), marks its sample
FAILED with the reason in `metadata["failure"]`; it never crashes the run. A NaN / Inf reward is kept: the train
step then fails with RF13 naming the samples (or skips the step with --no-check-for-nan-in-loss-and-grad).
"""
from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import inspect
import math
import re
import string
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from engine.diagnosis import ConfigError, Diagnosis
from engine.samples import Sample, Status

SYMPY_TIMEOUT_S = 2.0
SYMPY_START_GRACE_S = 15.0


def _norm(text: str) -> str:
    return " ".join(str(text).strip().split())


def exact_match(response: str, label: Any) -> float:
    return float(_norm(response) == _norm(label))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _math_normalize(s: str) -> str:
    s = s.strip().strip("$").replace(" ", "").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "").replace(",", "").rstrip(".")
    return s


def _to_sympy_text(s: str) -> str:
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    return s.replace("^", "**").replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi")


def _sympy_check(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    tr = standard_transformations + (implicit_multiplication_application,)  # "2x", "2sqrt(2)"
    return bool(sympy.simplify(parse_expr(_to_sympy_text(a), transformations=tr)
                               - parse_expr(_to_sympy_text(b), transformations=tr)) == 0)


def _sympy_serve(conn) -> None:  # runs in the worker process
    while True:
        try:
            a, b = conn.recv()
        except EOFError:
            return
        try:
            conn.send(_sympy_check(a, b))
        except Exception:
            conn.send(False)


class _SympyWorker:
    """One long-lived `spawn` process answering (a, b) → equal?; killed and restarted when a check overruns."""

    def __init__(self) -> None:
        self.proc = None
        self.conn = None
        self.lock = threading.Lock()
        self.timeouts = 0

    def equal(self, a: str, b: str, timeout_s: float) -> bool:
        import multiprocessing as mp

        with self.lock:
            grace = 0.0
            if self.proc is None or not self.proc.is_alive():
                ctx = mp.get_context("spawn")
                self.conn, child = ctx.Pipe()
                self.proc = ctx.Process(target=_sympy_serve, args=(child,), daemon=True, name="rollflow-sympy")
                self.proc.start()
                grace = SYMPY_START_GRACE_S  # a fresh worker first imports sympy
            self.conn.send((a, b))
            if self.conn.poll(timeout_s + grace):
                return bool(self.conn.recv())
            self.timeouts += 1
            self.proc.kill()
            self.proc.join()
            self.proc = None
            return False


_SYMPY = _SympyWorker()


def math_equal(a: str, b: str, timeout_s: float = SYMPY_TIMEOUT_S) -> bool:
    """String-equal after normalisation, else numerically equal, else sympy-equal within `timeout_s`."""
    na, nb = _math_normalize(a), _math_normalize(b)
    if na == nb:
        return True
    try:
        return math.isclose(float(na), float(nb), rel_tol=1e-9, abs_tol=1e-12)
    except ValueError:
        pass
    if not na or not nb:
        return False
    return _SYMPY.equal(na, nb, timeout_s)


def math_reward(response: str, label: Any) -> float:
    """Final \\boxed{} answer (else the last number in the response) compared with the label's answer: equal after
    slime's normalisation (engine/math_grader.py), else numerically or sympy-equal (rollflow's leniency)."""
    from engine.math_grader import label_answer, last_boxed, normalize

    answer = last_boxed(response)
    if answer is None:
        numbers = _NUMBER.findall(response)
        if not numbers:
            return 0.0
        answer = numbers[-1]
    got, want = normalize(answer), normalize(label_answer(label))
    return float(got == want or math_equal(got, want))


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def squad_normalize(text: Any) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles (a, an, the) removed, spaces collapsed."""
    s = "".join(c for c in str(text).lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def f1_reward(response: str, label: Any) -> dict[str, float]:
    """Token F1 after `squad_normalize`, with precision and recall (as slime's f1, after HotpotQA's evaluator): a
    yes / no / noanswer on either side scores only when both sides are that same word."""
    pred, gold = squad_normalize(response), squad_normalize(label)
    zero = {"score": 0.0, "precision": 0.0, "recall": 0.0}
    if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
        return zero
    p_toks, g_toks = pred.split(), gold.split()
    common = sum((Counter(p_toks) & Counter(g_toks)).values())
    if common == 0:
        return zero
    p, r = common / len(p_toks), common / len(g_toks)
    return {"score": 2 * p * r / (p + r), "precision": p, "recall": r}


def deepscaler_reward(response: str, label: Any) -> float:
    """slime's deepscaler reward, for thinking models: only the text after the last </think> (else after
    "###Response") counts, 0 without either; its last \\boxed{} against the label's answer (a boxed label's
    content), graded as `math_reward` grades (MATH normalisation, then numeric / sympy equality); 0 without a
    boxed answer or with an empty label."""
    from engine.math_grader import label_answer, last_boxed, normalize

    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 2)[1]
    else:
        return 0.0
    answer = last_boxed(solution)
    if answer is None or str(label).strip() == "":
        return 0.0
    got, want = normalize(answer), normalize(label_answer(label))
    return float(got == want or math_equal(got, want))


# DAPO's answer normalisation (verl's and slime's math_dapo, after Minerva's in lm-evaluation-harness)
_DAPO_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DAPO_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}",
                 "\\;", ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_normalize(answer: Any) -> str:
    """A final answer as DAPO compares it: the part after the last "=", units and TeX spacing dropped, the
    content of $…$, \\text{}, \\textbf{}, \\overline{}, \\boxed{} kept, \\fracab / \\sqrta braced, digit
    groups' commas removed."""
    s = str(answer).split("=")[-1]
    for before, after in _DAPO_REPLACED:
        s = s.replace(before, after)
    for dropped in _DAPO_DROPPED:
        s = s.replace(dropped, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for command in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_reward(response: str, label: Any) -> float:
    """slime's dapo reward (DAPO's): the last "Answer: …" line within the response's last 300 characters,
    normalised (`dapo_normalize`), against the label: 1.0 when equal, else -1.0. The label is compared as an
    integer (DAPO-Math's answers all are), a label that is not a number as its normalised text."""
    found = _DAPO_ANSWER.findall(str(response)[-300:])
    got = dapo_normalize(found[-1]) if found else None
    want = dapo_normalize(label)
    try:
        want = str(int(float(want)))
    except ValueError:
        pass
    return 1.0 if got == want else -1.0


BUILTIN = {"exact_match": exact_match, "math": math_reward, "f1": f1_reward, "deepscaler": deepscaler_reward,
           "dapo": dapo_reward}
#: the rewards slime's boxed_ prefix applies to (deepscaler and dapo find the answer in the whole response)
BOXABLE = ("exact_match", "math", "f1")


def rule_based(rm_type: str) -> Callable[[str, Any], Any] | None:
    """A built-in reward by name, slime's `boxed_` prefix included (`boxed_exact_match`, `boxed_f1`: the response's
    last \\boxed{…} graded, "" without one); None for a name that is none."""
    if rm_type.startswith("boxed_"):
        inner = BUILTIN.get(rm_type[len("boxed_"):]) if rm_type[len("boxed_"):] in BOXABLE else None
        if inner is None:
            return None
        from engine.math_grader import last_boxed

        return lambda response, label: inner(last_boxed(response) or "", label)
    return BUILTIN.get(rm_type)


#: every value a sample's metadata "rm_type" may take (with --rm-url: remote_rm too)
SAMPLE_RM_TYPES = sorted([*BUILTIN, *(f"boxed_{k}" for k in BOXABLE)])


# ---- custom functions ------------------------------------------------------------------------------------------
#: How each hook flag's function is called (engine/rollout/hooks.py, the train workers): alternatives of
#: (positional arguments, keyword arguments, the call as the docs write it). load_function checks that the function
#: accepts one of them, so a wrong signature fails at start, naming the flag, not at the first call, hours in.
HOOK_CALLS: dict[str, list[tuple[int, tuple[str, ...], str]]] = {
    "--rollout-function-path": [(3, ("evaluation",), "fn(args, rollout_id, data_source, evaluation=False)")],
    "--custom-generate-function-path": [(3, (), "async fn(args, sample, sampling_params)")],
    "--rollout-sample-hook-path": [(2, (), "fn(args, sample, *, rollout_id=None, evaluation=False)")],
    "--custom-reward-post-process-path": [(2, (), "fn(args, samples)")],
    "--dynamic-sampling-filter-path": [(2, (), "fn(args, group)"), (1, (), "fn(group)")],
    "--rollout-sample-filter-path": [(2, (), "fn(args, groups)")],
    "--rollout-all-samples-process-path": [(3, (), "fn(args, all_samples, data_source)")],
    "--data-source-path": [(1, (), "cls(args)")],
    "--eval-function-path": [(3, ("evaluation",), "fn(args, rollout_id, data_source, evaluation=True)")],
    "--custom-rollout-log-function-path": [(5, (), "fn(rollout_id, args, samples, rollout_extra_metrics, "
                                                   "rollout_time)")],
    "--custom-eval-rollout-log-function-path": [(4, (), "fn(rollout_id, args, data, extra_metrics)")],
    "--custom-rm-path": [(2, (), "fn(args, sample)"), (1, (), "fn(sample)")],
    "--custom-advantage-function-path": [(2, (), "fn(args, rollout_data)")],
    "--custom-loss-function-path": [(3, (), "fn(args, batch, sum_of_sample_mean)")],
    "--custom-tis-function-path": [(1, ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks",
                                        "total_lengths", "response_lengths"),
                                    "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
                                    "total_lengths, response_lengths)")],
    "--custom-pg-loss-reducer-function-path": [(4, (), "fn(total_lengths, response_lengths, loss_masks, "
                                                       "calculate_per_token_loss)")],
    "--rollout-data-postprocess-path": [(3, (), "fn(args, rollout_id, rollout_data)")],
    "--custom-megatron-init-path": [(1, (), "fn(args)")],
    "--custom-megatron-before-log-prob-hook-path": [(3, (), "fn(args, model, store_prefix)")],
    "--custom-megatron-before-train-step-hook-path": [(6, (), "fn(args, rollout_id, step_id, model, optimizer, "
                                                              "opt_param_scheduler)")],
}


def check_call(fn: Callable, flag: str, path: str) -> None:
    """A ConfigError unless `fn` accepts one of the calls HOOK_CALLS lists for `flag` (a signature Python cannot
    inspect passes: it is checked when called)."""
    calls = HOOK_CALLS.get(flag)
    if not calls:
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    for n, kws, _ in calls:
        try:
            sig.bind(*([None] * n), **{k: None for k in kws})
            return
        except TypeError:
            continue
    raise ConfigError(Diagnosis(
        code="CONFIG", severity="error",
        what=f"{flag} {path!r} has the signature {getattr(fn, '__name__', path)}{sig}, but rollflow calls it as "
             + " or ".join(c for _, _, c in calls),
        fix=f"give it that signature (slime's contract for {flag}; docs/hooks.md)",
        facts={"flag": flag, "path": path, "signature": str(sig)}))


def load_function(path: str, flag: str) -> Callable:
    """`pkg.module:function`, slime's `pkg.module.function`, or `path/to/file.py:function`; a bad path, or a
    function that cannot take the flag's call (check_call), is a ConfigError naming `flag`."""
    mod_name, sep, fn_name = path.rpartition(":")
    if not sep and not path.endswith(".py"):
        mod_name, sep, fn_name = path.rpartition(".")
    if not sep or not mod_name or not fn_name:
        raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"{flag} {path!r} is not module:function (or module.function)",
                                    fix=f"{flag} my_pkg.module:function (or path/to/file.py:function)"))
    try:
        if mod_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
            if spec is None or spec.loader is None or not Path(mod_name).is_file():
                raise FileNotFoundError(mod_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
        fn = getattr(module, fn_name)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        from engine.config.slime_flags import slime_import_fix

        raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                    what=f"{flag} {path!r} cannot be loaded: {type(e).__name__}: {e}",
                                    fix=slime_import_fix(e, path)
                                    or "check the module path (on PYTHONPATH) and the function name")) from None
    if not callable(fn):
        raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=f"{flag} {path!r} is not callable",
                                    fix="point it at a function"))
    check_call(fn, flag, path)
    return fn


def _takes_args(fn: Callable) -> bool:
    """slime's `fn(args, sample)` rather than rollflow's `fn(sample)`: two required positional parameters."""
    from engine.rollout.hooks import takes_args

    return takes_args(fn, 1)


def load_custom(path: str) -> Callable:
    return load_function(path, "--custom-rm-path")


def _run_coro(coro) -> Any:
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def call_maybe_async(fn: Callable, arg: Any) -> Any:
    out = fn(arg)
    return _run_coro(out) if inspect.isawaitable(out) else out


def _check_reward(r: Any) -> float | dict[str, float]:
    """A number, or a dict of numbers; anything else is an error naming what came back. NaN / Inf pass through on
    purpose: the train step stops on them with the sample ids (RF13), or skips the step with the flag."""
    if isinstance(r, (bool, int, float)):
        return float(r)
    if isinstance(r, dict) and r and all(isinstance(v, (bool, int, float)) for v in r.values()):
        return {str(k): float(v) for k, v in r.items()}
    raise ValueError(f"returned {type(r).__name__} {str(r)[:80]!r}; expected a float or a dict of floats")


def split_category(reward: Any, key: str | None, sample: Sample) -> Any:
    """--log-reward-category `key`: a dict reward's `key` (any text: why it scored as it did) moves to the sample's
    metadata "reward_category"; the rest is the reward. A reward without it is category "none"."""
    if key is None:
        return reward
    if isinstance(reward, dict) and key in reward:
        reward = dict(reward)
        sample.metadata["reward_category"] = str(reward.pop(key))
        if not reward:
            raise ValueError(f"the reward dict holds only --log-reward-category's key {key!r}: no reward is left")
    else:
        sample.metadata["reward_category"] = "none"
    return reward


def select_key(reward: float | dict[str, float], key: str | None) -> float | dict[str, float]:
    """`reward` unchanged, after checking that a dict reward holds --reward-key `key` (a sample's scalar reward is
    then that value: Sample.scalar_reward). A number passes: a run may mix numeric and dict rewards (per-sample
    rm_type)."""
    if key is not None and isinstance(reward, dict) and key not in reward:
        raise ValueError(f"the reward dict has no key {key!r} (--reward-key / --eval-reward-key); its keys: "
                         f"{', '.join(sorted(reward))}")
    return reward


class RemoteRewardError(RuntimeError):
    """The reward service refused a sample (a 4xx) or did not answer after every attempt."""


class RemoteReward:
    """--rm-type remote_rm (slime's): each sample POSTed to --rm-url as {"prompt", "response", "label"}; the reply's
    JSON is the reward. A connection error, a timeout, a 429 or a 5xx is retried (ATTEMPTS in all, backoff
    0.5–1, 1–2, 2–4, 4–8 s); another 4xx is not (the same request would be refused again). Error messages show
    the URL with any password or token redacted.

    A group's requests go out together from a client of their own, in an event loop of the calling thread (a rollout
    scores groups in executor threads). bench/results/remote_reward.json, loopback service, 64 samples in 8 groups on
    the quiet 2-core machine, medians of 7 passes: 0.28 s a pass this way, 0.40 s through one event-loop thread and
    one kept-open client for the run (the variant first written; why it is slower was not profiled)."""

    ATTEMPTS = 5
    TIMEOUT_S = 120.0

    def __init__(self, url: str):
        from engine.tracking.secrets import redact_text

        self.url, self.shown = url, redact_text(url)

    def score_sync(self, samples: list[Sample]) -> list[Any]:
        """One reply (or the exception) per sample, the group's requests in flight together."""
        return _run_coro(self.score(samples))

    async def score(self, samples: list[Sample]) -> list[Any]:
        import httpx

        async with httpx.AsyncClient(timeout=self.TIMEOUT_S) as client:
            return await asyncio.gather(*(self._one(client, s) for s in samples), return_exceptions=True)

    async def _one(self, client, sample: Sample) -> Any:
        import random

        import httpx

        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        for attempt in range(1, self.ATTEMPTS + 1):
            try:
                r = await client.post(self.url, json=payload)
                why = f"HTTP {r.status_code}" if r.status_code == 429 or r.status_code >= 500 else None
            except httpx.TransportError as e:  # connection refused or reset, timeouts
                why = f"{type(e).__name__}: {e}"
            if why is None:
                break
            if attempt == self.ATTEMPTS:
                from engine.tracking.secrets import redact_text

                raise RemoteRewardError(f"{self.shown} did not answer after {attempt} attempts ({redact_text(why)})")
            await asyncio.sleep(2 ** (attempt - 2) * (1 + random.random()))
        if r.status_code >= 400:
            raise RemoteRewardError(f"{self.shown} refused the sample: HTTP {r.status_code} {r.text[:200]!r}")
        try:
            return r.json()
        except ValueError as e:  # the reply is not JSON
            raise RemoteRewardError(f"{self.shown} answered with no JSON ({e}): {r.text[:200]!r}") from None


class RewardModel:
    """Scores groups of samples in place: sets `reward`, or FAILED status with the reason."""

    def __init__(self, rm_type: str | None, custom_rm_path: str | None, group_rm: bool = False,
                 rm_url: str | None = None, reward_key: str | None = None, category_key: str | None = None):
        if custom_rm_path is None and rm_type is None:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error", what="no reward: --rm-type and "
                                        "--custom-rm-path are both unset", fix="--rm-type exact_match"))
        if group_rm and custom_rm_path is None:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error",
                                        what="--group-rm needs --custom-rm-path (the built-in rewards are per sample)",
                                        fix="drop --group-rm, or --custom-rm-path my_rm:score_group"))
        custom = load_custom(custom_rm_path) if custom_rm_path else None
        self.args = None  # slime's reward functions take `args` first: engine.rollout.hooks.HookArgs, set by place
        if custom is not None and _takes_args(custom):
            self.custom = lambda x: custom(self.args, x)
            self.custom_is_async = inspect.iscoroutinefunction(custom)
        else:
            self.custom, self.custom_is_async = custom, inspect.iscoroutinefunction(custom)
        self.remote = RemoteReward(rm_url) if rm_url and not custom_rm_path else None
        self.builtin = rule_based(rm_type) if rm_type and rm_type != "remote_rm" and not custom_rm_path else None
        self.group_rm = group_rm
        self.reward_key = reward_key
        self.category_key = category_key  # --log-reward-category

    @classmethod
    def of(cls, cfg: Any) -> "RewardModel":
        """The run's reward, from its flags."""
        return cls(cfg.rm_type, cfg.custom_rm_path, cfg.group_rm, cfg.rm_url, cfg.reward_key, cfg.log_reward_category)

    def keyed(self, reward_key: str | None) -> "RewardModel":
        """The same rewards with another --reward-key (the evaluation's --eval-reward-key)."""
        other = copy.copy(self)
        other.reward_key = reward_key
        return other

    def score_group(self, group: list[Sample]) -> None:
        for s in group:
            s.reward_key = self.reward_key
        live = [s for s in group if s.status not in (Status.FAILED, Status.ABORTED)]
        if not live:
            return
        if self.custom is not None and self.group_rm:
            try:
                rewards = call_maybe_async(self.custom, live)
                if not isinstance(rewards, (list, tuple)) or len(rewards) != len(live):
                    raise ValueError(f"returned {type(rewards).__name__} of length "
                                     f"{len(rewards) if hasattr(rewards, '__len__') else '?'} for {len(live)} samples")
                checked = [_check_reward(split_category(r, self.category_key, s)) for s, r in zip(live, rewards)]
            except Exception as e:  # one bad group must not crash the run
                for s in live:
                    self._fail(s, e)
                return
            for s, r in zip(live, checked):
                try:
                    s.reward = select_key(r, self.reward_key)
                except Exception as e:
                    self._fail(s, e)
            return
        if self.custom is None:  # built-in or remote, per sample (slime: a sample's metadata "rm_type" first)
            outs: list[Any] = [None] * len(live)
            remote = []
            for i, s in enumerate(live):
                try:
                    grader = self.grader(s)
                    if grader == "remote":
                        remote.append(i)
                    else:
                        outs[i] = grader(s.response, s.label)
                except Exception as e:
                    outs[i] = e
            if remote:
                for i, out in zip(remote, self.remote.score_sync([live[i] for i in remote])):
                    outs[i] = out
        elif self.custom_is_async:
            async def all_of_group():
                return await asyncio.gather(*[self.custom(s) for s in live], return_exceptions=True)

            outs = _run_coro(all_of_group())
        else:
            outs = []
            for s in live:
                try:
                    outs.append(self.custom(s))
                except Exception as e:
                    outs.append(e)
        for s, out in zip(live, outs):
            try:
                if isinstance(out, BaseException):
                    raise out
                s.reward = select_key(_check_reward(split_category(out, self.category_key, s)), self.reward_key)
            except Exception as e:
                self._fail(s, e)

    def grader(self, s: Sample) -> Callable[[str, Any], Any] | str:
        """The reward of sample `s`: its metadata's "rm_type" (slime's per-sample override, e.g. a dataset mixing
        math and QA rows), else the run's --rm-type; "remote" for the --rm-url service."""
        name = s.metadata.get("rm_type") if isinstance(s.metadata, dict) else None
        if not name:
            if self.remote is not None:
                return "remote"
            return self.builtin
        name = str(name).strip()
        if name == "remote_rm":
            if self.remote is None:
                raise ValueError("the sample's metadata rm_type is remote_rm, but the run has no --rm-url")
            return "remote"
        if (fn := rule_based(name)) is None:
            raise ValueError(f"the sample's metadata rm_type {name!r} is not one of {', '.join(SAMPLE_RM_TYPES)} "
                             "(or remote_rm with --rm-url)")
        return fn

    @staticmethod
    def _fail(s: Sample, e: BaseException) -> None:
        s.status, s.reward = Status.FAILED, 0.0
        s.metadata["failure"] = f"reward: {type(e).__name__}: {e}"
