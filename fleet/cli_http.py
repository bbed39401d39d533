"""The ``fleet`` command's HTTP client: where the fleet is, the key, and errors in words.

``FLEET_URL`` (default http://127.0.0.1:8000) and ``FLEET_API_KEY`` (sent as
``Authorization: Bearer``) come from the environment. Every failure becomes a
:class:`FleetError` whose message says what to do next; the command prints it and exits 1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import requests

DEFAULT_URL = "http://127.0.0.1:8000"
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 120  # a JSONL batch of 50,000 lines is checked before the answer comes


class FleetError(Exception):
    """A failure the user can act on; ``str()`` says how. ``transient``: the same request
    may work in a moment (the fleet unreachable, overloaded or failing)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass
class Event:
    """One Server-Sent Event."""

    name: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


class FleetClient:
    """One session with the gateway at ``url`` (keep-alive: polls reuse one connection)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.http = requests.Session()
        self.http.headers["User-Agent"] = "fleet-cli"
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"

    @classmethod
    def from_env(cls) -> FleetClient:
        return cls(os.environ.get("FLEET_URL") or DEFAULT_URL, os.environ.get("FLEET_API_KEY"))

    def request(
        self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201, 202), **kwargs
    ) -> requests.Response:
        """The response, when its status is in ``ok``; a :class:`FleetError` otherwise."""
        kwargs.setdefault("timeout", (CONNECT_TIMEOUT_S, READ_TIMEOUT_S))
        try:
            response = self.http.request(method, self.url + path, **kwargs)
        except requests.ConnectionError as exc:
            raise FleetError(
                f"cannot reach the fleet at {self.url} ({_reason(exc)}). Is it up? Start it "
                "with `make up`, or point FLEET_URL at it.",
                transient=True,
            ) from None
        except requests.Timeout:
            raise FleetError(
                f"the fleet at {self.url} did not answer in time; retry", transient=True
            ) from None
        if response.status_code not in ok:
            raise self.error(response)
        return response

    def get_json(self, path: str, **kwargs) -> dict:
        return self.request("GET", path, **kwargs).json()

    def post_json(self, path: str, body: dict | None = None, **kwargs) -> dict:
        return self.request("POST", path, json=body, **kwargs).json()

    def events(self, response: requests.Response) -> Iterator[Event]:
        """The Server-Sent Events of a streamed response, as they arrive, until the stream
        ends or breaks off."""
        name, data, event_id = "message", [], None
        try:
            for raw in response.iter_lines(chunk_size=None, decode_unicode=False):
                line = raw.decode("utf-8")
                if not line:
                    if data:
                        yield Event(name, "\n".join(data), event_id)
                    name, data = "message", []
                elif line.startswith(":"):
                    continue  # a keepalive comment
                else:
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if field == "event":
                        name = value
                    elif field == "data":
                        data.append(value)
                    elif field == "id":
                        event_id = value
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            return  # the stream broke off: the caller resumes it, or says so
        finally:
            response.close()

    def download(self, path: str, out: IO[bytes]) -> int:
        """Stream the body at ``path`` into ``out`` without parsing it; its size in bytes."""
        size = 0
        with self.request("GET", path, stream=True) as response:
            for chunk in response.iter_content(chunk_size=1 << 16):
                out.write(chunk)
                size += len(chunk)
        return size

    def error(self, response: requests.Response) -> FleetError:
        """What went wrong, in the server's words, and what to do about it."""
        status = response.status_code
        code, message = _error_of(response)
        if status == 401:
            if not self.api_key:
                return FleetError(
                    f"the fleet at {self.url} needs an API key: set FLEET_API_KEY (an operator "
                    "makes one with `fleet keys create --name NAME`)"
                )
            return FleetError(f"FLEET_API_KEY was refused: {message}")
        if status == 403:
            return FleetError(f"not allowed: {message}")
        if status == 429:
            retry = response.headers.get("Retry-After")
            after = f" (retry in {retry}s)" if retry else ""
            return FleetError(f"the fleet is busy: {message}{after}", transient=True)
        if status >= 500:
            return FleetError(f"the fleet failed ({status} {code}): {message}", transient=True)
        return FleetError(message)


def _error_of(response: requests.Response) -> tuple[str, str]:
    """The ``{"error": {"code", "message"}}`` body, whichever API answered."""
    try:
        error = response.json()["error"]
        return str(error.get("code") or error.get("type") or ""), str(error["message"])
    except (ValueError, KeyError, TypeError):
        text = response.text.strip()[:200] or response.reason
        return str(response.status_code), f"{response.status_code} {text}"


def _reason(exc: requests.ConnectionError) -> str:
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text:
        return "unknown host"
    return text.rsplit(": ", 1)[-1].rstrip("'\")")
