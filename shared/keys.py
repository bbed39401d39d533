"""The Redis key scheme: every key name the fleet uses, and nothing else.

Gateway, workers, the webhook worker and the Lua scripts all name keys through
:class:`Keys`, so a key means one thing in the whole fleet. ``P`` is ``KEY_PREFIX``
(default ``fleet``) and ``{m}`` the served model id, in braces: the model is the Redis
Cluster hash tag, so one model's jobs, streams and counters live on one shard and every
script touches keys of one slot. The scripts derive the keys of a job's batch and the
model's outbox from ``P:{m}:`` (:meth:`Keys.base`); ``shared/lua/lib.lua`` mirrors those
names and the script key test checks that it does.

One model's keys (tag ``{m}``)::

    P:{m}:job:{id}            hash    one job's record (shared.records); expires RESULT_TTL_S
                                      after it reaches a terminal state
    P:{m}:stream              stream  the interactive queue; entries are {job: id}; consumer
                                      group "workers"; an entry is deleted once acked
    P:{m}:batch-stream        stream  the batch queue (same shape): read only for the room
                                      the interactive one leaves in a micro-batch
    P:{m}:dead                stream  dead letters: entries delivered more than
                                      MAX_DELIVERIES times, {job, entry, deliveries, at, lane}
    P:{m}:idem:{owner}:{key}  string  Idempotency-Key -> "job id fingerprint"; 24 h; {owner} is
                                      the API key's id ('' without keys): keys are per caller
    P:{m}:idem:batch:{owner}:{key}  string  the same for batches
    P:{m}:stats               hash    counters for metrics: submitted, finished:{status},
                                      batch:*, latency / wait histograms ({name}:{bucket}),
                                      cache:{hits,misses,coalesced,evictions,expired,bytes}
    P:{m}:recent              list    the last 1000 ended jobs, "completed_at latency status"
    P:{m}:batch:{id}          hash    one batch (shared.records); expires RESULT_TTL_S after
                                      it completes or is cancelled; one made through
                                      /openai/v1 has openai_* fields too (shared.openai_batches)
    P:{m}:batch-jobs:{id}     list    the batch's job ids, in input order
    P:{m}:batch-results:{id}  list    one JSONL result line per ended request, in end order
    P:{m}:tokens:{id}         stream  a streaming job's text as it is generated: {type: token,
                                      delta, index}, {type: restart} when a retry starts it
                                      again, and last {type: end, status}; expires with the job
    P:{m}:events              stream  outbox of webhook events {type, id, url}, written in the
                                      same script as the transition; consumer group "webhooks"
    P:{m}:cache:{digest}      string  a cached result (the output JSON), by the digest of the
                                      model version and the request (shared.cache); expires
                                      min(CACHE_TTL_S, RESULT_TTL_S) after it is stored
    P:{m}:cache-index         zset    "digest size" -> expiry time, of every cached result: the
                                      scripts keep the cache under CACHE_MAX_BYTES with it
    P:{m}:inflight:{fp}       string  request fingerprint -> the job computing it now (queued
                                      or running): identical requests follow that job
    P:{m}:followers:{id}      list    the jobs following job {id}: they end when it ends
    P:{m}:model-version       string  the version of the model the workers serve (each worker
                                      sets it as it loads the model)
    P:{m}:active:{owner}      set     the unfinished interactive jobs of one API key with a
                                      queue cap (KEY_MAX_QUEUED): submit.lua counts them
    P:{m}:jobs-of:{owner}     zset    the last RECENT_JOBS_KEPT interactive jobs of one API key
                                      ('' without keys) by creation time: GET /v1/jobs
    P:{m}:token-refunds       list    "owner tokens" per ended job charged to a key's tokens per
                                      minute: the unused part of its max_new_tokens, for the
                                      gateway to give back (gateway.rate_limits)
    P:{m}:workers             zset    worker name -> unix time of its last heartbeat
    P:{m}:worker:{name}       hash    what a worker serves (model, device, loaded_at); expires

Fleet-wide::

    P:api-key:{digest}                hash     one API key (shared.api_keys), by the SHA-256 of
                                               its secret: id, name, scopes, limits, times
    P:api-keys                        hash     key id -> digest, of every key
    P:limits/...                      (limits) per-key request and token counters, written by
                                               the `limits` library
    P:file:{id}                       hash     one uploaded file (shared.file_store): its
                                               bytes and metadata; expires FILES_TTL_S after
                                               upload
    P:files:{owner}                   zset     file id -> created_at, of one API key's files
    P:openai-batches:{owner}          zset     batch id -> created_at, of the batches one API key
                                               made through /openai/v1 (its list)

    P:job-finished                    channel  job ids, published when a job ends
    P:{webhooks}:webhook:{id}         hash     one webhook delivery (webhooks.store)
    P:{webhooks}:webhook-attempts:{id} list    that delivery's attempts, one JSON each
    P:{webhooks}:webhook-owner:{id}   list     delivery ids about one job or batch
    P:webhook-celery:*                (kombu)  the webhook Celery app's broker keys
"""

from __future__ import annotations

from shared.states import Lane

JOBS_GROUP = "workers"  # the consumer group of both job streams
EVENTS_GROUP = "webhooks"  # the consumer group of the events outbox
RECENT_JOBS_KEPT = 1000  # per API key, listed by GET /v1/jobs
_WEBHOOKS = "{webhooks}"  # the hash tag of every webhook delivery key


class Keys:
    """Every Redis key name, under one prefix so fleets can share a Redis."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.job_finished_channel = f"{prefix}:job-finished"

    def base(self, model: str) -> str:
        """What every key of one model starts with; the scripts derive keys from it."""
        return f"{self.prefix}:{{{model}}}:"

    def job(self, model: str, job_id: str) -> str:
        return f"{self.base(model)}job:{job_id}"

    def stream(self, model: str, lane: Lane = Lane.INTERACTIVE) -> str:
        return self.base(model) + ("batch-stream" if lane == Lane.BATCH else "stream")

    def dead_letters(self, model: str) -> str:
        return self.base(model) + "dead"

    def idempotency(self, model: str, key: str, owner: str = "") -> str:
        return f"{self.base(model)}idem:{owner}:{key}"

    def batch_idempotency(self, model: str, key: str, owner: str = "") -> str:
        return f"{self.base(model)}idem:batch:{owner}:{key}"

    def owner_active(self, model: str, owner: str) -> str:
        return f"{self.base(model)}active:{owner}"

    def jobs_of(self, model: str, owner: str) -> str:
        return f"{self.base(model)}jobs-of:{owner}"

    def token_refunds(self, model: str) -> str:
        return self.base(model) + "token-refunds"

    def stats(self, model: str) -> str:
        return self.base(model) + "stats"

    def recent(self, model: str) -> str:
        return self.base(model) + "recent"

    def batch(self, model: str, batch_id: str) -> str:
        return f"{self.base(model)}batch:{batch_id}"

    def batch_jobs(self, model: str, batch_id: str) -> str:
        return f"{self.base(model)}batch-jobs:{batch_id}"

    def batch_results(self, model: str, batch_id: str) -> str:
        return f"{self.base(model)}batch-results:{batch_id}"

    def tokens(self, model: str, job_id: str) -> str:
        return f"{self.base(model)}tokens:{job_id}"

    def events(self, model: str) -> str:
        return self.base(model) + "events"

    def cache(self, model: str, digest: str) -> str:
        return f"{self.base(model)}cache:{digest}"

    def cache_index(self, model: str) -> str:
        return self.base(model) + "cache-index"

    def inflight(self, model: str, fingerprint: str) -> str:
        return f"{self.base(model)}inflight:{fingerprint}"

    def followers(self, model: str, job_id: str) -> str:
        return f"{self.base(model)}followers:{job_id}"

    def model_version(self, model: str) -> str:
        return self.base(model) + "model-version"

    def workers(self, model: str) -> str:
        return self.base(model) + "workers"

    def worker(self, model: str, name: str) -> str:
        return f"{self.base(model)}worker:{name}"

    def api_key(self, digest: str) -> str:
        return f"{self.prefix}:api-key:{digest}"

    def api_keys(self) -> str:
        return f"{self.prefix}:api-keys"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def files(self, owner: str) -> str:
        return f"{self.prefix}:files:{owner}"

    def openai_batches(self, owner: str) -> str:
        return f"{self.prefix}:openai-batches:{owner}"

    def rate_limits_prefix(self) -> str:
        """The `limits` library's key_prefix."""
        return f"{self.prefix}:limits"

    def webhook(self, delivery_id: str) -> str:
        return f"{self.prefix}:{_WEBHOOKS}:webhook:{delivery_id}"

    def webhook_attempts(self, delivery_id: str) -> str:
        return f"{self.prefix}:{_WEBHOOKS}:webhook-attempts:{delivery_id}"

    def webhook_owner(self, owner_id: str) -> str:
        return f"{self.prefix}:{_WEBHOOKS}:webhook-owner:{owner_id}"

    def webhook_broker_prefix(self) -> str:
        """kombu's global_keyprefix for the webhooks Celery app."""
        return f"{self.prefix}:webhook-celery:"
