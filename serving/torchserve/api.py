"""TorchServe's management and inference APIs over loopback HTTP (token auth aware)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from serving.torchserve.config import TorchServeConfig


class TorchServeError(RuntimeError):
    """A TorchServe API call failed; ``status`` is the HTTP code, the message is TorchServe's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"TorchServe returned {status}: {message}")
        self.status = status
        self.message = message


# Loopback calls must never go through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(
    method: str,
    url: str,
    token: str | None,
    body: bytes | None = None,
    content_type: str = "",
    timeout_s: float = 300.0,
) -> bytes:
    req = urllib.request.Request(url, data=body, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        raw = e.read().decode("utf-8", "replace")
        try:
            message = json.loads(raw).get("message", raw)
        except (ValueError, AttributeError):
            message = raw
        raise TorchServeError(e.code, message.strip()) from None


class _Keys:
    """Reads TorchServe's key_file.json ({"management": {"key"}, "inference": {"key"}, "API": {...}})."""

    def __init__(self, key_file: Path | None):
        self.key_file = key_file

    def get(self, kind: str) -> str | None:
        if self.key_file is None:
            return None
        return json.loads(self.key_file.read_text())[kind]["key"]


class ManagementClient:
    """The TorchServe management API (stdlib HTTP). ``key_file`` is None when token auth is off;
    ``timeout_s`` bounds each call (a readiness probe's is short)."""

    def __init__(self, base_url: str, key_file: Path | None = None, defaults: TorchServeConfig | None = None,
                 timeout_s: float = 300.0):  # fmt: skip
        self.base_url = base_url.rstrip("/")
        self._keys = _Keys(key_file)
        self._defaults = defaults
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.base_url}{path}" + (f"?{query}" if query else "")
        raw = _http(method, url, self._keys.get("management"), timeout_s=self.timeout_s)
        return json.loads(raw) if raw else None

    def register(
        self,
        mar_name: str,
        model_name: str,
        initial_workers: int | None = None,
        batch_size: int | None = None,
        max_batch_delay_ms: int | None = None,
        synchronous: bool = True,
    ) -> dict:
        """Load ``mar_name`` (a file in the model store) as ``model_name``; its version comes from the .mar."""
        d = self._defaults

        def pick(value: int | None, field: str) -> int | None:  # explicit arg, else our config's default
            return value if value is not None or d is None else getattr(d, field)

        return self._call(
            "POST",
            "/models",
            url=mar_name,
            model_name=model_name,
            initial_workers=pick(initial_workers, "default_workers_per_model"),
            batch_size=pick(batch_size, "batch_size"),
            max_batch_delay=pick(max_batch_delay_ms, "max_batch_delay_ms"),
            response_timeout=pick(None, "response_timeout_s"),
            synchronous=str(synchronous).lower(),
        )

    def scale(self, model: str, version: str, min_workers: int, synchronous: bool = True) -> dict:
        return self._call(
            "PUT", f"/models/{model}/{version}", min_worker=min_workers, synchronous=str(synchronous).lower()
        )

    def rotate_key(self, kind: str = "inference") -> None:
        """Make TorchServe issue a new ``kind`` ("inference" or "management") key into key_file.json.

        Keys expire after ``token_expiration_min``; the key file's "API" key authorises this call.
        """
        _http("PUT", f"{self.base_url}/token?type={kind}", self._keys.get("API"))

    def set_default(self, model: str, version: str) -> dict:
        return self._call("PUT", f"/models/{model}/{version}/set-default")

    def unregister(self, model: str, version: str, synchronous: bool = True) -> dict:
        return self._call("DELETE", f"/models/{model}/{version}", synchronous=str(synchronous).lower())

    def list_models(self) -> list[dict]:
        """All registered models (following TorchServe's pagination)."""
        models: list[dict] = []
        token = None
        while True:
            page = self._call("GET", "/models", limit=100, next_page_token=token)
            models.extend(page.get("models", []))
            token = page.get("nextPageToken")
            if not token:
                return models

    def describe(self, model: str, version: str | None = None) -> list[dict]:
        """Per-version details (workers, batch settings, default flag); version "all" lists all."""
        return self._call("GET", f"/models/{model}" + (f"/{version}" if version else ""))


class InferenceClient:
    """Minimal inference API client (stdlib HTTP); for tests and tools, not for load generation."""

    def __init__(self, base_url: str, key_file: Path | None = None):
        self.base_url = base_url.rstrip("/")
        self._keys = _Keys(key_file)

    def ping(self) -> dict:
        # With token auth on, every inference-port request needs the inference key, /ping included.
        return json.loads(_http("GET", f"{self.base_url}/ping", self._keys.get("inference")))

    def predict(
        self, model: str, body: bytes, version: str | None = None, content_type: str = "application/json"
    ) -> bytes:
        path = f"/predictions/{model}" + (f"/{version}" if version else "")
        return _http("POST", self.base_url + path, self._keys.get("inference"), body, content_type)

    def inference_token(self) -> str | None:
        return self._keys.get("inference")
