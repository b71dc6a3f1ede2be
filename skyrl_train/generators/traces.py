"""Per-token metadata accumulated turn by turn: the general trace and the route trace.

docs/design.md §4: row i of a route array is the routing of token i when it was fed; it serves
the prediction of token i+1. ``prompt_start`` (rows captured so far) is sent as the next
turn's ``routed_experts_prompt_start``; a turn with P prompt and G generated tokens then
appends P - start + G - 1 rows (the last sampled token was never fed).

Decisions, each tested in tests/skyrl_train/generators/test_traces.py:
- A reply that ignored the prompt start carries P + G - 1 rows (the whole prefix). With
  start > 0 that count differs from the expected one, so it is recognised, the first
  ``start`` rows are dropped (the rows already captured are the routing that really
  produced those tokens) and ``whole_prefix_replies`` counts it. Any other count raises.
- A trailing token appended after the last routed token (the EOS that single-turn
  paths add) has no route row for its prediction. ``finalize`` refuses it if it carries
  loss mask 1; with loss mask 0 it is fine (its row is simply not captured). The gym
  generator never appends such a token: a stop token the engine sampled is already in
  the reply, and it is predicted from the previous token, whose row exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from inference.wire import route_filler
from skyrl_train.errors import RouteTraceError

_EMPTY_ROUTES_SHAPE = (0, 0, 0)


def _count(trajectory_id: str, turn: int | None, name: str, value: object, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        where = f"trajectory {trajectory_id}" + ("" if turn is None else f" turn {turn}")
        raise RouteTraceError(f"{where}: {name}", expected=f"an int >= {low}", got=repr(value))
    return int(value)


class TokenMetadataTrace:
    """Append-only row chunks for one trajectory, one chunk per turn.

    Every chunk's row count is checked against what the caller expects, its trailing
    shape must equal the first chunk's, and dtypes widen losslessly: a uint8 turn then
    an int16 turn yields int16 (servers send the smallest dtype that holds each turn's
    ids). ``kind`` is "int" or "float"; mixing kinds, or an integer pair whose only
    common type is a float (uint64 with int64), is refused rather than rounded.
    """

    def __init__(
        self,
        trajectory_id: str = "#0",
        *,
        field: str = "metadata",
        kind: str = "int",
        trailing_shape: tuple[int, ...] | None = None,
    ) -> None:
        if kind not in ("int", "float"):
            raise ValueError(f"TokenMetadataTrace.kind: expected 'int' or 'float', got {kind!r}")
        self.trajectory_id = str(trajectory_id)
        self.field = field
        self.kind = kind
        self._kinds = "iu" if kind == "int" else "f"
        self._trailing = None if trailing_shape is None else tuple(int(d) for d in trailing_shape)
        self._chunks: list[np.ndarray] = []
        self._rows = 0
        self._dtype: np.dtype | None = None

    @property
    def num_rows(self) -> int:
        return self._rows

    @property
    def trailing_shape(self) -> tuple[int, ...] | None:
        return self._trailing

    @property
    def dtype(self) -> np.dtype | None:
        """The widest dtype seen so far; None before the first chunk."""
        return self._dtype

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._chunks)

    def _where(self, turn: int, part: str = "") -> str:
        """The place an append error names: ``trajectory T turn N: field<part>``."""
        return f"trajectory {self.trajectory_id} turn {turn}: {self.field}{part}"

    def append(self, chunk: np.ndarray, *, expected_rows: int, turn: int | None = None) -> None:
        """Append one turn's rows; raises RouteTraceError naming trajectory and turn
        (``turn``, for messages, defaults to the number of chunks so far)."""
        if turn is None:
            turn = len(self._chunks)
        if not isinstance(chunk, np.ndarray):
            raise RouteTraceError(
                self._where(turn), expected="a numpy array", got=type(chunk).__name__
            )
        if chunk.ndim < 1:
            raise RouteTraceError(self._where(turn, ".ndim"), expected=">= 1", got=str(chunk.ndim))
        if chunk.dtype.kind not in self._kinds:
            raise RouteTraceError(
                self._where(turn, ".dtype"), expected=f"a {self.kind} dtype", got=str(chunk.dtype)
            )
        if chunk.shape[0] != expected_rows:
            raise RouteTraceError(
                self._where(turn, ".rows"), expected=str(expected_rows), got=str(chunk.shape[0])
            )
        trailing = tuple(chunk.shape[1:])
        if self._trailing is not None and trailing != self._trailing:
            raise RouteTraceError(
                self._where(turn, ".shape[1:]"),
                expected=f"{self._trailing} (fixed)",
                got=str(trailing),
            )
        dtype = chunk.dtype if self._dtype is None else np.promote_types(self._dtype, chunk.dtype)
        if dtype.kind not in self._kinds:
            raise RouteTraceError(
                self._where(turn, ".dtype"),
                expected=f"a lossless {self.kind} widening of {self._dtype}",
                got=f"{chunk.dtype} (common type {dtype})",
            )
        self._trailing = trailing
        self._dtype = dtype
        self._chunks.append(chunk)
        self._rows += expected_rows

    def truncate(self, rows: int) -> None:
        """Keep the first ``rows`` rows (a reply the environment cut short)."""
        if not 0 <= rows <= self._rows:
            raise ValueError(f"truncate.rows: expected 0..{self._rows}, got {rows}")
        kept: list[np.ndarray] = []
        left = rows
        for chunk in self._chunks:
            if left <= 0:
                break
            kept.append(chunk[:left])
            left -= min(left, chunk.shape[0])
        self._chunks = kept
        self._rows = rows

    def array(self, *, rows: int | None = None) -> np.ndarray:
        """The first ``rows`` rows (all by default) as one array in the widest dtype."""
        take = self._rows if rows is None else min(rows, self._rows)
        if self._dtype is None or self._trailing is None:
            trailing = self._trailing if self._trailing is not None else ()
            return np.zeros((0, *trailing), dtype=np.uint8 if self.kind == "int" else np.float32)
        out = np.empty((take, *self._trailing), dtype=self._dtype)
        pos = 0
        for chunk in self._chunks:
            if pos >= take:
                break
            n = min(chunk.shape[0], take - pos)
            out[pos : pos + n] = chunk[:n]
            pos += n
        return out


class RouteTraceResult(NamedTuple):
    """A finalized route trace; unpacks as ``routes, captured = trace.finalize(...)``."""

    routed_experts: np.ndarray
    """[token_count, layers, topk]: row t is the routing of token t where ``captured[t]``;
    rows never captured (the last token, say) hold the collation's padding row,
    ``route_filler`` (``arange(topk)``)."""
    captured: np.ndarray
    """[token_count] bool: True where token t has a route row (exactly t < rows)."""

    @property
    def rows(self) -> int:
        """How many leading rows were captured."""
        return int(self.captured.sum())

    @property
    def captured_routes(self) -> np.ndarray:
        """The captured prefix ``[rows, layers, topk]``: ``GeneratorOutput.routed_experts``."""
        return self.routed_experts[: self.rows]


class RoutedExpertTrace:
    """Routes of one trajectory, stitched from per-turn server replies (docs/design.md §4)."""

    def __init__(
        self, trajectory_id: str = "#0", *, num_layers: int | None = None, top_k: int | None = None
    ) -> None:
        trailing = None
        if num_layers is not None or top_k is not None:
            if num_layers is None or top_k is None:
                raise ValueError(
                    "RoutedExpertTrace: expected num_layers and top_k together, got only one"
                )
            trailing = (int(num_layers), int(top_k))
        self._trace = TokenMetadataTrace(
            trajectory_id, field="routed_experts", kind="int", trailing_shape=trailing
        )
        self.trajectory_id = str(trajectory_id)
        self.turns = 0
        self.whole_prefix_replies = 0
        """Replies that ignored routed_experts_prompt_start and sent the whole prefix."""
        self.bytes_received = 0
        """Bytes of route arrays received, prefix duplicates included (a metric)."""

    @property
    def prompt_start(self) -> int:
        """Rows captured so far; send it as the next turn's routed_experts_prompt_start."""
        return self._trace.num_rows

    @property
    def rows(self) -> int:
        return self._trace.num_rows

    def record_generation(
        self,
        *,
        prompt_token_count: int,
        generated_token_count: int,
        routed_experts: np.ndarray | None,
    ) -> None:
        """Append one turn: the reply to a request sent with start = ``prompt_start``."""
        turn = self.turns
        tid = self.trajectory_id
        start = self.prompt_start
        p = _count(tid, turn, "prompt_token_count", prompt_token_count, low=1)
        g = _count(tid, turn, "generated_token_count", generated_token_count, low=1)
        if p <= start:
            raise RouteTraceError(
                f"trajectory {tid} turn {turn}: prompt_token_count",
                expected=f"> prompt_start ({start}) so the prompt covers every routed token",
                got=str(p),
            )
        if routed_experts is None:
            raise RouteTraceError(
                f"trajectory {tid} turn {turn}: routed_experts",
                expected=f"an array of {p - start + g - 1} rows (routes were requested)",
                got="None",
            )
        if hasattr(routed_experts, "detach") and hasattr(routed_experts, "numpy"):
            routed_experts = routed_experts.detach().cpu().numpy()  # a torch tensor
        if not isinstance(routed_experts, np.ndarray) or routed_experts.ndim != 3:
            got = getattr(routed_experts, "shape", type(routed_experts).__name__)
            raise RouteTraceError(
                f"trajectory {tid} turn {turn}: routed_experts",
                expected="a [rows, layers, topk] array",
                got=str(got),
            )
        if routed_experts.dtype.kind in "iu" and routed_experts.size and routed_experts.min() < 0:
            raise RouteTraceError(
                f"trajectory {tid} turn {turn}: routed_experts",
                expected="expert ids >= 0",
                got=str(int(routed_experts.min())),
            )
        expected = p - start + g - 1
        whole = p + g - 1
        chunk = routed_experts
        if start > 0 and chunk.shape[0] == whole:
            # The server ignored the prompt start. Its rows are still token-aligned
            # (row i = token i), so the overlap is dropped, not guessed at.
            chunk = chunk[start:]
            self.whole_prefix_replies += 1
        elif chunk.shape[0] != expected:
            raise RouteTraceError(
                f"trajectory {tid} turn {turn}: routed_experts.rows",
                expected=f"{expected} "
                f"(P={p} - start={start} + G={g} - 1) or {whole} (whole prefix)",
                got=str(chunk.shape[0]),
            )
        self._trace.append(chunk, expected_rows=expected, turn=turn)
        self.bytes_received += routed_experts.nbytes
        self.turns += 1

    def truncate(self, rows: int) -> None:
        """Keep the first ``rows`` rows; the next turn's prompt start is then ``rows``.
        Used when the environment replaced the tail of a reply: the rows of the
        tokens kept are still the routing that produced them."""
        self._trace.truncate(rows)

    def finalize(self, *, token_count: int, loss_mask: Sequence[int]) -> RouteTraceResult:
        """Routes for a trajectory of ``token_count`` tokens (prompt + response).

        ``loss_mask`` covers all ``token_count`` tokens (0 on the prompt). Every token t
        with loss mask 1 is predicted from route row t - 1, which must be captured;
        rows past ``token_count`` (left by truncation) are dropped.
        """
        tid = self.trajectory_id
        n = _count(tid, None, "token_count", token_count, low=0)
        mask = np.asarray(loss_mask)
        if mask.shape != (n,):
            raise RouteTraceError(
                f"trajectory {tid}: loss_mask.shape",
                expected=f"({n},) (token_count)",
                got=str(mask.shape),
            )
        if mask.size and not np.isin(mask, (0, 1)).all():
            raise RouteTraceError(
                f"trajectory {tid}: loss_mask", expected="0/1 values", got=str(np.unique(mask))
            )
        rows = min(self._trace.num_rows, n)
        active = np.flatnonzero(mask)
        # Token t needs row t-1: token 0 has no predecessor, t > rows was predicted by
        # a token that was never fed (the trailing-EOS failure mode).
        bad = active[(active < 1) | (active > rows)]
        if bad.size:
            t = int(bad[0])
            raise RouteTraceError(
                f"trajectory {tid}: loss_mask[{t}]",
                expected=f"a captured route row {t - 1} for a loss-active token",
                got=f"{rows} rows after {self.turns} turns "
                "(a token appended after the last routed token, such as an EOS, must "
                "carry loss mask 0)",
            )
        captured = self._trace.array(rows=rows)
        if captured.ndim != 3:  # nothing was ever recorded: no [layers, topk] to pad with
            captured = np.zeros(_EMPTY_ROUTES_SHAPE, dtype=np.uint8)
            return RouteTraceResult(captured, np.zeros(n, dtype=bool))
        _, layers, topk = captured.shape
        routes = np.empty((n, layers, topk), dtype=captured.dtype)
        routes[:rows] = captured
        routes[rows:] = route_filler(topk, captured.dtype)
        return RouteTraceResult(routed_experts=routes, captured=np.arange(n) < rows)
