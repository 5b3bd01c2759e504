"""Python client for loraplex: `ServiceClient` -> `TrainingClient`, `SamplingClient` -> futures (sync `.result()`, or `await`)."""

from loraplex.client.futures import APIFuture
from loraplex.client.sampling import SamplingClient
from loraplex.client.service import ServiceClient
from loraplex.client.training import TrainingClient
from loraplex.client.types import AdamParams, Datum

__all__ = ["APIFuture", "AdamParams", "Datum", "SamplingClient", "ServiceClient", "TrainingClient"]
