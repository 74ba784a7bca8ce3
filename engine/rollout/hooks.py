"""Custom rollouts: slime's hook flags, with slime's names and call contracts.

| flag                                 | called as                                                 | returns                                          |
|--------------------------------------|-----------------------------------------------------------|--------------------------------------------------|
| `--rollout-function-path`            | `fn(args, rollout_id, data_source, evaluation=False)`     | `RolloutFnTrainOutput(samples, metrics)` or `[[Sample] × n] × B` |
| `--custom-generate-function-path`    | `async fn(args, sample, sampling_params[, evaluation])`   | the `Sample`, its response filled in             |
| `--rollout-sample-hook-path` (repeatable) | `fn(args, sample[, rollout_id, evaluation])` per sample, before its reward | the `Sample`, or `None` to keep it |
| `--custom-reward-post-process-path`  | `fn(args, samples)` (all samples of the rollout)          | `(raw_rewards, rewards)`: `rewards` replace GRPO's group normalisation |
| `--dynamic-sampling-filter-path`     | `fn(args, group)` (or `fn(group)`)                        | `bool` or `DynamicFilterOutput(keep, reason)`    |
| `--rollout-sample-filter-path`       | `fn(args, groups)` after the rollout                      | `None`; sets `sample.remove_sample = True` to keep a sample out of the loss |
| `--rollout-all-samples-process-path` | `fn(args, all_groups, data_source)` after the sample filter | ignored; all_groups has the dynamic filter's dropped groups too |
| `--data-source-path`                 | `cls(args)`, then `.get_samples(num_prompts)`             | `[[Sample] × n]` per prompt                      |
| `--eval-function-path`               | `fn(args, rollout_id, None, evaluation=True)` per evaluation | `RolloutFnEvalOutput(data={name: {"rewards": [...], "truncated": [...]}})` or that dict |

`args` is a `HookArgs`: every `rollflow train` flag as an attribute (`args.rollout_max_response_len`,
`args.n_samples_per_prompt`, …, as slime's argparse namespace), plus `args.engine` (`EngineClient`: `await
args.engine.generate(input_ids, sampling_params)` sends SGLang's `/generate` to the least-loaded serving engine —
a slime hook's `await post(url, payload)` becomes `await args.engine.post("/generate", payload)`), `args.tokenizer`,
`args.sampling_params` (the run's, SGLang's field names) and `args.rollout_id`.

A `Sample` a hook returns is checked before it is trained on (`check_sample`): `tokens` = prompt + response,
`loss_mask` and `rollout_log_probs` one entry per response token (tool / environment tokens: mask 0, any log-prob),
a final status. A hook that raises (or returns something else) fails the rollout task with `HookError`, naming the
flag, the function and the traceback; it is not retried (it would fail the same way). An engine that dies under a
hook is an infrastructure error as without hooks (retried; resent with --use-fault-tolerance).
"""
from __future__ import annotations

import asyncio
import inspect
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

from engine.diagnosis import Diagnosis, DiagnosisError
from engine.samples import Sample, Status

HOOK_FLAGS = {
    "rollout_function_path": "--rollout-function-path",
    "custom_generate_function_path": "--custom-generate-function-path",
    "custom_reward_post_process_path": "--custom-reward-post-process-path",
    "dynamic_sampling_filter_path": "--dynamic-sampling-filter-path",
    "rollout_sample_filter_path": "--rollout-sample-filter-path",
    "rollout_all_samples_process_path": "--rollout-all-samples-process-path",
    "data_source_path": "--data-source-path",
    "eval_function_path": "--eval-function-path",
    "custom_rollout_log_function_path": "--custom-rollout-log-function-path",
    "custom_eval_rollout_log_function_path": "--custom-eval-rollout-log-function-path",
}


class HookError(DiagnosisError):
    """A user hook raised or broke its contract: the rollout fails, not retried (code HOOK)."""

    @classmethod
    def of(cls, flag: str, path: str, what: str, exc: BaseException | None = None) -> "HookError":
        from engine.config.slime_flags import slime_import_fix

        tb = "".join(traceback.format_exception(exc)).rstrip() if exc is not None else ""
        return cls(Diagnosis(code="HOOK", severity="error",
                             what=f"{flag} {path!r} {what}" + (f"\n{tb}" if tb else ""),
                             fix=(exc is not None and slime_import_fix(exc, path)) or
                             f"fix the function behind {flag} (the traceback above is the hook's own), or drop the "
                             "flag; a hook error is not retried: it would fail the same way",
                             facts={"flag": flag, "path": path, "traceback": tb}))


@dataclass
class RolloutFnTrainOutput:
    """What a `--rollout-function-path` function returns (slime's type of the same name)."""
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """What an `--eval-function-path` function returns (slime's type of the same name): per eval set name, the
    per-sample "rewards" (numbers) and optionally "truncated" (bools, one per reward) and "samples" (kept by the
    function's caller only for their count); `metrics`, numbers published as they are named."""
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class DynamicFilterOutput:
    """What a dynamic sampling filter may return (slime's type of the same name); a bare bool works too."""
    keep: bool
    reason: str | None = None


class EngineClient:
    """The rollout engines as one async client (SGLang's HTTP API; the built-in engine speaks the same).

    Requests go to the serving engine with the fewest requests in flight; with --use-fault-tolerance a request
    whose engine dies is sent again to another (or the restarted) engine. `rid`s carry the rollout's prefix, so a
    cut or failed round aborts them on the engines (`/abort_request`).
    """

    def __init__(self, client: httpx.AsyncClient | None, engines: Any, outstanding: dict[str, int] | None = None,
                 rid_prefix: str = "", on_send: Callable[[str], None] | None = None, timeout_s: float = 600.0):
        """client: the rollout loop's connection pool; None (a --rollout-function-path, which runs its own event
        loops) opens one per request, with the engines' API key and `timeout_s`."""
        self._client, self._engines, self._outstanding = client, engines, outstanding if outstanding is not None else {}
        self._timeout_s = timeout_s
        self._rid_prefix, self._on_send, self._count = rid_prefix, on_send, 0
        self.retries = 0

    @property
    def urls(self) -> list[str]:
        return list(self._engines.serving())

    def _pick(self) -> str | None:
        urls = self._engines.serving()
        for u in urls:
            self._outstanding.setdefault(u, 0)
        return min(urls, key=lambda u: self._outstanding[u]) if urls else None

    async def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST `payload` to `path` (e.g. "/generate") on the least-loaded serving engine; its JSON reply."""
        from engine.rollout.loop import EngineFailure

        payload = dict(payload)
        if path == "/generate" and "rid" not in payload and self._rid_prefix:
            self._count += 1
            payload["rid"] = f"{self._rid_prefix}h{self._count}"
        while True:
            url = self._pick()
            if url is None:
                if not self._engines.fault_tolerant:
                    raise EngineFailure("no rollout engine is serving")
                await asyncio.sleep(0.2)
                continue
            self._outstanding[url] += 1
            if self._on_send:
                self._on_send(url)
            try:
                if self._client is not None:
                    r = await self._client.post(url + path, json=payload)
                else:
                    from engine.rollout.client import auth_headers

                    async with httpx.AsyncClient(timeout=httpx.Timeout(self._timeout_s, connect=10.0),
                                                 headers=auth_headers(getattr(self._engines, "api_key", None))) as c:
                        r = await c.post(url + path, json=payload)
                r.raise_for_status()
                return r.json()
            except httpx.TransportError as e:
                if not self._engines.fault_tolerant:
                    raise EngineFailure(f"engine {url} failed during {path} ({type(e).__name__}: {e}); "
                                        "--use-fault-tolerance restarts dead engines and resends their requests") from e
                self._engines.report_failure(url)
                self.retries += 1
            finally:
                self._outstanding[url] -= 1

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *,
                       return_logprob: bool = True, **fields: Any) -> dict[str, Any]:
        """SGLang's /generate for one sequence: {"text", "output_ids", "meta_info": {"output_token_logprobs":
        [[logprob, token_id, null], …], "finish_reason": {"type": "stop"|"length"|"abort", "matched": …}, …}}."""
        out = await self.post("/generate", {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                                            "return_logprob": return_logprob, **fields})
        return out[0] if isinstance(out, list) else out


#: what a HookArgs holds besides the run's flags (a --custom-config key may not take these names)
HOOK_ARGS_OWN = frozenset({"cfg", "tokenizer", "sampling_params", "rollout_id", "engine", "evaluation", "eval_sets",
                           "tracker", "with_engine"})


class HookArgs:
    """`args` of every hook: the run's flags as attributes, plus the engine client, the tokenizer, the sampling
    params and the rollout id (see the module docstring)."""

    def __init__(self, cfg: Any, *, tokenizer: Any, sampling_params: dict[str, Any], rollout_id: int,
                 engine: EngineClient | None = None, evaluation: bool = False,
                 eval_sets: dict[str, list] | None = None, tracker: Any = None):
        self.cfg, self.tokenizer, self.sampling_params = cfg, tokenizer, sampling_params
        self.rollout_id, self.engine, self.evaluation = rollout_id, engine, evaluation
        self.eval_sets = eval_sets or {}  # --eval-prompt-data as loaded: name → rows (prompt, label, metadata)
        self.tracker = tracker  # the run's MLflow tracker (log_metrics(metrics, step)), for the logging hooks

    def __getattr__(self, name: str) -> Any:  # only called for names not set above: the run's flags
        cfg = self.__dict__.get("cfg")
        if cfg is not None and hasattr(cfg, name):
            return getattr(cfg, name)
        raise AttributeError(f"hook args have no {name!r}: they hold every `rollflow train` flag (e.g. "
                             "args.rollout_max_response_len), --custom-config-path's arguments, plus engine, "
                             "tokenizer, sampling_params, rollout_id")

    def with_engine(self, engine: EngineClient) -> "HookArgs":
        return HookArgs(self.cfg, tokenizer=self.tokenizer, sampling_params=self.sampling_params,
                        rollout_id=self.rollout_id, engine=engine, evaluation=self.evaluation,
                        eval_sets=self.eval_sets, tracker=self.tracker)


# ---- loading and calling -------------------------------------------------------------------------------------
def load_hook(cfg: Any, key: str) -> Callable | None:
    from engine.rewards import load_function

    path = getattr(cfg, key)
    return load_function(path, HOOK_FLAGS[key]) if path else None


def _positional(fn: Callable) -> int:
    """Required positional parameters (0 when the signature cannot tell: `*args`, or not inspectable)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 0
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def takes_args(fn: Callable, without_args: int) -> bool:
    """slime's hooks take `args` first; rollflow's older ones did not (e.g. a filter `fn(group)`)."""
    return _positional(fn) > without_args


def accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


async def call_async_hook(flag: str, path: str, fn: Callable[..., Awaitable | Any], *a: Any, **kw: Any) -> Any:
    """Call a hook (sync or async); anything it raises becomes a HookError — except an engine that failed under it
    (EngineFailure, retried as without hooks) and cancellation."""
    from engine.rollout.loop import EngineFailure, RolloutTimeout

    try:
        out = fn(*a, **kw)
        return await out if inspect.isawaitable(out) else out
    except (EngineFailure, RolloutTimeout, asyncio.CancelledError, HookError):
        raise
    except Exception as e:
        raise HookError.of(flag, path, f"raised {type(e).__name__}: {e}", e) from e


def call_hook(flag: str, path: str, fn: Callable, *a: Any, **kw: Any) -> Any:
    """call_async_hook from sync code: a sync hook runs in this thread, outside any event loop (it may run its own,
    as slime's rollout functions do); an async one to completion."""
    from engine.rewards import _run_coro
    from engine.rollout.loop import EngineFailure, RolloutTimeout

    try:
        out = fn(*a, **kw)
        return _run_coro(out) if inspect.isawaitable(out) else out
    except (EngineFailure, RolloutTimeout, HookError):
        raise
    except Exception as e:
        raise HookError.of(flag, path, f"raised {type(e).__name__}: {e}", e) from e


# ---- what a hook hands back ----------------------------------------------------------------------------------
_FINAL = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED)


def check_sample(sample: Any, flag: str, path: str, *, prompt_ids: list[int] | None = None) -> Sample:
    """A Sample whose response is consistent, or a HookError saying which field is wrong and how."""
    def bad(what: str) -> HookError:
        return HookError.of(flag, path, f"returned {what}")

    if not isinstance(sample, Sample):
        kind = "a list" if isinstance(sample, list) else type(sample).__name__
        raise bad(f"{kind} instead of a Sample (one trainable sample per call; a fan-out into several samples "
                  "is not supported: put the turns of one trajectory in one Sample with a loss mask)")
    if isinstance(sample.status, str) and not isinstance(sample.status, Status):
        try:
            sample.status = Status(sample.status)
        except ValueError:
            raise bad(f"a sample with status {sample.status!r}; one of "
                      f"{', '.join(s.value for s in _FINAL)}") from None
    if sample.status not in _FINAL:
        raise bad(f"sample {sample.index} still {sample.status.value}: set sample.status to COMPLETED (stopped), "
                  "TRUNCATED (hit the length limit), ABORTED or FAILED")
    R = sample.response_length
    if R < 0 or R > len(sample.tokens):
        raise bad(f"sample {sample.index} with response_length {R} and {len(sample.tokens)} tokens")
    if prompt_ids is not None and list(sample.tokens[:len(sample.tokens) - R]) != list(prompt_ids):
        raise bad(f"sample {sample.index} whose tokens do not start with its prompt's {len(prompt_ids)} token ids "
                  "(tokens must be prompt + response; response_length counts the response, tool tokens included)")
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        if len(sample.loss_mask) != R:
            raise bad(f"sample {sample.index} with {len(sample.loss_mask)} loss-mask entries for response_length {R} "
                      "(one per response token: 1 = the model's token, 0 = a tool's or the environment's)")
        if any(m not in (0, 1) for m in sample.loss_mask):
            raise bad(f"sample {sample.index} with a loss mask that is not 0 / 1")
        if len(sample.rollout_log_probs) != R:
            raise bad(f"sample {sample.index} with {len(sample.rollout_log_probs)} rollout log-probs for "
                      f"response_length {R} (one per response token: the engine's "
                      "meta_info.output_token_logprobs for the model's tokens, e.g. 0.0 for tool tokens)")
    return sample


def new_samples(prompt_ids: list[int], row: Any, *, n: int, group_index: int, rollout_id: int,
                draw_index: int) -> list[Sample]:
    """n PENDING samples of one prompt, as a generate hook receives them (tokens = the prompt's ids)."""
    return [Sample(index=group_index * n + j, group_index=group_index, rollout_id=rollout_id, prompt=row.prompt,
                   tokens=list(prompt_ids), label=row.label,
                   metadata={**row.metadata, "row": row.row, "draw_index": draw_index}) for j in range(n)]


# ---- the data source -----------------------------------------------------------------------------------------
class PromptDataSource:
    """The built-in data source (slime's RolloutDataSource): the prompt file's rows in epoch order, each as a
    group of n samples whose `tokens` are the rendered prompt. Read-only, as slime's."""

    def __init__(self, dataset: Any, render: Callable[[Any], list[int]], n: int):
        self.dataset, self.render, self.n = dataset, render, n
        self.sample_group_index = 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for row in self.dataset.next_batch(num_samples):
            ids = self.render(row)
            groups.append(new_samples(ids, row, n=self.n, group_index=self.sample_group_index, rollout_id=-1,
                                      draw_index=self.sample_group_index))
            self.sample_group_index += 1
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError("the built-in data source is read-only (as slime's RolloutDataSource); keep your own "
                           "buffer in a --data-source-path class")

    def __len__(self) -> int:
        return len(self.dataset.rows)

    def state(self) -> dict[str, Any]:
        return self.dataset.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.dataset.load_state(state)


class CustomDataSource:
    """A `--data-source-path` class behind the built-in interface. Its state is checkpointed when it has
    `state_dict()` / `load_state_dict(d)` (JSON-serialisable; kept in the checkpoint manifest and restored on resume
    and before a retried rollout)."""

    def __init__(self, obj: Any, path: str, render: Callable[[Any], list[int]] | None = None):
        self.obj, self.path, self.render = obj, path, render
        if not callable(getattr(obj, "get_samples", None)):
            raise HookError.of("--data-source-path", path, "built an object without get_samples(num_samples)")
        self.stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = call_hook("--data-source-path", self.path, self.obj.get_samples, num_samples)
        if not isinstance(groups, list) or not all(isinstance(g, list) and g and all(isinstance(s, Sample) for s in g)
                                                   for g in groups):
            raise HookError.of("--data-source-path", self.path, "get_samples did not return a list of groups "
                               "(lists) of Samples")
        if len(groups) != num_samples:
            raise HookError.of("--data-source-path", self.path,
                               f"get_samples({num_samples}) returned {len(groups)} groups")
        for g in groups:  # a sample without tokens gets its prompt rendered (chat template when asked)
            for s in g:
                if not s.tokens and self.render is not None:
                    s.tokens = self.render(s.prompt)
        return groups

    def state(self) -> dict[str, Any] | None:
        return call_hook("--data-source-path", self.path, self.obj.state_dict) if self.stateful else None

    def load_state(self, state: dict[str, Any] | None) -> None:
        if self.stateful and state is not None:
            call_hook("--data-source-path", self.path, self.obj.load_state_dict, state)


def load_data_source(cfg: Any, args: HookArgs, render: Callable[[Any], list[int]] | None = None
                     ) -> CustomDataSource | None:
    cls = load_hook(cfg, "data_source_path")
    if cls is None:
        return None
    return CustomDataSource(call_hook("--data-source-path", cfg.data_source_path, cls, args), cfg.data_source_path,
                            render)


# ---- after the rollout ---------------------------------------------------------------------------------------
def apply_sample_filter(fn: Callable, path: str, args: HookArgs, groups: list[list[Sample]]) -> int:
    """--rollout-sample-filter-path: fn(args, groups) marks `remove_sample`; returns how many were removed."""
    call_hook("--rollout-sample-filter-path", path, fn, args, groups)
    return sum(bool(getattr(s, "remove_sample", False)) for g in groups for s in g)


def apply_reward_post_process(fn: Callable, path: str, args: HookArgs, samples: list[Sample]) -> None:
    """--custom-reward-post-process-path: (raw_rewards, rewards) = fn(args, samples); each sample keeps its
    post-processed reward in `advantage_reward` (what the advantage estimator starts from, without GRPO's own
    group normalisation)."""
    out = call_hook("--custom-reward-post-process-path", path, fn, args, samples)
    try:
        raw, processed = out
        processed = [float(x) for x in processed]
    except (TypeError, ValueError) as e:
        raise HookError.of("--custom-reward-post-process-path", path,
                           f"returned {type(out).__name__} {str(out)[:80]!r}; expected (raw_rewards, rewards), two "
                           f"lists of {len(samples)} numbers", e) from None
    if len(processed) != len(samples):
        raise HookError.of("--custom-reward-post-process-path", path,
                           f"returned {len(processed)} rewards for {len(samples)} samples")
    for s, r in zip(samples, processed):
        s.advantage_reward = r


async def apply_sample_hooks(hooks: list[tuple[str, Callable]], args: HookArgs, sample: Sample) -> Sample:
    """--rollout-sample-hook-path, in order: each returns the Sample that replaces the one it got, or None to keep
    it; rollout_id and evaluation are passed to a function that takes them (slime's contract). The result is
    checked as a generate hook's (check_sample: prompt unchanged, one mask entry and log-prob per response
    token)."""
    flag = "--rollout-sample-hook-path"
    prompt = list(sample.tokens[:len(sample.tokens) - sample.response_length])
    for path, fn in hooks:
        kw = {k: v for k, v in (("rollout_id", args.rollout_id), ("evaluation", args.evaluation)) if accepts(fn, k)}
        out = await call_async_hook(flag, path, fn, args, sample, **kw)
        if out is not None:
            if not isinstance(out, Sample):
                raise HookError.of(flag, path, f"returned {type(out).__name__}; expected the Sample or None")
            sample = out
        check_sample(sample, flag, path, prompt_ids=prompt)
    return sample


def load_sample_hooks(cfg: Any) -> list[tuple[str, Callable]]:
    from engine.rewards import load_function

    return [(path, load_function(path, "--rollout-sample-hook-path"))
            for path in getattr(cfg, "rollout_sample_hook_path", None) or []]


@dataclass
class Hooks:
    """The run's hooks, loaded once (a bad path is a ConfigError at start, naming the flag)."""
    rollout: Callable | None = None
    generate: Callable | None = None
    post_process: Callable | None = None
    sample_filter: Callable | None = None
    all_samples: Callable | None = None
    evaluate: Callable | None = None
    rollout_log: Callable | None = None
    eval_log: Callable | None = None
    sample_hooks: list[tuple[str, Callable]] = field(default_factory=list)  # (path, fn) per --rollout-sample-hook-path
    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, cfg: Any) -> "Hooks":
        return cls(rollout=load_hook(cfg, "rollout_function_path"),
                   generate=load_hook(cfg, "custom_generate_function_path"),
                   post_process=load_hook(cfg, "custom_reward_post_process_path"),
                   sample_filter=load_hook(cfg, "rollout_sample_filter_path"),
                   all_samples=load_hook(cfg, "rollout_all_samples_process_path"),
                   evaluate=load_hook(cfg, "eval_function_path"),
                   rollout_log=load_hook(cfg, "custom_rollout_log_function_path"),
                   eval_log=load_hook(cfg, "custom_eval_rollout_log_function_path"),
                   sample_hooks=load_sample_hooks(cfg),
                   paths={k: getattr(cfg, k) for k in HOOK_FLAGS if getattr(cfg, k, None)})


def eval_output_metrics(out: Any, flag: str, path: str) -> dict[str, float]:
    """An `--eval-function-path` result → eval/<name>_accuracy (the mean reward) and eval/<name>_truncated_share
    per set, plus its numeric `metrics`; anything else is a HookError naming what is wrong."""
    import math
    import re

    data, extra = (out.data, out.metrics or {}) if hasattr(out, "data") else (out, {})
    if not isinstance(data, dict) or not data:
        raise HookError.of(flag, path, f"returned {type(data).__name__}; expected RolloutFnEvalOutput(data={{name: "
                                       "{'rewards': [...]}}}) or that dict, with at least one eval set")
    metrics: dict[str, float] = {}
    for name, d in data.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise HookError.of(flag, path, f"eval set name {name!r} is not a word of letters, digits, _ or - (it "
                                           "names the metrics eval/<name>_*)")
        rewards = d.get("rewards") if isinstance(d, dict) else None
        if (not isinstance(rewards, (list, tuple)) or not rewards
                or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
                           for r in rewards)):
            raise HookError.of(flag, path, f"eval set {name!r}: 'rewards' must be a non-empty list of finite "
                                           f"numbers, one per sample; got {str(rewards)[:120]}")
        metrics[f"eval/{name}_accuracy"] = sum(rewards) / len(rewards)
        truncated = d.get("truncated")
        if truncated is not None:
            if not isinstance(truncated, (list, tuple)) or len(truncated) != len(rewards):
                raise HookError.of(flag, path, f"eval set {name!r}: 'truncated' must hold one bool per reward "
                                               f"({len(rewards)}); got {str(truncated)[:120]}")
            metrics[f"eval/{name}_truncated_share"] = sum(bool(t) for t in truncated) / len(truncated)
    metrics.update({k: float(v) for k, v in extra.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return metrics
