"""Causal per-access features for the learned reuse predictor (pure numpy, no I/O).

One row per block access of a request, built only from state observed *before* the request:
the request's own shape (length, output, how much of it was already known) and each block's
history (frequency, gap since its previous access, branching, the turn that wrote it).

The separating signal on multi-turn chat traces is turn structure: the next turn of a
conversation re-reads the previous prompt's *full* blocks, so the partial tail block of a request
is almost never reused, and whether a chain continues depends on how it has been extended so far.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

FEATURE_NAMES: tuple[str, ...] = (
    "pos_from_end",  # blocks between this one and the request's last block (0 = last)
    "partial_tail",  # 1 if this is the request's last block and it is not full (next turn rewrites it)
    "depth",  # position in the chain, 0 = root
    "request_blocks",  # blocks in the request
    "log_output_tokens",  # log1p(output_length)
    "known_blocks",  # blocks of the request already seen before it arrived (shared prefix length)
    "new_blocks",  # blocks of the request never seen before
    "turn",  # 1 + turn of the deepest already-known block (how often this chain was extended)
    "log_turn_gap_s",  # log1p(seconds since the deepest known block was last accessed); -1 if fresh
    "log_freq",  # log1p(accesses of this block before this one)
    "log_gap_s",  # log1p(seconds since this block's previous access); -1 on first touch
    "log_children",  # log1p(distinct children this block has had so far)
    "first_touch",  # 1 if this block was never seen before
    "tail_x_first",  # crossed: min(pos_from_end, 3) * 2 + first_touch  (categorical 0..7)
)
N_FEATURES = len(FEATURE_NAMES)
# columns that are small integers by construction (0..64, 0/1, 0..512, 0/1, 0..7): stored exactly as int16
INT_FEATURES: tuple[int, ...] = (0, 1, 2, 12, 13)
# optional re-touch columns (``LearnedPolicy(extra_features=...)``), appended after FEATURE_NAMES in order
EXTRA_FEATURES: tuple[str, ...] = (
    "log_life_s",  # log1p(seconds since this block's first access); -1 on first touch (freq / life ~ rate)
    "log_gap2_s",  # log1p(seconds since its second-to-last access, LRU-2's distance); -1 if seen < 2 times
    # first_touch x log1p(distinct blocks seen before, in thousands): enters the model raw only (not binned),
    # so its fitted slope extrapolates the drift of first-touch reuse past the training window's lag
    "first_log_seen",
)
RAW_ONLY_FEATURES: tuple[str, ...] = ("first_log_seen",)


def request_features(
    *,
    now_ms: float,
    input_length: int,
    output_length: int,
    block_tokens: int,
    known_blocks: int,
    turn: int,
    turn_last_ms: float,
    freq: IntArray,
    last_ms: FloatArray,
    children: npt.NDArray[np.integer[Any]],
    extra_cols: int = 0,
) -> FloatArray:
    """Feature matrix, shape (blocks, N_FEATURES + ``extra_cols``), for one request (the extra columns,
    zero here, are the caller's to fill).

    ``freq``/``last_ms``/``children`` are the per-block state *before* this request (freq 0 = never
    seen; last_ms ignored then). ``known_blocks`` is the length of the request's already-seen prefix,
    ``turn``/``turn_last_ms`` the turn number and last access time (ms) of the deepest known block
    (turn 0 / NaN when nothing is known). Times are milliseconds.
    """
    n = int(freq.shape[0])
    if n == 0:
        return np.empty((0, N_FEATURES + extra_cols), dtype=np.float64)
    out = _template(n, extra_cols).copy()  # the columns that depend only on n (positions)
    tg = (
        -1.0
        if known_blocks == 0 or not np.isfinite(turn_last_ms)
        else np.log1p(max(now_ms - turn_last_ms, 0.0) / 1000.0)
    )
    out[:, 4:9] = (np.log1p(max(output_length, 0)), known_blocks, n - known_blocks, turn + 1, tg)
    if input_length - (n - 1) * block_tokens < block_tokens:
        out[n - 1, 1] = 1.0
    first = freq == 0
    out[:, 9] = np.log1p(freq)
    gap = np.log1p(np.maximum(now_ms - last_ms, 0.0) / 1000.0)
    gap[first] = -1.0
    out[:, 10] = gap
    out[:, 11] = np.log1p(children)
    out[:, 12] = first
    out[:, 13] += first
    return out


_TEMPLATES: dict[tuple[int, int], FloatArray] = {}


def _template(n: int, extra_cols: int = 0) -> FloatArray:
    """Feature rows of an ``n``-block request that depend only on positions (cached per shape)."""
    t = _TEMPLATES.get((n, extra_cols))
    if t is None:
        j = np.arange(n, dtype=np.float64)
        pos_from_end = (n - 1) - j
        t = np.zeros((n, N_FEATURES + extra_cols), dtype=np.float64)
        t[:, 0] = np.minimum(pos_from_end, 64.0)
        t[:, 2] = np.minimum(j, 512.0)
        t[:, 3] = n
        t[:, 13] = np.minimum(pos_from_end, 3.0) * 2.0
        if len(_TEMPLATES) < 4096:
            _TEMPLATES[(n, extra_cols)] = t
    return t


class FeatureRing:
    """Fixed ring of stored feature rows (``size`` x ``n_cols``) for the learned policy's events.

    Reads give exactly what a float32 matrix would (``float32(x)`` as float64) but take 46 instead of 56
    bytes per row. The :data:`INT_FEATURES` columns (small integers, exact in int16 and in float32) are
    kept as int16, the rest (including any columns past ``N_FEATURES``) as float32. ``ring[pos]`` (pos:
    int, slice or index array) -> float64 rows, ``ring[pos, col]`` -> one column; ``ring[pos] = x``
    stores float64 rows ``x``."""

    def __init__(self, size: int, n_cols: int = N_FEATURES) -> None:
        self.n_cols = n_cols
        self._icols = np.array(INT_FEATURES, dtype=np.intp)
        self._fcols = np.array([c for c in range(n_cols) if c not in INT_FEATURES], dtype=np.intp)
        self._col = {int(c): (False, i) for i, c in enumerate(self._fcols)}
        self._col.update({int(c): (True, i) for i, c in enumerate(self._icols)})
        self._f = np.zeros((size, self._fcols.size), dtype=np.float32)
        self._i = np.zeros((size, self._icols.size), dtype=np.int16)

    @property
    def nbytes(self) -> int:
        return int(self._f.nbytes + self._i.nbytes)

    def __setitem__(self, pos: slice | npt.NDArray[np.int64], x: FloatArray) -> None:
        self._f[pos] = x[:, self._fcols]
        self._i[pos] = x[:, self._icols]

    def __getitem__(self, key: int | slice | npt.NDArray[np.int64] | tuple[Any, int]) -> FloatArray:
        if isinstance(key, tuple):
            pos, col = key
            is_int, j = self._col[int(col)]
            return (self._i if is_int else self._f)[pos, j].astype(np.float64)
        f = self._f[key]
        out = np.empty(f.shape[:-1] + (self.n_cols,), dtype=np.float64)
        out[..., self._fcols] = f
        out[..., self._icols] = self._i[key]
        return out
