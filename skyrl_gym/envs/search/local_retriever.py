"""A small BM25 retriever, in process or behind SkyRL's ``/retrieve`` HTTP protocol.

    index = BM25Index(load_corpus("corpus.jsonl"))        # or BM25Index(DEMO_CORPUS)
    index.retrieve("capital of Italy", 3)                   # {"result": [[{"document", "score"}]]}
    with serve_retriever(index) as server:                  # 127.0.0.1, a free port
        env_config = {"search_url": server.url}

    python -m skyrl_gym.envs.search --corpus corpus.jsonl --port 8000    # main() below

A corpus is a list of ``{"id": ..., "contents": str}`` documents (Search-R1's JSONL,
where ``contents`` is ``"Title"\\ntext``). The index is exact BM25 over lowercase
alphanumeric tokens, in memory: fine for the thousands of passages of a test or a
small offline run, not for Wikipedia (use SkyRL's FAISS server for that; the env
speaks to both the same way).

Two ways to use it from the ``search`` environment, both offline:

* ``search_url: local`` (with ``corpus_path``, a JSONL file, or without it for the
  built-in demo corpus): the tool searches in this process, no socket, no server to
  keep alive; the index is built once per file and shared by every episode.
* ``serve_retriever`` and ``search_url: <its url>``: the full HTTP path, as a run with
  a real retrieval server takes it (what the tests exercise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from skyrl_gym.error import EnvError

_TOKEN = re.compile(r"[a-z0-9]+")
MAX_REQUEST_BYTES = 1 << 20


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def check_corpus(docs: Iterable[Any], where: str = "corpus") -> list[dict[str, Any]]:
    """The documents as a list, each refused unless it has a str ``contents``."""
    checked = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, Mapping) or not isinstance(doc.get("contents"), str):
            raise EnvError(f"{where}[{i}]: expected {{'id', 'contents': str}}, got {doc!r:.120}")
        checked.append({"id": str(doc.get("id", i)), **doc})
    if not checked:
        raise EnvError(f"{where}: expected at least one document, got none")
    return checked


def load_corpus(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A JSON Lines corpus, one document per non-blank line."""
    docs = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        docs.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise EnvError(
                            f"{path}:{number}: expected a JSON object, got {exc}"
                        ) from exc
    except OSError as exc:
        raise EnvError(f"{path}: expected a readable JSONL file, got {exc}") from exc
    return check_corpus(docs, where=str(path))


class BM25Index:
    """Okapi BM25 (``k1``, ``b``: Pyserini's defaults) over ``docs``."""

    def __init__(self, docs: Iterable[Mapping[str, Any]], *, k1: float = 0.9, b: float = 0.4):
        self.docs = check_corpus(docs)
        self.k1, self.b = k1, b
        self.postings: dict[str, list[tuple[int, int]]] = {}
        self.lengths: list[int] = []
        for i, doc in enumerate(self.docs):
            counts = Counter(tokenize(doc["contents"]))
            self.lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self.postings.setdefault(term, []).append((i, tf))
        self.average_length = max(sum(self.lengths) / len(self.docs), 1.0)

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1 + (len(self.docs) - df + 0.5) / (df + 0.5))

    def search(self, query: str, topk: int) -> list[tuple[dict[str, Any], float]]:
        """The ``topk`` best documents with a positive score, best first (ties: corpus order)."""
        scores: dict[int, float] = {}
        for term in set(tokenize(query)):
            idf = self.idf(term)
            for i, tf in self.postings.get(term, ()):
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.average_length)
                scores[i] = scores.get(i, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:topk]
        return [(self.docs[i], score) for i, score in best]

    def retrieve(self, query: str, topk: int, *, return_scores: bool = True) -> dict[str, Any]:
        """The server's answer for one query: ``{"result": [[hit, ...]]}``."""
        hits = self.search(query, topk)
        if return_scores:
            return {"result": [[{"document": d, "score": s} for d, s in hits]]}
        return {"result": [[d for d, _ in hits]]}


@lru_cache(maxsize=8)
def _cached_index(path: str, mtime_ns: int, size: int) -> BM25Index:
    return BM25Index(load_corpus(path))


def index_for(corpus_path: str | None) -> BM25Index:
    """The index of ``corpus_path`` (the demo corpus for None), built once per file
    version: every episode's environment shares it."""
    if corpus_path is None:
        from skyrl_gym.envs.search.demo import demo_index

        return demo_index()
    path = os.path.abspath(os.path.expanduser(corpus_path))
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise EnvError(f"{corpus_path}: expected a JSONL file, got {exc}") from exc
    return _cached_index(path, stat.st_mtime_ns, stat.st_size)


def _handler(index: BM25Index, default_topk: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/retrieve":
                return self._send(404, {"detail": f"no route {self.path}; POST /retrieve"})
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_REQUEST_BYTES:
                return self._send(400, {"detail": f"expected a JSON body, got {length} bytes"})
            try:
                request = json.loads(self.rfile.read(length))
                queries = request.get("queries", [request.get("query")])  # batch or single
                topk = request.get("topk") or default_topk
                if not all(isinstance(q, str) for q in queries) or not isinstance(topk, int):
                    raise ValueError("expected 'query': str (or 'queries': [str]), 'topk': int")
            except (ValueError, AttributeError, TypeError) as exc:
                return self._send(400, {"detail": str(exc)})
            scores = bool(request.get("return_scores", False))
            hits = [index.retrieve(q, topk, return_scores=scores)["result"][0] for q in queries]
            return self._send(200, {"result": hits})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # one line per request would flood a training log

    return Handler


class RetrieverServer:
    """A running ``/retrieve`` server; ``stop()`` (or leaving the ``with``) ends it."""

    def __init__(self, index: BM25Index, host: str, port: int, topk: int) -> None:
        self.httpd = ThreadingHTTPServer((host, port), _handler(index, topk))
        self.httpd.daemon_threads = True
        bound_host, bound_port = self.httpd.server_address[:2]
        self.url = f"http://{bound_host!s}:{bound_port}/retrieve"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def __enter__(self) -> RetrieverServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_retriever(
    corpus: BM25Index | Iterable[Mapping[str, Any]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    topk: int = 3,
) -> RetrieverServer:
    """Serve ``corpus`` (documents or a built index) on ``host:port`` (0: a free port)
    in a background thread; the server's ``url`` is what ``search_url`` takes."""
    index = corpus if isinstance(corpus, BM25Index) else BM25Index(corpus)
    return RetrieverServer(index, host, port, topk)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a JSONL corpus over /retrieve (BM25).")
    parser.add_argument("--corpus", help="JSONL with id and contents; default: the demo corpus")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3)
    args = parser.parse_args(argv)
    index = index_for(args.corpus)
    server = serve_retriever(index, host=args.host, port=args.port, topk=args.topk)
    print(f"serving {len(index.docs)} documents at {server.url}", flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.stop()
