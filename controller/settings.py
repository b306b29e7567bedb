"""The one settings tree of ``kvtier serve``: flags > ``KVTIER_*`` environment > config file > defaults.

Sections: ``serve`` (listen, state, logs, mode), ``collectors`` (peers and scrape cadence), ``loop``
(tick cadence, placement policy), ``planner`` (tiers, budgets, thresholds), ``predictor``, ``learned``
(the learned policy's knobs) and ``actuators`` (a list tagged by ``kind``). The ``loop``, ``planner`` and
``predictor`` sections seed the policy document (``/v1/policy``); a persisted document overrides them.

Every model forbids unknown keys: a misspelled key is an error naming it (``kvtier serve`` exits 2).
The config file is YAML (``.yaml``/``.yml``, the Kubernetes ConfigMap form), JSON (``.json``) or TOML
(anything else). Nested environment variables use ``__`` (``KVTIER_COLLECTORS__SCRAPE_INTERVAL_S=1``);
the flat names of the collectors and serve fields (``KVTIER_ENGINE_URLS``, ``KVTIER_MODE``, ...) and the
flat config-file keys stay accepted and are lifted into their section (:data:`FLAT_KEYS`).

List values in the environment are JSON (``KVTIER_ENGINE_URLS='["http://127.0.0.1:8000"]'``) or
comma-separated (``KVTIER_ENGINE_URLS=http://a:8000,http://b:8000``). ``KVTIER_TIER_PATHS`` is a JSON object
(``'{"disk": "/mnt/kv-l2"}'``) or ``tier=path[,tier=path]`` (``disk=/mnt/kv-l2,remote=/mnt/nvmeof0``).
"""

from __future__ import annotations

import inspect
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as _SourceError

from kvtier.controller.policy_doc import LoopKnobs, Mode, PlannerKnobs, PredictorSettings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


def _url(u: str) -> str:
    u = u.strip().rstrip("/")
    return u if u.startswith(("http://", "https://")) else "http://" + u


class ServeSettings(_Section):
    """The process: where it listens, what it keeps, how it logs, the operating mode."""

    listen: str = Field(default="127.0.0.1:8787", description="HOST:PORT of the HTTP API")
    state_dir: str = Field(
        default=".kvtier-state", description="directory of the SQLite file with policy, pins, trained model"
    )
    api_token: str | None = Field(default=None, description="bearer token required for API mutations")
    log_level: str = Field(default="INFO", description="Python logging level name")
    log_json: bool = Field(default=False, description="structured JSON-lines logs")
    mode: Mode | None = Field(
        default=None, description="off | shadow | active; None keeps the persisted policy's (default shadow)"
    )

    @property
    def listen_host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen must be HOST:PORT, got {self.listen!r}")
        return host.strip("[]"), int(port)


class CollectorSettings(_Section):
    """The peers watched and how often. Intervals and timeouts in seconds."""

    engine_urls: list[str] = Field(default_factory=list, description="vLLM API servers")
    lmcache_urls: list[str] = Field(default_factory=list, description="LMCache MP servers (HTTP)")
    mooncake_urls: list[str] = Field(default_factory=list, description="Mooncake masters (HTTP metrics)")
    lmcache_controller_urls: list[str] = Field(
        default_factory=list, description="legacy LMCache cache controllers (LMCacheConnectorV1 deployments)"
    )
    engine_model: str = Field(
        default="", description="served model name for warm-ups; '' = first of the engine's /v1/models"
    )
    scrape_interval_s: float = Field(default=2.0, gt=0, description="period of /metrics scrapes of peers, s")
    discovery_interval_s: float = Field(
        default=5.0, gt=0, description="period of GET /kv_event_sources (KV-event publisher discovery), s"
    )
    storage_interval_s: float = Field(default=5.0, gt=0, description="period of /proc and /sys reads, s")
    http_timeout_s: float = Field(default=5.0, gt=0, description="timeout of one HTTP call to a peer, s")
    replay_timeout_s: float = Field(
        default=2.0, gt=0, description="wait for a KV-event replay after a sequence gap, s"
    )
    max_seq_gap: int = Field(
        default=10_000, gt=0, description="largest KV-event seq step (batches) confirming a held batch"
    )
    index_max_blocks: int = Field(
        default=2_000_000,
        gt=0,
        description="blocks the index tracks at most (~250 B each); beyond it the stalest non-resident "
        "blocks are forgotten (resident blocks never: stores that do not fit are counted and skipped)",
    )
    storage_enabled: bool = Field(default=True, description="collect block-device and filesystem stats")
    storage_root: str = Field(default="/", description="prefix for /proc and /sys (tests use canned trees)")
    storage_devices: list[str] | None = Field(
        default=None, description="devices watched; None = all but loop/ram"
    )
    tier_paths: dict[str, str] = Field(
        default_factory=dict, description="tier -> path whose filesystem capacity is reported"
    )

    @field_validator(
        "engine_urls", "lmcache_urls", "mooncake_urls", "lmcache_controller_urls", "storage_devices",
        mode="before",
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
        return [_url(u) for u in v]


class LoopSettings(LoopKnobs):
    """The reconcile loop: tick cadence (seeds the policy document) and the placement policy object."""

    policy: str = Field(
        default="learned", description="placement policy object (registry name; 'none' = index-only planning)"
    )
    policy_tier: str = Field(
        default="cpu", description="tier that policy places (capacity from planner.tiers)"
    )


def _learned_defaults() -> dict[str, Any]:
    from kvtier.policies.learned import LearnedPolicy

    sig = inspect.signature(LearnedPolicy.__init__)
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


_LD = _learned_defaults()  # the learned policy's constructor holds the defaults; this section mirrors them


class LearnedSettings(_Section):
    """Knobs of the ``learned`` placement policy (:class:`kvtier.policies.learned.LearnedPolicy`).

    Defaults are the policy constructor's; only values that differ from them are passed on."""

    horizon_s: float = Field(default=_LD["horizon_s"], gt=0, description="reuse label horizon, seconds")
    retrain_every: int = Field(default=_LD["retrain_every"], ge=1, description="refit every N requests")
    max_train: int = Field(default=_LD["max_train"], ge=1, description="training rows sampled per refit")
    min_class: int = Field(default=_LD["min_class"], ge=1, description="rows of each label before a fit")
    tau_mode: str = Field(default=_LD["tau_mode"], description="how the age scale tau is set ('gap', ...)")
    experts: tuple[str, ...] = Field(
        default=_LD["experts"], description="classic policies shadowed as experts"
    )
    learned_mults: tuple[float, ...] = Field(
        default=_LD["learned_mults"], description="recency scales of the model-keyed expert planners"
    )
    heuristic_mults: tuple[float, ...] = Field(
        default=_LD["heuristic_mults"], description="recency scales of the heuristic-keyed expert planners"
    )
    switch_every: int = Field(default=_LD["switch_every"], ge=1, description="requests between leader checks")
    switch_margin: float = Field(
        default=_LD["switch_margin"], ge=1.0, description="paired lead (x prefix-hit tokens) to switch leader"
    )
    switch_z: float = Field(default=_LD["switch_z"], ge=0, description="z-score the lead must clear")
    recency_mult: float = Field(
        default=_LD["recency_mult"], gt=0, description="scale of the real cache's tau"
    )
    expert_decay: float = Field(
        default=_LD["expert_decay"], gt=0, le=1, description="per-request decay of the experts' scores"
    )
    event_buffer: int = Field(default=_LD["event_buffer"], ge=1, description="access events kept for labels")
    lead_bias: float = Field(
        default=_LD["lead_bias"], description="log-odds added to blocks the followed expert holds"
    )
    home_z: float | None = Field(
        default=_LD["home_z"], description="z to return home to the model; None = off"
    )
    extra_features: tuple[str, ...] = Field(
        default=_LD["extra_features"], description="optional re-touch feature columns"
    )
    classic_key: str = Field(
        default=_LD["classic_key"], description="keyed expert ranking blocks while a classic one leads"
    )
    return_z: float | None = Field(default=_LD["return_z"], description="z to return to a former leader")
    return_within: int = Field(
        default=_LD["return_within"], ge=0, description="requests a former leader stays eligible to return"
    )

    def options(self) -> dict[str, Any]:
        """Keyword arguments for the policy constructor: the values that differ from its defaults."""
        return {k: v for k, v in self.model_dump().items() if v != _LD[k]}


class ShadowActuatorSettings(_Section):
    """Records what would be done; moves nothing."""

    kind: Literal["shadow"] = "shadow"


class VllmWarmupSettings(_Section):
    """Re-creates evicted GPU prefixes through the engine's OpenAI API (``max_tokens=1`` requests)."""

    kind: Literal["vllm-warmup"] = "vllm-warmup"
    tokens_per_s: float = Field(default=4096.0, gt=0, description="budget: prompt tokens per second")
    requests_per_s: float = Field(default=4.0, gt=0, description="budget: requests per second")


class LMCacheMPSettings(_Section):
    """LMCache multi-process server (``/api/v1`` control plane). ``url`` defaults to the first lmcache_url."""

    kind: Literal["lmcache-mp"] = "lmcache-mp"
    url: str | None = Field(
        default=None, description="MP server HTTP address; None = collectors.lmcache_urls[0]"
    )
    timeout_s: float = Field(default=5.0, gt=0, description="per-request timeout, s")
    retries: int = Field(default=3, ge=1, description="attempts per request")
    breaker_failures: int = Field(default=3, ge=1, description="consecutive failures that open the breaker")
    breaker_reset_s: float = Field(default=5.0, ge=0, description="open-breaker wait before a trial call, s")
    model_name: str | None = Field(
        default=None, description="model name in LMCache keys; None = the engine's --model (/v1/models root)"
    )
    prefetch_timeout_s: float = Field(default=10.0, gt=0, description="wait for a prefetch to land, s")


class LMCacheControllerSettings(_Section):
    """Legacy LMCache cache controller. ``url`` defaults to the first lmcache_controller_url."""

    kind: Literal["lmcache-controller"] = "lmcache-controller"
    url: str | None = Field(
        default=None, description="controller URL; None = collectors.lmcache_controller_urls[0]"
    )
    instance_id: str = Field(description="LMCache instance id the controller addresses")
    timeout_s: float = Field(default=10.0, gt=0, description="per-request timeout, s")


class MooncakeSettings(_Section):
    """Mooncake store client (needs the ``mooncake-transfer-engine`` wheel)."""

    kind: Literal["mooncake"] = "mooncake"
    admin_url: str = Field(description="master's HTTP admin/metrics address")
    local_hostname: str = Field(description="this client's address in the transfer engine")
    metadata_url: str = Field(description="transfer-engine metadata server (e.g. http://host:8080/metadata)")
    master_addr: str = Field(description="master RPC address host:port")
    segment_bytes: int = Field(default=64 << 20, ge=1, description="memory segment this client contributes")
    buffer_bytes: int = Field(default=16 << 20, ge=1, description="local transfer buffer")
    protocol: str = Field(default="tcp", description="transfer protocol (tcp, rdma)")
    timeout_s: float = Field(default=5.0, gt=0, description="admin HTTP timeout, s")


class MemorySettings(_Section):
    """The simulator's cache layer (``kvtier demo``); built in Python, not from a file."""

    kind: Literal["memory"] = "memory"
    layer: Any = Field(description="the kvtier.replay.sim CacheLayer the actuator drives")


ActuatorSettings = Annotated[
    ShadowActuatorSettings
    | VllmWarmupSettings
    | LMCacheMPSettings
    | LMCacheControllerSettings
    | MooncakeSettings
    | MemorySettings,
    Field(discriminator="kind"),
]

# flat (pre-tree) keys, in config files, ``Settings(...)`` and ``KVTIER_<KEY>`` -> the section holding them
FLAT_KEYS: dict[str, str] = {
    **{k: "serve" for k in ServeSettings.model_fields},
    **{k: "collectors" for k in CollectorSettings.model_fields},
    "policy": "loop",
    "policy_tier": "loop",
}
_SECTIONS = ("serve", "collectors", "loop", "planner", "predictor", "learned", "actuators")


def _lift(data: Mapping[str, Any]) -> dict[str, Any]:
    """Flat keys -> their section; ``actuators: [name, ...]`` + ``actuator_options`` + ``warmup_*`` -> the
    tagged list. Unknown keys are left in place for the model to reject by name."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k in FLAT_KEYS and k not in _SECTIONS:
            sec = out.setdefault(FLAT_KEYS[k], {})
            if isinstance(sec, dict):
                sec[k] = v
        elif k in _SECTIONS and isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = {**v, **out[k]}
        elif k not in ("actuator_options", "warmup_tokens_per_s", "warmup_requests_per_s"):
            out[k] = v
    acts = out.get("actuators")
    if isinstance(acts, str):
        acts = _split(acts)
    options = data.get("actuator_options") or {}
    if isinstance(options, str):
        options = json.loads(options) if options.strip() else {}
    if acts is not None and not isinstance(acts, list | tuple):
        return out
    warm = {
        k.removeprefix("warmup_"): data[k]
        for k in ("warmup_tokens_per_s", "warmup_requests_per_s")
        if k in data
    }
    if acts is None and (options or warm):
        acts = []
    if acts is not None:
        tagged = []
        for a in acts:
            if isinstance(a, str):
                entry: dict[str, Any] = {"kind": a, **dict(options.get(a) or {})}
                if a == "vllm-warmup":
                    entry.update(warm)
                tagged.append(entry)
            else:
                tagged.append(a)
        out["actuators"] = tagged
    return out


# the flat ``KVTIER_<KEY>`` environment variables read (lower-cased key without the prefix)
FLAT_ENV: tuple[str, ...] = (
    *FLAT_KEYS,
    "actuators",
    "actuator_options",
    "warmup_tokens_per_s",
    "warmup_requests_per_s",
)


class _FlatEnv(PydanticBaseSettingsSource):
    """``KVTIER_<FLAT_KEY>`` environment variables (``KVTIER_ENGINE_URLS``, ``KVTIER_ACTUATORS``, ...)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        flat = {}
        for k in FLAT_ENV:
            v = os.environ.get(f"KVTIER_{k.upper()}")
            if v is not None:
                flat[k] = v
        return _lift(flat)


class Settings(BaseSettings):
    """Everything ``kvtier serve`` needs, as one tree of sections (see the module docstring)."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_", env_nested_delimiter="__", extra="forbid")

    serve: ServeSettings = Field(default_factory=ServeSettings, description="the process")
    collectors: CollectorSettings = Field(default_factory=CollectorSettings, description="peers watched")
    loop: LoopSettings = Field(default_factory=LoopSettings, description="tick cadence, placement policy")
    planner: PlannerKnobs = Field(default_factory=PlannerKnobs, description="tiers, budgets, thresholds")
    predictor: PredictorSettings = Field(default_factory=PredictorSettings, description="reuse predictor")
    learned: LearnedSettings = Field(default_factory=LearnedSettings, description="learned policy knobs")
    actuators: Annotated[list[ActuatorSettings], NoDecode] = Field(
        default_factory=list, description="adapters that act, tagged by kind (none: decide and score only)"
    )

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        return _lift(data) if isinstance(data, Mapping) else data

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # the flat variables first: KVTIER_ACTUATORS with KVTIER_ACTUATOR_OPTIONS is lifted there as a whole
        return init_settings, _FlatEnv(settings_cls), env_settings

    def policy_doc_seed(self) -> dict[str, Any]:
        """The policy document these settings seed (a persisted document overrides it)."""
        loop = self.loop.model_dump(include=set(LoopKnobs.model_fields))
        seed = {**self.planner.model_dump(), **loop, "predictor": self.predictor.model_dump()}
        if self.serve.mode is not None:
            seed["mode"] = self.serve.mode
        return seed


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML (``.yaml``/``.yml``), JSON (``.json``) or TOML (anything else) file -> dict of settings.

    Raises ValueError naming the file if it is unreadable or malformed."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: {exc.strerror or exc}") from exc
    try:
        if p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{p}: {' '.join(str(exc).split())}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected an object/table at top level")
    return data


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


class SettingsError(ValueError):
    """A settings problem as one line (unknown key, bad value), fit for stderr."""


def describe(exc: ValidationError, source: str = "settings") -> str:
    """One line naming each bad key by its dotted path."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"] if not (isinstance(x, str) and x in _KINDS))
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key {loc!r}")
        else:
            parts.append(f"{loc}: {e['msg']}")
    return f"{source}: " + "; ".join(parts)


_KINDS = {"shadow", "vllm-warmup", "lmcache-mp", "lmcache-controller", "mooncake", "memory"}


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Defaults < config file < ``KVTIER_*`` env < ``overrides`` (CLI flags, flat or sectioned keys; None
    values are ignored). Raises :class:`SettingsError` (a ValueError) with one line naming bad keys."""
    file_vals = _lift(read_config_file(config_file)) if config_file else {}
    source = str(config_file) if config_file else "settings"
    try:
        env_vals = Settings().model_dump(exclude_unset=True)
        flags = _lift({k: v for k, v in overrides.items() if v is not None})
        return Settings(**_deep_merge(_deep_merge(file_vals, env_vals), flags))
    except ValidationError as exc:
        raise SettingsError(describe(exc, source)) from None
    except (_SourceError, json.JSONDecodeError) as exc:
        raise SettingsError(f"environment: {exc}") from None
