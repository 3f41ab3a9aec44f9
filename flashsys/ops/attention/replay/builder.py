"""Builds the native launcher's extension (`native`) in a process of its own.

`native` runs this file as a script, in a session of its own, and waits for it. So the build:
- outlives the process that asked for it: a script stopped in its first minute leaves a completed build to the next
  process, not a half-built one;
- keeps torch.utils.cpp_extension's work (its import, ~0.1 s holding the GIL, and its compiler and ninja runs) out
  of that process, whose eager calls go on meanwhile;
- takes turns with other builders under an flock, which the OS drops when its holder dies. torch's own build lock
  is a file that a killed build leaves behind, after which every later build waits on it forever; under the flock
  no other builder is running, so such a file is stale and is removed.

A completed build leaves `<name>.so` and the mark BUILT in its directory, which `native` then imports directly.
Only the standard library is imported at the top: importing the script costs nothing, running it imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

BUILT = "built"  # written once a build has compiled, linked and imported


def completed(directory: Path, name: str) -> Path | None:
    """The library a completed build left in `directory`, or None."""
    library = directory / f"{name}.so"
    return library if (directory / BUILT).exists() and library.exists() else None


@contextlib.contextmanager
def exclusive(path: Path):
    """An exclusive lock on `path` across processes, dropped by the OS when its holder dies."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: torch's lock alone
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(name: str, source: Path, include: Path, directory: Path, cflags: list[str]) -> None:
    """Compile, link and import the extension in `directory` unless a completed build is there already."""
    directory.mkdir(parents=True, exist_ok=True)
    with exclusive(directory / "flashsys.lock"):
        if completed(directory, name) is not None:  # another builder finished while this one waited
            return
        (directory / "lock").unlink(missing_ok=True)  # torch's, stale (see the module's docstring)
        from torch.utils.cpp_extension import load

        load(name=name, sources=[str(source)], extra_include_paths=[str(include)], extra_cflags=cflags,
             build_directory=str(directory), verbose=False)
        (directory / BUILT).touch()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the module's name (TORCH_EXTENSION_NAME)")
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--include", type=Path, required=True, help="the directory of the cuda.h to compile with")
    parser.add_argument("--directory", type=Path, required=True, help="the build directory")
    parser.add_argument("--cflag", action="append", default=[], help="a compiler flag (repeat for more)")
    a = parser.parse_args(argv)
    try:
        build(a.name, a.source, a.include, a.directory, a.cflag)
    except Exception as e:  # noqa: BLE001 - the asking process reports it (the compiler's first error)
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
