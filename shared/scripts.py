"""Loads the Lua scripts in ``shared/lua/`` by name: every multi-key change is one of them.

Each ``.lua`` file starts with a header that names its KEYS, ARGV, reply and invariants.
A script is sent as one chunk: ``#!lua`` (so that in a Redis Cluster every key it touches
must hash to the slot of its KEYS), then the constants below, generated from the enums of
:mod:`shared.states` and :mod:`shared.stats` (so Lua never spells a status itself), then
``lib.lua``, then the script. Redis never rolls a script back, so each one does the write
that may fail first and its bookkeeping after.
"""

from __future__ import annotations

import json
from enum import Enum
from functools import cache
from pathlib import Path

import redis
from redis.commands.core import Script

from shared.cache import CACHE_ENTRY_OVERHEAD, INFLIGHT_TTL_S
from shared.keys import RECENT_JOBS_KEPT
from shared.states import (
    BATCH_COUNTER,
    EVENT_OF_BATCH_END,
    EVENT_OF_END,
    TERMINAL_STATUSES,
    BatchEvent,
    BatchStatus,
    DeliveryState,
    JobEvent,
    JobStatus,
)
from shared.stats import LATENCY_BUCKETS, bucket_name

LUA_DIR = Path(__file__).with_name("lua")
NAMES = tuple(sorted(p.stem for p in LUA_DIR.glob("*.lua") if p.stem != "lib"))


def _lua(value: object) -> str:
    """A Python constant as a Lua literal: str, number, bool, dict or list/tuple."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(str(value))  # a JSON string of ASCII is a Lua string
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{_lua(k)}] = {_lua(v)}" for k, v in value.items()) + "}"
    return "{" + ", ".join(_lua(v) for v in value) + "}"


def _names(enum: type[Enum], strip: str = "") -> dict[str, str]:
    return {member.name.removeprefix(strip): member.value for member in enum}


@cache
def constants() -> str:
    """The Lua constants every script sees (``JOB.RUNNING``, ``TERMINAL[status]``, ...)."""
    events = {f"JOB_{e.name}": e.value for e in JobEvent} | {
        f"BATCH_{e.name}": e.value for e in BatchEvent
    }
    values = {
        "JOB": _names(JobStatus),
        "TERMINAL": dict.fromkeys(sorted(TERMINAL_STATUSES), True),
        "BATCH": _names(BatchStatus),
        "DELIVERY": _names(DeliveryState),
        "EVENT": events,
        "EVENT_OF_END": {str(k): str(v) for k, v in EVENT_OF_END.items()},
        "BATCH_COUNTER": {str(k): v for k, v in BATCH_COUNTER.items()},
        "EVENT_OF_BATCH_END": {str(k): str(v) for k, v in EVENT_OF_BATCH_END.items()},
        "BUCKETS": [[bound, bucket_name(bound)] for bound in LATENCY_BUCKETS],
        "INFLIGHT_TTL_S": INFLIGHT_TTL_S,
        "CACHE_ENTRY_OVERHEAD": CACHE_ENTRY_OVERHEAD,
        "RECENT_JOBS_KEPT": RECENT_JOBS_KEPT,
    }
    return "".join(f"local {name} = {_lua(value)}\n" for name, value in values.items())


@cache
def source(name: str) -> str:
    """The whole text sent to Redis for the script ``name``."""
    if name not in NAMES:
        raise KeyError(f"no script {name!r} in {LUA_DIR}")
    lib = (LUA_DIR / "lib.lua").read_text()
    return "#!lua\n" + constants() + lib + (LUA_DIR / f"{name}.lua").read_text()


def pairs(mapping: dict[str, str]) -> list[str]:
    """A mapping as the flat field, value, ... list that HSET takes in a script."""
    return [item for pair in mapping.items() for item in pair]


def load(client: redis.Redis, name: str) -> Script:
    """The script registered on ``client`` (EVALSHA, loaded again if Redis lost it)."""
    return client.register_script(source(name))
