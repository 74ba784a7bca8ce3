"""Model, data and reward flags."""
import json
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from engine import PROJECT_ROOT
from engine.config.base import Section, config_error

BUNDLED_MODEL = str(PROJECT_ROOT / "examples" / "tiny-qwen2-arith")
BUNDLED_TRAIN = str(PROJECT_ROOT / "examples" / "data" / "arith" / "train.jsonl")
BUNDLED_TEST = str(PROJECT_ROOT / "examples" / "data" / "arith" / "test.jsonl")

#: the chat template's arguments rollflow sets itself (--apply-chat-template-kwargs may not)
TEMPLATE_ARGS_SET = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt"})


class DataArgs(Section):
    hf_checkpoint: str = BUNDLED_MODEL
    """Hugging Face model directory: the policy's initial weights, tokenizer and chat template (default: the bundled tiny Qwen2 model). On a cluster every node reads the same path, or give `s3://bucket/prefix`: each node (and the driver) downloads it once into its cache, $ROLLFLOW_MODEL_CACHE or ~/.cache/rollflow/models (docs/cluster.md)."""

    model_name: Optional[str] = None
    """Architecture name (e.g. qwen2, llama) so workers need not infer it from files (RF04)."""

    prompt_data: str = BUNDLED_TRAIN
    """Training prompts: a JSONL or Parquet file, or an s3:// object (fetched once into the cache of docs/cluster.md); `path@[a:b]` takes rows a..b-1 (default: the bundled arithmetic task)."""

    rollout_max_prompt_len: Optional[int] = Field(None, ge=1)
    """Drop the --prompt-data rows whose prompt is longer than this many tokens (rendered as the engines get it,
    chat template included) when the data is loaded (slime's flag); the log says how many and which lines. Eval
    prompts and a --data-source-path class's are not filtered. A resume keeps it (it decides which rows a data
    position counts)."""

    eval_prompt_data: Optional[list[str]] = [BUNDLED_TEST]
    """Held-out prompts scored before and after training (and every --eval-interval): one JSONL or Parquet file
    (metrics eval/test_*), or NAME PATH pairs as slime takes them (`--eval-prompt-data aime aime.jsonl gsm8k
    gsm8k.jsonl`: eval/aime_*, eval/gsm8k_*; the first set is the run's headline accuracy); empty to skip."""

    eval_max_samples: int = Field(128, ge=1)
    """At most this many prompts of each eval set are scored."""

    eval_interval: Optional[int] = Field(None, ge=1)
    """Also evaluate every N rollouts (after that rollout's weight sync; logged at step = rollouts trained), for an
    eval curve; before and after training always (slime's flag). Needs eval sets (an error with --eval-prompt-data ''
    and no --eval-config)."""

    n_samples_per_eval_prompt: int = Field(1, ge=1)
    """Samples per eval prompt: 1 = greedy (eval/<set>_accuracy); k > 1 = k samples at --rollout-temperature,
    logged as eval/<set>_mean_at_k (their mean reward, also the accuracy) and eval/<set>_pass_at_k (the mean over
    prompts of the best of k rewards: pass@k for 0/1 rewards). --eval-temperature changes the temperature."""

    eval_temperature: Optional[float] = Field(None, ge=0.0)
    """Sampling temperature of the evaluation (slime's flag). Default: 0 (greedy) with --n-samples-per-eval-prompt
    1, else --rollout-temperature."""

    eval_top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    """Nucleus threshold of the evaluation (slime's flag). Default: --rollout-top-p."""

    eval_max_response_len: Optional[int] = Field(None, ge=1)
    """New tokens an evaluation answer may take (slime's flag), e.g. longer than training's. Default:
    --rollout-max-response-len. Preflight checks the eval prompts against it."""

    @field_validator("eval_prompt_data", mode="before")
    @classmethod
    def _eval_sets(cls, v):
        """A single path (a YAML string, older configs) is one set; "" or nothing is none."""
        if isinstance(v, str):
            v = [v]
        v = [x for x in (v or []) if x != ""]
        if len(v) > 1 and len(v) % 2:
            raise ValueError(f"--eval-prompt-data takes one path or NAME PATH pairs; got {len(v)} values {v}: "
                             "add the missing name or path")
        names = v[0::2] if len(v) > 1 else []
        bad = [n for n in names if not n.replace("_", "").replace("-", "").isalnum()]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"--eval-prompt-data names {names}: each a distinct word of letters, digits, _ or - "
                             "(it names the metrics eval/<name>_accuracy)")
        return v or None

    rollout_max_context_len: Optional[int] = Field(None, ge=2)
    """The most tokens a sample may hold, prompt and response (slime's flag): each group asks the engine for min(--rollout-max-response-len, this − its prompt's tokens) new tokens (a --custom-generate-function-path gets that too, and reads the flag as args.rollout_max_context_len for its later turns), and, unless --rollout-max-prompt-len is set, prompts of this many tokens or more are dropped when the data is loaded (slime's default --rollout-max-prompt-len = this − 1). A resume keeps it."""

    eval_max_context_len: Optional[int] = Field(None, ge=2)
    """The same for the evaluation (slime's flag); default: --rollout-max-context-len."""

    eval_max_prompt_len: Optional[int] = Field(None, ge=1)
    """Drop eval prompts of more tokens than this (after the chat template) when an eval set is loaded (slime's
    flag), before --eval-max-samples are taken; the dropped lines are logged, and a set left empty is a DATA error."""

    eval_min_new_tokens: Optional[int] = Field(None, ge=0)
    """The fewest tokens an eval answer has (slime's flag, SGLang's min_new_tokens): EOS, --rollout-stop-token-ids and stop strings cannot end it earlier (the engine masks the stop tokens until then). At most the answer length; default 0. --eval-config's per-set `min_new_tokens` overrides it."""

    eval_top_k: Optional[int] = None
    """Top-k of the evaluation (slime's flag); -1 = off. Default: --rollout-top-k."""

    eval_input_key: Optional[str] = None
    """Row key of the eval prompts (slime's flag), when the eval files name it otherwise than the training data.
    Default: --input-key."""

    eval_label_key: Optional[str] = None
    """Row key of the eval answers (slime's flag). Default: --label-key."""

    eval_tool_key: Optional[str] = None
    """Row key of the eval prompts' tools (slime's flag), read as --tool-key reads the training data's. Default: --tool-key."""

    skip_eval_before_train: bool = False
    """Do not evaluate before the first rollout (slime's flag), e.g. to start training sooner: the summary's accuracy
    before training is then unknown; the evaluations every --eval-interval and after training still run."""

    eval_config: Optional[str] = None
    """A YAML file of eval sets, each with its own keys, reward and sampling (slime's flag): `eval: {defaults: {...}, datasets: [{name, path, rm_type, prompt_key/input_key, label_key, metadata_key, tool_key, n_samples_per_eval_prompt, temperature, top_p, top_k, max_response_len, min_new_tokens, stop, stop_token_ids, metadata_overrides}]}`. A field set neither by the dataset nor by `defaults` comes from the flags (--eval-temperature, …). Replaces --eval-prompt-data (setting both is an error). Format: docs/engines.md, "Evaluation"; the flags stay the default of every field."""

    @property
    def eval_sets(self) -> list[tuple[str, str]]:
        """(name, path) of every eval set: one path is named "test"; --eval-config's datasets when set."""
        if self.eval_config:
            return [(d.name, d.path) for d in self.eval_datasets()]
        v = self.eval_prompt_data or []
        return [("test", v[0])] if len(v) == 1 else list(zip(v[0::2], v[1::2]))

    def eval_datasets(self) -> list:
        """Every eval set with each of its fields resolved (engine/config/eval_config.py: the --eval-config entry,
        its `defaults`, then the flags); from --eval-prompt-data's pairs, with the flags, without --eval-config."""
        from engine.config import eval_config

        if self.eval_config:
            sets = eval_config.load(self.eval_config)
        else:
            sets = [eval_config.EvalDataset(name=name, path=path) for name, path in self.eval_sets]
        return [d.resolved(self) for d in sets]

    input_key: str = "prompt"
    """Row key holding the prompt (a string, or a list of chat messages)."""

    label_key: Optional[str] = "label"
    """Row key holding the reference answer passed to the reward function."""

    metadata_key: Optional[str] = None
    """Row key holding a dict copied into each sample's metadata."""

    tool_key: Optional[str] = "tools"
    """Row key holding the prompt's tools (slime's flag): a list of tool schemas, or its JSON text. --apply-chat-template passes them to the chat template as `tools` wherever a prompt is rendered (rollout, evaluation, the SFT rollout's conversations, where they are never trained on; the length checks count them); every sample also carries them as metadata["tools"] for custom generate and reward functions. A row without the key (or null) has none; anything but a list is a DATA error naming the line. '' reads no tools."""

    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (a string prompt becomes one user message)."""

    apply_chat_template_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the chat template, a JSON object (slime's flag), e.g. `'{"enable_thinking": false}'` for Qwen3's template. Every rendering of a prompt gets them: rollout, evaluation, the length checks and the doctor's. Needs --apply-chat-template."""

    rollout_shuffle: bool = False
    """Shuffle prompts every epoch (seeded by --seed)."""

    rm_type: Optional[Literal["exact_match", "math", "f1", "deepscaler", "dapo", "boxed_exact_match", "boxed_f1",
                              "remote_rm"]] = "exact_match"
    """Built-in reward: exact_match (stripped text == label), math (final \\boxed{} or last number vs the label, slime's MATH normalisation, then numeric / sympy-equivalent), f1 (SQuAD-normalised token F1, with precision and recall), deepscaler (slime's, for thinking models: the last \\boxed{} after the last </think>, else after "###Response", graded as math; 0 without them), dapo (slime's DAPO reward: the last "Answer: …" line of the response's last 300 characters against the integer label after DAPO's normalisation, 1 or -1), boxed_exact_match / boxed_f1 (slime's boxed_ prefix: the response's last \\boxed{} graded, "" without one), remote_rm (a reward service at --rm-url, slime's). As in slime, a row's metadata (--metadata-key) may name its own, e.g. "rm_type": "math"; preflight checks the names."""

    rm_url: Optional[str] = None
    """--rm-type remote_rm: the reward service's URL (http or https). Each sample is POSTed as slime sends it, JSON {"prompt", "response", "label"}, and the reply's JSON is its reward: a number, or a dict of numbers (its "score" is the reward, the others are logged). A connection error, a 429 or a 5xx is retried 4 times with backoff (~15 s in all); another 4xx, or no answer after that, fails the sample (FAILED, reason in its metadata; a rollout where every sample failed is retried). The samples of a group are sent at once."""

    custom_rm_path: Optional[str] = None
    """Custom reward `module:function` or `path/to/file.py:function`, called as fn(sample) -> float | dict (sync or async)."""

    group_rm: bool = False
    """Call the custom reward once per group: fn(samples) -> list of rewards."""

    reward_key: Optional[str] = None
    """When the reward is a dict (f1's {"score", "precision", "recall"}, a custom reward's, the --rm-url service's, a --rollout-function-path's): the key whose value is the training reward (slime's flag), e.g. `--rm-type f1 --reward-key recall`. Unset: its "score" key, else the mean of its values. Every key is still logged. A scored dict without the key fails that sample (FAILED, the dict's keys in its metadata); one a rollout function set is a HOOK error. A number reward is used as it is. With --load-debug-rollout-data: another key of the recorded rewards (the same samples, another reward). Refused where every reward is a number (--rm-type exact_match / math without --metadata-key, no custom reward, rollout function or replay)."""

    log_reward_category: Optional[str] = None
    """Log the share of each category a reward dict names under this key (slime's flag), e.g. a custom reward returning `{"score": 0, "why": "format_error"}` with `--log-reward-category why` gives rollout/reward_category/format_error. The key's value (any text) is taken out of the reward dict when the sample is scored and kept in its metadata as "reward_category"; the rest of the dict is the reward as usual. A sample without the key counts as "none". Needs rewards that can be dicts of your making: --custom-rm-path, --rm-url, --rollout-function-path or a replay."""

    eval_reward_key: Optional[str] = None
    """The same for the evaluation's accuracy (slime's flag); unset: --reward-key."""

    @field_validator("apply_chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs_json(cls, v: Any) -> Any:
        """The flag's JSON text (the command line gives a string) → a dict; a YAML file may give the dict."""
        from engine.config.base import json_object

        v = json_object(v, '{"enable_thinking": false}')
        taken = sorted(set(v) & TEMPLATE_ARGS_SET)
        if taken:
            raise ValueError(f"{', '.join(taken)} are set by rollflow itself (the messages, tokenize=False, "
                             "add_generation_prompt=True); leave them out")
        return v

    @model_validator(mode="after")
    def _template_kwargs_need_template(self) -> "DataArgs":
        if self.apply_chat_template_kwargs and not self.apply_chat_template:
            raise config_error(f"--apply-chat-template-kwargs {json.dumps(self.apply_chat_template_kwargs)} is read "
                               "only by the chat template, and --apply-chat-template is off: prompts are raw text",
                               "add --apply-chat-template, or drop --apply-chat-template-kwargs",
                               field="apply_chat_template_kwargs", value=self.apply_chat_template_kwargs)
        return self

    @model_validator(mode="after")
    def _remote_reward(self) -> "DataArgs":
        from engine.diagnosis import ConfigError, Diagnosis
        from engine.tracking.secrets import redact_text

        what = fix = None
        if self.rm_type == "remote_rm" and not self.rm_url:
            what, fix = "--rm-type remote_rm needs the service's --rm-url", "--rm-url http://HOST:PORT/PATH"
        elif self.rm_url and self.rm_type != "remote_rm":
            what = f"--rm-url {redact_text(self.rm_url)} is read only with --rm-type remote_rm (now {self.rm_type})"
            fix = "--rm-type remote_rm, or drop --rm-url"
        elif self.rm_url and not self.rm_url.startswith(("http://", "https://")):
            what = f"--rm-url {redact_text(self.rm_url)!r} is not an http(s) URL"
            fix = "--rm-url http://HOST:PORT/PATH (the service takes a POST of JSON)"
        elif self.rm_type == "remote_rm" and self.custom_rm_path:
            what = f"--rm-type remote_rm with --custom-rm-path {self.custom_rm_path!r}: the custom reward replaces it"
            fix = "drop one of them (a custom reward may call your service itself)"
        if what:
            raise ConfigError(Diagnosis(code="CONFIG", severity="error", what=what, fix=fix,
                                        facts={"field": "rm_url", "rm_type": self.rm_type}))
        return self
