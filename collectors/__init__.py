"""Collectors: observe the engine, the cache layers and the storage devices (I/O lives here)."""
