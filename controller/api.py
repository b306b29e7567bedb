"""REST policy API (FastAPI routers): policy, pins, decisions, blocks, model; bearer auth on mutations.

Mount with :func:`add_control_routes` on the sidecar's app (collectors' ``controller.app``). Every mutation
needs ``Authorization: Bearer <token>`` when a token is configured (``KVTIER_API_TOKEN``): 401 when missing,
403 when wrong -- checked by :class:`~kvtier.controller.guard.RequestGuard` before the body is read, together
with the body-size limit, the Host allow-list and JSON-only mutations. Validation errors are 422 with a
``detail`` list naming the field and the reason (never echoing the input). Every mutation writes the state
database first and changes memory only after the write succeeded (503 when it fails); policy updates are
serialised by a lock so concurrent PATCHes of different fields all survive. ``mode: active`` is refused (403)
unless the process was started with active allowed (``--allow-active`` / ``--mode active``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import httpx
import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvtier.controller.guard import RequestGuard
from kvtier.controller.loop import ReconcileLoop, block_key_hex
from kvtier.controller.model import ModelManager
from kvtier.controller.pins import Pin
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.store import StateStore, StoreError
from kvtier.policies.index import to_key
from kvtier.policies.prefix_hash import block_hashes
from kvtier.policies.tiers import TIER_ORDER, Tier

log = logging.getLogger(__name__)

Tokenizer = Callable[[str, str], Awaitable[list[int]]]  # (prompt, model) -> token ids


class PinRequest(BaseModel):
    """Exactly one of ``prompt``, ``token_ids``, ``block_hash``."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = Field(
        default=None, min_length=1, max_length=1_000_000, description="tokenized by the engine"
    )
    token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        default=None, min_length=1, max_length=1_000_000
    )
    block_hash: str | int | None = Field(
        default=None,
        description="16 hex digits (or 0x-prefixed) or a decimal uint64",
        union_mode="left_to_right",
    )
    tier: Tier = Field(default=Tier.GPU, description="gpu, cpu, disk or remote")
    ttl_s: float | None = Field(
        default=None, gt=0, le=86400 * 365, description="expire after this many seconds"
    )
    model: str | None = Field(
        default=None, max_length=256, description="served model name (default: the engine's)"
    )

    @model_validator(mode="after")
    def _one_of(self) -> PinRequest:
        if self.prompt is not None and not _utf8(self.prompt):
            raise ValueError("prompt is not valid UTF-8 text (lone surrogate)")
        if self.model is not None and not _utf8(self.model):
            raise ValueError("model is not valid UTF-8 text (lone surrogate)")
        if isinstance(self.block_hash, str) and len(self.block_hash) > 40:
            raise ValueError("block_hash is longer than 40 characters")
        given = [k for k in ("prompt", "token_ids", "block_hash") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, token_ids, block_hash (got {given or 'none'})")
        return self


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _safe_text(v: Any, limit: int = 200) -> str:
    """Any value -> printable, UTF-8-encodable text of at most ``limit`` characters (for error messages)."""
    return str(v).encode("utf-8", "backslashreplace").decode("utf-8")[:limit]


def parse_block_hash(v: str | int) -> int:
    """Hex (16 digits or 0x-prefixed) or decimal -> int64 key. ValueError when it is not a 64-bit hash."""
    if isinstance(v, bool):
        raise ValueError("block_hash must be a string or an integer")
    if isinstance(v, int):
        return to_key(v)
    s = v.strip().lower()
    if s.startswith("0x"):
        n = int(s[2:], 16)
    elif len(s) == 16 and all(c in "0123456789abcdef" for c in s):
        n = int(s, 16)
    elif s.lstrip("-").isdigit():
        n = int(s)
    else:
        raise ValueError(f"block_hash {v!r} is neither 16 hex digits, 0x-hex nor decimal")
    if not -(1 << 63) <= n < (1 << 64):
        raise ValueError(f"block_hash {v!r} does not fit in 64 bits")
    return to_key(n)


class ControlContext:
    """What the routers need; built once by the sidecar."""

    def __init__(
        self,
        loop: ReconcileLoop,
        store: StateStore,
        models: ModelManager,
        *,
        api_token: str | None = None,
        tokenizer: Tokenizer | None = None,
        engine_model: str = "",
        clock: Callable[[], float] = time.time,
        allow_active: bool = False,
        allowed_hosts: frozenset[str] | None = None,
        max_body_bytes: int = 1 << 20,
        max_inflight: int = 64,
        max_pins: int = 1024,
        max_pinned_tokens: int = 1 << 20,
        max_pin_tokens: int = 131_072,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """``allow_active``: the API may set ``mode: active`` (else 403); ``allowed_hosts``: the Host
        allow-list (None = any Host; ``kvtier serve`` derives it from ``--listen``); the ``max_*`` caps
        bound request bodies (bytes), concurrent requests, pins, and pinned token ids (all pins / one pin)."""
        if api_token is not None and not api_token.strip():
            raise ValueError("api token is empty or whitespace")
        self.loop, self.store, self.models = loop, store, models
        self.api_token = api_token or None
        self.allow_active = allow_active
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.max_pins = max_pins
        self.max_pinned_tokens = max_pinned_tokens
        self.max_pin_tokens = max_pin_tokens
        self.registry = registry
        self.policy_lock = threading.Lock()  # serialises policy read-modify-write (PATCH/PUT)
        self.pin_lock = threading.Lock()  # serialises the pin caps check with the insert
        self.tokenizer = tokenizer
        self.engine_model = engine_model
        self.clock = clock

    def restore(self) -> None:
        """Load the persisted policy and pins (called at startup)."""
        doc = self.store.get_json("policy")
        if doc is not None:
            try:
                pd = PolicyDoc.model_validate(doc)
                if pd.mode == "active" and not self.allow_active:
                    log.warning(
                        "persisted policy says mode active but active is not allowed: starting in shadow"
                    )
                    pd = pd.model_copy(update={"mode": "shadow"})
                self.loop.set_policy(pd)
            except ValidationError as e:
                self.store.errors["row"] += 1
                log.error("persisted policy is invalid, keeping defaults: %s", e)
        for p in self.store.load_pins()[: self.max_pins]:
            self.loop.pins.add(p)
            if p.token_ids is not None and p.block_size:
                self.loop.tokens.add_chain(p.blocks, p.token_ids, p.block_size)
        self.models.load()


def engine_tokenizer(base_url: str, client: httpx.AsyncClient, timeout_s: float = 10.0) -> Tokenizer:
    """``POST {base_url}/tokenize`` (vLLM) -> token ids."""

    async def tokenize(prompt: str, model: str) -> list[int]:
        body: dict[str, Any] = {"prompt": prompt}
        if model:
            body["model"] = model
        r = await client.post(base_url.rstrip("/") + "/tokenize", json=body, timeout=timeout_s)
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    return tokenize


def _auth(ctx: ControlContext) -> Callable[..., None]:
    def check(authorization: Annotated[str | None, Header()] = None) -> None:
        if ctx.api_token is None:
            return
        if not authorization:
            raise HTTPException(
                401, "missing Authorization: Bearer <token> header", headers={"WWW-Authenticate": "Bearer"}
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HTTPException(
                401, "Authorization header must be 'Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
            )
        if not hmac.compare_digest(token.strip().encode(), ctx.api_token.encode()):
            raise HTTPException(403, "invalid API token")

    return check


def _validation_422(e: ValidationError) -> HTTPException:
    return HTTPException(
        422,
        [
            {
                "loc": [x if isinstance(x, int) else _safe_text(x, 80) for x in err["loc"]],
                "msg": _safe_text(err["msg"]),
                "type": err["type"],
            }
            for err in e.errors(include_url=False)[:20]
        ],
    )


def build_router(ctx: ControlContext) -> APIRouter:
    r = APIRouter()
    auth = Depends(_auth(ctx))
    loop = ctx.loop

    # -- policy ------------------------------------------------------------------------------------------
    @r.get("/v1/policy", response_model=PolicyDoc, tags=["policy"])
    def get_policy() -> PolicyDoc:
        """The active policy (or the one pending for the next tick)."""
        return loop.next_policy

    def _apply(doc: PolicyDoc) -> PolicyDoc:
        """Caller holds ``ctx.policy_lock``. Database first, then memory."""
        current = loop.next_policy
        if doc.mode == "active" and current.mode != "active" and not ctx.allow_active:
            raise HTTPException(
                403, "mode active is not allowed: start kvtier with --allow-active (or --mode active)"
            )
        ctx.store.put_json("policy", doc.model_dump(mode="json"))
        loop.set_policy(doc)
        return doc

    @r.put("/v1/policy", response_model=PolicyDoc, tags=["policy"], dependencies=[auth])
    def put_policy(doc: PolicyDoc) -> PolicyDoc:
        """Replace the whole policy; it takes effect at the next tick boundary."""
        with ctx.policy_lock:
            return _apply(doc)

    @r.patch("/v1/policy", response_model=PolicyDoc, tags=["policy"], dependencies=[auth])
    def patch_policy(patch: dict[str, Any]) -> PolicyDoc:
        """Merge a partial policy (objects merge, lists replace), validate, apply at the next tick."""
        with ctx.policy_lock:
            try:
                doc = loop.next_policy.merged(patch)
            except ValidationError as e:
                raise _validation_422(e) from e
            return _apply(doc)

    # -- pins ----------------------------------------------------------------------------------------------
    @r.get("/v1/pins", tags=["pins"])
    def list_pins() -> dict[str, Any]:
        now = ctx.clock()
        return {"pins": [p.to_dict() for p in loop.pins.all() if not p.expired(now)]}

    @r.post("/v1/pins", status_code=201, tags=["pins"], dependencies=[auth])
    async def add_pin(req: PinRequest) -> dict[str, Any]:
        """Pin a prefix to a tier: the planner keeps it there (or brings it there) until deleted / expired."""
        bs = loop.policy.block_size_tokens
        model = req.model or ctx.engine_model
        tokens: list[int] | None = None
        if req.prompt is not None:
            if ctx.tokenizer is None:
                raise HTTPException(
                    422,
                    [
                        {
                            "loc": ["body", "prompt"],
                            "type": "value_error",
                            "msg": "prompt pins need an engine to tokenize (--engine-url); "
                            "send token_ids instead",
                        }
                    ],
                )
            try:
                tokens = await ctx.tokenizer(req.prompt, model)
            except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
                raise HTTPException(
                    503, f"engine /tokenize failed: {type(e).__name__}: {_safe_text(e)}"
                ) from e
            source = "prompt"
        elif req.token_ids is not None:
            tokens = req.token_ids
            source = "token_ids"
        else:
            source = "block_hash"
        if tokens is not None and len(tokens) > ctx.max_pin_tokens:
            raise HTTPException(
                422,
                [
                    {
                        "loc": ["body", source],
                        "type": "value_error",
                        "msg": f"prefix has {len(tokens)} tokens, more than one pin may hold "
                        f"({ctx.max_pin_tokens}; KVTIER_MAX_PIN_TOKENS)",
                    }
                ],
            )
        if tokens is not None:
            if len(tokens) < bs:
                raise HTTPException(
                    422,
                    [
                        {
                            "loc": ["body", source],
                            "type": "value_error",
                            "msg": f"prefix has {len(tokens)} tokens, less than one block "
                            f"({bs} tokens): nothing to pin",
                        }
                    ],
                )
            toks = tokens

            def _hash() -> list[int]:
                return [to_key(h) for h in block_hashes(toks, bs)]

            blocks = await asyncio.to_thread(_hash)  # ~1 s per 100k tokens: never on the event loop
            tokens = tokens[: len(blocks) * bs]
        else:
            assert req.block_hash is not None
            try:
                blocks = [parse_block_hash(req.block_hash)]
            except ValueError as e:
                raise HTTPException(
                    422, [{"loc": ["body", "block_hash"], "type": "value_error", "msg": str(e)}]
                ) from e
        pin = Pin(
            id=uuid.uuid4().hex[:16],
            tier=req.tier,
            blocks=blocks,
            created_at_s=ctx.clock(),
            ttl_s=req.ttl_s,
            source=source,
            token_ids=tokens,
            block_size=bs if tokens else 0,
            model=model,
        )
        await asyncio.to_thread(_commit_pin, pin)
        if tokens is not None:
            loop.tokens.add_chain(blocks, tokens, bs)
        loop.wake()
        return pin.to_dict()

    def _commit_pin(pin: Pin) -> None:
        """Check the caps, write the database, then add to memory (one lock: the caps hold under races)."""
        with ctx.pin_lock:
            if len(loop.pins) >= ctx.max_pins:
                raise HTTPException(
                    409, f"pin limit reached ({ctx.max_pins}; KVTIER_MAX_PINS): delete some first"
                )
            if pin.num_tokens and loop.pins.total_tokens() + pin.num_tokens > ctx.max_pinned_tokens:
                raise HTTPException(
                    409, f"pinned token limit reached ({ctx.max_pinned_tokens}; KVTIER_MAX_PINNED_TOKENS)"
                )
            ctx.store.save_pin(pin)
            loop.pins.add(pin)

    @r.delete("/v1/pins/{pin_id}", status_code=204, tags=["pins"], dependencies=[auth])
    def delete_pin(pin_id: Annotated[str, Path(max_length=64)]) -> Response:
        with ctx.pin_lock:
            if loop.pins.get(pin_id) is None:
                raise HTTPException(404, f"no pin {_safe_text(pin_id)!r}")
            ctx.store.delete_pin(pin_id)  # database first: a failed write leaves the pin in place
            p = loop.pins.remove(pin_id)
        if p is not None:
            loop.pinned_at_layer.difference_update(p.blocks)
        return Response(status_code=204)

    @r.delete("/v1/pins", status_code=204, tags=["pins"], dependencies=[auth])
    def delete_pin_q(id: Annotated[str, Query(max_length=64, description="pin id")]) -> Response:  # noqa: A002
        return delete_pin(id)

    # -- decisions -----------------------------------------------------------------------------------------
    @r.get("/v1/decisions", tags=["audit"])
    def decisions(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        action: Annotated[
            Literal["promote", "demote", "prefetch", "pin", "evict", "admit"] | None, Query()
        ] = None,
        tier: Annotated[Tier | None, Query()] = None,
        outcome: Annotated[
            Literal["planned", "shadow", "applied", "failed", "skipped"] | None, Query()
        ] = None,
    ) -> dict[str, Any]:
        """The audit trail, newest first, with each decision's counterfactual score once known."""
        ds = loop.decisions.query(limit, action, tier.value if tier else None, outcome=outcome)
        return {"decisions": [d.to_dict() for d in ds], "shadow": loop.decisions.report.to_dict()}

    # -- blocks --------------------------------------------------------------------------------------------
    @r.get("/v1/blocks/{block_hash}", tags=["blocks"])
    def explain_block(block_hash: Annotated[str, Path(max_length=32)]) -> dict[str, Any]:
        """Explain one block: features, predicted reuse, tiers, pin, last decisions."""
        try:
            key = parse_block_hash(block_hash)
        except ValueError as e:
            raise HTTPException(
                422, [{"loc": ["path", "block_hash"], "type": "value_error", "msg": str(e)}]
            ) from e
        idx = loop.index
        st = idx.get(key)
        pins = loop.pins.block_map(ctx.clock())
        if st is None and key not in pins:
            raise HTTPException(404, f"block {block_key_hex(key)} is not tracked")
        out: dict[str, Any] = {
            "block_hash": block_key_hex(key),
            "key": key,
            "pinned_tier": pins[key].value if key in pins else None,
            "tokens_known": key in loop.tokens,
            "decisions": [d.to_dict() for d in loop.decisions.query(20, block=key)],
        }
        if st is not None:
            s = idx.slot_of(key)
            now_ms = ctx.clock() * loop.index_ms_per_s
            try:
                p = float(np.asarray(loop.predictor.predict(idx, s + 1, now_ms))[s])
                pname = loop.predictor.name
            except Exception:  # noqa: BLE001
                p = float(np.asarray(loop.fallback.predict(idx, s + 1, now_ms))[s])
                pname = loop.fallback.name
            out.update(
                {
                    "tiers": [t.value for t in st.tiers],
                    "predicted_reuse": p,
                    "predictor": pname,
                    "features": {
                        "frequency": st.frequency,
                        "depth": st.depth,
                        "age_s": max(0.0, now_ms - st.last_access_ms) / loop.index_ms_per_s,
                        "last_gap_s": None
                        if np.isnan(st.last_gap_ms)
                        else st.last_gap_ms / loop.index_ms_per_s,
                        "gap_ewma_s": None
                        if np.isnan(st.gap_ewma_ms)
                        else st.gap_ewma_ms / loop.index_ms_per_s,
                        "nbytes": st.nbytes,
                        "children": st.children,
                        "resident_children": {t.value: v for t, v in st.resident_children.items()},
                    },
                    "parent": None if st.parent is None else block_key_hex(st.parent),
                }
            )
        else:
            out.update({"tiers": [], "predicted_reuse": None, "features": None})
        return out

    # -- model ---------------------------------------------------------------------------------------------
    @r.get("/v1/model", tags=["model"])
    def model_info() -> dict[str, Any]:
        """Predictor version, training set size, AUC and calibration."""
        return ctx.models.info()

    @r.post("/v1/model/retrain", tags=["model"], dependencies=[auth])
    def retrain() -> dict[str, Any]:
        """Retrain the predictor now on what has been observed so far; persisted as a new version."""
        try:
            return ctx.models.retrain()
        except ModelManager.NotTrainable as e:
            raise HTTPException(409, str(e)) from e

    return r


def status_extra(ctx: ControlContext) -> dict[str, Any]:
    """Additions to ``GET /v1/status``: mode, actuator health, last tick, pins, shadow summary."""
    st = ctx.loop.status()
    st["tiers"] = [t.value for t in TIER_ORDER]
    return {"controller": st, "mode": st["mode"]}


def add_control_routes(app: FastAPI, ctx: ControlContext) -> None:
    """Mount the policy API on ``app`` (``/v1/status`` is the sidecar's, extended by :func:`status_extra`)."""
    app.include_router(build_router(ctx))
    app.state.control = ctx
    guard_kw = dict(token=ctx.api_token, allowed_hosts=ctx.allowed_hosts, max_body_bytes=ctx.max_body_bytes,
                    max_inflight=ctx.max_inflight, registry=ctx.registry)  # fmt: skip
    app.add_middleware(RequestGuard, **guard_kw)  # type: ignore[arg-type]
    app.state.guard_token = ctx.api_token
    install_error_handlers(app)


def install_error_handlers(app: FastAPI) -> None:
    """422 that never echoes input nor fails to serialise (NaN, lone surrogates); 503 on store errors."""

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        detail = [
            {
                "loc": [x if isinstance(x, int) else _safe_text(x, 80) for x in err.get("loc", ())][:8],
                "msg": _safe_text(err.get("msg", "")),
                "type": _safe_text(err.get("type", ""), 60),
            }
            for err in exc.errors()[:20]
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    async def store_failed(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"state store unavailable: {_safe_text(exc)}"}, status_code=503)

    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StoreError, store_failed)
    app.add_exception_handler(sqlite3.Error, store_failed)
