"""Durable server state: the stored responses and conversations of the Responses API."""

from spark.state.store import ANONYMOUS, AsyncStore, Store, owner_of

__all__ = ["ANONYMOUS", "AsyncStore", "Store", "owner_of"]
