"""``PythonCodeExecutorToolGroup``: SkyRL's ``python`` tool, run in the sandbox.

The tool answers with the program's stdout (stripped). When the program fails, the
answer starts with ``Error executing Python code:`` (SkyRL's prefix, which prompts
and parsers may look for) and says why: the last lines of its traceback, or the
limit it ran into.
"""

from __future__ import annotations

import math

from skyrl_gym.error import EnvError
from skyrl_gym.sandbox import SandboxLimits, SandboxResult, run_python
from skyrl_gym.tools.core import ToolGroup, tool

ERROR_PREFIX = "Error executing Python code:"
_ERROR_TAIL = 2000
"""At most this many characters of stderr go back to the model."""


def describe_failure(result: SandboxResult, timeout: float) -> str:
    """One observation for a run that did not end well."""
    reasons = {
        "timeout": f"execution timed out after {timeout:g} seconds",
        "memory": "the program ran out of memory",
        "output_limit": "the program printed more output than allowed",
        "forbidden": "the program tried an operation the sandbox does not allow",
        "killed": f"the program was killed (exit status {result.exit_code})",
    }
    detail = result.stderr.strip()[-_ERROR_TAIL:]
    reason = reasons.get(result.status)
    if reason and detail and result.status != "timeout":
        return f"{ERROR_PREFIX} {reason}.\n{detail}"
    return f"{ERROR_PREFIX} {reason or detail or f'exit status {result.exit_code}'}"


class PythonCodeExecutorToolGroup(ToolGroup):
    def __init__(self, timeout: float = 10.0) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise EnvError(
                f"PythonCodeExecutorToolGroup.timeout: expected seconds > 0, got {timeout!r}"
            )
        self.timeout = float(timeout)
        self.limits = SandboxLimits(wall_s=self.timeout, cpu_s=max(1, math.ceil(self.timeout)))
        super().__init__(name="PythonCodeExecutorToolGroup")

    @tool
    def python(self, code: str) -> str:
        """Run ``code``; its stdout, or an error message naming what went wrong."""
        result = run_python(str(code), limits=self.limits)
        if result.ok:
            return result.stdout.strip()
        return describe_failure(result, self.timeout)
