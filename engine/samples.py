"""The Sample contract shared by rollout, pack and train (design.md, "Data contracts")."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped at EOS / a stop string or id
    TRUNCATED = "truncated"  # reached rollout_max_response_len
    ABORTED = "aborted"  # the engine aborted the request
    FAILED = "failed"  # generation or reward failed; excluded from training


@dataclass
class Sample:
    index: int  # position in the rollout (group_index · n + j)
    group_index: int  # which prompt of the rollout
    rollout_id: int
    prompt: str | list[dict[str, Any]]  # raw prompt (text or chat messages)
    tokens: list[int] = field(default_factory=list)  # [P + R] prompt + response token ids
    response_length: int = 0  # R
    response: str = ""  # decoded response text
    label: Any = None
    reward: float | dict[str, float] | None = None
    loss_mask: list[int] = field(default_factory=list)  # [R] 1 = token is trained on
    rollout_log_probs: list[float] = field(default_factory=list)  # [R] log π_engine(a|s) at the rollout temperature
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    remove_sample: bool = False  # set by --rollout-sample-filter-path: kept out of the loss (slime's field)
    reward_key: str | None = None  # a dict reward's key that is the training reward (--reward-key; set when scored)
    teacher_log_probs: list[float] | None = None  # [R] --use-opd --opd-type sglang: log π_teacher of the response
    # --use-rollout-routing-replay: the experts the engine routed each token but the last to, as SGLang returns them
    # (meta_info.routed_experts: base64 of int32 [P + R - 1, num_hidden_layers, top_k]) or as an array of that shape
    rollout_routed_experts: Any = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def scalar_reward(self) -> float:
        """The reward used for advantages: a dict reward contributes its `reward_key` (--reward-key), else its
        "score" key, else the mean of its values."""
        if isinstance(self.reward, dict):
            if self.reward_key is not None:
                return float(self.reward[self.reward_key])  # scoring checked the key (rewards.select_key)
            return float(self.reward.get("score", sum(self.reward.values()) / max(len(self.reward), 1)))
        return float(self.reward or 0.0)

    def to_dict(self) -> dict[str, Any]:
        """The fields, plus any attribute a custom rollout set (kept by `from_dict`, as slime keeps them)."""
        d = asdict(self)
        d.update({k: v for k, v in vars(self).items() if k not in _FIELDS})
        d["status"] = self.status.value
        if d["rollout_routed_experts"] is not None and not isinstance(d["rollout_routed_experts"], str):
            from engine.packing.microbatch import base64_int32  # an array, as SGLang sends it: JSON-ready

            d["rollout_routed_experts"] = base64_int32(d["rollout_routed_experts"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        """Keys that are not fields become attributes (slime's Sample.from_dict does the same: custom rollouts
        carry their own keys through); `status` may be the enum or its value."""
        known = {k: v for k, v in d.items() if k in _FIELDS}
        sample = cls(**{**known, "status": Status(d.get("status", "pending"))})
        for k, v in d.items():
            if k not in _FIELDS:
                setattr(sample, k, v)
        return sample


_FIELDS = frozenset(f.name for f in fields(Sample))
