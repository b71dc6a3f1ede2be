"""Mutation testing of the R3 critical path: plant one realistic bug at a time and check
that the tests meant to catch it fail.

    OMP_NUM_THREADS=1 python scripts/mutate.py                  # every mutant: table + score
    python scripts/mutate.py --list                             # names, modules, tests
    python scripts/mutate.py --only wire-rank-higher [--only NAME ...]

Each mutant below names a module, the exact original snippet, its replacement and the
test files that should catch it. The working tree is never touched: the repository is
copied once into a temporary folder (without .git, runs and caches), each mutant is
written into the copy, its tests run there with ``pytest -x -q`` (``PYTHONPATH`` at the
copy, ``OMP_NUM_THREADS=1``, no bytecode written, so a patched module is always
recompiled), and the module is restored before the next one. The unmodified copy's
tests run first (the baseline): a mutant only counts as caught if they passed.

Outcomes: ``caught`` (pytest exit 1, or the per-mutant time limit, as in mutmut),
``survived`` (exit 0), ``error`` (any other exit: a collection or usage error, not
scored). The score is caught / (caught + survived). Exit status: 0 when every mutant
was caught, 1 when some survived or errored, 2 when an original snippet does not occur
exactly once in its module (the code drifted: update the list) or the baseline fails.

Not part of CI: a full run takes several minutes (each pytest start imports torch).

Kept whole: most of it is the mutant table, one entry per planted bug, which reads best
as one list next to the runner that applies it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(
    ".git",
    "runs",
    "outputs",
    "build",
    "dist",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    ".venv",
)

T_NDARRAY = "tests/inference/wire/test_wire_ndarray.py"
T_FIELDS = "tests/inference/wire/test_wire_fields.py"
T_BODY = "tests/inference/wire/test_wire_body.py"
T_BODY_ORDER = "tests/inference/wire/test_wire_body_order.py"
T_RESPONSE = "tests/inference/wire/test_wire_response.py"
T_TRACES = "tests/skyrl_train/generators/test_traces.py"
T_COLLATE = "tests/skyrl_train/dataset/test_collate_routes.py"
T_PREPROCESS = "tests/skyrl_train/dataset/test_preprocess.py"
T_REPLAY = "tests/skyrl_train/workers/test_megatron_checks.py"
T_VALIDATE = "tests/skyrl_train/config/test_validate_cfg.py"
T_RETRY = "tests/inference/client/test_retry_policy.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    module: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    bug: str
    """What the planted bug does, in one line."""


WIRE_NDARRAY = "inference/wire/ndarray.py"
WIRE_FIELDS = "inference/wire/fields.py"
WIRE_BODY = "inference/wire/body.py"
TRACES = "skyrl_train/generators/traces.py"
ROUTES = "skyrl_train/dataset/routes.py"
PREPROCESS = "skyrl_train/dataset/preprocess.py"
REPLAY = "skyrl_train/workers/megatron/replay.py"
VALIDATE = "skyrl_train/config/validate.py"
MEGATRON_UNSUPPORTED = "skyrl_train/config/megatron_unsupported.py"
MEGATRON_RULES = "skyrl_train/config/megatron_rules.py"
RETRY = "inference/client/retry.py"

MUTANTS: tuple[Mutant, ...] = (
    # ---- wire codec and splice (inference/wire) ----------------------------------
    Mutant(
        "wire-rank-higher",
        WIRE_NDARRAY,
        "if ndim is not None and len(shape) != ndim:",
        "if ndim is not None and len(shape) < ndim:",
        (T_NDARRAY, T_FIELDS),
        "an envelope of higher rank than the field's is accepted",
    ),
    Mutant(
        "wire-bytes-too-many",
        WIRE_NDARRAY,
        "if len(buf) != count * dtype.itemsize:",
        "if len(buf) < count * dtype.itemsize:",
        (T_NDARRAY,),
        "only too few bytes are refused; too many reach numpy's reshape",
    ),
    Mutant(
        "wire-shape-bool-dims",
        WIRE_NDARRAY,
        "if type(dim) is not int or dim < 0:",
        "if not isinstance(dim, int) or dim < 0:",
        (T_NDARRAY,),
        "true/false pass as shape dims (bool is an int subclass)",
    ),
    Mutant(
        "wire-partial-memoryview",
        WIRE_BODY,
        "if raw.c_contiguous and isinstance(obj, bytes | bytearray) and raw.nbytes == len(obj):",
        "if raw.c_contiguous and isinstance(obj, bytes | bytearray):",
        (T_BODY,),
        "a view of part of a buffer is scanned as the whole buffer",
    ),
    Mutant(
        "wire-escaped-quote",
        WIRE_BODY,
        "and buf[open_ + 1 : close] == key\n            and _unescaped(buf, open_)",
        "and buf[open_ + 1 : close] == key",
        (T_BODY,),
        "a key behind an escaped quote is taken for a registered field",
    ),
    Mutant(
        "wire-blob-end-off-by-one",
        WIRE_BODY,
        "prev = end\n",
        "prev = end + 1\n",
        (T_BODY,),
        "the remainder resumes one byte after the blob's closing quote",
    ),
    Mutant(
        "wire-restore-registry-order",
        WIRE_BODY,
        "in_order = in_order and index == len(found)",
        "in_order = in_order and index is not None",
        (T_BODY_ORDER,),
        "blobs are restored in registry order: a choice with its support before its routes "
        "gets them swapped",
    ),
    Mutant(
        "wire-empty-blob-end",
        WIRE_BODY,
        "end = find(b'\"', start)",
        "end = find(b'\"', start + 1)",
        (T_BODY_ORDER,),
        "the closing quote is searched one byte late: an empty data string runs on",
    ),
    Mutant(
        "wire-restore-count",
        WIRE_BODY,
        "return found if in_order and len(found) == len(splice.spans) else None",
        "return found if in_order else None",
        (T_BODY,),
        "the fast restore skips the walk although blobs sit outside choices[i]",
    ),
    Mutant(
        "wire-route-dtype-boundary",
        WIRE_FIELDS,
        "if max_id <= np.iinfo(name).max:",
        "if max_id < np.iinfo(name).max:",
        (T_FIELDS,),
        "id 255 (32767) is sent one dtype wider than canonical",
    ),
    Mutant(
        "wire-negative-ids-hidden",
        WIRE_FIELDS,
        'unsigned = arr.view(arr.dtype.str.replace("i", "u"))',
        "unsigned = arr",
        (T_FIELDS,),
        "the one-pass max no longer reveals negative expert ids",
    ),
    Mutant(
        "wire-support-pair-dropped",
        WIRE_FIELDS,
        "    if ids is not None and logprobs is not None:\n"
        "        _check_support_pair(ids.shape, logprobs.shape, path)\n"
        "    return out",
        "    return out",
        (T_FIELDS,),
        "decode_packed_fields accepts support ids and logprobs of different shapes",
    ),
    Mutant(
        "wire-clamp-inf",
        "inference/wire/response.py",
        "if value is None or not math.isfinite(value):",
        "if value is None or math.isnan(value):",
        (T_RESPONSE,),
        "+/-inf sampled logprobs are not clamped",
    ),
    # ---- traces (skyrl_train/generators/traces.py) ------------------------------
    Mutant(
        "traces-expected-rows",
        TRACES,
        "expected = p - start + g - 1",
        "expected = p - start + g",
        (T_TRACES,),
        "a turn expects a row for the last sampled token, which was never fed",
    ),
    Mutant(
        "traces-whole-prefix-misaligned",
        TRACES,
        "chunk = chunk[start:]",
        "chunk = chunk[:expected]",
        (T_TRACES,),
        "a whole-prefix reply keeps its first rows instead of dropping the overlap",
    ),
    Mutant(
        "traces-trailing-eos",
        TRACES,
        "bad = active[(active < 1) | (active > rows)]",
        "bad = active[(active < 1) | (active > rows + 1)]",
        (T_TRACES,),
        "a loss-active token after the last routed token is accepted",
    ),
    Mutant(
        "traces-prompt-start-equal",
        TRACES,
        "if p <= start:",
        "if p < start:",
        (T_TRACES,),
        "a prompt no longer than the rows already captured is accepted",
    ),
    Mutant(
        "traces-no-widening",
        TRACES,
        "dtype = chunk.dtype if self._dtype is None else np.promote_types(self._dtype, chunk.dtype)",
        "dtype = chunk.dtype",
        (T_TRACES,),
        "the trace takes the last turn's dtype instead of the widest",
    ),
    Mutant(
        "traces-padding-zeros",
        TRACES,
        "routes[rows:] = route_filler(topk, captured.dtype)",
        "routes[rows:] = 0",
        (T_TRACES,),
        "uncaptured rows hold K zeros, not K distinct experts",
    ),
    # ---- collation (skyrl_train/dataset) -----------------------------------------
    Mutant(
        "collate-rows-upper-bound",
        ROUTES,
        "if not 1 <= rows <= tokens:",
        "if not 1 <= rows <= tokens + 1:",
        (T_COLLATE, T_PREPROCESS),
        "a trajectory with one route row more than tokens is accepted",
    ),
    Mutant(
        "collate-response-mask",
        ROUTES,
        "            mask[first:end] = piece is None\n",
        "            mask[first : max(first, end - 1)] = piece is None\n",
        (T_COLLATE,),
        "the last captured response row is marked as padding",
    ),
    Mutant(
        "collate-layers-unchecked",
        ROUTES,
        "elif sample.shape[1:] != trailing:",
        "elif sample.shape[2] != trailing[1]:",
        (T_COLLATE,),
        "trajectories with different layer counts are collated together",
    ),
    Mutant(
        "collate-dtype-first-sample",
        ROUTES,
        "dtype = np.result_type(*{s.dtype for s in samples})",
        "dtype = samples[0].dtype",
        (T_COLLATE,),
        "the batch takes trajectory 0's dtype, truncating wider ids",
    ),
    Mutant(
        "preprocess-loss-mask-values",
        PREPROCESS,
        "if n and not np.isin(loss_mask, (0, 1)).all():",
        "if n and loss_mask.max() > 1:",
        (T_PREPROCESS,),
        "negative loss-mask values pass",
    ),
    Mutant(
        "preprocess-routes-length",
        PREPROCESS,
        '        _per_trajectory(output, "routed_experts", len(trajectories))\n',
        "",
        (T_PREPROCESS,),
        "a routes list shorter than the batch is not named as such",
    ),
    # ---- replay and config validation --------------------------------------------
    Mutant(
        "replay-expert-upper-bound",
        REPLAY,
        "bad = (ids < 0) | (ids >= routers.num_experts)",
        "bad = (ids < 0) | (ids > routers.num_experts)",
        (T_REPLAY,),
        "expert id == num_experts is accepted",
    ),
    Mutant(
        "replay-dispatch-count-total-only",
        REPLAY,
        "if not bool((per_token == top_k).all()):",
        "if int(per_token.sum()) != tokens * top_k:",
        (T_REPLAY,),
        "a ragged dispatch with the right total is reshaped into misgrouped rows",
    ),
    Mutant(
        "replay-distinct-unsorted",
        REPLAY,
        "ordered = ids.sort(dim=3).values",
        "ordered = ids",
        (T_REPLAY,),
        "repeated experts are only found when adjacent in the row",
    ),
    Mutant(
        "validate-vpp-one",
        MEGATRON_UNSUPPORTED,
        'bool(vpp := s.get("virtual_pipeline_model_parallel_size"))',
        '(vpp := s.get("virtual_pipeline_model_parallel_size") or 0) > 1',
        (T_VALIDATE,),
        "virtual_pipeline_model_parallel_size=1 passes with replay",
    ),
    Mutant(
        "validate-sinkhorn-in-list",
        MEGATRON_UNSUPPORTED,
        "return [balancing] if isinstance(balancing, str) else list(balancing or [])",
        "return [balancing]",
        (T_VALIDATE,),
        "sinkhorn inside a list of balancing types passes with replay",
    ),
    Mutant(
        "validate-r2-demands-routes",
        MEGATRON_RULES,
        "if rollout and not cfg.generator.inference_engine.enable_return_routed_experts:",
        "if not cfg.generator.inference_engine.enable_return_routed_experts:",
        (T_VALIDATE,),
        "R2 (old_policy) still demands routes from the engine",
    ),
    Mutant(
        "validate-mini-batch-samples",
        VALIDATE,
        "if mini % dp:",
        "if tr.policy_mini_batch_size % dp:",
        (T_VALIDATE,),
        "the data-parallel split ignores n_samples_per_prompt",
    ),
    # ---- retries (inference/client/retry.py) -------------------------------------
    Mutant(
        "retry-sleep-after-last",
        RETRY,
        "if number == policy.max_attempts:",
        "if number > policy.max_attempts:",
        (T_RETRY,),
        "the loop sleeps once more after the final attempt",
    ),
    Mutant(
        "retry-floor-min",
        RETRY,
        "delay = max(delay, policy.min_backoff_s)",
        "delay = min(delay, policy.min_backoff_s)",
        (T_RETRY,),
        "the floor becomes a ceiling: every sleep is at most min_backoff_s",
    ),
    Mutant(
        "retry-jitter-sign",
        RETRY,
        "return base * (1.0 - self.jitter * rng.random())",
        "return base * (1.0 + self.jitter * rng.random())",
        (T_RETRY,),
        "jitter lengthens the backoff past max_backoff_s",
    ),
    Mutant(
        "retry-catches-every-error",
        RETRY,
        "except GenerateTransportError as exc:",
        "except GenerateError as exc:",
        (T_RETRY,),
        "HTTP errors are retried like transport errors",
    ),
    Mutant(
        "retry-attempt-timeout-uncut",
        RETRY,
        "timeout_s = min(policy.attempt_timeout_s, remaining)",
        "timeout_s = policy.attempt_timeout_s",
        (T_RETRY,),
        "an attempt may run past the call's deadline",
    ),
)


@dataclass
class Outcome:
    mutant: Mutant
    result: str
    seconds: float
    detail: str


def check_snippets(root: Path, mutants: tuple[Mutant, ...]) -> list[str]:
    """One line per mutant whose original snippet does not occur exactly once."""
    problems = []
    for m in mutants:
        path = root / m.module
        if not path.is_file():
            problems.append(f"{m.name}: {m.module}: no such file")
            continue
        count = path.read_text().count(m.original)
        if count != 1:
            problems.append(
                f"{m.name}: {m.module}: original snippet found {count} times, expected once: "
                f"{m.original.strip()[:70]!r}"
            )
    return problems


def pytest_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a patched module is always recompiled
    return env


def run_pytest(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(
            cmd,
            cwd=copy,
            env=pytest_env(copy),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None, f"no result within {timeout_s:.0f} s"
    return proc.returncode, proc.stdout + proc.stderr


def first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return match.group(1).split("/")[-1] if match else ""


def check_imports_from_copy(copy: Path, mutants: tuple[Mutant, ...]) -> None:
    """Refuse to run if the mutated modules would be imported from anywhere but the copy
    (an editable install must not shadow it)."""
    names = sorted({m.module.removesuffix(".py").replace("/", ".") for m in mutants})
    code = "import importlib\n" + "".join(
        f"print(importlib.import_module({n!r}).__file__)\n" for n in names
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=copy, env=pytest_env(copy), capture_output=True, text=True
    )
    files = proc.stdout.split()
    if proc.returncode != 0 or any(not Path(f).resolve().is_relative_to(copy) for f in files):
        sys.exit(f"modules not imported from the copy {copy}:\n{proc.stdout}{proc.stderr}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutant only")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per mutant (default 600)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmodified run")
    args = parser.parse_args()

    mutants = MUTANTS
    if args.only:
        known = {m.name for m in MUTANTS}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            parser.error(f"--only: unknown mutant(s) {unknown}; see --list")
        mutants = tuple(m for m in MUTANTS if m.name in args.only)
    if args.list:
        for m in mutants:
            tests = ", ".join(Path(t).name for t in m.tests)
            print(f"{m.name:34} {m.module:38} {tests}\n{'':34} {m.bug}")
        return 0

    problems = check_snippets(REPO, mutants)
    if problems:
        print("code drifted; update MUTANTS in scripts/mutate.py:", *problems, sep="\n  ")
        return 2

    print(f"python {sys.version.split()[0]}, {len(mutants)} mutants, OMP_NUM_THREADS=1")
    with tempfile.TemporaryDirectory(prefix="r3-mutate-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(REPO, copy, ignore=IGNORE)
        # Re-checked on the copy: the tree may have changed while it was copied.
        problems = check_snippets(copy, mutants)
        if problems:
            print("code drifted during the copy:", *problems, sep="\n  ")
            return 2
        check_imports_from_copy(copy, mutants)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            start = time.perf_counter()
            code, output = run_pytest(copy, tests, args.timeout * 2)
            print(
                f"baseline: {len(tests)} test files, exit {code}, {time.perf_counter() - start:.0f} s"
            )
            if code != 0:
                print(output[-3000:])
                return 2

        outcomes: list[Outcome] = []
        for i, m in enumerate(mutants, 1):
            path = copy / m.module
            original = path.read_text()
            path.write_text(original.replace(m.original, m.replacement, 1))
            start = time.perf_counter()
            try:
                code, output = run_pytest(copy, m.tests, args.timeout)
            finally:
                path.write_text(original)
            seconds = time.perf_counter() - start
            if code == 1:
                outcome = Outcome(m, "caught", seconds, first_failure(output))
            elif code is None:
                outcome = Outcome(m, "caught", seconds, output)  # a time-out kills it
            elif code == 0:
                outcome = Outcome(m, "survived", seconds, m.bug)
            else:
                outcome = Outcome(m, "error", seconds, f"pytest exit {code}: {output[-300:]}")
            outcomes.append(outcome)
            print(
                f"[{i:2}/{len(mutants)}] {m.name:34} {outcome.result:8} {seconds:5.0f} s",
                flush=True,
            )

    print()
    print(f"{'mutant':34} {'module':38} {'result':8} {'time':>6}  detail")
    for o in outcomes:
        print(f"{o.mutant.name:34} {o.mutant.module:38} {o.result:8} {o.seconds:5.0f}s  {o.detail}")
    caught = sum(o.result == "caught" for o in outcomes)
    survived = sum(o.result == "survived" for o in outcomes)
    errors = sum(o.result == "error" for o in outcomes)
    scored = caught + survived
    share = 100.0 * caught / scored if scored else 0.0
    print(f"\nscore: {caught}/{scored} mutants caught ({share:.1f}%), {errors} errors")
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
