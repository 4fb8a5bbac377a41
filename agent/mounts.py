"""The volume's file system on this host: probe, fsck, guarded mkfs, mount, unmount.

Safety rules (docs/volume-host.md has the full policy):

- Format only a volume the agent itself created empty, and only when two `blkid -p` probes
  both find nothing and the first and last MiB read all zero. Anything else that holds no
  recognisable file system is refused: a damaged superblock looks "empty" to a probe
  (dstack #3973 reformatted a full volume on a cache-based check).
- An ambiguous probe (the two probes disagree, blkid reports an ambivalent result, or blkid
  fails) is refused, never formatted. Partition tables and non-file-system signatures (swap,
  RAID, LVM, LUKS) are refused too: pool volumes hold one file system on the whole device.
- fsck before mount: e2fsck -p (the fixes that are safe unattended) for ext2/3/4;
  xfs_repair -n for xfs, replaying a dirty log by mounting once; anything more is left to an
  operator, and the volume is not mounted.
- Unmount syncs first, retries while busy, then names the processes holding the mount; it is
  never lazy or forced. `assert_detachable` is the check to run before a detach.

Every command runs through `spotagent.subp.run`; the mount table is read from
/proc/<pid>/mountinfo.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from spotagent import subp
from spotagent.errors import SpotagentError, SubprocessError
from spotagent.log import get_logger

log = get_logger("mounts")

MIB = 1 << 20
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
EXT_TYPES = frozenset({"ext2", "ext3", "ext4"})
MKFS_TYPES = frozenset({"ext4", "xfs"})
_LABEL_MAX = {"ext4": 16, "xfs": 12}
PROBE_TIMEOUT = 60.0
MKFS_TIMEOUT = 900.0
FSCK_TIMEOUT = 3600.0  # e2fsck of a multi-TiB volume after a crash can take a long while
MOUNT_TIMEOUT = 600.0  # includes xfs/ext4 journal replay
UMOUNT_TIMEOUT = 120.0


def _c_env() -> dict[str, str]:
    """Messages of umount and xfs_repair are parsed ("busy", "metadata changes in a log"):
    run the tools untranslated."""
    return {**os.environ, "LC_ALL": "C"}



class MountError(SpotagentError):
    """A file-system operation on the volume failed or was refused."""


class UnsafeVolumeError(MountError):
    """The volume may hold data the agent cannot recognise: it is neither mounted nor formatted."""


class BusyError(MountError):
    """A mount point stays busy; `holders` lists the processes using it."""

    def __init__(self, message: str, *, holders: Sequence[Holder] = (), **context: object) -> None:
        super().__init__(message, **context)
        self.holders = list(holders)


class FsckError(MountError):
    """The file-system check found damage it may not repair unattended."""


# --- probing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What `blkid -p` found on a device (two probes, compared)."""

    fstype: str | None
    uuid: str | None
    label: str | None
    ambiguous: bool
    detail: str
    usage: str | None = None  # blkid USAGE: filesystem, raid, crypto, other
    pttype: str | None = None  # a partition table (dos, gpt, ...) on the whole device
    tags: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def clean(self) -> bool:
        """Nothing recognised by either probe, and the probes agreed."""
        return not self.ambiguous and self.fstype is None and self.pttype is None and not self.tags


def _unescape_export(value: str) -> str:
    """Undo `blkid -o export` shell escaping (`my\\ label` → `my label`)."""
    return re.sub(r"\\(.)", r"\1", value)


def parse_blkid_export(text: str) -> dict[str, str]:
    """`KEY=value` lines of `blkid -o export` → dict (DEVNAME dropped: it names the probe)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key and key != "DEVNAME":
            out[key] = _unescape_export(value)
    return out


def _blkid_once(device: Path) -> tuple[str, dict[str, str], str]:
    """One low-level probe: ("found"|"nothing"|"ambivalent"|"error", tags, detail)."""
    try:
        res = subp.run(["blkid", "-p", "-o", "export", str(device)],
                       timeout=PROBE_TIMEOUT, check=False, env=_c_env())
    except SubprocessError as exc:
        return "error", {}, str(exc)
    stderr = res.stderr.strip()
    if res.returncode == 0:
        return "found", parse_blkid_export(res.stdout), ""
    if res.returncode == 2:
        return "nothing", {}, ""
    if res.returncode == 8 or "ambivalent" in stderr:
        return "ambivalent", {}, stderr or "blkid: ambivalent result"
    return "error", {}, f"blkid exit {res.returncode}: {stderr[-300:]}"


def _unreadable(device: Path) -> str | None:
    """Why `device` cannot be probed, or None. blkid -p exits 2 ("nothing found") also for a
    path that does not exist or cannot be read, so "nothing found" is only believed for a
    block device we just read from."""
    try:
        if not stat.S_ISBLK(os.stat(device).st_mode):
            return "not a block device"
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.pread(fd, 4096, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"cannot read device: {exc}"
    return None


def probe(device: Path) -> Probe:
    """Probe the superblocks of `device` twice with `blkid -p` (no cache) and compare.

    Exit 2 = nothing found (clean). Ambiguous when the probes disagree, blkid reports an
    ambivalent result (exit 8: more than one signature), blkid fails, or the device cannot be
    read (blkid says "nothing" for a path it cannot open).
    """
    why = _unreadable(device)
    if why is not None:
        log.warning("volume_probed", device=str(device), ambiguous=True, detail=why)
        return Probe(fstype=None, uuid=None, label=None, ambiguous=True, detail=why)
    first = _blkid_once(device)
    second = _blkid_once(device)
    kind, tags, detail = first
    ambiguous = False
    if first != second:
        ambiguous = True
        detail = f"probes disagree: first={first[0]} {first[1]} second={second[0]} {second[1]}"
    elif kind in ("ambivalent", "error"):
        ambiguous = True
    elif kind == "nothing":
        detail = "no signature found"
    else:
        detail = " ".join(f"{k}={v}" for k, v in sorted(tags.items()))
    result = Probe(
        fstype=None if ambiguous else tags.get("TYPE"),
        uuid=None if ambiguous else tags.get("UUID"),
        label=None if ambiguous else tags.get("LABEL"),
        ambiguous=ambiguous,
        detail=detail,
        usage=None if ambiguous else tags.get("USAGE"),
        pttype=None if ambiguous else tags.get("PTTYPE"),
        tags=() if ambiguous else tuple(sorted(tags.items())),
    )
    log.info("volume_probed", device=str(device), fstype=result.fstype, pttype=result.pttype,
             ambiguous=result.ambiguous, detail=result.detail)
    return result


def _read_at(fd: int, offset: int, length: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def first_nonzero_offset(device: Path, *, span: int = MIB) -> int | None:
    """Offset of the first non-zero byte in the first and last `span` bytes, or None.

    A volume fresh from CreateVolume reads zero everywhere; metadata of a file system, a
    partition table (and its GPT backup at the end) or RAID lives in these regions.
    """
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        # Drop cached pages so these reads come from the device, not from memory.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for start in sorted({0, max(0, size - span)}):
            data = _read_at(fd, start, min(span, size - start))
            stripped = data.lstrip(b"\0")
            if stripped:
                return start + len(data) - len(stripped)
        return None
    finally:
        os.close(fd)


def ext_backup_superblock(device: Path) -> int | None:
    """Byte offset of an ext2/3/4 backup superblock (group 1), or None.

    A hint for the refusal message: a backup superblock with a missing primary means a damaged
    file system that `e2fsck -b` may recover — never a blank volume.
    """
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for block_size in (1024, 2048, 4096):
            first_data_block = 1 if block_size == 1024 else 0
            offset = (8 * block_size + first_data_block) * block_size
            sb = _read_at(fd, offset, 1024)
            # s_magic at 56; s_log_block_size (block size = 1024 << n) at 24.
            if len(sb) == 1024 and sb[56:58] == b"\x53\xef" and \
                    1024 << int.from_bytes(sb[24:28], "little") == block_size:
                return offset
        return None
    finally:
        os.close(fd)


def _refuse(reason: str, device: Path, **context: object) -> UnsafeVolumeError:
    log.error("volume_refused", device=str(device), reason=reason, **context)
    return UnsafeVolumeError(reason, device=str(device), **context)


def _mkfs_argv(fstype: str, device: Path, label: str | None) -> list[str]:
    # ext4 errors=remount-ro: a damaged file system stops taking writes instead of spreading
    # damage into checkpoints. xfs without -f: mkfs.xfs refuses a device that carries any
    # signature — one more guard.
    argv = ["mkfs.ext4", "-q", "-e", "remount-ro"] if fstype == "ext4" else ["mkfs.xfs", "-q"]
    if label:
        argv += ["-L", label]
    return [*argv, str(device)]


def ensure_filesystem(
    device: Path,
    *,
    created_empty_by_agent: bool,
    fstype: str = "ext4",
    label: str | None = None,
) -> str:
    """Return the file-system type on `device`, formatting it only when provably blank.

    mkfs runs only when `created_empty_by_agent` is true, both probes find nothing and the
    first and last MiB read all zero. A recognised file system is returned as it is (even if it
    is not `fstype`): data is never reformatted. Raises UnsafeVolumeError when the probe is
    ambiguous, the device holds a partition table or a non-file-system signature, or nothing is
    recognised on a volume the agent did not create.
    """
    if fstype not in MKFS_TYPES:
        raise ValueError(f"fstype must be one of {sorted(MKFS_TYPES)}, got {fstype!r}")
    if label is not None and len(label.encode()) > _LABEL_MAX[fstype]:
        raise ValueError(f"{fstype} label {label!r} longer than {_LABEL_MAX[fstype]} bytes")
    found = probe(device)
    if found.ambiguous:
        raise _refuse("probe of the volume is ambiguous; refusing to mount or format it",
                      device, detail=found.detail)
    if found.pttype is not None:
        raise _refuse("volume holds a partition table; pool volumes carry one file system on "
                      "the whole device", device, pttype=found.pttype, detail=found.detail)
    if found.fstype is not None:
        if found.usage != "filesystem":
            raise _refuse("volume holds a signature that is not a file system", device,
                          type=found.fstype, usage=found.usage)
        log.info("filesystem_found", device=str(device), fstype=found.fstype,
                 uuid=found.uuid, label=found.label)
        return found.fstype
    if not found.clean:
        raise _refuse("probe found signatures but no file system", device, detail=found.detail)
    if not created_empty_by_agent:
        try:
            backup = ext_backup_superblock(device)
        except OSError:
            backup = None  # only a hint for the message
        hint = {"ext_backup_superblock_at": backup} if backup is not None else {}
        raise _refuse("no file system recognised on a volume the agent did not create empty; "
                      "it may hold data (a damaged superblock looks blank); not formatting",
                      device, **hint)
    try:
        nonzero = first_nonzero_offset(device)
    except OSError as exc:
        raise _refuse("cannot read the volume to confirm it is blank; not formatting",
                      device, error=str(exc)) from exc
    if nonzero is not None:
        raise _refuse("volume was created empty by the agent but holds non-zero data; "
                      "not formatting", device, nonzero_at=nonzero)
    if is_mounted(device):
        raise _refuse("blank volume is mounted; not formatting", device)
    log.info("volume_formatting", device=str(device), fstype=fstype, label=label)
    subp.run(_mkfs_argv(fstype, device, label), timeout=MKFS_TIMEOUT)
    after = probe(device)
    if after.fstype != fstype:
        raise MountError("mkfs finished but the probe does not show the new file system",
                         device=str(device), fstype=fstype, detail=after.detail)
    log.info("volume_formatted", device=str(device), fstype=fstype, uuid=after.uuid)
    return fstype


# --- fsck ----------------------------------------------------------------------------------


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


def _xfs_log_dirty(output: str) -> bool:
    # xfs_repair -n: "ALERT: The filesystem has valuable metadata changes in a log which is
    # being ignored because the -n option was used."
    return "metadata changes in a log" in output


def _xfs_replay_log(device: Path) -> None:
    """Mount and unmount once so the kernel replays the xfs log (xfs recovers on mount)."""
    tmp = Path(tempfile.mkdtemp(prefix="spotagent-xfs-replay-"))
    try:
        try:
            subp.run(["mount", "-t", "xfs", "-o", "nodev,nosuid,noexec", str(device), str(tmp)],
                     timeout=MOUNT_TIMEOUT, env=_c_env())
        except SubprocessError as exc:
            raise FsckError("xfs log replay (mount) failed; run xfs_repair by hand — its -L "
                            "discards the log and the changes in it", device=str(device),
                            error=str(exc)) from exc
        unmount(tmp)
    finally:
        with contextlib.suppress(OSError):
            tmp.rmdir()


def check_filesystem(device: Path, fstype: str, *, timeout: float = FSCK_TIMEOUT) -> None:
    """Check (and for ext, preen) the unmounted file system on `device` before mounting.

    ext2/3/4: `e2fsck -p` replays the journal and fixes what is safe unattended; exit 0/1 are
    fine, 2 ("reboot") is fine for a file system that is not mounted, 4 and up raise FsckError.
    xfs: `xfs_repair -n` (read-only); if it reports a dirty log, mount once to let the kernel
    replay it and check again; any damage left raises FsckError (xfs_repair without -n, or
    -L which throws the log away, is for an operator). Other types: skipped, logged.
    """
    if is_mounted(device):
        raise MountError("refusing to check a mounted file system", device=str(device))
    if fstype in EXT_TYPES:
        res = subp.run(["e2fsck", "-p", str(device)], timeout=timeout, check=False, env=_c_env())
        if res.returncode >= 4:
            raise FsckError("e2fsck found damage it cannot repair unattended; run e2fsck by hand",
                            device=str(device), code=res.returncode,
                            output=_tail(res.stdout + res.stderr))
        log.info("fsck_done", device=str(device), fstype=fstype, code=res.returncode,
                 repaired=res.returncode != 0, output=_tail(res.stdout))
        return
    if fstype == "xfs":
        argv = ["xfs_repair", "-n", str(device)]
        res = subp.run(argv, timeout=timeout, check=False, env=_c_env())
        if res.returncode != 0 and _xfs_log_dirty(res.stdout + res.stderr):
            log.info("fsck_xfs_log_replay", device=str(device))
            _xfs_replay_log(device)
            res = subp.run(argv, timeout=timeout, check=False, env=_c_env())
        if res.returncode != 0:
            raise FsckError("xfs_repair -n found damage; run xfs_repair by hand",
                            device=str(device), code=res.returncode,
                            output=_tail(res.stdout + res.stderr))
        log.info("fsck_done", device=str(device), fstype=fstype, code=0, repaired=False)
        return
    log.warning("fsck_skipped", device=str(device), fstype=fstype, reason="no checker for type")


# --- the mount table -----------------------------------------------------------------------


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/<pid>/mountinfo."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: Path
    options: tuple[str, ...]
    fstype: str
    source: str
    super_options: tuple[str, ...]

    @property
    def devno(self) -> int:
        return os.makedev(self.major, self.minor)


_OCTAL = re.compile(rb"\\([0-7]{3})")


def unescape_mountinfo(field_: str | bytes) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\040 \\011 \\012 \\134;
    names that are not UTF-8 survive as surrogate escapes (os.fsdecode)."""
    raw = field_ if isinstance(field_, bytes) else os.fsencode(field_)
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), raw))


def parse_mountinfo(text: str | bytes) -> list[MountEntry]:
    """Parse mountinfo (proc(5)); lines that do not parse are skipped."""
    data = text if isinstance(text, bytes) else os.fsencode(text)
    out: list[MountEntry] = []
    for line in data.splitlines():
        parts = line.split(b" ")
        try:
            sep = parts.index(b"-", 6)
            major, minor = parts[2].split(b":")
            out.append(MountEntry(
                mount_id=int(parts[0]),
                parent_id=int(parts[1]),
                major=int(major),
                minor=int(minor),
                root=unescape_mountinfo(parts[3]),
                mount_point=Path(unescape_mountinfo(parts[4])),
                options=tuple(os.fsdecode(parts[5]).split(",")),
                fstype=os.fsdecode(parts[sep + 1]),
                source=unescape_mountinfo(parts[sep + 2]),
                super_options=(tuple(os.fsdecode(parts[sep + 3]).split(","))
                               if len(parts) > sep + 3 else ()),
            ))
        except (ValueError, IndexError):
            continue
    return out


def read_mountinfo(path: Path = PROC_MOUNTINFO) -> list[MountEntry]:
    return parse_mountinfo(path.read_bytes())


def _canonical(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _is_under(path: Path, prefix: Path) -> bool:
    return path == prefix or prefix in path.parents


def unmount_order(entries: Sequence[MountEntry]) -> list[MountEntry]:
    """`entries` in an order they can be unmounted in: every mount before the mount it sits on
    (children first, by parent id, so deeper mounts go before the mounts they are on), and
    among mounts that are free to go the newest first (mountinfo lists mounts in the order they
    were made), so a mount stacked on a path, or mounted over a parent directory of an older
    mount and hiding it, goes before what it covers."""
    index = {id(e): i for i, e in enumerate(entries)}
    left = list(entries)
    out: list[MountEntry] = []
    while left:
        parents = {e.parent_id for e in left}
        # One snapshot has no cycles; `or left` only guards against looping forever.
        leaves = [e for e in left if e.mount_id not in parents] or left[:]
        leaves.sort(key=lambda e: index[id(e)], reverse=True)
        out += leaves
        taken = {id(e) for e in leaves}
        left = [e for e in left if id(e) not in taken]
    return out


def mounts_under(prefix: Path, *, mountinfo: Path = PROC_MOUNTINFO) -> list[MountEntry]:
    """Mounts at or under `prefix` in the order to unmount them in (see `unmount_order`)."""
    root = _canonical(prefix)
    return unmount_order([e for e in read_mountinfo(mountinfo) if _is_under(e.mount_point, root)])


def _mount_namespaces_mountinfo() -> Iterable[tuple[str, Path]]:
    """One mountinfo file per mount namespace on the host (ours first)."""
    seen: set[str] = set()
    candidates = [Path("/proc/self")]
    with contextlib.suppress(OSError):
        candidates += [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    for proc_dir in candidates:
        try:
            ns = os.readlink(proc_dir / "ns" / "mnt")
        except OSError:
            continue
        if ns not in seen:
            seen.add(ns)
            yield ns, proc_dir / "mountinfo"


def _devno(device: Path) -> int:
    st = os.stat(device)
    if not stat.S_ISBLK(st.st_mode):
        raise MountError("not a block device", device=str(device))
    return st.st_rdev


def mounts_of(device: Path, *, all_namespaces: bool = True) -> list[MountEntry]:
    """Every mount of `device` (by major:minor), in every mount namespace by default."""
    devno = _devno(device)
    files = ([p for _, p in _mount_namespaces_mountinfo()] if all_namespaces
             else [PROC_MOUNTINFO])
    out: list[MountEntry] = []
    for path in files:
        try:
            entries = read_mountinfo(path)
        except OSError:
            continue  # the process went away
        out += [e for e in entries if e.devno == devno]
    return out


def is_mounted(device: Path, *, all_namespaces: bool = True) -> bool:
    """Whether any mount of `device` exists (major:minor from mountinfo vs st_rdev)."""
    return bool(mounts_of(device, all_namespaces=all_namespaces))


def assert_detachable(device: Path, *, sysfs: Path = Path("/sys")) -> None:
    """Raise MountError unless `device` is safe to detach: no mount in any namespace, no
    holder (device-mapper, md), not swap, and the kernel grants an exclusive open."""
    where = [str(e.mount_point) for e in mounts_of(device)]
    if where:
        raise MountError("device is still mounted; not detaching", device=str(device),
                         mounted_at=",".join(sorted(set(where))))
    name = Path(os.path.realpath(device)).name
    holders_dir = sysfs / "class" / "block" / name / "holders"
    with contextlib.suppress(OSError):
        held_by = sorted(p.name for p in holders_dir.iterdir())
        if held_by:
            raise MountError("device is held by another block device", device=str(device),
                             holders=",".join(held_by))
    try:
        fd = os.open(device, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise MountError("device is in use (exclusive open refused)",
                             device=str(device)) from exc
        raise MountError("cannot open device", device=str(device), error=str(exc)) from exc
    os.close(fd)


# --- mount / unmount -----------------------------------------------------------------------


def mount(
    device: Path,
    mount_point: Path,
    fstype: str,
    *,
    options: Sequence[str] = ("noatime",),
    timeout: float = MOUNT_TIMEOUT,
) -> None:
    """Mount `device` at `mount_point` (created if missing).

    Idempotent when this device is already mounted there. Refuses (MountError) when something
    else is mounted at the mount point, or the device is mounted elsewhere.
    """
    devno = _devno(device)
    mount_point.mkdir(parents=True, exist_ok=True)
    target = _canonical(mount_point)
    entries = read_mountinfo()
    here = [e for e in entries if e.mount_point == target]
    if here:
        top = here[-1]
        if top.devno == devno and top.root == "/":
            log.info("already_mounted", device=str(device), mount_point=str(target))
            return
        raise MountError("mount point is already in use", mount_point=str(target),
                         mounted=top.source, fstype=top.fstype)
    elsewhere = [str(e.mount_point) for e in entries if e.devno == devno]
    if elsewhere:
        raise MountError("device is already mounted elsewhere", device=str(device),
                         mounted_at=",".join(elsewhere))
    argv = ["mount", "-t", fstype]
    if options:
        argv += ["-o", ",".join(options)]
    subp.run([*argv, str(device), str(target)], timeout=timeout, env=_c_env())
    log.info("mounted", device=str(device), mount_point=str(target), fstype=fstype,
             options=",".join(options))


def mount_volume(
    device: Path,
    mount_point: Path,
    *,
    created_empty_by_agent: bool,
    fstype: str = "ext4",
    label: str | None = None,
    options: Sequence[str] = ("noatime",),
) -> str:
    """Probe (format only if provably blank), check, mount; return the file-system type.

    The whole of step 3 of the boot. Idempotent: a device already mounted at `mount_point`
    is left as it is (no fsck of a mounted file system).
    """
    target = _canonical(mount_point) if mount_point.exists() else mount_point
    devno = _devno(device)
    for e in read_mountinfo():
        if e.mount_point == target and e.devno == devno and e.root == "/":
            log.info("already_mounted", device=str(device), mount_point=str(target))
            return e.fstype
    found = ensure_filesystem(device, created_empty_by_agent=created_empty_by_agent,
                              fstype=fstype, label=label)
    check_filesystem(device, found)
    mount(device, mount_point, found, options=options)
    return found


@dataclass(frozen=True)
class Holder:
    """A process using a mounted file system, and how (cwd, root, exe, open file, mmap)."""

    pid: int
    command: str
    how: str

    def __str__(self) -> str:
        return f"{self.pid}({self.command}):{self.how}"


def _link_path(link: Path) -> Path | None:
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return Path(target.removesuffix(" (deleted)")) if target.startswith("/") else None


def _uses(link: Path, devs: set[int], prefix: Path) -> bool:
    target = _link_path(link)
    if target is not None and _is_under(target, prefix):
        return True
    try:
        return os.stat(link).st_dev in devs
    except OSError:
        return False


def _exclusive_devs(prefix: Path) -> set[int]:
    """Devices mounted only at or under `prefix`: any file on them is under the prefix, so
    they can be matched by st_dev (which also catches deleted files and other namespaces'
    paths). A bind mount of a directory from elsewhere (the root fs) is matched by path only,
    or every process on the host would count as a holder."""
    inside: set[int] = set()
    outside: set[int] = set()
    for e in read_mountinfo():
        (inside if _is_under(e.mount_point, prefix) else outside).add(e.devno)
    return inside - outside


def find_holders(mount_point: Path) -> list[Holder]:
    """Processes whose cwd, root, executable, open files or mappings are on the mount (or on
    a mount below it), found through psutil and /proc/<pid>."""
    prefix = _canonical(mount_point)
    devs = _exclusive_devs(prefix)
    out: list[Holder] = []
    for proc in psutil.process_iter(["pid", "name"]):
        pid = proc.info["pid"]
        base = Path(f"/proc/{pid}")
        hows: list[str] = []
        for what in ("cwd", "root", "exe"):
            if _uses(base / what, devs, prefix):
                hows.append(what)
        with contextlib.suppress(OSError):
            for fd in os.listdir(base / "fd"):
                link = base / "fd" / fd
                if _uses(link, devs, prefix):
                    hows.append(f"open:{_link_path(link) or fd}")
        with contextlib.suppress(OSError):
            for line in (base / "maps").read_text().splitlines():
                cols = line.split(maxsplit=5)
                if len(cols) < 6 or cols[3] == "00:00":
                    continue
                major, minor = (int(x, 16) for x in cols[3].split(":"))
                path = Path(cols[5].removesuffix(" (deleted)"))
                if os.makedev(major, minor) in devs or _is_under(path, prefix):
                    hows.append(f"mmap:{cols[5]}")
                    break
        if hows:
            out.append(Holder(pid=pid, command=proc.info["name"] or "?", how=",".join(hows)))
    return out


def _mounted_at(target: Path) -> bool:
    return any(e.mount_point == target for e in read_mountinfo())


def unmount(mount_point: Path, *, retries: int = 5, delay: float = 0.5,
            timeout: float = UMOUNT_TIMEOUT) -> None:
    """Sync, then unmount the top mount at `mount_point`; a no-op when nothing is mounted.

    While umount reports busy it retries `retries` times `delay` seconds apart, then raises
    BusyError naming the processes (pid, command, how) holding it. Never lazy, never forced.
    """
    target = _canonical(mount_point)
    if not _mounted_at(target):
        log.info("unmount_not_mounted", mount_point=str(target))
        return
    os.sync()
    stderr = ""
    for attempt in range(retries + 1):
        res = subp.run(["umount", str(target)], timeout=timeout, check=False, env=_c_env())
        if res.returncode == 0:
            log.info("unmounted", mount_point=str(target), attempts=attempt + 1)
            return
        stderr = res.stderr.strip()
        if not _mounted_at(target):
            log.info("unmounted", mount_point=str(target), attempts=attempt + 1)
            return
        if "busy" not in stderr:
            raise MountError("umount failed", mount_point=str(target), code=res.returncode,
                             stderr=stderr[-300:])
        log.warning("unmount_busy", mount_point=str(target), attempt=attempt + 1,
                    retries=retries)
        if attempt < retries:
            time.sleep(delay)
    holders = find_holders(target)
    nested = [str(e.mount_point) for e in mounts_under(target) if e.mount_point != target]
    context: dict[str, object] = {"mount_point": str(target),
                                  "held_by": "; ".join(map(str, holders)) or "none found"}
    if nested:
        context["nested_mounts"] = ",".join(nested)
    log.error("unmount_busy_gave_up", **context)
    raise BusyError("mount point is busy", holders=holders, **context)


def unmount_tree(prefix: Path, *, retries: int = 5, delay: float = 0.5) -> None:
    """Unmount every mount at or under `prefix`, deepest first (stacked mounts top first)."""
    while True:
        entries = mounts_under(prefix)
        if not entries:
            return
        top = entries[0]
        unmount(top.mount_point, retries=retries, delay=delay)
        if mounts_under(prefix) and mounts_under(prefix)[0] == top:
            raise MountError("mount did not go away after umount", mount_point=str(top.mount_point))
