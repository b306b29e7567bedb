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

from pydantic import Field, field_validator, model_validator
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
    # lower bounds keep a typo (1e-6) from turning a poll loop into a busy loop
    scrape_interval_s: float = Field(default=2.0, ge=0.1, le=3600)  # /metrics of peers
    discovery_interval_s: float = Field(default=5.0, ge=0.1, le=3600)  # GET /kv_event_sources
    storage_interval_s: float = Field(default=5.0, ge=0.1, le=3600)
    http_timeout_s: float = Field(default=5.0, ge=0.1, le=600)
    replay_timeout_s: float = Field(default=2.0, ge=0.1, le=600)
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
    # -- hardening (issue 18): see controller/guard.py and docs/security.md --
    insecure_no_auth: bool = False  # allow a non-loopback --listen without a token (logged loudly)
    allow_active: bool = False  # the API may switch mode to active (implied by --mode active)
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list
    )  # extra Host names ("*" = any)
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)  # request bodies, checked pre-parse
    http_max_inflight: int = Field(
        default=64, ge=4, le=4096
    )  # concurrent requests (503 beyond; not /healthz)
    http_keepalive_s: float = Field(default=5.0, ge=0.5, le=300)  # idle keep-alive connections closed after
    http_request_deadline_s: float = Field(default=15.0, ge=1, le=600)  # to receive a whole request
    max_pins: int = Field(default=1024, ge=1, le=100_000)
    max_pinned_tokens: int = Field(default=1 << 20, ge=1, le=1 << 26)  # all pins' token ids together
    max_pin_tokens: int = Field(default=131_072, ge=1, le=1 << 22)  # one pin's prefix
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
        "actuators", "allowed_hosts", mode="before",
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

    @field_validator("api_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError(
                "api_token (KVTIER_API_TOKEN) is empty or whitespace: set a real token or unset it"
            )
        if v is not None and v != v.strip():
            raise ValueError("api_token (KVTIER_API_TOKEN) has leading/trailing whitespace")
        return v

    @model_validator(mode="after")
    def _secure_listen(self) -> Settings:
        from kvtier.controller.guard import is_loopback

        host, _ = self.listen_host_port
        if not is_loopback(host) and self.api_token is None and not self.insecure_no_auth:
            raise ValueError(
                f"--listen {self.listen} is reachable from other hosts but no API token is set: set "
                "KVTIER_API_TOKEN (or pass --insecure-no-auth to serve mutations unauthenticated)"
            )
        if self.mode == "active":
            self.allow_active = True  # started active: the operator allowed it
        return self

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
