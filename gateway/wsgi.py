"""WSGI entry point: ``gunicorn -c gateway/gunicorn_conf.py gateway.wsgi:app``."""

from gateway import create_app

app = create_app()
