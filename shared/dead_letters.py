"""Dead letters: jobs whose entry killed workers MAX_DELIVERIES times. Operators list them
and put them back in their lane (``python -m fleet.deadletters``)."""

from __future__ import annotations

import redis

from shared.keys import Keys
from shared.redis_client import FleetRedis
from shared.scripts import load
from shared.states import Lane


class DeadLetters(FleetRedis):
    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        super().__init__(client, keys, result_ttl_s)
        self._requeue = load(client, "requeue")

    def list(self, model: str, count: int = 1000) -> list[dict[str, str]]:
        rows = self.redis.xrange(self.keys.dead_letters(model), count=count)
        return [{"id": entry_id, **fields} for entry_id, fields in rows]

    def requeue(self, model: str, letter_id: str) -> str | None:
        """Queue a dead letter's job again; returns its new entry id (None if its job is gone)."""
        rows = self.redis.xrange(self.keys.dead_letters(model), letter_id, letter_id)
        if not rows:
            raise KeyError(letter_id)
        job_id, lane = rows[0][1]["job"], Lane(rows[0][1].get("lane", Lane.INTERACTIVE))
        entry = self._requeue(
            keys=[
                self.keys.dead_letters(model),
                self.keys.stream(model, lane),
                self.keys.job(model, job_id),
            ],
            args=[letter_id, job_id, self.keys.base(model)],
        )
        return entry or None
