"""Consuming a Redis Stream in a consumer group: the delivery protocol, nothing about jobs.

The GPU workers (through :class:`shared.job_consumer.JobConsumer`) and the webhook
dispatcher both consume this way:

* read new entries with ``XREADGROUP >``; a restarted consumer first re-reads its own
  pending ones (``0``), the entries it read but never acked;
* while it works on entries it may refresh their idle time (``XCLAIM ... JUSTID``), so a
  live consumer's entries never look abandoned however long it works;
* entries idle longer than a limit belong to a dead consumer and are taken over with
  ``XAUTOCLAIM``; every such redelivery counts (:meth:`StreamConsumer.times_delivered`);
* an entry is acked (and deleted) once its work is stored. A pending id whose entry is
  gone is acked on sight: there is nothing to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

Message = tuple[str, dict[str, str]]  # (entry id, fields)


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create the stream and its group; from id 0, so no entry added before is missed."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass(frozen=True)
class StreamConsumer:
    client: redis.Redis
    group: str
    name: str

    def read(
        self, streams: list[str], count: int, block_ms: int | None, *, own_pending: bool = False
    ) -> list[tuple[str, Message]]:
        """(stream, message) pairs: new ones, or (own_pending) those read but never acked.
        Up to ``count`` from each stream."""
        reply = self.client.xreadgroup(
            self.group,
            self.name,
            dict.fromkeys(streams, "0" if own_pending else ">"),
            count=count,
            block=block_ms,
        )
        out = []
        for stream, messages in reply or []:
            gone = [entry_id for entry_id, fields in messages if not fields]
            if gone:  # pending ids whose entries were deleted: nothing to run, forget them
                self.client.xack(stream, self.group, *gone)
            out.extend((stream, (entry_id, fields)) for entry_id, fields in messages if fields)
        return out

    def claim_abandoned(self, stream: str, idle_ms: int, count: int) -> list[Message]:
        """Take over entries idle longer than ``idle_ms``: their consumer died unacked."""
        reply = self.client.xautoclaim(stream, self.group, self.name, idle_ms, "0-0", count=count)
        messages, deleted = reply[1], reply[2] if len(reply) > 2 else []
        if deleted:  # ids in the group's pending list whose entries no longer exist
            self.client.xack(stream, self.group, *deleted)
        return [(entry_id, fields) for entry_id, fields in messages if fields]

    def touch(self, stream: str, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this live consumer is still working on."""
        if entry_ids:
            self.client.xclaim(stream, self.group, self.name, 0, entry_ids, justid=True)

    def times_delivered(self, stream: str, entry_ids: list[str]) -> dict[str, int]:
        """How many times each of these entries (pending for this consumer) was delivered."""
        ids = sorted(entry_ids, key=_id_order)
        rows = self.client.xpending_range(
            stream, self.group, ids[0], ids[-1], len(ids) + 1000, consumername=self.name
        )
        counts = {row["message_id"]: int(row["times_delivered"]) for row in rows}
        return {entry_id: counts.get(entry_id, 1) for entry_id in entry_ids}

    def ack(self, stream: str, entry_ids: list[str]) -> None:
        """Acknowledge and delete: only acked entries are deleted, so the lag stays exact."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(stream, self.group, *entry_ids)
        pipe.xdel(stream, *entry_ids)
        pipe.execute()


def _id_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
