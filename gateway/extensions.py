"""The gateway's per-app connections, reached from views and the serving layer as ``fleet``."""

from __future__ import annotations

from flask import Flask, current_app
from werkzeug.local import LocalProxy

from gateway.backpressure import Backpressure
from gateway.rate_limits import RateLimits, TokenRefunds
from gateway.waiting import JobWaiter
from shared.api_keys import ApiKeyStore
from shared.batch_store import BatchStore
from shared.cache import CachePolicy
from shared.coalesce import Coalescer
from shared.dead_letters import DeadLetters
from shared.file_store import FileStore
from shared.job_store import JobStore
from shared.openai_batch_store import OpenAIBatchStore
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.settings import Settings
from shared.stats import QueueStats


class Fleet:
    """What a request needs: settings, the stores (one Redis pool), API keys and their
    limits, and the waiter for ``Prefer: wait``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cache = CachePolicy.from_settings(settings)
        client = connect(settings)
        # Concurrent requests' submits, key lookups and rate-limit checks share round trips.
        coalescer = Coalescer(client)
        self.jobs = JobStore.from_settings(settings, client)
        self.jobs.coalesce_submits(coalescer)
        self.keys = self.jobs.keys
        self.batches = BatchStore.from_settings(settings, client)
        self.stats = QueueStats.from_settings(settings, client)
        self.registry = WorkerRegistry.from_settings(settings, client)
        self.backpressure = Backpressure(self.stats, settings.max_queue_depth)
        self.api_keys = ApiKeyStore.from_settings(settings, client)
        self.api_keys.coalesce_lookups(coalescer)
        self.dead_letters = DeadLetters.from_settings(settings, client)
        # OpenAI's Files and Batch API: uploads are bytes (a pool that does not decode).
        raw = connect(settings, decode_responses=False)
        self.files = FileStore(client, raw, self.keys, settings.files_ttl_s)
        self.openai_batches = OpenAIBatchStore(client, self.keys, settings.result_ttl_s)
        self.rate_limits = RateLimits(client, self.keys, settings, coalescer)
        self.token_refunds = TokenRefunds(
            client, self.keys, self.served_models(), self.api_keys, self.rate_limits
        )
        # Each open event stream waits in XREAD on a connection of its own.
        self.stream_reader = connect(settings, max_connections=settings.gateway_max_streams)
        # The subscriber blocks on its socket for as long as no job ends: no read timeout.
        self.waiter = JobWaiter(
            connect(settings, socket_timeout=None), self.keys.job_finished_channel
        )

    def served_models(self) -> list[str]:
        return [self.settings.served_model]

    def init_app(self, app: Flask) -> None:
        app.extensions["fleet"] = self


fleet: Fleet = LocalProxy(lambda: current_app.extensions["fleet"])  # type: ignore[assignment]
