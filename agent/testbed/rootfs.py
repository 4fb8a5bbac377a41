"""Build a tiny busybox root file system: a real root to chroot into for tests and the demo.

It has what the chroot and supervisor code looks at in a real deep-learning root: /etc/passwd
and /etc/group (root, the trainer user and a user that exists only in this root),
/etc/os-release, /tmp, the /proc /sys /dev /run mount points and a shell with the usual applets.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from spotagent.errors import SpotagentError

BUSYBOX = Path("/bin/busybox")

DEFAULT_USERS: Mapping[str, int] = MappingProxyType({"trainer": 1000})
# A user no host has: proves that users are looked up in the root's own /etc/passwd.
CHROOT_ONLY_USER = "sa-chroot-only"
CHROOT_ONLY_UID = 1777
# A supplementary group every non-root user of the root belongs to.
SHARED_GROUP = "datasets"
SHARED_GID = 2000

APPLETS = (
    "sh", "ash", "sleep", "cat", "echo", "id", "env", "kill", "ls", "touch", "mkdir", "rm",
    "pwd", "ps", "grep", "sed", "true", "false", "test", "[", "printf", "wc", "head", "tail",
    "stat", "readlink", "date", "chmod", "cp", "mv", "ln", "uname", "whoami", "dd", "sync",
    "nproc", "seq", "yes", "usleep", "timeout",
)
USR_BIN_LINKS = ("env",)   # `#!/usr/bin/env sh` scripts must work


class RootfsBuildError(SpotagentError):
    """The test root file system could not be built."""


def build_busybox_root(
    dest: Path,
    *,
    users: Mapping[str, int] = DEFAULT_USERS,
    busybox: Path = BUSYBOX,
) -> Path:
    """Create (or refresh) a busybox root at `dest` and return it.

    `users` maps user names to uids; each gets a same-numbered primary group, a home under
    /home owned by it, and membership of the `datasets` group (gid 2000). `sa-chroot-only`
    (uid 1777) is always added: it exists in this root and on no host.
    """
    if not busybox.is_file():
        raise RootfsBuildError("busybox not found (apt-get install busybox-static)",
                               path=busybox)
    if any(uid == 0 for uid in users.values()) or "root" in users:
        raise RootfsBuildError("users must not include root; root is always present")
    everyone = dict(users)
    everyone.setdefault(CHROOT_ONLY_USER, CHROOT_ONLY_UID)

    dest.mkdir(parents=True, exist_ok=True)
    # The trainer user must be able to traverse the root (mkdtemp makes 0700 directories).
    dest.chmod(0o755)
    for name in ("bin", "sbin", "usr/bin", "usr/sbin", "usr/local/bin", "etc", "root", "home",
                 "proc", "sys", "dev", "run", "var/log", "var/lib", "opt", "tmp"):
        (dest / name).mkdir(parents=True, exist_ok=True)
    (dest / "root").chmod(0o700)
    (dest / "tmp").chmod(0o1777)

    target = dest / "bin" / "busybox"
    shutil.copy2(busybox, target)
    target.chmod(0o755)
    for applet in APPLETS:
        _symlink("busybox", dest / "bin" / applet)
    for applet in USR_BIN_LINKS:
        _symlink("/bin/busybox", dest / "usr" / "bin" / applet)

    passwd = ["root:x:0:0:root:/root:/bin/sh"]
    group = ["root:x:0:"]
    for name, uid in everyone.items():
        passwd.append(f"{name}:x:{uid}:{uid}:{name}:/home/{name}:/bin/sh")
        group.append(f"{name}:x:{uid}:")
        home = dest / "home" / name
        home.mkdir(exist_ok=True)
        os.chown(home, uid, uid)
        home.chmod(0o750)
    group.append(f"{SHARED_GROUP}:x:{SHARED_GID}:{','.join(everyone)}")
    _write(dest / "etc" / "passwd", passwd)
    _write(dest / "etc" / "group", group)
    _write(dest / "etc" / "os-release", [
        'NAME="spotagent busybox test root"',
        "ID=spotagent-testbed",
        'PRETTY_NAME="spotagent busybox test root"',
    ])
    _write(dest / "etc" / "hostname", ["spotagent-testbed"])
    return dest


def _symlink(target: str, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.chmod(0o644)
