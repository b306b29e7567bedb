"""Observe stage: the block index (plus the layer-residency overlay) as the planner's :class:`BlockView`.

Per-tick arrays live in buffers kept across ticks (the tick is serial): fresh multi-MB allocations each
tick cost page faults, which on a loaded machine made single ticks 30+ ms slower. Block sizes are
refreshed only where the index logged a change.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.reconcile.context import StageFailed, TickContext
from kvtier.controller.reconcile.residency import LayerState
from kvtier.policies.index import BlockIndex
from kvtier.policies.planner import BlockView
from kvtier.policies.slotmap import grown_size


class ObserveStage:
    """Builds the view of index rows ``[0, n)``; P(reuse) and admittable are placeholders here."""

    def __init__(self, layers: LayerState) -> None:
        self.layers = layers
        self._tokens_buf: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self._nbytes_buf: npt.NDArray[np.signedinteger[Any]] = np.zeros(0, np.int64)
        self._nbytes_key: tuple[Any, ...] | None = None  # (index, block_bytes, dtype) the buffer holds
        self._nbytes_version: int | None = None  # the index's nbytes_version when last refreshed
        self._nbytes_n = 0  # rows refreshed
        self._mask_buf: npt.NDArray[np.uint8] = np.zeros(0, np.uint8)

    def run(self, ctx: TickContext) -> None:
        """``ctx.view`` of ``ctx.n`` rows; any failure is the stage's (the tick falls back to no action)."""
        try:
            ctx.faults.inject("observe")
            ctx.view = self.view(ctx.index, ctx.policy, ctx.n)
        except Exception as exc:  # noqa: BLE001
            raise StageFailed("observe", "no_action", exc) from exc

    def view(self, idx: BlockIndex, policy: PolicyDoc, n: int | None = None) -> BlockView:
        """The view of rows ``[0, n)`` (default: every row) under ``policy``'s block size and bytes."""
        if n is None:
            n = idx.n_rows
        bst = policy.block_size_tokens
        if self._tokens_buf.shape[0] != n or (n and int(self._tokens_buf[0]) != bst):
            # every row saves one block of tokens: a read-only broadcast (no 4 B/row array)
            self._tokens_buf = np.broadcast_to(np.int32(bst), (n,))
        nbytes = self._nbytes(idx, int(policy.block_bytes), n)
        if self._mask_buf.shape[0] != n:
            self._mask_buf = np.zeros(n, np.uint8)
        mask = self._mask_buf
        np.copyto(mask, idx.tiers[:n])
        self.layers.overlay(mask, idx, n)
        return BlockView(
            hashes=idx.hash[:n],
            tier_mask=mask,
            tokens=self._tokens_buf,
            nbytes=nbytes,
            # placeholders until the predict stage builds the real view (read-only, no memory)
            p_reuse=np.broadcast_to(np.float32(0.0), (n,)),
            admittable=np.broadcast_to(np.False_, (n,)),
            lookup=idx.slot_of,
            lookup_many=idx.slots_of_keys,
            epoch=idx.epoch,
        )

    def _nbytes(self, idx: BlockIndex, bb: int, n: int) -> npt.NDArray[np.signedinteger[Any]]:
        """Block sizes (bytes) of rows ``[0, n)``, unknown (<= 0) ones as ``bb`` (the policy's
        ``block_bytes``): kept across ticks and refreshed only where the index logged a size change (and
        for new rows); all rows when the log does not reach back to the last tick, the index or ``bb``
        changed."""
        nb_all = idx.nbytes
        # the index's sizes are int32: so is the view's unless the default block size does not fit
        dt = np.int32 if nb_all.dtype == np.int32 and bb <= np.iinfo(np.int32).max else np.int64
        buf = self._nbytes_buf
        version = idx.nbytes_version
        key = (id(idx), bb, np.dtype(dt))
        changed = None
        last = self._nbytes_version
        if version is not None and last is not None and self._nbytes_key == key and self._nbytes_n <= n:
            changed = idx.nbytes_changed_since(last) if n <= buf.shape[0] else None
        if changed is None:  # everything
            if buf.shape[0] < n or buf.dtype != dt:  # exact size first, then grown steps as n grows
                grow = buf.dtype == dt and buf.shape[0] > 0
                buf = self._nbytes_buf = np.zeros(grown_size(buf.shape[0], n) if grow else n, dt)
            lo, rows = 0, np.zeros(0, np.intp)
        else:
            lo = self._nbytes_n
            rows = np.asarray(changed, np.intp)
            rows = rows[rows < lo]
        self._nbytes_key, self._nbytes_version, self._nbytes_n = key, version, n
        if rows.size:
            v = nb_all[rows]
            buf[rows] = np.where(v <= 0, bb, v)
        if lo < n:
            nb, out = nb_all[lo:n], buf[lo:n]
            if nb.dtype in (np.int32, np.int64) and bb >= 0:
                # max(nb, (nb <= 0) * bb): exact for bb >= 0, branch-free (a masked store over a random
                # mask is ~2 ms at 1M rows); the bool mask in the tier-mask buffer (overwritten next)
                if self._mask_buf.shape[0] < n:
                    self._mask_buf = np.zeros(n, np.uint8)
                unknown = np.less_equal(nb, 0, out=self._mask_buf[: n - lo].view(np.bool_))
                np.multiply(unknown, dt(bb), out=out)
                np.maximum(out, nb, out=out)
            else:
                np.copyto(out, nb, casting="unsafe")
                np.putmask(out, nb <= 0, bb)
        return buf[:n]
