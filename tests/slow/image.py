"""The spotagent image as CI builds it: `packer build -only=null.local` into a booted container.

Recipe (what an AMI build does on AWS, with a local machine in place of the EC2 builder):

1. the wheelhouse: `pip wheel .[agent]` (the same command as `make wheelhouse`);
2. the cached debootstrapped Debian root (`spotagent.testbed.images.base_root`) booted under
   systemd-nspawn through an overlay, with sshd on a free port of 127.0.0.1 and a generated key;
3. `packer build -only=null.local packer/spotagent.pkr.hcl`: the template's file uploads and
   packer/scripts/install.sh over SSH, exactly as the amazon-ebs source runs them;
4. a clean poweroff; the overlay's upper directory, minus the SSH access made for Packer, is
   the provisioned layer. Base root + layer is the image the systemd tier boots.

The result is cached as `$SPOTAGENT_CACHE/spotagent-image-<key>/{layer,packer.log}` (the
testbed's cache: built under a temporary name and a lock, renamed into place when complete),
keyed by the base root, the content of every wheel, the provisioning inputs (template,
install.sh, unit, config, IAM policy) and this recipe. `SPOTAGENT_SLOW_REBUILD=1` forces a fresh
`packer build`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nspawn

from spotagent.testbed import images

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "packer/spotagent.pkr.hcl"
# Everything the provisioning reads: a change to any of them is a different image.
PROVISION_INPUTS = (TEMPLATE, "packer/scripts/install.sh", "packer/files/config.toml",
                    "systemd/spotagent.service", "agent/iam/instance-policy.json")
RECIPE = "1"
# What the agent needs on the image (and what the AMI's base has): systemd as init, a Python
# with venv, the mount/loop/blkid/fsck tools, sshd for Packer's communicator.
# The kernel (Debian's cloud flavour, with its initrd) is for the QEMU tests; containers ignore it.
BASE_PACKAGES = ("systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv",
                 "util-linux", "mount", "e2fsprogs", "xfsprogs", "busybox-static", "procps",
                 "linux-image-cloud-amd64")
KEEP_IMAGES = 3
PACKER_TIMEOUT = 900
SSHD_DROPIN = "etc/ssh/sshd_config.d/spotagent-packer.conf"


@dataclass(frozen=True)
class Image:
    base: Path          # the debootstrapped root (read-only lower layer)
    layer: Path         # what provisioning added (read-only lower layer above base)
    packer_log: Path
    key: str
    built_now: bool
    seconds: float      # time to get the image this run (build or cache hit)

    @property
    def lowers(self) -> list[Path]:
        return [self.layer, self.base]


def build_wheelhouse(dest: Path) -> Path:
    """spotagent and its agent dependencies as wheels (`make wheelhouse` runs the same)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                    "--wheel-dir", str(dest), f"{REPO}[agent]"],
                   check=True, capture_output=True, timeout=600, cwd=REPO)
    return dest


def wheelhouse_digest(wheelhouse: Path) -> str:
    """A hash of what the wheels contain (names and bytes of their members), not of the zip
    files: a rebuilt wheel of the same source has new timestamps but the same digest."""
    h = hashlib.sha256()
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {wheelhouse}")
    for wheel in wheels:
        h.update(wheel.name.encode() + b"\0")
        with zipfile.ZipFile(wheel) as z:
            for name in sorted(z.namelist()):
                h.update(name.encode() + b"\0")
                h.update(hashlib.sha256(z.read(name)).digest())
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def image_key(base: Path, wheelhouse: Path) -> str:
    return images.cache_key({
        "what": "spotagent-image", "recipe": RECIPE, "base": base.name,
        "wheels": wheelhouse_digest(wheelhouse),
        "inputs": {p: _file_digest(REPO / p) for p in PROVISION_INPUTS}})


def provisioned_image(wheelhouse: Path, workdir: Path) -> Image:
    """The cached image for this wheelhouse and these provisioning files; built on a miss."""
    start = time.monotonic()
    base = images.base_root(BASE_PACKAGES)
    key = image_key(base, wheelhouse)
    cache = images.cache_dir()
    name = f"spotagent-image-{key}"
    if os.environ.get("SPOTAGENT_SLOW_REBUILD") == "1" and (cache / name).exists():
        doomed = cache / f".{name}.old-{os.getpid()}"
        (cache / name).rename(doomed)
        shutil.rmtree(doomed)
    built = not (cache / name).exists()
    entry = images.cached(cache, name, lambda tmp: _build(base, wheelhouse, tmp, workdir))
    os.utime(entry)
    # Every change to the agent is a new image (~75 MB): keep the ones used last.
    images.prune(cache, "spotagent-image-", keep=KEEP_IMAGES)
    return Image(base, entry / "layer", entry / "packer.log", key, built,
                 time.monotonic() - start)


def ssh_key(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / "id_ed25519"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "spotagent-packer",
                        "-f", str(key)], check=True, timeout=30)
    return key


def _build(base: Path, wheelhouse: Path, entry: Path, workdir: Path) -> None:
    """Into `entry` (a fresh directory): `layer/` (the overlay's upper dir) and packer.log."""
    entry.mkdir()
    key = ssh_key(workdir / "packer-ssh")
    port = nspawn.free_port()
    with nspawn.overlay([base], entry) as root:
        _give_packer_ssh(root, key, port)
        with nspawn.boot(root, machine=f"spotagent-packer-{os.getpid()}",
                         log_path=workdir / "packer-console.log") as box:
            nspawn.wait_for_port(port, 120, alive=box.proc)
            text = _packer_build(wheelhouse, key, port)
            box.wait_booted(60)
        _take_packer_ssh_away(root)
    (entry / "upper").rename(entry / "layer")
    shutil.rmtree(entry / "work")
    (entry / "merged").rmdir()
    (entry / "packer.log").write_text(text)


def _give_packer_ssh(root: Path, key: Path, port: int) -> None:
    dropin = root / SSHD_DROPIN
    dropin.parent.mkdir(parents=True, exist_ok=True)
    # Loopback only: the container shares the host's network.
    dropin.write_text(f"Port {port}\nListenAddress 127.0.0.1\nPasswordAuthentication no\n"
                      "PermitRootLogin prohibit-password\n")
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    auth = ssh_dir / "authorized_keys"
    auth.write_text(key.with_suffix(".pub").read_text())
    auth.chmod(0o600)


def _take_packer_ssh_away(root: Path) -> None:
    (root / SSHD_DROPIN).unlink(missing_ok=True)
    (root / "root/.ssh/authorized_keys").unlink(missing_ok=True)


def _packer_build(wheelhouse: Path, key: Path, port: int) -> str:
    argv = ["packer", "build", "-color=false", "-only=null.local",
            f"-var=wheelhouse={wheelhouse}", "-var=local_host=127.0.0.1",
            f"-var=local_port={port}", "-var=local_user=root", f"-var=local_key_file={key}",
            TEMPLATE]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=PACKER_TIMEOUT,
                          env={**os.environ, "CHECKPOINT_DISABLE": "1"})
    text = f"$ {' '.join(argv)}\n{proc.stdout}{proc.stderr}"
    if proc.returncode != 0:
        raise AssertionError(f"packer build failed ({proc.returncode}):\n{text[-6000:]}")
    return text
