"""Cached root file systems and volume images for the testbed: build once, reuse everywhere.

`base_root()` is a debootstrapped Debian root (minbase plus packages), `torch_root()` adds torch,
numpy, the `spottrainer` package and a `trainer` user to it, and `torch_image()` is that root as
an ext4 image ready to be a pool volume's snapshot (`World.make_snapshot`). `fs_image()` turns
any directory into such an image.

Everything lands in one cache directory (env SPOTAGENT_CACHE, default /var/cache/spotagent),
outside the repository so reruns and fresh clones on the same machine reuse it. Each entry is
named by a hash of everything that goes into it (suite, packages, torch and numpy versions, the
spottrainer source files, the recipe version), is built under a temporary name and renamed into
place, so a killed build never leaves a half entry, and is built under a lock file, so two
builds of the same entry wait for each other instead of racing. Entries are read-only by
contract: copy a root (`cp -a --reflink=auto`) before changing it.

Commands run inside a root only through `unshare --mount --pid --fork --mount-proc=ROOT/proc
chroot ROOT ...`: /proc is mounted in a private mount namespace that dies with the command, so
nothing stays mounted on the host even when a build is killed.

The one side effect of this module is the cache directory (and the commands that fill it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from spotagent import subp
from spotagent.errors import SpotagentError

CACHE_ENV = "SPOTAGENT_CACHE"
DEFAULT_CACHE = Path("/var/cache/spotagent")
DEFAULT_SUITE = "bookworm"
FALLBACK_MIRROR = "http://deb.debian.org/debian"
# Bump when the recipe changes in a way the inputs below do not show.
RECIPE = 1

TORCH_VERSION = "2.13.0"
NUMPY_VERSION = "2.4.6"
TORCH_DEBS = ("python3",)
TRAINER_USER = "trainer"
TRAINER_UID = 1000
CHECKPOINT_DIR = "/var/lib/spotagent/checkpoints"
LOG_DIR = "/var/log/spotagent"
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
# Free space an image keeps beyond its content (checkpoints, logs, ext4 metadata).
HEADROOM = 0.30
MIN_IMAGE_MIB = 64
# Torch roots and images kept per suite (each spottrainer change makes a new pair).
KEEP_TORCH = 3

CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEBOOTSTRAP_TIMEOUT = 1800.0
PIP_TIMEOUT = 1800.0
MKFS_TIMEOUT = 1800.0

Progress = Callable[[str], None]


class ImageBuildError(SpotagentError):
    """A root file system or an image could not be built (the cache is left without it)."""


def _stderr(line: str) -> None:
    sys.stderr.write(f"[images] {line}\n")
    sys.stderr.flush()


# --- the cache ----------------------------------------------------------------------------------


def cache_dir(cache: Path | None = None) -> Path:
    """The cache directory: `cache`, else $SPOTAGENT_CACHE, else /var/cache/spotagent."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else DEFAULT_CACHE


def cache_key(inputs: Mapping[str, Any]) -> str:
    """A short stable hash of `inputs` (JSON-serialisable; key order does not matter)."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached(cache: Path, name: str, build: Callable[[Path], None], *,
           progress: Progress = _stderr) -> Path:
    """Return `cache/name`, building it first with `build(tmp)` if it is missing.

    `build` must create `tmp` (a file or a directory); on success it is renamed to `name`,
    on any failure it is removed and nothing is published. A lock file serialises builders of
    the same entry; temporary leftovers of a killed build are removed under that lock.
    """
    final = cache / name
    if final.exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with _lock(cache, name, progress):
        if final.exists():      # another process built it while we waited
            return final
        for stale in cache.glob(f".{name}.tmp-*"):
            # We hold the lock, so its builder is dead; debootstrap mounts /proc and /sys in
            # its target while it works, and a killed one leaves them mounted.
            progress(f"removing {stale.name} (left by a killed build)")
            _unmount_under(stale)
            _remove(stale)
        tmp = cache / f".{name}.tmp-{os.getpid()}"
        try:
            build(tmp)
            if not tmp.exists():
                raise ImageBuildError("build produced nothing", entry=name)
            os.rename(tmp, final)
        except BaseException:
            _remove(tmp)
            raise
    return final


@contextlib.contextmanager
def _lock(cache: Path, name: str, progress: Progress) -> Iterator[None]:
    locks = cache / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{name}.lock", "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another build of {name}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    """Remove a temporary entry; refuse (loudly) to descend into anything still mounted."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink():
        busy = mounts_under(path)
        if busy:
            raise ImageBuildError("temporary build directory has mounts; not removing it",
                                  path=path, mounts=",".join(busy))
        shutil.rmtree(path)
    else:
        path.unlink()


def _unmount_under(path: Path) -> None:
    """Unmount what a dead build left mounted below `path` (deepest first; lazily only when a
    plain unmount is refused: these are /proc, /sys and the like of a throwaway root)."""
    for mp in sorted(mounts_under(path), key=lambda m: m.count("/"), reverse=True):
        res = subp.run(["umount", mp], timeout=60, check=False)
        if res.returncode != 0:
            subp.run(["umount", "-l", mp], timeout=60, check=False)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this mount namespace."""
    real = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if mp == real or mp.startswith(real + "/"):
                found.append(mp)
    return found


class _Step:
    """One long step: a line when it starts and one with the elapsed seconds when it ends."""

    def __init__(self, progress: Progress, what: str) -> None:
        self.progress = progress
        self.what = what

    def __enter__(self) -> _Step:
        self.t0 = time.monotonic()
        self.progress(f"{self.what} ...")
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        took = time.monotonic() - self.t0
        self.progress(f"{self.what}: {'done' if exc_type is None else 'FAILED'} in {took:.1f} s")


# --- the Debian mirror ------------------------------------------------------------------------


def debian_mirror(suite: str = DEFAULT_SUITE, etc_apt: Path = Path("/etc/apt")) -> str:
    """The host's Debian mirror for `suite` from its apt sources, else deb.debian.org.

    Reads `sources.list` and `sources.list.d/*.list` (one-line format) and
    `sources.list.d/*.sources` (deb822), in apt's order; the first enabled `deb` entry that
    lists `suite` itself (not `suite-updates` or `suite-security`) wins.
    """
    for uri, suites in _apt_entries(etc_apt):
        if suite in suites and uri.startswith(("http://", "https://", "file:/")):
            return uri.rstrip("/")
    return FALLBACK_MIRROR


def _apt_entries(etc_apt: Path) -> Iterator[tuple[str, list[str]]]:
    files = [etc_apt / "sources.list"]
    d = etc_apt / "sources.list.d"
    if d.is_dir():
        files += sorted(p for p in d.iterdir() if p.suffix in (".list", ".sources"))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if path.suffix == ".sources":
            yield from _deb822_entries(text)
        else:
            yield from _one_line_entries(text)


def _one_line_entries(text: str) -> Iterator[tuple[str, list[str]]]:
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        line = re.sub(r"\[[^\]]*\]", " ", line)     # [arch=amd64 signed-by=...]
        fields = line.split()
        if len(fields) >= 3 and fields[0] == "deb":
            yield fields[1], [fields[2]]


def _deb822_entries(text: str) -> Iterator[tuple[str, list[str]]]:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for raw in stanza.splitlines():
            if raw.startswith("#"):
                continue
            if raw[:1] in (" ", "\t") and key is not None:
                fields[key] += " " + raw.strip()
                continue
            name, sep, value = raw.partition(":")
            if sep:
                key = name.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").strip().lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        for uri in fields.get("uris", "").split():
            yield uri, suites


# --- roots ------------------------------------------------------------------------------------


def base_root(include: Sequence[str] = (), *, suite: str = DEFAULT_SUITE,
              cache: Path | None = None, mirror: str | None = None,
              progress: Progress = _stderr) -> Path:
    """A Debian `suite` root (debootstrap --variant=minbase plus `include`), cached.

    The directory is shared: treat it as read-only and copy it before changing it. The key is
    the suite, the sorted package list, the architecture and the recipe version (the mirror is
    where the packages come from, not what goes in, so it is not part of the key).
    """
    cache = cache_dir(cache)
    packages = sorted(set(include))
    arch = _dpkg_arch()
    key = cache_key({"what": "base", "recipe": RECIPE, "suite": suite, "include": packages,
                     "arch": arch, "variant": "minbase"})
    name = f"base-{suite}-{key}"

    def build(tmp: Path) -> None:
        url = mirror or debian_mirror(suite)
        extra = f" +{','.join(packages)}" if packages else ""
        argv = ["debootstrap", "--variant=minbase", f"--arch={arch}"]
        if packages:
            argv.append(f"--include={','.join(packages)}")
        argv += [suite, str(tmp), url]
        with _Step(progress, f"debootstrap {suite} minbase{extra} from {url}"):
            tmp.mkdir(mode=0o755)
            subp.run(argv, timeout=DEBOOTSTRAP_TIMEOUT)
        for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()

    return cached(cache, name, build, progress=progress)


def trainer_sources() -> list[Path]:
    """The files of the `spottrainer` package (located without importing it: no torch here)."""
    spec = importlib.util.find_spec("spottrainer")
    if spec is None or not spec.submodule_search_locations:
        raise ImageBuildError("cannot find the spottrainer package")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    return sorted(p for p in pkg.iterdir()
                  if p.is_file() and (p.suffix == ".py" or p.name == "py.typed"))


def _sources_digest(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def torch_key(*, suite: str = DEFAULT_SUITE, torch: str = TORCH_VERSION,
              numpy: str = NUMPY_VERSION, sources: Sequence[Path] | None = None) -> str:
    """The cache key of the torch root and image: every input that goes into them."""
    files = trainer_sources() if sources is None else list(sources)
    return cache_key({"what": "torch", "recipe": RECIPE, "suite": suite, "debs": list(TORCH_DEBS),
                      "arch": _dpkg_arch(), "torch": torch, "numpy": numpy,
                      "platform": WHEEL_PLATFORM, "user": [TRAINER_USER, TRAINER_UID],
                      "checkpoint_dir": CHECKPOINT_DIR, "spottrainer": _sources_digest(files)})


def wheels(*, python: str, torch: str = TORCH_VERSION, numpy: str = NUMPY_VERSION,
           cache: Path | None = None, progress: Progress = _stderr) -> Path:
    """A directory of wheels (torch, numpy and their dependencies) for CPython `python`,
    downloaded on the host with the host's pip configuration (its index, its find-links and
    its certificates), cached."""
    cache = cache_dir(cache)
    abi = "cp" + python.replace(".", "")
    key = cache_key({"what": "wheels", "recipe": RECIPE, "python": python, "torch": torch,
                     "numpy": numpy, "platform": WHEEL_PLATFORM})
    name = f"wheels-{abi}-{key}"

    def build(tmp: Path) -> None:
        tmp.mkdir()
        with _Step(progress, f"pip download torch=={torch} numpy=={numpy} for {abi}"):
            subp.run([sys.executable, "-m", "pip", "download", "--quiet",
                      "--only-binary=:all:", "--platform", WHEEL_PLATFORM,
                      "--python-version", python, "--implementation", "cp", "--abi", abi,
                      "--dest", str(tmp), f"torch=={torch}", f"numpy=={numpy}"],
                     timeout=PIP_TIMEOUT)

    return cached(cache, name, build, progress=progress)


def torch_root(*, suite: str = DEFAULT_SUITE, cache: Path | None = None,
               progress: Progress = _stderr) -> Path:
    """A deep-learning root: Debian `suite` with python3, torch (CPU) and numpy, the
    spottrainer package, a `trainer` user (uid 1000) and its checkpoint directory. Cached."""
    cache = cache_dir(cache)
    sources = trainer_sources()
    key = torch_key(suite=suite, sources=sources)
    name = f"torch-root-{suite}-{key}"
    if (cache / name).exists():
        os.utime(cache / name)   # used: `prune` keeps the entries used last
        return cache / name
    base = base_root(TORCH_DEBS, suite=suite, cache=cache, progress=progress)
    python = _root_python(base)

    def build(tmp: Path) -> None:
        with _Step(progress, "copy the base root"):
            subp.run(["cp", "-a", "--reflink=auto", str(base), str(tmp)], timeout=600)
        site_in_root = f"/usr/local/lib/python{python}/dist-packages"
        site = tmp / site_in_root.lstrip("/")
        site.mkdir(parents=True, exist_ok=True)
        wheel_dir = wheels(python=python, cache=cache, progress=progress)
        with _Step(progress, f"install torch {TORCH_VERSION} and numpy into the root"):
            subp.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                      "--find-links", str(wheel_dir), "--only-binary=:all:",
                      "--platform", WHEEL_PLATFORM, "--python-version", python,
                      "--implementation", "cp", "--abi", "cp" + python.replace(".", ""),
                      "--no-compile", "--no-warn-script-location",
                      "--target", str(site), f"torch=={TORCH_VERSION}",
                      f"numpy=={NUMPY_VERSION}"], timeout=PIP_TIMEOUT)
            # --target leaves console scripts whose #! names the host's python: not ours.
            shutil.rmtree(site / "bin", ignore_errors=True)
        pkg = site / "spottrainer"
        pkg.mkdir()
        for src in sources:
            shutil.copy2(src, pkg / src.name)
        for d in (site, pkg):
            d.chmod(0o755)
        with _Step(progress, "compile bytecode, add the trainer user, check imports"):
            # Exit 1 = some files did not compile: torch ships a few that are not meant to
            # (templates, code for other Python versions); the import check below is the test.
            in_root(tmp, ["python3", "-m", "compileall", "-q", "-j", "0", site_in_root],
                    timeout=1200, ok_codes=(0, 1))
            in_root(tmp, ["useradd", "--uid", str(TRAINER_UID), "--user-group",
                          "--create-home", "--shell", "/bin/bash", TRAINER_USER])
            for owned in (CHECKPOINT_DIR, LOG_DIR):
                path = tmp / owned.lstrip("/")
                path.mkdir(parents=True, exist_ok=True)
                os.chown(path, TRAINER_UID, TRAINER_UID)
                path.chmod(0o755)
            out = in_root(tmp, ["python3", "-c", "import torch, numpy, spottrainer.train; "
                                "print(torch.__version__, numpy.__version__)"],
                          user=TRAINER_UID, timeout=300).stdout.split()
            if not out or not out[0].startswith(TORCH_VERSION):
                raise ImageBuildError("the root's torch is not the expected one",
                                      expected=TORCH_VERSION, found=" ".join(out))
        for junk in ("var/lib/apt/lists", "var/cache/apt"):
            for p in (tmp / junk).glob("*"):
                if p.is_file():
                    p.unlink()

    return cached(cache, name, build, progress=progress)


def torch_image(*, suite: str = DEFAULT_SUITE, cache: Path | None = None,
                progress: Progress = _stderr) -> Path:
    """`torch_root()` as an ext4 image (content + 30 % headroom, sparse), cached by the same
    key. Pool volumes made from it (`World.make_snapshot`) start as copies of it."""
    cache = cache_dir(cache)
    key = torch_key(suite=suite)
    name = f"torch-{suite}-{key}.img"
    image = cache / name
    if not image.exists():
        root = torch_root(suite=suite, cache=cache, progress=progress)
        image = fs_image(root, name, cache=cache, progress=progress)
        os.utime(root)
    os.utime(image)
    # Every change to spottrainer makes a new root and image (2.5 GB together): keep the ones
    # used last, so a machine where the trainer is being worked on does not fill up.
    prune(cache, f"torch-{suite}-", keep=KEEP_TORCH, progress=progress)
    prune(cache, f"torch-root-{suite}-", keep=KEEP_TORCH, progress=progress)
    return image


def prune(cache: Path, prefix: str, *, keep: int, progress: Progress = _stderr) -> list[str]:
    """Remove all but the `keep` most recently used entries named `prefix...` (use = mtime,
    touched by their getters). An entry being built or used under its lock is skipped."""
    (cache / ".locks").mkdir(parents=True, exist_ok=True)
    entries = sorted((p for p in cache.glob(f"{prefix}*") if not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    for old in entries[keep:]:
        lock = cache / ".locks" / f"{old.name}.lock"
        with open(lock, "a+b") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                progress(f"removing {old.name} (not used lately; keeping {keep})")
                _remove(old)
                removed.append(old.name)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    return removed


def fs_image(root: Path, name: str, *, cache: Path | None = None, headroom: float = HEADROOM,
             progress: Progress = _stderr) -> Path:
    """An ext4 image `cache/name` holding the directory `root` (mkfs.ext4 -d: no mount),
    sized to its content plus `headroom`. Cached under `name`: the caller keys the name."""
    cache = cache_dir(cache)
    root = Path(root)

    def build(tmp: Path) -> None:
        if not root.is_dir():
            raise ImageBuildError("image source is not a directory", root=root)
        size_mib = image_size_mib(content_bytes(root), headroom)
        with _Step(progress, f"mkfs.ext4 -d {root.name} ({size_mib} MiB, sparse)"):
            with open(tmp, "xb") as f:
                f.truncate(size_mib * 1024 * 1024)
            subp.run(["mkfs.ext4", "-q", "-F", "-L", "spotagent", "-d", str(root), str(tmp)],
                     timeout=MKFS_TIMEOUT)

    return cached(cache, name, build, progress=progress)


def content_bytes(root: Path) -> int:
    """Roughly what `root` takes in an ext4 file system: 4 KiB blocks plus an inode each."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            total += 256  # the inode
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                total += -(-st.st_size // 4096) * 4096
            elif stat.S_ISDIR(st.st_mode):
                total += 4096
    return total


def image_size_mib(content: int, headroom: float = HEADROOM) -> int:
    """Image size for `content` bytes: plus `headroom`, plus room for ext4's own metadata."""
    mib = math.ceil(content * (1 + headroom) / (1024 * 1024))
    return max(MIN_IMAGE_MIB, mib + 32 + mib // 50)


# --- commands inside a root -------------------------------------------------------------------


def in_root(root: Path, argv: Sequence[str], *, user: int | None = None,
            timeout: float = 600.0, ok_codes: Sequence[int] = (0,)) -> subp.Result:
    """Run `argv` chrooted in `root` with /proc mounted in a private mount namespace that
    ends with the command (nothing to unmount afterwards, even if we are killed)."""
    chroot = ["chroot"]
    home = "/root"
    if user is not None:
        chroot.append(f"--userspec={user}:{user}")
        home = "/"
    env = {"PATH": CHROOT_PATH, "LANG": "C.UTF-8", "HOME": home}
    return subp.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork",
                     f"--mount-proc={root}/proc", *chroot, str(root), *argv],
                    env=env, timeout=timeout, ok_codes=ok_codes)


def _root_python(root: Path) -> str:
    """The X.Y of the root's python3 (from its stdlib directory: no need to run it)."""
    found = sorted(p.name[len("python"):] for p in (root / "usr/lib").glob("python3.*")
                   if re.fullmatch(r"python3\.\d+", p.name) and (p / "os.py").exists())
    if not found:
        raise ImageBuildError("no python3 in the root", root=root)
    return found[-1]


def _dpkg_arch() -> str:
    try:
        return subp.run(["dpkg", "--print-architecture"], timeout=30).stdout.strip()
    except SpotagentError:
        return os.uname().machine
