"""A passage-retrieval tool over HTTP (SkyRL's ``search`` tool, Search-R1's protocol).

    group = SearchToolGroup("http://127.0.0.1:8000/retrieve", topk=3)
    group.execute_tool("search", "capital of Italy")   # '{"result": "Doc 1: ..."}'

The retrieval server takes ``POST <search_url>`` with the JSON body
``{"query": str, "topk": int, "return_scores": bool}`` and answers
``{"result": [[{"document": {"id": ..., "contents": str}, "score": float}, ...]]}``:
one list of hits per query (the older batch servers answer the same shape, and a hit
may also be the bare document when scores were not asked for). The tool renders the
hits as ``Doc 1: <contents>`` lines inside ``{"result": "..."}``, the text models
trained with SkyRL read; anything that goes wrong becomes ``Search error: ...`` in the
same place, never an exception.

``call_search_api`` retries a refused connection, a timeout and a 429/5xx answer (the
server restarting or overloaded) with a growing pause; a 4xx or a body that is not
JSON is final. Its ``session`` argument carries the retry policy (``SearchSession``);
urllib opens one connection per call, so nothing else is pooled. ``timeout`` bounds
each socket operation, not the whole call. With ``search_url="local"`` the group asks
an in-process ``retriever`` instead (``skyrl_gym/envs/search/local_retriever.py``).
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

from skyrl_gym.error import EnvError
from skyrl_gym.tools.core import ToolGroup, tool

logger = logging.getLogger(__name__)

LOCAL = "local"
"""``search_url`` value meaning: search in this process, no HTTP."""
DEFAULT_URL = "http://127.0.0.1:8000/retrieve"
DEFAULT_TIMEOUT = 30.0
DEFAULT_RETRIES = 2
"""Retries after the first attempt. SkyRL makes 10 attempts (45 s of pauses); a run
against a busy shared server can raise it with the ``retries`` setting."""
RETRY_DELAY = 0.5
"""Seconds before the first retry; the n-th retry waits n times this."""
MAX_RESPONSE_BYTES = 8 << 20
"""A larger answer is refused: it would not fit in a prompt anyway."""
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class SearchSession:
    """What ``call_search_api`` reuses across calls: its retry policy."""

    retries: int = DEFAULT_RETRIES
    retry_delay: float = RETRY_DELAY


class Retriever(Protocol):
    """An in-process index answering in the server's JSON shape."""

    def retrieve(self, query: str, topk: int, *, return_scores: bool = True) -> dict[str, Any]: ...


def _post_once(url: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:  # a status >= 400 still has a body to report
        with exc:
            return exc.code, exc.read(2000)


def _is_timeout(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, (TimeoutError, socket.timeout))


def call_search_api(
    retrieval_service_url: str,
    query: str,
    topk: int = 3,
    return_scores: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    log_requests: bool = True,
    session: Any = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """POST one query; ``(response, None)`` on success, ``(None, error)`` otherwise.

    Never raises for anything the server or the network does. ``session``: a
    ``SearchSession`` (or any object with ``retries`` / ``retry_delay``); None uses
    the defaults."""
    retries = int(getattr(session, "retries", DEFAULT_RETRIES))
    delay = float(getattr(session, "retry_delay", RETRY_DELAY))
    body = json.dumps({"query": query, "topk": topk, "return_scores": return_scores}).encode()
    error = "no attempt made"
    for attempt in range(1, retries + 2):
        if attempt > 1:
            time.sleep(delay * (attempt - 1))
        if log_requests:
            logger.info(
                "search %s attempt %d/%d: %r", retrieval_service_url, attempt, retries + 1, query
            )
        try:
            status, raw = _post_once(retrieval_service_url, body, timeout)
        except (urllib.error.URLError, OSError) as exc:
            kind = "Timeout Error" if _is_timeout(exc) else "Connection Error"
            error = f"{kind}: {getattr(exc, 'reason', exc)} (attempt {attempt}/{retries + 1})"
            logger.warning("search %s: %s", retrieval_service_url, error)
            continue
        except Exception as exc:  # a malformed URL or a broken response: final
            return None, f"Request Error: {type(exc).__name__}: {exc}"
        if status in _RETRY_STATUS:
            error = f"Server Error ({status}) (attempt {attempt}/{retries + 1})"
            logger.warning("search %s: %s", retrieval_service_url, error)
            continue
        text = raw.decode("utf-8", errors="replace")
        if status >= 400:
            return None, f"HTTP Error {status}: {text[:200]}"
        if len(raw) > MAX_RESPONSE_BYTES:
            return None, f"Response Error: more than {MAX_RESPONSE_BYTES} bytes"
        try:
            response = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"JSON Decode Error: {exc}; response starts {text[:200]!r}"
        if not isinstance(response, dict):
            return None, f"Response Error: expected a JSON object, got {text[:200]!r}"
        return response, None
    return None, error


def _contents(hit: Any) -> str:
    document = hit.get("document", hit) if isinstance(hit, dict) else None
    contents = document.get("contents") if isinstance(document, dict) else None
    if not isinstance(contents, str):
        raise ValueError(f"expected a hit with document.contents, got {hit!r:.200}")
    return contents.strip()


def render_results(response: dict[str, Any]) -> str:
    """The hits as ``Doc i: ...`` lines, one block per query joined by ``---``;
    ``ValueError`` for a response that does not have the protocol's shape."""
    per_query = response.get("result")
    if not isinstance(per_query, list) or not all(isinstance(h, list) for h in per_query):
        raise ValueError(f"expected 'result': a list of lists of hits, got {per_query!r:.200}")
    blocks = [
        "".join(f"Doc {i}: {_contents(hit)}\n" for i, hit in enumerate(hits, 1))
        for hits in per_query
    ]
    return "\n---\n".join(blocks) if any(blocks) else ""


def _result(text: str) -> str:
    return json.dumps({"result": text})


def check_search_url(field: str, value: Any) -> str:
    """An http(s) URL with a host, or ``local``."""
    if isinstance(value, str) and value == LOCAL:
        return value
    parsed = urlparse(value) if isinstance(value, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EnvError(f"{field}: expected an http(s) URL or {LOCAL!r}, got {value!r:.200}")
    return value


def check_seconds(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 600:
        raise EnvError(f"{field}: expected seconds in (0, 600], got {value!r}")
    return float(value)


def check_count(field: str, value: Any, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EnvError(f"{field}: expected an int in [{low}, {high}], got {value!r}")
    return value


class SearchToolGroup(ToolGroup):
    """The ``search`` tool against a retrieval server, or an in-process ``retriever``
    when ``search_url`` is ``local``."""

    def __init__(
        self,
        search_url: str = DEFAULT_URL,
        *,
        topk: int = 3,
        timeout: float = DEFAULT_TIMEOUT,
        log_requests: bool = True,
        retries: int = DEFAULT_RETRIES,
        retry_delay: float = RETRY_DELAY,
        retriever: Retriever | None = None,
    ) -> None:
        self.search_url = check_search_url("SearchToolGroup.search_url", search_url)
        self.topk = check_count("SearchToolGroup.topk", topk, low=1, high=100)
        self.timeout = check_seconds("SearchToolGroup.timeout", timeout)
        if not isinstance(log_requests, bool):
            raise EnvError(f"SearchToolGroup.log_requests: expected a bool, got {log_requests!r}")
        self.log_requests = log_requests
        self.session = SearchSession(
            retries=check_count("SearchToolGroup.retries", retries, low=0, high=20),
            retry_delay=check_seconds("SearchToolGroup.retry_delay", retry_delay),
        )
        if (search_url == LOCAL) != (retriever is not None):
            raise EnvError(
                "SearchToolGroup.retriever: expected one exactly when search_url is "
                f"{LOCAL!r}, got {type(retriever).__name__} with search_url={search_url!r}"
            )
        self.retriever = retriever
        super().__init__(name="SearchToolGroup")

    def _ask(self, query: str) -> tuple[dict[str, Any] | None, str | None]:
        if self.retriever is not None:
            return self.retriever.retrieve(query, self.topk, return_scores=True), None
        # Looked up as a module global on every call: tests patch it there.
        return call_search_api(
            retrieval_service_url=self.search_url,
            query=query,
            topk=self.topk,
            timeout=self.timeout,
            log_requests=self.log_requests,
            session=self.session,
        )

    @tool
    def search(self, query: str | None) -> str:
        """``{"result": "Doc 1: ..."}`` for ``query``; an empty string for None (the
        reply had no ``<search>``), as SkyRL answers."""
        if query is None:
            return ""
        try:
            response, error = self._ask(str(query).strip())
            if error is None and response is not None:
                text = render_results(response)
                return _result(text or "No search results found.")
        except Exception as exc:  # a retriever bug or a malformed response: reported
            error = f"{type(exc).__name__}: {exc}"
        logger.error("search %r failed: %s", query, error)
        return _result(f"Search error: {error or 'no response'}")
