"""Shared fixtures for the cache-layer tests: real LMCache MP server (+ vLLM CPU with LMCacheMPConnector)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.peers.lmcache import LMCacheMPServer, VllmWithLMCache


@pytest.fixture(scope="module")
def mp_with_vllm(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LMCacheMPServer, VllmWithLMCache]]:
    work: Path = tmp_path_factory.mktemp("lmcache_vllm")
    server = LMCacheMPServer(work)
    vllm = VllmWithLMCache(server)
    try:
        server.start()
        vllm.start()
        yield server, vllm
    finally:
        vllm.stop()
        server.stop()
