"""The trainer's environment: bind mounts into the root on the volume, and undoing them.

Besides the mounts this module answers the questions asked of a root before the trainer starts,
always from inside the root (never from the host): who is the trainer user (the root's own
/etc/passwd and /etc/group), where does the command resolve (symlinks followed relative to the
root), is the checkpoint directory writable by that user, and does the host's NVIDIA driver
satisfy the CUDA version the root was built with.

Mounts, in order (see docs/runtime.md):

    <root>/proc             fresh proc      nosuid,nodev,noexec, private
    <root>/sys              bind /sys       slave
    <root>/dev              bind /dev       slave  (GPU nodes /dev/nvidia* come with it)
    <root>/dev/pts          bind /dev/pts   slave
    <root>/dev/shm          bind /dev/shm   slave
    <root>/etc/resolv.conf  bind host file  slave
    <root>/run/spotagent    bind control    slave  (SPOTAGENT_CONTROL_DIR)

Binds are non-recursive and each is made a slave right after it is made: host-side mount
events still reach the chroot, but nothing done under the root (above all the unmounts at
teardown) propagates back to the host's /dev or /sys. Teardown reads /proc/self/mountinfo, so
it also removes what a crashed agent left behind.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from spotagent import subp
from spotagent.errors import SpotagentError, SubprocessError
from spotagent.log import get_logger

log = get_logger("chroot")

CONTROL_DIR_IN_ROOT = "/run/spotagent"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
MOUNT_TIMEOUT = 30.0
MAX_SYMLINKS = 40


# --- errors -------------------------------------------------------------------------------------


class ChrootError(SpotagentError):
    """The environment cannot be prepared, used or torn down."""


class NotARootError(ChrootError):
    """The directory does not look like a root file system."""


class UserNotFoundError(ChrootError):
    """The trainer user is not in the root's /etc/passwd."""


class RootUserRefusedError(ChrootError):
    """The trainer would run as uid 0."""


class CommandNotFoundError(ChrootError):
    """argv[0] (or its #! interpreter) does not resolve inside the root."""


class CommandNotExecutableError(ChrootError):
    """argv[0] resolves inside the root but the trainer user may not execute it."""


class CheckpointDirError(ChrootError):
    """The checkpoint directory cannot be created or is not writable by the trainer user."""


class ChrootMountError(ChrootError):
    """A mount of the environment failed."""


class ChrootTeardownError(ChrootError):
    """Mounts are left under the root after teardown (usually: a process still uses them)."""


# --- mountinfo (merge candidate with spotagent.mounts) ------------------------------------------


@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/<pid>/mountinfo (proc(5)), escapes decoded."""

    mount_id: int
    parent_id: int
    root: str
    mount_point: str
    options: str
    propagation: tuple[str, ...]
    fstype: str
    source: str


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo (e.g. \\040)."""
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def parse_mountinfo(data: bytes) -> list[MountInfo]:
    """Parse mountinfo text; malformed lines are skipped (the kernel writes none)."""
    entries: list[MountInfo] = []
    for line in data.splitlines():
        fields = line.split(b" ")
        try:
            sep = fields.index(b"-", 6)
            entries.append(MountInfo(
                mount_id=int(fields[0]),
                parent_id=int(fields[1]),
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=fields[5].decode(),
                propagation=tuple(f.decode() for f in fields[6:sep]),
                fstype=fields[sep + 1].decode(),
                source=_unescape(fields[sep + 2]),
            ))
        except (ValueError, IndexError):
            continue
    return entries


def read_mountinfo(path: Path = PROC_MOUNTINFO) -> list[MountInfo]:
    return parse_mountinfo(path.read_bytes())


def _canonical_root(root: Path) -> Path:
    resolved = Path(os.path.realpath(root))
    if resolved == Path("/"):
        raise ChrootError("refusing to use / as the chroot root", root=root)
    return resolved


def _mounts_beneath(root: Path, entries: Sequence[MountInfo]) -> list[MountInfo]:
    """Mounts strictly beneath `root`, children before parents, newest first among siblings.

    The mount at `root` itself is not included: it is the volume (spotagent.mounts owns it).
    """
    prefix = str(root).rstrip("/") + "/"
    below = [e for e in entries if e.mount_point.startswith(prefix)]
    ordered: list[MountInfo] = []
    while below:
        parents = {e.parent_id for e in below}
        leaves = [e for e in below if e.mount_id not in parents]
        if not leaves:   # a cycle cannot happen in one snapshot; never loop forever
            leaves = below[:]
        leaves.sort(key=lambda e: e.mount_id, reverse=True)
        ordered.extend(leaves)
        gone = {id(e) for e in leaves}
        below = [e for e in below if id(e) not in gone]
    return ordered


def leftover_mounts(root: Path, *, mountinfo: Path = PROC_MOUNTINFO) -> list[Path]:
    """Mount points beneath `root`, in the order they must be unmounted (deepest first)."""
    canonical = _canonical_root(root)
    return [Path(e.mount_point) for e in _mounts_beneath(canonical, read_mountinfo(mountinfo))]


def unmount_beneath(root: Path, *, lazy: bool = False,
                    mountinfo: Path = PROC_MOUNTINFO) -> None:
    """Unmount everything beneath `root`, children first; idempotent.

    A busy mount raises ChrootTeardownError naming what is left, unless `lazy`: then it is
    detached with `umount --lazy` (and the volume stays busy until its last user exits).
    """
    canonical = _canonical_root(root)
    failures: dict[str, str] = {}
    for entry in _mounts_beneath(canonical, read_mountinfo(mountinfo)):
        try:
            subp.run(["umount", entry.mount_point], timeout=MOUNT_TIMEOUT)
        except SubprocessError as exc:
            if not lazy:
                failures[entry.mount_point] = str(exc.context.get("stderr", exc))
                continue
            log.warning("chroot_unmount_lazy", mount_point=entry.mount_point,
                        error=str(exc.context.get("stderr", exc)))
            try:
                subp.run(["umount", "--lazy", entry.mount_point], timeout=MOUNT_TIMEOUT)
            except SubprocessError as exc2:
                failures[entry.mount_point] = str(exc2.context.get("stderr", exc2))
                continue
        log.info("chroot_unmounted", mount_point=entry.mount_point, fstype=entry.fstype)
    left = [e.mount_point for e in _mounts_beneath(canonical, read_mountinfo(mountinfo))]
    if left:
        first = next(iter(failures.items()), ("", ""))
        raise ChrootTeardownError(
            "mounts left beneath the chroot root", root=canonical, mounts=",".join(left),
            failed=first[0], error=first[1])


# --- paths inside the root ----------------------------------------------------------------------


def resolve_in_root(root: Path, path: str, *, follow_last: bool = True) -> Path:
    """The host path that `path` names for a process chrooted at `root`.

    Symlinks are followed as the chroot sees them: absolute targets restart at `root`, and
    `..` never climbs above it. Components that do not exist are kept as they are, so the
    result may name something to be created. The result contains no symlink up to the first
    missing component.
    """
    if not path.startswith("/"):
        raise ChrootError("path inside the chroot must be absolute", path=path)
    pending = deque(p for p in path.split("/") if p not in ("", "."))
    resolved: list[str] = []
    links = 0
    while pending:
        name = pending.popleft()
        if name == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, name)
        if (pending or follow_last) and candidate.is_symlink():
            links += 1
            if links > MAX_SYMLINKS:
                raise ChrootError("too many levels of symbolic links inside the chroot",
                                  path=path, root=root)
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            pending.extendleft(reversed([p for p in target.split("/") if p not in ("", ".")]))
            continue
        resolved.append(name)
    return root.joinpath(*resolved)


def looks_like_root(root: Path) -> None:
    """Raise NotARootError unless `root` has /etc/passwd and a /bin or /usr/bin."""
    if not root.is_dir():
        raise NotARootError("chroot root is not a directory", root=root)
    passwd = resolve_in_root(root, "/etc/passwd")
    if not passwd.is_file():
        raise NotARootError("not a root file system: no /etc/passwd", root=root,
                            missing=passwd)
    if not any(resolve_in_root(root, d).is_dir() for d in ("/bin", "/usr/bin")):
        raise NotARootError("not a root file system: no /bin or /usr/bin", root=root)


# --- users --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]   # supplementary groups, primary gid not repeated
    home: str


def _colon_records(path: Path, width: int) -> Iterable[list[str]]:
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line or line.startswith(("#", "+", "-")):
            continue
        fields = line.split(":")
        if len(fields) >= width:
            yield fields


def lookup_user(root: Path, name: str) -> TrainerUser:
    """Resolve `name` in the root's /etc/passwd and /etc/group (never the host's).

    Refuses uid 0: the trainer never runs as root.
    """
    passwd = resolve_in_root(root, "/etc/passwd")
    group = resolve_in_root(root, "/etc/group")
    if not passwd.is_file():
        raise NotARootError("not a root file system: no /etc/passwd", root=root,
                            missing=passwd)
    for fields in _colon_records(passwd, 7):
        if fields[0] != name:
            continue
        try:
            uid, gid = int(fields[2]), int(fields[3])
        except ValueError as exc:
            raise UserNotFoundError("malformed passwd entry for the trainer user",
                                    user=name, passwd=passwd) from exc
        if uid == 0:
            raise RootUserRefusedError("refusing to run the trainer as root (uid 0)",
                                       user=name, passwd=passwd)
        extra: list[int] = []
        if group.is_file():
            for gfields in _colon_records(group, 4):
                members = [m.strip() for m in gfields[3].split(",")]
                try:
                    g = int(gfields[2])
                except ValueError:
                    continue
                if name in members and g != gid and g not in extra:
                    extra.append(g)
        return TrainerUser(name=name, uid=uid, gid=gid, groups=tuple(extra), home=fields[5])
    raise UserNotFoundError("trainer user not found in the chroot's passwd", user=name,
                            passwd=passwd)


def _permits(st: os.stat_result, user: TrainerUser, want: int) -> bool:
    """Classic mode-bit check for `user` (want: bitmask of 4=r, 2=w, 1=x); ACLs ignored."""
    if st.st_uid == user.uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid == user.gid or st.st_gid in user.groups:
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    return bits & want == want


def _searchable_ancestors(root: Path, host_path: Path, user: TrainerUser) -> Path | None:
    """First directory from `root` down to host_path's parent the user cannot traverse."""
    current = root
    for part in host_path.relative_to(root).parts[:-1]:
        if not _permits(current.stat(), user, 1):
            return current
        current = current / part
    if not _permits(current.stat(), user, 1):
        return current
    return None


# --- commands -----------------------------------------------------------------------------------


def _candidates(argv0: str, search_path: str, cwd: str) -> list[str]:
    if "/" in argv0:
        return [argv0 if argv0.startswith("/") else os.path.join(cwd, argv0)]
    return [f"{d.rstrip('/')}/{argv0}" for d in search_path.split(":") if d.startswith("/")]


def resolve_command(root: Path, argv0: str, *, search_path: str = DEFAULT_PATH,
                    cwd: str = "/", user: TrainerUser | None = None) -> str:
    """The path inside the root that exec would run for `argv0`, with its #! interpreter checked.

    With `user`, also checks that the user may execute it (mode bits, and search permission on
    every directory on the way).
    """
    if not argv0:
        raise CommandNotFoundError("empty command", root=root)
    for inside in _candidates(argv0, search_path, cwd):
        host = resolve_in_root(root, inside)
        if not host.is_file():
            continue
        st = host.stat()
        if st.st_mode & 0o111 == 0:
            raise CommandNotExecutableError("command is not executable", command=argv0,
                                            path=inside, root=root)
        if user is not None:
            blocked = _searchable_ancestors(root, host, user)
            if blocked is not None or not _permits(st, user, 1):
                raise CommandNotExecutableError(
                    "trainer user may not execute the command", command=argv0, path=inside,
                    user=user.name, blocked=blocked or host, root=root)
        _check_interpreter(root, host, inside, search_path)
        return inside
    raise CommandNotFoundError("command not found inside the chroot", command=argv0, root=root,
                               PATH=search_path if "/" not in argv0 else "-")


def _check_interpreter(root: Path, host: Path, inside: str, search_path: str) -> None:
    try:
        with host.open("rb") as f:
            head = f.read(256)
    except OSError as exc:
        raise CommandNotExecutableError("command cannot be read", path=inside,
                                        root=root) from exc
    if not head.startswith(b"#!"):
        return
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words:
        raise CommandNotExecutableError("empty #! line", path=inside, root=root)
    interpreter = words[0]
    if not resolve_in_root(root, interpreter).is_file():
        raise CommandNotFoundError("interpreter of the command not found inside the chroot",
                                   command=inside, interpreter=interpreter, root=root)
    if os.path.basename(interpreter) == "env":
        program = next((w for w in words[1:] if not w.startswith("-")), None)
        if program is not None and "=" not in program:
            resolve_command(root, program, search_path=search_path)


# --- GPUs ---------------------------------------------------------------------------------------

# CUDA toolkit (major, minor) -> minimum Linux x86_64 driver of its GA release (NVIDIA's
# "CUDA Toolkit and Corresponding Driver Versions" table).
CUDA_MIN_DRIVER: dict[tuple[int, int], str] = {
    (10, 0): "410.48", (10, 1): "418.39", (10, 2): "440.33",
    (11, 0): "450.36.06", (11, 1): "455.23", (11, 2): "460.27.03", (11, 3): "465.19.01",
    (11, 4): "470.42.01", (11, 5): "495.29.05", (11, 6): "510.39.01", (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06",
    (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
}
# Below the toolkit's own minimum but at or above this, "minor version compatibility" runs most
# applications (no PTX JIT of newer code); below it nothing of that CUDA major runs.
CUDA_MAJOR_FLOOR: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

LIBCUDA_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/nvidia/lib64")

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def parse_driver_version(text: str) -> str | None:
    """From /proc/driver/nvidia/version ("... Kernel Module  535.104.05  ...") or the bare
    version of /sys/module/nvidia/version."""
    m = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text + " ")
    if m:
        return m.group(1)
    bare = text.strip()
    return bare if re.fullmatch(r"\d+\.\d+(?:\.\d+)?", bare) else None


def parse_cuda_version(text: str) -> str | None:
    """From version.json ({"cuda": {"version": "12.2.2"}}) or version.txt
    ("CUDA Version 11.0.228")."""
    try:
        doc = json.loads(text)
    except ValueError:
        m = re.search(r"CUDA Version\s+(\d+\.\d+(?:\.\d+)?)", text)
        return m.group(1) if m else None
    if isinstance(doc, dict):
        cuda = doc.get("cuda")
        if isinstance(cuda, dict) and isinstance(cuda.get("version"), str):
            return str(cuda["version"])
    return None


def min_driver_for_cuda(cuda_version: str) -> str | None:
    """Minimum driver for a CUDA version (nearest known release at or below it)."""
    m = _VERSION.match(cuda_version)
    if not m:
        return None
    want = (int(m.group(1)), int(m.group(2)))
    known = [k for k in CUDA_MIN_DRIVER if k[0] == want[0] and k <= want]
    return CUDA_MIN_DRIVER[max(known)] if known else None


def driver_at_least(driver: str, required: str) -> bool:
    return _vtuple(driver) >= _vtuple(required)


@dataclass(frozen=True)
class GpuReport:
    gpus: tuple[str, ...]            # PCI bus ids from /proc/driver/nvidia/gpus
    device_nodes: tuple[str, ...]    # /dev/nvidia* (what the bound /dev shows the trainer)
    driver_version: str | None
    cuda_version: str | None         # from the root's /usr/local/cuda
    cuda_min_driver: str | None
    root_libcuda: tuple[str, ...]    # versions of libcuda.so.<version> found in the root
    warnings: tuple[str, ...]

    @property
    def present(self) -> bool:
        return bool(self.gpus or self.driver_version)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


# --- the environment ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mount:
    target: str                 # path inside the root
    source: str | None          # host path to bind, None for a fresh file system
    fstype: str | None = None   # for fresh mounts
    options: str = ""
    is_file: bool = False
    create: bool = True         # False under /dev: never mkdir inside the host's /dev
    optional: bool = False      # skipped when the source does not exist


class Environment:
    """One chroot: its mounts, and the checks made before the trainer starts inside it."""

    def __init__(
        self,
        root: Path,
        *,
        control_dir: Path,
        resolv_conf: Path = Path("/etc/resolv.conf"),
        proc_root: Path = Path("/proc"),
        sys_root: Path = Path("/sys"),
        dev_root: Path = Path("/dev"),
        mountinfo: Path = PROC_MOUNTINFO,
    ) -> None:
        self.root = _canonical_root(root)
        self.control_dir = control_dir
        self.resolv_conf = resolv_conf
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.dev_root = dev_root
        self.mountinfo = mountinfo

    def _plan(self) -> list[_Mount]:
        return [
            _Mount("/proc", None, fstype="proc", options="nosuid,nodev,noexec"),
            _Mount("/sys", "/sys"),
            _Mount("/dev", "/dev"),
            _Mount("/dev/pts", "/dev/pts", create=False, optional=True),
            _Mount("/dev/shm", "/dev/shm", create=False, optional=True),
            _Mount("/etc/resolv.conf", str(self.resolv_conf), is_file=True, optional=True),
            _Mount(CONTROL_DIR_IN_ROOT, str(self.control_dir)),
        ]

    def host_path(self, path_in_root: str, *, create_parents: bool = False) -> Path:
        """Host path of a path inside the root (symlinks resolved as the chroot sees them)."""
        host = resolve_in_root(self.root, path_in_root)
        if create_parents:
            host.parent.mkdir(parents=True, exist_ok=True)
        return host

    def prepare(self, *, user: TrainerUser | None = None) -> None:
        """Mount the environment; mounts already in place are left alone (idempotent).

        With `user`, the control directory is made writable by the user's primary group with
        the sticky bit set: the trainer can add its own files but not remove the agent's.
        On a failure the mounts made by this call are undone before the error is raised.
        """
        looks_like_root(self.root)
        self.control_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        if user is not None:
            os.chown(self.control_dir, 0, user.gid)
            self.control_dir.chmod(0o1775)
        made: list[str] = []
        present = {e.mount_point for e in read_mountinfo(self.mountinfo)}
        try:
            for spec in self._plan():
                target = self._mount_one(spec, present)
                if target is not None:
                    made.append(target)
                    present.add(target)
        except ChrootError:
            for target in reversed(made):
                try:
                    subp.run(["umount", target], timeout=MOUNT_TIMEOUT)
                except SubprocessError as exc:
                    log.error("chroot_rollback_failed", mount_point=target, error=str(exc))
            raise
        log.info("chroot_prepared", root=str(self.root), mounted=len(made))

    def _mount_one(self, spec: _Mount, present: set[str]) -> str | None:
        if spec.source is not None and spec.optional and not os.path.exists(spec.source):
            log.warning("chroot_mount_skipped", target=spec.target, source=spec.source,
                        reason="source missing")
            return None
        target = resolve_in_root(self.root, spec.target)
        if str(target) in present:
            log.info("chroot_mount_present", mount_point=str(target))
            return None
        if not target.exists():   # resolve_in_root followed any symlink: no dangling link
            if not spec.create:
                log.warning("chroot_mount_skipped", target=spec.target,
                            reason="mount point missing")
                return None
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                if spec.is_file:
                    target.touch(mode=0o644)
                else:
                    target.mkdir(mode=0o755)
            except OSError as exc:
                raise ChrootMountError("cannot create the mount point", target=target,
                                       error=os.strerror(exc.errno or errno.EIO)) from exc
        elif target.is_dir() == spec.is_file:
            raise ChrootMountError("mount point has the wrong type", target=target,
                                   expected="file" if spec.is_file else "directory")
        if spec.source is None:
            argv = ["mount", "-t", str(spec.fstype), "-o", spec.options, str(spec.fstype),
                    str(target)]
            propagation = "--make-private"
        else:
            argv = ["mount", "--bind", spec.source, str(target)]
            propagation = "--make-slave"
        try:
            subp.run(argv, timeout=MOUNT_TIMEOUT)
        except SubprocessError as exc:
            raise ChrootMountError("mount failed", target=target, source=spec.source or
                                   spec.fstype, error=exc.context.get("stderr", "")) from exc
        try:
            subp.run(["mount", propagation, str(target)], timeout=MOUNT_TIMEOUT)
        except SubprocessError as exc:
            subp.run(["umount", str(target)], timeout=MOUNT_TIMEOUT, check=False)
            raise ChrootMountError("cannot set mount propagation", target=target,
                                   propagation=propagation,
                                   error=exc.context.get("stderr", "")) from exc
        log.info("chroot_mounted", mount_point=str(target), source=spec.source or spec.fstype)
        return str(target)

    def teardown(self, *, lazy: bool = False) -> None:
        """Unmount everything beneath the root (read from mountinfo: works after a crash)."""
        unmount_beneath(self.root, lazy=lazy, mountinfo=self.mountinfo)
        log.info("chroot_torn_down", root=str(self.root))

    def leftover_mounts(self) -> list[Path]:
        return leftover_mounts(self.root, mountinfo=self.mountinfo)

    def check_command(self, argv: Sequence[str], *, user: TrainerUser | None = None,
                      search_path: str = DEFAULT_PATH, cwd: str = "/") -> str:
        """Raise unless argv[0] resolves to an executable inside the root; return its path."""
        looks_like_root(self.root)
        if not argv:
            raise CommandNotFoundError("empty command", root=self.root)
        return resolve_command(self.root, argv[0], search_path=search_path, cwd=cwd, user=user)

    def ensure_checkpoint_dir(self, path_in_root: str, user: TrainerUser) -> Path:
        """Create the checkpoint directory if missing (owned by `user`, mode 0750; missing
        parents root-owned 0755) and check that `user` can write it. Returns the host path."""
        if not path_in_root.startswith("/"):
            raise CheckpointDirError("checkpoint directory must be an absolute path inside "
                                     "the chroot", path=path_in_root)
        host = resolve_in_root(self.root, path_in_root)
        try:
            if not host.exists():
                host.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
                host.mkdir(mode=0o750)
                os.chown(host, user.uid, user.gid)
                log.info("checkpoint_dir_created", path=path_in_root, host_path=str(host),
                         uid=user.uid, gid=user.gid)
            st = host.stat()
            readonly = bool(os.statvfs(host).f_flag & os.ST_RDONLY)
        except OSError as exc:
            raise CheckpointDirError("cannot create the checkpoint directory",
                                     path=path_in_root, host_path=host,
                                     error=os.strerror(exc.errno or errno.EIO)) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointDirError("checkpoint path is not a directory", path=path_in_root,
                                     host_path=host)
        if readonly:
            raise CheckpointDirError("checkpoint directory is on a read-only file system",
                                     path=path_in_root, host_path=host)
        blocked = _searchable_ancestors(self.root, host, user)
        if blocked is not None or not _permits(st, user, 3):
            raise CheckpointDirError(
                "checkpoint directory is not writable by the trainer user", path=path_in_root,
                host_path=blocked or host, user=user.name, uid=user.uid, owner=st.st_uid,
                mode=oct(stat.S_IMODE(st.st_mode)))
        return host

    def gpu_report(self) -> GpuReport:
        """GPUs and driver from the host's /proc and /sys, CUDA from the root; warns when the
        driver is older than that CUDA needs, or when the UVM device node is missing."""
        nv = self.proc_root / "driver" / "nvidia"
        gpus_dir = nv / "gpus"
        gpus = tuple(sorted(p.name for p in gpus_dir.iterdir())) if gpus_dir.is_dir() else ()
        nodes = tuple(sorted(p.name for p in self.dev_root.glob("nvidia*")))
        driver_text = _read_text(nv / "version") or _read_text(
            self.sys_root / "module" / "nvidia" / "version")
        driver = parse_driver_version(driver_text) if driver_text else None
        cuda = self._cuda_version()
        required = min_driver_for_cuda(cuda) if cuda else None
        warnings: list[str] = []
        if driver and cuda and required and not driver_at_least(driver, required):
            floor = CUDA_MAJOR_FLOOR.get(_vtuple(cuda)[0])
            compat = floor is not None and driver_at_least(driver, floor)
            warnings.append(
                f"driver {driver} is older than CUDA {cuda} needs ({required})"
                + ("; only CUDA minor version compatibility applies" if compat
                   else "; CUDA will not initialise"))
            log.warning("gpu_driver_too_old", driver=driver, cuda=cuda, required=required,
                        minor_version_compat=compat)
        libcuda = self._root_libcuda()
        if driver and gpus and not libcuda:
            warnings.append(f"no libcuda.so in the root: CUDA needs the driver's user-space "
                            f"libraries of version {driver} installed in the environment")
            log.warning("gpu_libcuda_missing", driver=driver)
        elif driver and libcuda and driver not in libcuda:
            warnings.append(f"libcuda.so {','.join(libcuda)} in the root does not match the "
                            f"host kernel module {driver} (CUDA fails: version mismatch)")
            log.warning("gpu_libcuda_mismatch", driver=driver, libcuda=",".join(libcuda))
        if gpus and "nvidia-uvm" not in nodes:
            warnings.append("GPUs present but /dev/nvidia-uvm missing (nvidia-uvm not loaded)")
            log.warning("gpu_uvm_missing", gpus=len(gpus))
        report = GpuReport(gpus=gpus, device_nodes=nodes, driver_version=driver,
                           cuda_version=cuda, cuda_min_driver=required,
                           root_libcuda=libcuda, warnings=tuple(warnings))
        log.info("gpu_report", gpus=len(gpus), driver=driver, cuda=cuda, required=required,
                 device_nodes=",".join(nodes))
        return report

    def _root_libcuda(self) -> tuple[str, ...]:
        """Versions of the NVIDIA user-space driver library installed in the root: in a chroot
        it must be the host kernel module's version exactly (nothing injects the host's)."""
        found: set[str] = set()
        for d in LIBCUDA_DIRS:
            host = resolve_in_root(self.root, d)
            if host.is_dir():
                for lib in host.glob("libcuda.so.*"):
                    version = lib.name[len("libcuda.so."):]
                    if re.fullmatch(r"\d+\.\d+(?:\.\d+)?", version):
                        found.add(version)
        return tuple(sorted(found, key=_vtuple))

    def _cuda_version(self) -> str | None:
        for name in ("version.json", "version.txt"):
            text = _read_text(resolve_in_root(self.root, f"/usr/local/cuda/{name}"))
            if text:
                version = parse_cuda_version(text)
                if version:
                    return version
        return None
