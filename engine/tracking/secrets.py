"""What counts as a secret, and how it is kept out of MLflow params, tags, artifacts and log lines.

A value is secret when
- its key names a secret: the key (lower case, `-` → `_`) ends in password, passwd, secret, token, api_key, apikey,
  access_key, secret_key, private_key, credential(s), auth, authorization or wandb_key (`client_secret`, `hf_token`,
  `sglang_args["api-key"]`); `rollout_stop_token_ids` and `input_key` do not match: only the ending counts;
- or it looks like one, wherever it appears: a Hugging Face (`hf_…`), OpenAI-style (`sk-…`), GitHub (`ghp_…`,
  `github_pat_…`), Slack (`xox?-…`) or AWS (`AKIA…`) key, a JWT, a `Bearer …` header, the password of a URL
  (`https://user:PASSWORD@host`) or a credential in a query string (`?token=…`, `&sig=…`).
Secret values become `REDACTED` (URLs keep their user and host). Pure functions; no I/O.
"""
from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

_SECRET_KEY = re.compile(r"(^|_)(password|passwd|secret|token|api_?key|access_key|secret_key|private_key|"
                         r"credentials?|auth|authorization|wandb_key)$")
_SECRET_VALUES = [
    re.compile(r"hf_[A-Za-z0-9]{30,}"),  # long distinctive prefixes: matched even when glued to other text
    re.compile(r"gh[pousr]_[A-Za-z0-9]{30,}"),
    re.compile(r"github_pat_[A-Za-z0-9_]{30,}"),
    re.compile(r"xox[abposr]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"),  # "sk-" only at a word start ("task-…" is no key)
    re.compile(r"\b(?:AKIA|ASIA|A3T[A-Z0-9])[A-Z0-9]{16}\b"),
    re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    re.compile(r"(?i)\bBearer\s+[A-Za-z0-9._~+/\-]+=*"),
]
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]+):[^/\s@]+@")
_QUERY_SECRET = re.compile(r"(?i)([?&](?:token|access_token|api_?key|key|sig|signature|password|secret)=)[^&\s#]+")


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(str(key).lower().replace("-", "_")))


def redact_text(text: str) -> str:
    """Replace every secret-looking substring of `text`."""
    for pat in _SECRET_VALUES:
        text = pat.sub(REDACTED, text)
    text = _URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    return _QUERY_SECRET.sub(rf"\1{REDACTED}", text)


def redact(obj: Any, key: str | None = None) -> Any:
    """A copy of `obj` (dicts, lists, strings, numbers) with secret values replaced; see the module docstring."""
    if key is not None and is_secret_key(key) and obj not in (None, "", [], {}, False):
        return REDACTED
    if isinstance(obj, dict):
        return {k: redact(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj
