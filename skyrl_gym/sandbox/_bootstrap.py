"""Runs inside the sandboxed interpreter, before the program (``python -I -c <this>``).

argv: ``[sandbox_dir, settings]``. It sets the resource limits (here rather than in a
``preexec_fn``, which is unsafe in a threaded parent and slows every spawn), drops to
the unprivileged uid when told to, installs an audit hook, then runs
``sandbox_dir/main.py`` as ``__main__``. ``settings`` is a Python literal from the
parent, read with ``eval``: importing json (and traceback, imported only when the
program fails) would double the start-up time.

The hook is defence in depth beside the kernel limits, not a boundary of its own
(native code can bypass audit hooks, which is why ctypes is refused): it ends the
process at once, with ``EXIT_FORBIDDEN``, on a socket, a new process, a signal to
another process, ctypes, a write or a file-system change outside the sandbox
directory, or a read under a denied root (the caller's home, its run folder). Ending
the process, rather than raising, means the program cannot catch the refusal.

This file must import nothing from the package: it is run as source text.
"""

import os
import resource
import sys

EXIT_FORBIDDEN = 120
EXIT_MEMORY = 121


def _inside(path, roots):
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _real(path):
    if isinstance(path, int) or path is None:
        return None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return os.path.realpath(path)


def _install_hook(box, deny, allow_read):
    refuse_prefixes = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn")
    refuse = {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "pty.spawn",
        "os.startfile",
        "sys.remote_exec",
    }
    refuse_imports = {"_ctypes", "ctypes", "_posixsubprocess", "resource"}
    mutating = {
        "os.mkdir",
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.symlink",
        "os.link",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.setxattr",
        "os.removexattr",
        "shutil.rmtree",
        "os.chflags",
        "os.lchflags",
    }
    listing = {"os.listdir", "os.scandir", "os.walk", "glob.glob"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    boxes = (box,)
    write_ok = boxes + ("/dev/null",)

    def deny_event(event, detail):
        os.write(2, f"\nsandbox: refused {event} {detail!r:.200}\n".encode())
        os._exit(EXIT_FORBIDDEN)

    def readable(path):
        return path is None or not _inside(path, deny) or _inside(path, allow_read)

    def hook(event, args):
        if event == "open":
            path = _real(args[0])
            mode, flags = args[1] or "", args[2] or 0
            writing = any(c in mode for c in "wax+") or flags & write_flags
            if path is not None and writing and not _inside(path, write_ok):
                deny_event(event, path)
            if not readable(path):
                deny_event(event, path)
        elif event in mutating:
            for arg in args:
                if isinstance(arg, (str, bytes)) and not _inside(_real(arg), boxes):
                    deny_event(event, arg)
        elif event in listing:
            if args and not readable(_real(args[0])):
                deny_event(event, args[0])
        elif event == "import":
            if args[0] in refuse_imports:
                deny_event(event, args[0])
        elif event in refuse or event.startswith(refuse_prefixes):
            deny_event(event, args[:2])

    sys.addaudithook(hook)
    # Calls that write or reach outside without raising an audit event: removed instead.
    posix = sys.modules[os.name]
    for name in ("mkfifo", "mknod", "pidfd_open"):
        for module in (os, posix):
            if hasattr(module, name):
                delattr(module, name)


def main():
    box, settings = sys.argv[1], eval(sys.argv[2], {"__builtins__": {}})  # from the parent
    for name, value in settings["rlimits"].items():
        soft, hard = value if isinstance(value, list) else (value, value)
        resource.setrlimit(getattr(resource, name), (soft, hard))
    del sys.modules["resource"]  # a program left root could raise its limits again
    uid = settings.get("uid")
    if uid is not None:  # root only: give up root before running anything of the program
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.chdir(box)
    with open(os.path.join(box, "main.py"), encoding="utf-8", errors="replace") as f:
        source = f.read()
    box = os.path.realpath(box)  # its own directory stays readable, even under a denied root
    _install_hook(box, tuple(settings["deny"]), (box, *settings["allow_read"]))
    module = type(sys)("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # the traceback starts at the program, not here
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_MEMORY if isinstance(exc, MemoryError) else 1)


if __name__ == "__main__":  # run as ``python -c``; importing it only reads the constants
    main()
