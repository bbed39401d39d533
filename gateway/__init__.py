"""The Flask gateway: ``create_app()`` builds one app; blueprints hold the routes."""

from __future__ import annotations

import logging

from flask import Flask

from gateway import batches, health, jobs, metrics, openai_routes, openapi
from gateway.errors import register_error_handlers
from gateway.extensions import Fleet
from shared.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or get_settings()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json.sort_keys = False
    Fleet(settings).init_app(app)
    register_error_handlers(app)
    for blueprint in (jobs.bp, batches.bp, openai_routes.bp, health.bp, openapi.bp):
        app.register_blueprint(blueprint)
    metrics.init_app(app)
    openapi.api_spec.register(app)
    logging.getLogger("gateway").setLevel(logging.INFO)
    return app
