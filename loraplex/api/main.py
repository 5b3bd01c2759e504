"""ASGI entry point for uvicorn: `uvicorn loraplex.api.main:app` (settings from LORAPLEX_* env vars)."""

from loraplex.api.app import create_app

app = create_app()
