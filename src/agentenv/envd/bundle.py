"""The envd runtime bundle: a self-contained, read-only tree mounted at ``/.aenv``.

It lets envd run in ANY rootfs (busybox, musl, no Python): it carries the Python
3.11 interpreter, the stdlib envd needs, envd's dependencies, envd itself, the
relocated E2B protocol modules, and the full ``ldd`` closure of the interpreter
and of every extension module (including the dynamic loader), so nothing is read
from the rootfs's own libraries or Python.

Layout of ``<dest_root>/<hash>/``::

    lib/                       ld-linux-x86-64.so.2, libc, libpython3.11.so.1.0, libssl, ...
    python/bin/python3.11      the interpreter
    python/lib/python3.11/     trimmed stdlib (+ lib-dynload), pre-compiled .pyc
    site/                      connectrpc, protobuf, uvicorn, h11, ..., agentenv/envd,
                               aenv_envd_protos
    BUNDLE.json                what went in (python version, packages, hash)

Start envd with :func:`envd_command`. ``python -m agentenv.envd.bundle DEST_ROOT``
builds the bundle and prints its path.
"""

from __future__ import annotations

import compileall
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import py_compile
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from .state import DEFAULT_PATH

log = logging.getLogger("agentenv.envd.bundle")

BUNDLE_FORMAT = 1
LOADER = "ld-linux-x86-64.so.2"
PY_VER = f"{sys.version_info.major}.{sys.version_info.minor}"

# Top-level modules/packages envd imports from the environment (site dir), with
# the distribution that provides each (its version goes into the bundle hash).
SITE_MODULES: dict[str, str] = {
    "connectrpc": "connectrpc",
    "protobuf": "protobuf-py",
    "protobuf_ext": "protobuf-py-ext",
    "pyqwest": "pyqwest",  # connectrpc imports it even on the server side
    "uvicorn": "uvicorn",
    "h11": "h11",
    "click": "click",  # `import uvicorn` imports click
    "python_multipart": "python-multipart",
    "typing_extensions": "typing-extensions",
}

# Stdlib parts envd never needs.
STDLIB_EXCLUDE = {
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
    "pydoc_data", "distutils", "venv", "unittest", "sqlite3", "dbm", "curses", "xmlrpc",
    "turtle.py", "__pycache__", "__phello__",
}
DYNLOAD_EXCLUDE = re.compile(
    r"^(_test|_tkinter|_ctypes_test|xxlimited|_xxtestfuzz|_xxsubinterpreters|_curses|"
    r"_sqlite3|_dbm|_gdbm|nis|ossaudiodev|readline|audioop|spwd|_crypt)")
# Extension modules whose libraries must be present: a build without them is broken.
REQUIRED_DYNLOAD = ("_ssl", "_hashlib", "zlib", "_ctypes", "_posixsubprocess", "select",
                    "_socket", "_asyncio", "fcntl", "termios", "grp", "_json")
# glibc dlopens libgcc_s for thread cancellation/unwinding; ldd does not show it.
EXTRA_LIBS = ("libgcc_s.so.1",)


STUB_NAME = "envd-stub"
EXEC_AS_SOURCE = Path(__file__).resolve().parent / "exec_as.c"
# pid 1's image while envd is dormant (dormancy.py).
STUB_SOURCE = Path(__file__).resolve().parent / "envd_stub.c"
# The mounts of filesystem resets, for envd (layers.py).
KEEPER_SOURCE = Path(__file__).resolve().parent / "layer_keeper.c"
# No libc: no start-up code or libraries to fault in under gVisor (see exec_as.c).
EXEC_AS_CFLAGS = ("-static", "-nostdlib", "-fno-pie", "-no-pie", "-Os", "-s", "-ffreestanding",
                  "-fno-builtin", "-fno-stack-protector", "-fno-tree-loop-distribute-patterns",
                  "-fcf-protection=none", "-fno-asynchronous-unwind-tables", "-Wall", "-Werror")


# -- inputs ---------------------------------------------------------------------------
def _envd_sources() -> list[Path]:
    pkg = Path(__file__).resolve().parent
    return [pkg.parent / "__init__.py", *sorted(pkg.glob("*.py"))]


def _module_path(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise RuntimeError(f"envd dependency '{name}' is not installed")
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    assert spec.origin
    return Path(spec.origin)


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def bundle_hash() -> str:
    """Content hash of everything that goes into the bundle."""
    from .protos import source_files

    h = hashlib.sha256()
    h.update(f"format={BUNDLE_FORMAT}\n{sys.version}\n{sys.base_prefix}\n".encode())
    for mod, dist in sorted(SITE_MODULES.items()):
        h.update(f"{mod}={dist}=={_dist_version(dist)}\n".encode())
    for f in [*_envd_sources(), EXEC_AS_SOURCE, STUB_SOURCE, KEEPER_SOURCE, *source_files()]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(f"cc={_compiler()}\n".encode())  # with or without exec-as
    return h.hexdigest()[:20]


# -- helpers --------------------------------------------------------------------------
def _copytree(src: Path, dst: Path, skip=lambda p: False) -> None:
    def ignore(d, names):
        return [n for n in names if n == "__pycache__" or skip(Path(d) / n)]

    shutil.copytree(src, dst, ignore=ignore, symlinks=False, dirs_exist_ok=True)


_LDD_LINE = re.compile(r"^\s*(\S+)\s*=>\s*(\S+)\s*\(0x[0-9a-f]+\)")
_LDD_LOADER = re.compile(r"^\s*(/\S*ld-linux[^\s]*)\s*\(0x[0-9a-f]+\)")


def _ldd(path: Path) -> tuple[dict[str, str], list[str]]:
    """``soname -> resolved path`` for ``path``'s closure, and the unresolved sonames."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
    found: dict[str, str] = {}
    missing: list[str] = []
    for line in out.stdout.splitlines():
        if "=> not found" in line:
            missing.append(line.split()[0])
            continue
        m = _LDD_LINE.match(line)
        if m:
            found[m.group(1)] = m.group(2)
            continue
        m = _LDD_LOADER.match(line)
        if m:
            found[LOADER] = m.group(1)
    return found, missing


def _dist_info_dir(dist: str) -> Path | None:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = getattr(d, "_path", None)
    return Path(path) if path is not None and Path(path).is_dir() else None


def _find_system_lib(name: str) -> Path | None:
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
              "/lib", "/usr/lib"):
        p = Path(d) / name
        if p.exists():
            return p
    return None


def _python_binary() -> Path:
    exe = Path(sys.base_prefix) / "bin" / f"python{PY_VER}"
    if not exe.exists():
        raise RuntimeError(f"no interpreter at {exe}")
    return exe


def _compiler() -> str | None:
    """The C compiler exec-as and envd-stub are built with: x86_64 only (raw system calls)."""
    if os.uname().machine != "x86_64":
        return None
    return shutil.which("cc") or shutil.which("gcc")


def _build_native(source: Path, dest: Path, without: str) -> None:
    """Compile one of envd's libc-free helpers; without a compiler the bundle lacks
    it and envd does ``without``."""
    cc = _compiler()
    if cc is None:
        return
    try:
        subprocess.run([cc, *EXEC_AS_CFLAGS, "-o", str(dest), str(source)],
                       check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning("%s not built, %s: %s %s", dest.name, without,
                    e, err.decode(errors="replace")[-500:])
        with contextlib.suppress(OSError):
            dest.unlink()


# -- build ----------------------------------------------------------------------------
def _build_into(root: Path) -> dict:
    from .protos import write_package

    py_root = root / "python"
    stdlib_src = Path(sysconfig.get_paths(vars={"installed_base": sys.base_prefix,
                                                "base": sys.base_prefix})["stdlib"])
    stdlib = py_root / "lib" / f"python{PY_VER}"
    libdir = root / "lib"
    site = root / "site"
    for d in (py_root / "bin", stdlib, libdir, site):
        d.mkdir(parents=True, exist_ok=True)

    # interpreter, and setpriv for starting commands as other users (see spawn.py)
    shutil.copy2(_python_binary(), py_root / "bin" / f"python{PY_VER}")
    (root / "bin").mkdir()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("setpriv (util-linux) is needed to build the envd bundle")
    shutil.copy2(setpriv, root / "bin" / "setpriv")
    _build_native(EXEC_AS_SOURCE, root / "bin" / "exec-as",
                  "commands as users go through setpriv")  # see spawn.py
    _build_native(STUB_SOURCE, root / "bin" / STUB_NAME, "envd never goes dormant")
    _build_native(KEEPER_SOURCE, root / "bin" / "layer-keeper",
                  "resets in filesystem mode are full ones")
    _write_sudo(root / "bin" / "sudo")

    # stdlib (trimmed) and its extension modules
    for entry in sorted(stdlib_src.iterdir()):
        if entry.name in STDLIB_EXCLUDE or entry.name.startswith("config-"):
            continue
        if entry.name == "lib-dynload":
            continue
        if entry.is_dir():
            _copytree(entry, stdlib / entry.name)
        elif entry.suffix == ".py":
            shutil.copy2(entry, stdlib / entry.name)
    dynload = stdlib / "lib-dynload"
    dynload.mkdir()
    for so in sorted((stdlib_src / "lib-dynload").glob("*.so")):
        if not DYNLOAD_EXCLUDE.match(so.name):
            shutil.copy2(so, dynload / so.name)

    # site dir: dependencies, envd itself, the relocated protocol modules
    for mod in SITE_MODULES:
        src = _module_path(mod)
        if src.is_dir():
            _copytree(src, site / src.name, skip=lambda p: p.suffix == ".pyi")
        else:
            shutil.copy2(src, site / src.name)
    for dist in set(SITE_MODULES.values()):  # metadata: some read their own version
        info = _dist_info_dir(dist)
        if info is not None:
            _copytree(info, site / info.name)
    _pin_connectrpc_version(site / "connectrpc" / "_version.py")
    envd_src = Path(__file__).resolve().parent
    (site / "agentenv").mkdir()
    shutil.copy2(envd_src.parent / "__init__.py", site / "agentenv" / "__init__.py")
    _copytree(envd_src, site / "agentenv" / "envd")
    write_package(site)

    # shared libraries: the full ldd closure of the interpreter and every extension
    libs: dict[str, str] = {}
    objects = [py_root / "bin" / f"python{PY_VER}", root / "bin" / "setpriv",
               *dynload.glob("*.so"), *site.rglob("*.so")]
    for obj in objects:
        found, missing = _ldd(obj)
        if missing:
            mod = obj.name.split(".")[0]
            if obj.parent == dynload and mod not in REQUIRED_DYNLOAD:
                obj.unlink()  # optional module whose libraries this host lacks
                continue
            raise RuntimeError(f"{obj.name}: missing shared libraries {missing}")
        libs.update(found)
    for extra in EXTRA_LIBS:
        p = _find_system_lib(extra)
        if p is not None:
            libs.setdefault(extra, str(p))
    if LOADER not in libs:
        raise RuntimeError("ldd did not report the dynamic loader")
    for soname, path in sorted(libs.items()):
        shutil.copy2(os.path.realpath(path), libdir / soname)
    _strip(libdir.glob("*.so*"), root / "bin" / "setpriv", *dynload.glob("*.so"),
           *site.rglob("*.so"))

    # byte-compile everything; hash-based pycs stay valid whatever the mtimes
    for tree in (stdlib, site):
        ok = compileall.compile_dir(
            str(tree), quiet=2, workers=0,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        if not ok:
            raise RuntimeError(f"byte-compiling {tree} failed")

    return {
        "format": BUNDLE_FORMAT,
        "python": sys.version.split()[0],
        "packages": {d: _dist_version(d) for d in SITE_MODULES.values()},
        "libs": sorted(libs),
    }


def _pin_connectrpc_version(path: Path) -> None:
    """connectrpc reads its own version through ``importlib.metadata`` at import, which
    imports email, zipfile and csv: ~2 MB of every idle envd's memory. The bundle holds
    one known version, so it is written in as a constant (a file of another shape is
    left alone)."""
    expected = 'from importlib.metadata import version\n\n__version__ = version("connectrpc")\n'
    if path.is_file() and path.read_text().endswith(expected):
        version = _dist_version("connectrpc")
        path.write_text(f'"""Pinned by the envd bundle."""\n\n__version__ = {version!r}\n')


def _strip(*groups) -> None:
    """Drop symbols from the bundle's binaries: every byte is read through gVisor's
    file layer at each sandbox's start (libpython alone shrinks from 23 to 5 MB)."""
    strip = shutil.which("strip")
    if strip is None:
        return
    files: list[str] = []
    for group in groups:
        files += [str(p) for p in ([group] if isinstance(group, Path) else group)]
    if files:
        subprocess.run([strip, "--strip-unneeded", *files], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def build_bundle(dest_root: Path) -> Path:
    """Build (idempotently) the envd runtime bundle into ``dest_root/<hash>/``.

    The directory name is a content hash of envd's source, the interpreter and
    the pinned dependency versions; an existing complete bundle is reused. The
    tree is assembled in a temporary directory and renamed into place, so a
    reader never sees a partial bundle.
    """
    dest_root = Path(dest_root)
    h = bundle_hash()
    final = dest_root / h
    if (final / "BUNDLE.json").exists():
        return final
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{h}.tmp-", dir=dest_root))
    try:
        manifest = _build_into(tmp)
        manifest["hash"] = h
        (tmp / "BUNDLE.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "BUNDLE.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent build won
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_sudo(path: Path, mp: str = "/.aenv") -> None:
    """The ``sudo`` templates link to (see envd/sudo.py): the bundle's interpreter runs
    the client; the caller's own PYTHONHOME is saved for the command sudo runs."""
    path.write_text(
        "#!/bin/sh\n"
        "# sudo under gVisor: envd runs the real sudo as root (agentenv.envd.sudo).\n"
        '[ -n "${PYTHONHOME+x}" ] && export AENV_SUDO_SAVED_PYTHONHOME="$PYTHONHOME"\n'
        'case "$0" in *sudoedit) set -- -e "$@" ;; esac\n'
        f'PYTHONHOME={mp}/python exec {mp}/lib/{LOADER} --library-path {mp}/lib '
        f'{mp}/python/bin/python{PY_VER} -S -c '
        f'"import sys; sys.path.insert(0, \'{mp}/site\'); '
        'from agentenv.envd.sudo_client import main; sys.exit(main())" "$@"\n')
    path.chmod(0o755)


def envd_command(mount_point: str = "/.aenv", port: int = 49983
                 ) -> tuple[list[str], dict[str, str]]:
    """argv and environment that start envd from a bundle mounted at ``mount_point``.

    The interpreter is started through the bundle's own dynamic loader with an
    explicit library path (a loader flag, not ``LD_LIBRARY_PATH``), and the
    ``PYTHON*`` variables point only into the bundle. envd builds every child
    process's environment from scratch, so none of this reaches user commands.
    """
    mp = mount_point.rstrip("/") or "/"
    argv = [
        f"{mp}/lib/{LOADER}", "--library-path", f"{mp}/lib",
        # -S: no site module; PYTHONPATH names every directory envd imports from.
        f"{mp}/python/bin/python{PY_VER}", "-S", "-m", "agentenv.envd", "--port", str(port),
    ]
    env = {
        "PYTHONHOME": f"{mp}/python",
        "PYTHONPATH": f"{mp}/site",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "PYTHONUTF8": "1",
        "PATH": DEFAULT_PATH,
    }
    return argv, env


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m agentenv.envd.bundle DEST_ROOT", file=sys.stderr)
        raise SystemExit(2)
    print(build_bundle(Path(args[0])))


if __name__ == "__main__":
    main()
