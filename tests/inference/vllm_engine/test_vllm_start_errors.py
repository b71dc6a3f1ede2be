"""A vLLM server that cannot start raises ``EngineStartError`` with vLLM's own log lines,
well within its deadline, and leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from inference.errors import EngineStartError
from inference.vllm.process import VLLMServerProcess, VLLMServerSpec
from tests.inference.vllm_engine.harness import KV_CACHE_BYTES, group_members

pytestmark = pytest.mark.slow


def test_a_bad_checkpoint_folder_raises_with_the_server_log(
    vllm_python, tmp_path, monkeypatch
) -> None:
    launched: list[int] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        launched.append(proc.pid)
        return proc

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    spec = VLLMServerSpec(
        checkpoint=str(folder),
        python=vllm_python,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        startup_timeout_s=180,
        log_file=str(tmp_path / "vllm.log"),
    )
    server = VLLMServerProcess(spec)
    start = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        server.start()
    took = time.monotonic() - start
    print(f"\nfailed start took {took:.1f} s")
    assert took < 120
    err = info.value
    assert "exited with code" in str(err)
    assert "no_such_family" in err.log_tail, err.log_tail
    assert err.log_tail in str(err) and err.log_path == str(tmp_path / "vllm.log")
    assert len(launched) == 1 and group_members(launched[0]) == []
