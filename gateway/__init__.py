"""The Flask gateway: ``create_app()`` builds one app; blueprints hold the routes."""

from __future__ import annotations

import logging

from flask import Flask

from gateway import (
    admin,
    auth,
    batches,
    console,
    fleet_view,
    health,
    jobs,
    metrics,
    openai_batches,
    openai_files,
    openai_routes,
    openapi,
)
from gateway.errors import register_error_handlers
from gateway.extensions import Fleet
from shared.settings import Settings, get_settings

log = logging.getLogger("gateway")


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or get_settings()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json.sort_keys = False
    Fleet(settings).init_app(app)
    register_error_handlers(app)
    auth.init_app(app)
    apis = (jobs.bp, batches.bp, openai_routes.bp, openai_files.bp, openai_batches.bp)
    for blueprint in (*apis, admin.bp, health.bp, openapi.bp, fleet_view.bp, console.bp):
        app.register_blueprint(blueprint)
    metrics.init_app(app)
    openapi.api_spec.register(app)
    logging.getLogger("gateway").setLevel(logging.INFO)
    if not settings.require_api_keys:
        log.warning(
            "REQUIRE_API_KEYS is off: anyone who reaches this gateway can submit, read every "
            "job and use the admin routes (make up turns keys on unless AUTH=off)"
        )
    return app
