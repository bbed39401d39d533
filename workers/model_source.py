"""Which checkpoint a worker loads: MODEL, or the demo model built offline."""

from __future__ import annotations

from shared.settings import Settings
from workers import demo_model


def resolve_model_path(settings: Settings) -> str:
    """A local path or hub id; with MODEL unset, the demo model (built if not cached)."""
    if settings.model:
        return settings.model
    return str(demo_model.build())
