"""Gunicorn settings for the gateway, from the fleet's settings.

gevent workers: a request held by ``Prefer: wait`` is a parked greenlet, not a thread, so
hundreds of waiting clients do not stop others from submitting or polling.
"""

from shared.settings import get_settings

_settings = get_settings()

bind = f"{_settings.gateway_host}:{_settings.gateway_port}"
workers = _settings.gateway_processes
worker_class = "gevent"
worker_connections = 2000
timeout = 90  # longer than the longest Prefer: wait (60 s)
graceful_timeout = 70
keepalive = 5
accesslog = "-"
errorlog = "-"
loglevel = "info"
