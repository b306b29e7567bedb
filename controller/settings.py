"""Sidecar settings: CLI flags > ``KVTIER_*`` environment variables > config file (JSON or TOML) > defaults.

List values in the environment are JSON (``KVTIER_ENGINE_URLS='["http://127.0.0.1:8000"]'``) or
comma-separated (``KVTIER_ENGINE_URLS=http://a:8000,http://b:8000``). ``KVTIER_TIER_PATHS`` is a JSON object
(``'{"disk": "/mnt/kv-l2"}'``) or ``tier=path[,tier=path]`` (``disk=/mnt/kv-l2,remote=/mnt/nvmeof0``).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _split(v: Any) -> Any:
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            return json.loads(s)
        return [x.strip() for x in s.split(",") if x.strip()]
    return v


def _tier_paths(v: Any) -> Any:
    """``KVTIER_TIER_PATHS``: a JSON object or ``tier=path[,tier=path]`` -> dict (dicts pass through)."""
    if not isinstance(v, str):
        return v
    s = v.strip()
    if s.startswith("{"):
        try:
            out = json.loads(s)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tier_paths: invalid JSON object {s!r}: {exc}") from exc
        if not isinstance(out, dict):
            raise ValueError(f"tier_paths: expected a JSON object, got {s!r}")
        return out
    pairs: dict[str, str] = {}
    for item in (x.strip() for x in s.split(",")):
        if not item:
            continue
        tier, eq, path = (x.strip() for x in item.partition("="))
        if not eq or not tier or not path:
            raise ValueError(f"tier_paths: expected tier=path[,tier=path] or a JSON object, got {s!r}")
        if tier in pairs:
            raise ValueError(f"tier_paths: tier {tier!r} given twice in {s!r}")
        pairs[tier] = path
    return pairs


class Settings(BaseSettings):
    """Everything ``kvtier serve`` needs. Intervals in seconds."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_", extra="ignore")

    engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)  # vLLM API servers
    lmcache_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)  # LMCache MP servers
    mooncake_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)  # Mooncake masters
    # legacy LMCache cache controllers (``lmcache_controller``, LMCacheConnectorV1 deployments)
    lmcache_controller_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    listen: str = "127.0.0.1:8787"
    scrape_interval_s: float = Field(default=2.0, gt=0)  # /metrics of peers
    discovery_interval_s: float = Field(default=5.0, gt=0)  # GET /kv_event_sources
    storage_interval_s: float = Field(default=5.0, gt=0)
    http_timeout_s: float = Field(default=5.0, gt=0)
    replay_timeout_s: float = Field(default=2.0, gt=0)
    # largest KV-event seq step (batches) confirming a held out-of-sequence batch (vllm_kv_subscriber)
    max_seq_gap: int = Field(default=10_000, gt=0)
    # blocks the sidecar's index tracks at most (~250 B each); beyond it the stalest blocks resident nowhere
    # are forgotten. Resident blocks are never dropped: stores that do not fit are counted and skipped
    index_max_blocks: int = Field(default=2_000_000, gt=0)
    storage_enabled: bool = True
    storage_root: str = "/"  # prefix for /proc and /sys (tests use canned trees)
    storage_devices: Annotated[list[str] | None, NoDecode] = None  # None: all but loop/ram
    # tier -> path, capacity is reported; env: JSON object or tier=path[,tier=path]
    tier_paths: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    log_level: str = "INFO"
    # -- control plane (issue 4) --
    mode: Literal["off", "shadow", "active"] | None = None  # None: persisted policy's (default shadow)
    actuators: Annotated[list[str], NoDecode] = Field(default_factory=list)  # shadow, vllm-warmup, lmcache-mp
    state_dir: str = ".kvtier-state"  # SQLite file with policy, pins, trained model
    api_token: str | None = None  # KVTIER_API_TOKEN: bearer token required for API mutations
    engine_model: str = ""  # served model name for warm-ups ("" = first of the engine's /v1/models)
    warmup_tokens_per_s: float = Field(default=4096.0, gt=0)  # vllm-warmup budget: prompt tokens per second
    warmup_requests_per_s: float = Field(default=4.0, gt=0)  # vllm-warmup budget: requests per second
    log_json: bool = False  # structured JSON-lines logs
    policy: str = "learned"  # placement policy object (registry name; "none" = index-only planning)
    policy_tier: str = "cpu"  # the tier that policy places (capacity from /v1/policy tiers)
    # per-actuator factory options, e.g. {"mooncake": {"admin_url": ..., "master_addr": ...}}
    actuator_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator(
        "engine_urls", "lmcache_urls", "mooncake_urls", "lmcache_controller_urls", "storage_devices",
        "actuators", mode="before",
    )  # fmt: skip
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return _split(v)

    @field_validator("tier_paths", mode="before")
    @classmethod
    def _tiers(cls, v: Any) -> Any:
        return _tier_paths(v)

    @field_validator("engine_urls", "lmcache_urls", "mooncake_urls", "lmcache_controller_urls")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        out = []
        for u in v:
            u = u.strip().rstrip("/")
            if not u.startswith(("http://", "https://")):
                u = "http://" + u
            out.append(u)
        return out

    @property
    def listen_host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen must be HOST:PORT, got {self.listen!r}")
        return host.strip("[]"), int(port)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A JSON (``.json``) or TOML (anything else) file -> dict of settings. Raises ValueError if malformed."""
    p = Path(path)
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{p}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected an object/table at top level")
    return data


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Defaults < config file < ``KVTIER_*`` env < ``overrides`` (CLI flags; None values are ignored)."""
    file_vals = read_config_file(config_file) if config_file else {}
    env_vals = Settings().model_dump(exclude_unset=True)
    merged = {**file_vals, **env_vals, **{k: v for k, v in overrides.items() if v is not None}}
    return Settings(**merged)
