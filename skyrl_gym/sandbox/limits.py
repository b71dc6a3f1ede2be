"""What a sandboxed program may use: time, memory, output, processes, file sizes."""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_gym.error import SandboxError

MIB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    """Per-execution limits; every one is enforced by the kernel or by the parent.

    ``memory_bytes`` is the address-space limit (``RLIMIT_AS``), so it counts mapped
    but untouched memory too: the interpreter alone maps about 30 MiB.
    ``max_processes`` is ``RLIMIT_NPROC``, which the kernel applies only to a
    non-root user (see ``isolation``). ``site_packages`` lets the program import
    installed packages (numpy, ...); off, the interpreter starts with ``-S``, which
    is faster and exposes less.
    """

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1024 * MIB
    output_bytes: int = 1 * MIB
    """Cap on stdout and on stderr, each; past it the program is killed."""
    max_processes: int = 32
    max_file_bytes: int = 16 * MIB
    max_open_files: int = 64
    site_packages: bool = False

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "output_bytes", "max_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise SandboxError(
                    f"SandboxLimits.{name}: expected a positive number, got {value!r}"
                )
        for name in ("max_file_bytes", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 16:
                raise SandboxError(f"SandboxLimits.{name}: expected an int >= 16, got {value!r}")


DEFAULT_LIMITS = SandboxLimits()
