"""Every setting of the fleet, read from the environment in one typed place.

Gateway, workers and the launcher all call :func:`get_settings`, so a value means the same
thing everywhere. Invalid values fail at start with pydantic's message naming the variable.
"""

from __future__ import annotations

import base64
import binascii
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEMO_MODEL_ID = "demo/qwen3.5-tiny-awq"
# The embedded Redis's password, in DATA_DIR: `make up` generates it once (mode 0600).
EMBEDDED_REDIS_PASSWORD_FILE = "redis.password"
_MAKE_SECRET = (
    "make one with: python3 -c 'import base64, os; "
    'print("whsec_" + base64.b64encode(os.urandom(32)).decode())\'; empty: no webhooks'
)


def _check_webhook_secret(value: str) -> None:
    """One secret: whsec_ + base64 of 24 to 64 bytes. The message never shows the value."""
    if not value.startswith("whsec_"):
        raise ValueError(f"WEBHOOK_SECRET must start with whsec_ ({_MAKE_SECRET})")
    encoded = value.removeprefix("whsec_")
    try:
        raw = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            f"WEBHOOK_SECRET must be whsec_ followed by base64 ({_MAKE_SECRET})"
        ) from None
    if not 24 <= len(raw) <= 64:
        raise ValueError(f"WEBHOOK_SECRET must encode 24 to 64 bytes ({_MAKE_SECRET})")


def masked_url(url: str) -> str:
    """``url`` with the password of its user info replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inference-fleet"


class Settings(BaseSettings):
    """Fleet settings. Each field is read from the environment variable of the same name."""

    # Inputs are left out of error messages: a mistyped WEBHOOK_SECRET must not reach the logs.
    model_config = SettingsConfigDict(
        case_sensitive=False, frozen=True, protected_namespaces=(), hide_input_in_errors=True
    )

    # --- network -------------------------------------------------------------------------
    gateway_host: str = Field("127.0.0.1", description="Interface the gateway binds to.")
    gateway_port: int = Field(8000, ge=1, le=65535, description="Gateway HTTP port.")
    gateway_processes: int = Field(2, ge=1, le=64, description="Gunicorn worker processes.")
    gateway_max_streams: int = Field(
        1000,
        ge=1,
        description="Open event streams one gateway process serves at once: each waits for "
        "its next tokens on a Redis connection of its own (Redis allows 10,000 clients).",
    )
    gateway_access_log: bool = Field(
        False,
        description="Log every request (gunicorn's access log). Off by default: it costs "
        "about 115 us of a submit's ~850 us (make bench's bench.submit).",
    )
    flower_port: int = Field(5555, ge=1, le=65535, description="Flower UI port.")
    flower_basic_auth: str | None = Field(None, description="user:password for Flower.")

    # --- redis ---------------------------------------------------------------------------
    redis_url: str | None = Field(
        None, description="Redis to use. Unset: `make up` starts an embedded Redis."
    )
    embedded_redis_port: int = Field(
        6380, ge=1, le=65535, description="Port of the embedded Redis (when REDIS_URL is unset)."
    )
    data_dir: Path = Field(
        Path("data"), description="Embedded Redis AOF files and process logs live here."
    )
    key_prefix: str = Field(
        "fleet", pattern=r"^[A-Za-z0-9_.-]+$", description="Prefix of every Redis key we own."
    )

    # --- model ---------------------------------------------------------------------------
    model: str | None = Field(
        None, description="Hub id or local path of an AWQ checkpoint. Unset: the demo model."
    )
    model_name: str | None = Field(
        None, description="Id clients use for the model. Default: MODEL, or the demo id."
    )
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="Torch device.")
    engine: str = Field(
        "auto",
        pattern=r"^(auto|transformers|vllm)$",
        description="transformers: micro-batches of generate(); vllm: continuous batching "
        "(its own virtualenv, .venv-vllm); auto: vllm where it is installed and a GPU is present.",
    )
    worker_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="Torch intra-op threads of a CPU worker (0: its share of the cores, the "
        "cores divided by the workers that share them, at least 1).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU's memory vLLM may take (weights + KV)."
    )
    vllm_max_model_len: int | None = Field(
        None, ge=16, description="vLLM's context length. Default: the model's."
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir, description="Where the demo model is built."
    )

    # --- batching and limits -------------------------------------------------------------
    max_batch_size: int = Field(
        16,
        ge=1,
        le=256,
        description="Most jobs in one micro-batch (transformers), or sequences running at once "
        "(vllm).",
    )
    max_batch_wait_ms: int = Field(
        20, ge=0, le=10_000, description="Longest wait for a micro-batch to fill."
    )
    max_new_tokens_limit: int = Field(
        512, ge=1, le=32_768, description="Largest max_new_tokens a job may ask for."
    )
    result_ttl_s: int = Field(
        86_400, ge=1, description="Seconds a finished job stays readable, then 404."
    )
    max_request_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body the gateway accepts (413)."
    )
    worker_heartbeat_s: float = Field(
        2.0, gt=0, description="How often a worker refreshes its liveness record and claims."
    )
    worker_orphan_grace_s: float = Field(
        30.0,
        gt=0,
        description="A worker whose parent (make up's supervisor) died exits within this, "
        "abandoning its micro-batch to another worker's claim.",
    )

    worker_metrics_port: int = Field(
        9400, ge=0, le=65535, description="Port of a worker's /metrics (0: none)."
    )

    # --- autoscaling ---------------------------------------------------------------------
    target_backlog_per_worker: int = Field(
        8, ge=1, description="Backlog one worker should have; more adds workers."
    )
    min_workers: int = Field(1, ge=0, description="Fewest workers (0: scale to zero when idle).")
    max_workers: int | None = Field(
        None, ge=1, description="Most workers. Default: one per visible GPU, or 1 without GPU."
    )
    scale_down_cooldown_s: float = Field(
        300, ge=0, description="Low load must last this long before workers are removed."
    )
    autoscaler_interval_s: float = Field(5, gt=0, description="How often to decide.")
    autoscaler_metrics_port: int = Field(
        9500, ge=0, le=65535, description="Port of the autoscaler's /metrics (0: none)."
    )
    autoscaler_mode: str = Field(
        "local",
        pattern=r"^(local|kubernetes)$",
        description="local: start/stop worker processes (make up); kubernetes: patch the "
        "worker Deployment's scale.",
    )
    autoscaler_deployment: str = Field("worker", description="Deployment to scale (kubernetes).")
    autoscaler_namespace: str | None = Field(
        None, description="Its namespace. Default: the pod's own."
    )

    # --- reliability ---------------------------------------------------------------------
    claim_idle_s: float = Field(
        30.0,
        gt=0,
        description="An entry idle this long belongs to a dead worker and is "
        "taken over. Live workers refresh theirs every heartbeat, so a long batch never ages.",
    )
    max_deliveries: int = Field(
        3, ge=1, description="Deliveries after which an entry is dead-lettered (poison job)."
    )
    max_queue_depth: int = Field(
        10_000, ge=1, description="Backlog (unread + running) above which submits get 429."
    )
    batch_max_requests: int = Field(
        50_000, ge=1, description="Most requests in one batch (POST /v1/batches)."
    )
    batch_max_bytes: int = Field(
        104_857_600, ge=1024, description="Largest batch request body (413)."
    )
    batch_max_queue_depth: int = Field(
        1_000_000,
        ge=1,
        description="Batch requests queued (unread + running) above which a new batch gets 429.",
    )
    files_ttl_s: int = Field(
        86_400,
        ge=60,
        description="Seconds an uploaded file (POST /openai/v1/files) is kept, then 404. Files "
        "live in Redis, which every gateway replica shares (DATA_DIR is per pod); a batch "
        "copies its requests when it is created and never reads its input file again.",
    )
    files_max_bytes: int = Field(
        104_857_600, ge=1024, description="Largest uploaded file (413); as BATCH_MAX_BYTES."
    )
    openai_batch_short_windows: bool = Field(
        False,
        description="Testing only: an OpenAI batch's completion_window may also be 'Ns' (N "
        "seconds, 1 to 3600), so that expiry can be tested. Never set it in production.",
    )
    # --- API keys and per-key limits ----------------------------------------------------
    require_api_keys: bool = Field(
        False,
        description="Every /v1 and /openai/v1 request needs `Authorization: Bearer <key>` "
        "(python -m fleet.keys). `make up` and the k8s manifests turn it on; off, anyone who "
        "reaches the gateway may do anything.",
    )
    key_rpm: int = Field(
        0, ge=0, description="Requests per minute of a key that sets none (0: no limit)."
    )
    key_tpm: int = Field(
        0,
        ge=0,
        description="Generated tokens per minute of a key that sets none (0: no limit); a job "
        "is charged its max_new_tokens at submit and given back what it did not generate.",
    )
    key_max_queued: int | None = Field(
        None,
        ge=0,
        description="Unfinished interactive jobs one key may have (0: no cap). Default: a "
        "quarter of MAX_QUEUE_DEPTH, so that no key's flood fills the queue for the others.",
    )
    metrics_token: SecretStr | None = Field(
        None, description="If set, /metrics needs `Authorization: Bearer <this>`."
    )

    # --- result cache ----------------------------------------------------------------------
    cache_enabled: bool = Field(
        True,
        description="Answer a repeated greedy or seeded request from the result cache, and let "
        "an identical one that arrives while the first is queued or running follow it.",
    )
    cache_ttl_s: int = Field(
        300, ge=1, description="Seconds a result stays in the cache (never past RESULT_TTL_S)."
    )
    cache_max_bytes: int = Field(
        67_108_864,
        ge=1024,
        description="Size bound of one model's cached results; past it the soonest to expire "
        "are evicted.",
    )
    cache_scope: Literal["key", "global"] = Field(
        "key",
        description="key: a result is served only to the API key that made it; global: to "
        "every key (where API keys exist).",
    )
    model_version: str | None = Field(
        None,
        description="What a cached result is tied to. Default: the engine and a digest of the "
        "checkpoint's files, so a new checkpoint never serves old answers.",
    )

    fault_crash_marker: str | None = Field(
        None,
        description="Testing only: a worker dies (as if OOM-killed) on a prompt "
        "containing this string. Never set it in production.",
    )

    # --- webhooks ------------------------------------------------------------------------
    webhook_secret: SecretStr | None = Field(
        None,
        description="Standard Webhooks signing secret, whsec_ + base64 of 24..64 random bytes. "
        "During a rotation two, new first ('whsec_new whsec_old'): each delivery is signed "
        "with both, so receivers switch without a gap. Unset: no webhook can be sent.",
    )
    webhook_allow_private: bool = Field(
        False,
        description="Allow webhook URLs that resolve to loopback or private addresses "
        "(tests, on-prem receivers). Cloud metadata addresses stay refused.",
    )
    webhook_retry_schedule_s: Annotated[
        tuple[Annotated[float, Field(ge=0, le=7 * 86_400)], ...], NoDecode
    ] = Field(
        (5, 300, 1800, 7200, 18000, 36000, 36000),
        description="Seconds before each retry of a webhook (+/-20% jitter), comma-separated; "
        "the default spans about a day; empty: no retries.",
    )
    webhook_timeout_s: float = Field(
        15, gt=0, le=120, description="Whole-request timeout of one webhook attempt."
    )
    webhook_metrics_port: int = Field(
        9450, ge=0, le=65535, description="Port of the webhook worker's /metrics (0: none)."
    )

    @field_validator("webhook_secret", mode="before")
    @classmethod
    def _webhook_secret_format(cls, value: object) -> object:
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if not isinstance(value, str):
            raise ValueError(f"WEBHOOK_SECRET must start with whsec_ ({_MAKE_SECRET})")
        secrets = value.replace(",", " ").split()
        if len(secrets) > 2:
            raise ValueError("WEBHOOK_SECRET holds one secret, or two during a rotation")
        for secret in secrets:
            _check_webhook_secret(secret)
        return " ".join(secrets)

    @field_validator("webhook_retry_schedule_s", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip().removeprefix("[").removesuffix("]")
            return tuple(part.strip() for part in text.split(",") if part.strip())
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> Settings:
        if self.max_workers is not None and self.min_workers > self.max_workers:
            raise ValueError("MIN_WORKERS must not exceed MAX_WORKERS")
        return self

    @model_validator(mode="after")
    def _claims_outlast_heartbeats(self) -> Settings:
        if self.claim_idle_s < self.worker_max_age_s:
            raise ValueError("CLAIM_IDLE_S must be at least 3 x WORKER_HEARTBEAT_S")
        return self

    @model_validator(mode="after")
    def _model_id_is_a_hash_tag(self) -> Settings:
        if "{" in self.served_model or "}" in self.served_model:
            raise ValueError("the model id (MODEL_NAME, or MODEL) must not contain '{' or '}'")
        return self

    @field_validator(
        "model", "model_name", "redis_url", "flower_basic_auth", "fault_crash_marker",
        "metrics_token", "key_max_queued", mode="before",
    )  # fmt: skip
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @property
    def default_key_max_queued(self) -> int:
        if self.key_max_queued is not None:
            return self.key_max_queued
        return max(1, self.max_queue_depth // 4)

    @property
    def webhook_secrets(self) -> list[str]:
        """The signing secrets, the current one first (none when unset)."""
        return self.webhook_secret.get_secret_value().split() if self.webhook_secret else []

    @property
    def served_model(self) -> str:
        """The model id clients name in requests and that keys the model's stream."""
        if self.model_name:
            return self.model_name
        return self.model or DEMO_MODEL_ID

    @property
    def worker_max_age_s(self) -> float:
        """A worker whose last heartbeat is older than this is taken for dead."""
        return 3 * self.worker_heartbeat_s

    @property
    def embedded_redis_password_file(self) -> Path:
        return self.data_dir / EMBEDDED_REDIS_PASSWORD_FILE

    @property
    def embedded_redis_url(self) -> str:
        """The embedded Redis, with the password `make up` keeps in DATA_DIR once it exists:
        every process of the fleet reads it there, so it is never on a command line."""
        try:
            password = self.embedded_redis_password_file.read_text().strip()
        except FileNotFoundError:
            password = ""
        auth = f":{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.embedded_redis_port}/0"

    @property
    def effective_redis_url(self) -> str:
        return self.redis_url or self.embedded_redis_url

    @property
    def shown_redis_url(self) -> str:
        """The Redis URL as it may be printed or logged: its password masked."""
        return masked_url(self.effective_redis_url)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
