"""Policy versions and multi-upload commits of ``POST /skyrl/v1/update_weights``.

A trainer's push may span several uploads (buckets); two request headers make it land
as one step, and tag what the engine then generates (``policy_version`` in every
generate reply and in ``/health``):

``X-Policy-Version: <int >= 0>``
    The policy version the weights are. On the committing upload the engine's version
    becomes it in the same model-locked step as the copy: a generate batch sees the old
    weights and version or the new ones, never a mix. A version below the engine's is
    refused with a 409 naming ``X-Policy-Version`` (expected >= the current one), and
    weights and version stay as they were; the same version again is accepted (a retried
    commit whose reply was lost).
``X-Weight-Commit: true | false`` (default true)
    false: the upload is validated (``weights_upload``, steps 1-3) and its tensors are
    staged in the app's memory, not loaded; the reply's ``num_loaded`` is 0. true: the
    staged tensors and this upload's (which win on a repeated name) go to ONE
    ``load_weights(..., policy_version=v)``: all or nothing. Values are checked there,
    so a non-finite one in any staged upload refuses the whole commit, naming the
    tensor. Staging ends as soon as a commit's body has been read whole, loaded or
    refused; a commit whose body never arrived (timeout, reset) keeps it, so the
    client's retry of that commit completes the push.

Rules, checked under the weight lock before the data section is read:

- a commit while tensors are staged must name a version: otherwise a 400 naming
  ``X-Policy-Version``, and the staging waits;
- staging belongs to one version, set by the first staged upload naming one (staged
  uploads may name it; an unnamed staging is adopted by whichever version names it).
  An upload naming another version drops it: that push was abandoned (one pusher at a
  time is assumed). A 409 drops the staging of the refused version (a refused commit:
  an unnamed staging too), which can never commit;
- staged tensors take at most one copy of the model's parameters: names are staged
  once (a repeat replaces the earlier tensor, and tensors that shared a buffer with the
  replaced one are copied out so the buffer can go).

Without either header an upload loads at once and leaves the version unchanged, as
before versions existed. Either header on an engine that keeps no policy version is a
501. A malformed value is a 400 naming the header. The reply is ``{"num_loaded": int,
"num_staged": int, "policy_version": int | null}``: tensors loaded by this upload (0
when staged), tensors waiting for a commit after it, and the engine's version after it
(null only for an engine that keeps none).

``weights_upload.receive_weights`` validates and streams each upload; this module holds
what its headers ask for (``parse_upload_headers``), the staged tensors between uploads
(``StagedWeights``) and the version rules (``check_version``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from aiohttp import web

from inference.errors import RequestValidationError

__all__ = [
    "COMMIT_HEADER",
    "MAX_POLICY_VERSION",
    "POLICY_VERSION_HEADER",
    "StagedWeights",
    "UploadIntent",
    "UploadOutcome",
    "check_version",
    "engine_policy_version",
    "parse_upload_headers",
]

logger = logging.getLogger(__name__)

POLICY_VERSION_HEADER = "X-Policy-Version"
COMMIT_HEADER = "X-Weight-Commit"
MAX_POLICY_VERSION = 2**63 - 1
"""Versions fit an int64 (metrics, tensors); a longer header value is refused before int()."""


@dataclass(frozen=True)
class UploadIntent:
    """What an upload's ``X-Policy-Version`` / ``X-Weight-Commit`` headers ask for."""

    policy_version: int | None = None
    """None when the header is absent."""
    commit: bool = True

    @property
    def versioned(self) -> bool:
        """Whether the upload uses versions or staging at all (needs a versioned engine)."""
        return self.policy_version is not None or not self.commit


@dataclass(frozen=True)
class UploadOutcome:
    """The reply of one upload (see the module docstring)."""

    num_loaded: int
    num_staged: int
    policy_version: int | None


class StagedWeights:
    """Tensors of ``X-Weight-Commit: false`` uploads waiting for their commit.

    Held in the app and touched only under its weight lock. Each tensor is a view into
    its upload's buffer (no copy), unless it outlived a tensor of the same buffer that a
    later upload replaced: then it is copied out, so staging never holds more than one
    copy of the model's parameters.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The version staged uploads named; None when none named one."""

    def __len__(self) -> int:
        return len(self.tensors)

    def clear(self) -> None:
        self.tensors = {}
        self.version = None

    def add(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        replaced = {name for name, _ in named if name in self.tensors}
        if replaced:
            freed = {self.tensors[name].untyped_storage().data_ptr() for name in replaced}
            for name, tensor in self.tensors.items():
                if name not in replaced and tensor.untyped_storage().data_ptr() in freed:
                    self.tensors[name] = tensor.clone()
        self.tensors.update(named)
        if version is not None:
            self.version = version

    def take(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Staged tensors and ``named`` (which win on a repeated name); staging ends."""
        together = {**self.tensors, **dict(named)}
        self.clear()
        return list(together.items())


def engine_policy_version(engine: object) -> int | None:
    """The engine's ``policy_version``; None for an engine that keeps none (a wrapper
    written before versions existed), which then cannot take versioned uploads."""
    version = getattr(engine, "policy_version", None)
    return version if type(version) is int else None


def parse_upload_headers(request: web.Request) -> UploadIntent:
    """The upload's version headers, or a 400 naming the header that is malformed."""
    raw_version = _one_header(request, POLICY_VERSION_HEADER)
    version = None
    if raw_version is not None:
        text = raw_version.strip()
        # isascii: str.isdigit is also true of digits such as "²" that int() refuses.
        if not (text.isascii() and text.isdigit()):
            raise RequestValidationError(POLICY_VERSION_HEADER, "an int >= 0", raw_version)
        if len(text) > len(str(MAX_POLICY_VERSION)) or int(text) > MAX_POLICY_VERSION:
            raise RequestValidationError(
                POLICY_VERSION_HEADER, f"an int >= 0 and <= {MAX_POLICY_VERSION}", raw_version
            )
        version = int(text)
    raw_commit = _one_header(request, COMMIT_HEADER)
    commit = True
    if raw_commit is not None:
        word = raw_commit.strip().lower()
        if word not in ("true", "false"):
            raise RequestValidationError(COMMIT_HEADER, "true or false", raw_commit)
        commit = word == "true"
    return UploadIntent(policy_version=version, commit=commit)


def _one_header(request: web.Request, name: str) -> str | None:
    values = request.headers.getall(name, [])
    if len(values) > 1:
        raise RequestValidationError(name, "the header at most once", values)
    return values[0] if values else None


def check_version(intent: UploadIntent, staged: StagedWeights, current: int) -> None:
    """The rules of the module docstring; may drop an abandoned staging."""
    version = intent.policy_version
    if version is None:
        if intent.commit and len(staged):
            raise RequestValidationError(
                POLICY_VERSION_HEADER,
                f"an int >= {current} (a commit of {len(staged)} staged tensors names "
                "their policy version)",
                None,
            )
        return
    if version < current:
        if staged.version == version or (intent.commit and staged.version is None):
            staged.clear()  # the refused push's own staging: it can never commit
        raise RequestValidationError(
            POLICY_VERSION_HEADER,
            f"an int >= {current} (the policy version serving now)",
            version,
            status=409,
        )
    if staged.version is not None and staged.version != version:
        logger.warning(
            "dropping %d staged tensors of policy version %d: an upload names version %d",
            len(staged),
            staged.version,
            version,
        )
        staged.clear()
