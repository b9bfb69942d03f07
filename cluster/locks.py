"""The Redis connection the control plane shares: reconciler lock, and later the gateway's counters."""

import functools

import redis
from django.conf import settings

from cluster import redis_options


@functools.cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, **redis_options.options())
