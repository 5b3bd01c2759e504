"""Where a pipelines worker finds its Redis: LORAPLEX_CELERY_BROKER_URL (the broker) and LORAPLEX_REDIS_URL (the
service's queue, which the tasks train through), else the Redis of the embedded stack of the same LORAPLEX_HOME
(`serve --embedded` remembers its port there: runtime/redis_home.py). Never Celery's own default broker (AMQP on
localhost, retried for minutes in silence): with nothing configured, NoBrokerError names the settings."""

from __future__ import annotations

import os

from loraplex.errors import LoraplexError
from loraplex.runtime.redis_home import remembered_url
from loraplex.settings import Settings, get_settings


class NoBrokerError(LoraplexError):
    """No Redis for the pipelines worker: its message says which settings to set."""


def worker_settings() -> Settings:
    """This process's settings, its Redis found. Without LORAPLEX_REDIS_URL the embedded stack's remembered URL goes
    into this process's environment, so every later get_settings() (the tasks', their services') reads it too."""
    settings = get_settings()
    if settings.redis_url:
        return settings
    url = remembered_url(settings.home)
    if url is None:
        raise NoBrokerError(
            "no Redis for the pipelines: set LORAPLEX_REDIS_URL (the gateway's Redis), or start "
            f"`loraplex serve --embedded` once with this LORAPLEX_HOME ({settings.home})"
        )
    os.environ["LORAPLEX_REDIS_URL"] = url
    get_settings.cache_clear()
    return get_settings()
