"""A weight push to one vLLM server over its RL HTTP API, as a per-client state machine.

``WeightSyncer`` calls ``update_weights`` once per bucket: every bucket of a versioned
push but the last with ``commit=False``, the last with ``commit=True`` and the version;
an unversioned push commits every bucket. Here that becomes::

    [/init_weight_transfer_engine]             once per client, if the backend has one
    /pause?PAUSE_QUERY /start_weight_update    at a push's first bucket
    /update_weights {"update_info": ...}       every bucket (the sender delivers it)
    /finish_weight_update {"weight_version"}   at the committing bucket: str(v) or null
    /resume

``transport.PAUSE_QUERY`` (``mode=keep&clear_cache=true``, measured there) freezes
in-flight requests instead of aborting them; they continue after ``/resume`` under the
new weights, recomputed without stale KV, and their ``weight_versions`` spans report
both versions.

A failure anywhere in a push ends it here, best effort, before the error is raised: a
``/finish_weight_update`` without a version if an update session *may* be open, then
``/resume`` if the server *may* be paused, so a half-applied push never leaves the
server paused or its session open. "May": each flag is set before its request is sent,
not after its reply, because a request whose reply was lost may still have acted. A
``/start_weight_update`` that reached the server but whose reply did not left a session
open, and vLLM refuses every later start while one is (``test_vllm_client_push.py``: a
dropped start reply, then a push that works). Finishing lets vLLM's layerwise reload
put back what was not loaded; the label stays the old version. A cleanup finish that
fails (refused because no session was open after all, or lost) leaves the flag set,
and the next push sends it again before its own start, whatever its answer. The next
push sends every tensor again (``WeightSyncer`` records a versioned push's delta only on
commit). Cleanup failures are added to the raised error as notes.

Which calls are retried (transport errors and 429/503, as for generate):

- ``/pause`` and ``/resume``: yes. Each sets a state, so sending one twice (a reply
  lost after the server acted) leaves the server as sending it once would.
- ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
  ``/init_weight_transfer_engine``: no, one attempt. A lost reply cannot be told from
  a lost request, and a second attempt is not harmless: vLLM refuses a second start
  ("already active") and a finish without a session, a bucket applied twice counts
  its weights twice toward a layer's reload, and a worker-side failure has already
  closed the session, so a retry could only fail with a misleading message. The
  cleanup above is what recovers from these.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping
from typing import Any, Final, Protocol

from inference.vllm.senders import BucketSender
from inference.vllm.transport import PAUSE_QUERY

INIT_PATH: Final = "/init_weight_transfer_engine"
PAUSE_PATH: Final = "/pause"
START_PATH: Final = "/start_weight_update"
UPDATE_PATH: Final = "/update_weights"
FINISH_PATH: Final = "/finish_weight_update"
RESUME_PATH: Final = "/resume"


class ControlCall(Protocol):
    """One RL API request: POST ``path`` with ``body`` as JSON (None: no body) and
    ``query``; ``idempotent`` says whether it may be retried. Raises on failure."""

    def __call__(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: str | None = None,
        idempotent: bool,
    ) -> Awaitable[None]: ...


class WeightPush:
    """The push state of one client: what it may have left in effect on the server."""

    def __init__(self, call: ControlCall, sender: BucketSender) -> None:
        self._call = call
        self.sender = sender
        self._connected = False
        self.paused = False
        """The server may be paused by this client: a ``/resume`` is owed."""
        self.session = False
        """An update session may be open: a ``/finish_weight_update`` is owed."""
        self._pushing = False
        """A push is between its first bucket and its commit."""
        # Buckets arrive one at a time per client; the lock makes an overlapping call
        # wait rather than interleave its pause/start with another bucket's.
        self._lock = asyncio.Lock()

    @property
    def in_progress(self) -> bool:
        """A push has begun and not yet been committed or abandoned."""
        return self.paused or self.session

    async def bucket(
        self, named_tensors: Mapping[str, Any], *, policy_version: int | None, commit: bool
    ) -> int:
        """Send one bucket (see the module docstring); returns how many tensors it held."""
        async with self._lock:
            try:
                await self._bucket(named_tensors, policy_version=policy_version, commit=commit)
            except BaseException as exc:
                await self._abandon(exc)
                raise
        return len(named_tensors)

    async def _bucket(
        self, named_tensors: Mapping[str, Any], *, policy_version: int | None, commit: bool
    ) -> None:
        call = self._call
        if not self._connected:
            await self.sender.connect(
                lambda info: call(INIT_PATH, {"init_info": info}, idempotent=False)
            )
            self._connected = True
        if not self._pushing:
            if self.session:  # an earlier cleanup's finish got no answer
                await self._finish_unanswered()
            self.paused = True
            await call(PAUSE_PATH, query=PAUSE_QUERY, idempotent=True)
            self.session = True
            await call(START_PATH, idempotent=False)
            self._pushing = True
        if named_tensors:
            await self.sender.send(
                named_tensors,
                lambda info: call(UPDATE_PATH, {"update_info": info}, idempotent=False),
            )
        if commit:
            version = None if policy_version is None else str(policy_version)
            await call(FINISH_PATH, {"weight_version": version}, idempotent=False)
            self.session = self._pushing = False
            await call(RESUME_PATH, idempotent=True)
            self.paused = False

    async def abandon(self) -> list[str]:
        """End a push in progress, best effort (a client closing mid-push); returns
        what failed, one line each."""
        async with self._lock:
            return await self._cleanup()

    async def _abandon(self, exc: BaseException) -> None:
        for note in await self._cleanup():
            exc.add_note(note)

    async def _finish_unanswered(self) -> None:
        # A refusal here is the usual answer (the session had closed after all: vLLM
        # ends it on a failed update); any other trouble fails the start that follows.
        with contextlib.suppress(Exception):
            await self._call(FINISH_PATH, {"weight_version": None}, idempotent=False)
        self.session = False

    async def _cleanup(self) -> list[str]:
        failures = []
        self._pushing = False
        if self.session:
            try:
                await self._call(FINISH_PATH, {"weight_version": None}, idempotent=False)
                self.session = False
            except Exception as cleanup:
                # vLLM answers "no session" and "could not finish" alike (a plain 500,
                # which the client cannot tell from a gateway's), and a lost reply says
                # nothing: kept, so the next push ends it first.
                failures.append(
                    f"while ending the push: {FINISH_PATH} failed, an update session may "
                    f"still be open (the next push ends it first): {cleanup}"
                )
        if self.paused:
            try:
                await self._call(RESUME_PATH, idempotent=True)
                self.paused = False  # kept True on failure, so close() tries again
            except Exception as cleanup:
                failures.append(
                    f"while ending the push: {RESUME_PATH} failed, the server may still be "
                    f"paused: {cleanup}"
                )
        return failures
