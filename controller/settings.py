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

import difflib
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
    cpu_nice: int = Field(
        default=0, ge=0, le=19,
        description="raise the process's nice value by this at start (Linux): where the sidecar shares cores "
        "with the engine, its ticks and scrapes then yield the CPU to it",
    )  # fmt: skip
    # -- hardening: see controller/guard.py and docs/security.md --
    insecure_no_auth: bool = Field(
        default=False, description="allow a non-loopback listen without an API token (logged loudly)"
    )
    allow_active: bool = Field(
        default=False, description="the API may switch mode to active (implied by mode active)"
    )
    allowed_hosts: list[str] = Field(
        default_factory=list, description="extra Host header names accepted besides listen's ('*' = any)"
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, le=64 << 20, description="largest request body, checked before parsing, B"
    )
    http_max_inflight: int = Field(
        default=64, ge=4, le=4096, description="concurrent requests (503 beyond; /healthz exempt)"
    )
    http_keepalive_s: float = Field(
        default=5.0, ge=0.5, le=300, description="idle keep-alive connections are closed after this, s"
    )
    http_request_deadline_s: float = Field(
        default=15.0, ge=1, le=600, description="a connection must deliver a whole request within this, s"
    )
    max_pins: int = Field(default=1024, ge=1, le=100_000, description="pins held at most")
    max_pinned_tokens: int = Field(
        default=1 << 20, ge=1, le=1 << 26, description="token ids of all pins together, at most"
    )
    max_pin_tokens: int = Field(
        default=131_072, ge=1, le=1 << 22, description="token ids of one pin's prefix, at most"
    )

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, v: Any) -> Any:
        return _split(v)

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
    def _secure_listen(self) -> ServeSettings:
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
    # lower bounds keep a typo (1e-6) from turning a poll loop into a busy loop
    scrape_interval_s: float = Field(
        default=2.0, ge=0.1, le=3600, description="period of /metrics scrapes of peers, s"
    )
    discovery_interval_s: float = Field(
        default=5.0, ge=0.1, le=3600,
        description="period of GET /kv_event_sources (KV-event publisher discovery), s",
    )  # fmt: skip
    storage_interval_s: float = Field(
        default=5.0, ge=0.1, le=3600, description="period of /proc and /sys reads, s"
    )
    http_timeout_s: float = Field(
        default=5.0, ge=0.1, le=600, description="timeout of one HTTP call to a peer, s"
    )
    kv_flush_interval_s: float = Field(
        default=0.25, ge=0, le=60,
        description="least time between block-index updates from KV events, s (0 = after every message)",
    )  # fmt: skip
    replay_timeout_s: float = Field(
        default=2.0, ge=0.1, le=600, description="wait for a KV-event replay after a sequence gap, s"
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


class LMCacheL1Settings(_Section):
    """The LMCache MP L1 keeper (:mod:`kvtier.controller.l1_keeper`): second-sight L1 admission behind a
    measured guard. Acts on its own worker thread, not through the planner; needs collectors.lmcache_urls."""

    kind: Literal["lmcache-l1"] = "lmcache-l1"
    model_name: str | None = Field(
        default=None, description="model name in LMCache keys; None = the engine's --model (/v1/models root)"
    )
    capacity_chunks: int = Field(
        default=256, ge=1, description="L1 capacity the counterfactual assumes until /status reports one"
    )
    window: int = Field(default=512, ge=1, description="chunk sightings per guard window")
    probation_chunks: int = Field(
        default=32, ge=0,
        description="first-sight chunks that wait in L1 before the oldest not seen again is dropped; 0 = drop"
        " each first-sight chunk delay_s after its store",
    )  # fmt: skip
    cold_fill: float | None = Field(
        default=None, gt=0, lt=1,
        description="cold-chain eviction: keep L1 (as /status counts it) under this share of its capacity by"
        " dropping the chunks of the chains least likely continued next (learned online by age); just under"
        " LMCache's eviction watermark (0.8): 0.75; null = off, the default: it did not pay on the live rig"
        " (docs/perf/live_ab_lmcache_l1.md)",
    )  # fmt: skip
    readmit_by_gap: bool = Field(
        default=True,
        description="readmit a dropped chunk at its second sight only if chunks back after as many requests"
        " are used again (while they would stay in L1) at least as often as the average second sight"
        " (learned online); false = readmit every one (+5 points of L1 hits live with it on,"
        " docs/perf/live_ab_lmcache_l1.md)",
    )
    delay_s: float = Field(
        default=0.5, ge=0,
        description="with probation 0, wait after a store before its L1 drop; always the wait before"
        " checking again for a chunk's L2 copy, s",
    )  # fmt: skip
    verify_deadline_s: float = Field(
        default=15.0, gt=0, description="give up on a drop whose L2 copy has not appeared by then, s"
    )
    status_every_s: float = Field(default=2.0, gt=0, description="period of the layer's /status reads, s")
    measure_every_s: float = Field(
        default=10.0, gt=0, description="measured-guard period on LMCache's own L1-hit counter, s"
    )
    latency_guard: bool = Field(
        default=False,
        description="switchback guard on the engine's TTFT (its /metrics, once per measure period): hold in"
        " shadow while acting costs latency",
    )

    def keeper_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~kvtier.controller.l1_keeper.L1Keeper` (all but kind, model and
        the latency guard's switch: the composition root gives the keeper an engine TTFT reader for it)."""
        return self.model_dump(exclude={"kind", "model_name", "latency_guard"})


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
    | LMCacheL1Settings
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

    @staticmethod
    def read() -> dict[str, Any]:
        """The flat variables set, by lower-cased key (values as strings)."""
        flat = {}
        for k in FLAT_ENV:
            v = os.environ.get(f"KVTIER_{k.upper()}")
            if v is not None:
                flat[k] = v
        return flat

    def __call__(self) -> dict[str, Any]:
        return _lift(self.read())


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

    Raises ValueError naming the file if it is malformed, OSError (FileNotFoundError, ...) if unreadable."""
    p = Path(path)
    text = p.read_text()
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
        if e["type"] == "union_tag_invalid" and loc.startswith("actuators."):
            tag = (e.get("ctx") or {}).get("tag")
            parts.append(f"{loc}: unknown actuator {tag!r}; known: {', '.join(_KIND_MODELS)}")
        elif e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), _candidates(e["loc"]), n=1)
            parts.append(f"unknown key {loc!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        else:
            parts.append(f"{loc}: {e['msg']}")
    return f"{source}: " + "; ".join(parts)


def _candidates(loc: tuple[int | str, ...]) -> list[str]:
    """Names valid where ``loc`` points (for a did-you-mean hint): top level = sections and flat keys."""
    if len(loc) <= 1:
        return [*_SECTIONS, *FLAT_ENV]
    field = Settings.model_fields.get(str(loc[0]))
    model = field.annotation if field is not None else None
    if len(loc) == 2 and isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    if loc[0] == "actuators" and len(loc) == 4:
        kind = _KIND_MODELS.get(str(loc[2]))
        return list(kind.model_fields) if kind is not None else []
    return []


_KIND_MODELS: dict[str, type[BaseModel]] = {
    m.model_fields["kind"].default: m
    for m in (ShadowActuatorSettings, VllmWarmupSettings, LMCacheMPSettings, MooncakeSettings,
              LMCacheControllerSettings, MemorySettings, LMCacheL1Settings)
}  # fmt: skip

_KINDS = set(_KIND_MODELS)


_FLAT_OPTIONS = ("actuator_options", "warmup_tokens_per_s", "warmup_requests_per_s")


def _carry(top: list[Any], pool: Mapping[str, Any]) -> list[Any]:
    """Entries of ``top`` that name only a kind (``--actuator lmcache-l1``) take the entry of that kind from
    ``pool`` (kind -> the highest lower source's entry, e.g. the config file's options for it)."""
    return [pool.get(e["kind"], e) if isinstance(e, Mapping) and set(e) == {"kind"} else e for e in top]


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Defaults < config file < ``KVTIER_*`` env < ``overrides`` (CLI flags, flat or sectioned keys; None
    values are ignored). Raises :class:`SettingsError` (a ValueError) with one line naming bad keys.

    Actuator options follow the actuators wherever they are named: the flat ``actuator_options`` and
    ``warmup_*`` of the highest source that sets them apply to the names of the source that names the
    actuators (a config file's ``actuator_options: {lmcache-l1: ...}`` with ``--actuator lmcache-l1``), and a
    name alone takes a lower source's entry of that kind."""
    file_raw = read_config_file(config_file) if config_file else {}
    flags_raw = {k: v for k, v in overrides.items() if v is not None}
    source = str(config_file) if config_file else "settings"
    try:
        env_raw = _FlatEnv.read()
        carried: dict[str, Any] = {}
        for src in (file_raw, env_raw, flags_raw):
            carried.update({k: src[k] for k in _FLAT_OPTIONS if k in src})

        def lift(src: Mapping[str, Any]) -> dict[str, Any]:
            own = {k: v for k, v in src.items() if k not in _FLAT_OPTIONS}
            return _lift({**own, **carried} if "actuators" in own else own)

        file_vals = lift(file_raw)
        env_vals = Settings().model_dump(exclude_unset=True)
        if "actuators" in env_raw:  # the flat names with the options carried from any source
            env_vals["actuators"] = lift({"actuators": env_raw["actuators"]})["actuators"]
        flags = lift(flags_raw)
        merged: dict[str, Any] = {}
        pool: dict[str, Any] = {}  # kind -> entry, from the sources below the one being merged
        for src in (file_vals, env_vals, flags):
            acts = src.get("actuators")
            if isinstance(acts, list):
                src["actuators"] = acts = _carry(acts, pool)
                pool.update({e["kind"]: e for e in acts if isinstance(e, Mapping) and "kind" in e})
            merged = _deep_merge(merged, src)
        return Settings(**merged)
    except ValidationError as exc:
        raise SettingsError(describe(exc, source)) from None
    except (_SourceError, json.JSONDecodeError) as exc:
        raise SettingsError(f"environment: {exc}") from None
