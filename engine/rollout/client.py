"""HTTP client for SGLang-API engines (built-in or SGLang); every call has its own deadline."""
from __future__ import annotations

from typing import Any

import httpx


class EngineClient:
    def __init__(self, url: str, timeout_s: float = 60.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def _get(self, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        r = httpx.get(self.url + path, timeout=timeout_s or self.timeout_s)
        r.raise_for_status()
        return r.json() if r.content else {}

    def _post(self, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        r = httpx.post(self.url + path, json=body or {}, timeout=timeout_s or self.timeout_s)
        if r.status_code >= 400:
            raise RuntimeError(f"{self.url}{path} → HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            return httpx.get(self.url + "/health_generate", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def model_info(self) -> dict[str, Any]:
        return self._get("/get_model_info")

    def generate(self, body: dict[str, Any], timeout_s: float | None = None) -> Any:
        return self._post("/generate", body, timeout_s)

    def update_weights_from_disk(self, path: str, version: int, timeout_s: float | None = None) -> dict:
        out = self._post("/update_weights_from_disk", {"model_path": path, "weight_version": str(version)},
                         timeout_s)
        if not out.get("success", False):
            raise RuntimeError(f"{self.url} refused the weights in {path}: {out.get('message')}")
        return out

    def flush_cache(self) -> dict:
        return self._post("/flush_cache")

    def abort(self, rid: str | None = None) -> dict:
        return self._post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    def release_memory(self) -> dict:
        return self._post("/release_memory_occupation")

    def resume_memory(self) -> dict:
        return self._post("/resume_memory_occupation")
