"""The command line's error convention, one for every `dsv4` command.

- Bad input (a flag, file, checkpoint or config value the user can change): exit 2 and one
  line `dsv4 CMD: error: ...` naming the flag, file, key or field and what would be valid.
  `UsageError`, `ValueError` (so `checkpoints.errors.CheckpointError`) and the OSErrors
  that name a path the user gave (missing, existing, not a directory, no permission).
- A failure while working (device, out of memory, a write that fails): exit 1 and one line
  `dsv4 CMD: failed: ...`.
- Ctrl-C: exit 130 and one line saying what was kept and how to resume.
A bug (any other exception) keeps its traceback.
"""
from __future__ import annotations

import sys

USAGE, FAILURE, INTERRUPTED = 2, 1, 130

_USAGE_OS_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                    PermissionError)


class UsageError(ValueError):
    """Bad input the user can fix; the message names the flag / file / field."""


def _is_runtime_failure(e: BaseException) -> bool:
    name = type(e).__name__
    return (isinstance(e, (RuntimeError, MemoryError)) or name == "XlaRuntimeError"
            or (isinstance(e, OSError) and not isinstance(e, _USAGE_OS_ERRORS)))


def run_command(cmd: str, fn, *, on_interrupt: str = "nothing was written") -> int:
    """Run `fn()` under the convention above -> the exit status (0 when `fn` returns None).
    `on_interrupt`: what Ctrl-C leaves behind and how to resume, for the one-line message."""
    try:
        rc = fn()
        return 0 if rc is None else int(rc)
    except KeyboardInterrupt:
        print(f"\ndsv4 {cmd}: interrupted: {on_interrupt}", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, *_USAGE_OS_ERRORS) as e:
        print(f"dsv4 {cmd}: error: {_message(e)}", file=sys.stderr)
        return USAGE
    except BaseException as e:
        if not _is_runtime_failure(e):
            raise
        print(f"dsv4 {cmd}: failed: {type(e).__name__}: {_message(e)}", file=sys.stderr)
        return FAILURE


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in str(e.strerror or ""):
        return f"{e.filename}: {e.strerror or e}"
    return str(e).strip() or type(e).__name__
