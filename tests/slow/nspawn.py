"""Boot a root file system with systemd as PID 1 under systemd-nspawn; run commands inside it.

`boot()` starts `systemd-nspawn -b --register=no --keep-unit` (no host systemd is needed:
nothing is registered with machined and no scope unit is made) sharing the host's network, so
services inside reach the emulators on 127.0.0.1 and an sshd inside listens on a host port.
The container gets cgroup v2 (unified hierarchy), as the systemd of a current AMI does.
Commands run inside through `nsenter` into the container's PID 1 namespaces.

Block devices: nspawn gives the container a private /dev with the basic nodes only. `LoopRelay`
plays udev for the container: it mirrors the host's loop devices into the container's /dev with
mknod (through /proc/<pid>/root), including the ones the device plane creates after boot.

Everything is stopped on exit, also when the test failed: a clean poweroff first (SIGTERM to
nspawn makes systemd inside shut down, so services stop as on a real instance), then SIGKILL
of the container's PID 1 (which ends every process in its PID namespace, and with them the
container's mount namespace and all mounts made inside it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
NSENTER = ["nsenter", "--mount", "--uts", "--ipc", "--pid", "--cgroup", "--root", "--wd"]
# systemctl/journalctl output that tests parse: no pager, no colours, no width cut.
TOOL_ENV = {"SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", "LANG": "C.UTF-8", "COLUMNS": "500",
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


class ContainerError(AssertionError):
    """The container did not do what the test needed (boot, run a command, stop)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float, *, alive: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if alive.poll() is not None:
            raise ContainerError(f"container exited ({alive.returncode}) before port {port}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise ContainerError(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s")


def _ns_pid_chain(pid: int) -> list[int]:
    """The NSpid line of a process: its pid in each nested PID namespace, outermost first."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


@dataclass
class Container:
    machine: str
    root: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float                  # time.monotonic() just before nspawn was started
    _init_pid: int | None = None
    _relay: LoopRelay | None = field(default=None, repr=False)

    # --- finding the container --------------------------------------------------------------

    def init_pid(self, timeout: float = 30) -> int:
        """Host pid of the container's PID 1 (a child of nspawn that is pid 1 inside)."""
        if self._init_pid is not None:
            return self._init_pid
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited {self.proc.returncode}:\n"
                                     + self.console())
            for child in _children(self.proc.pid):
                chain = _ns_pid_chain(child)
                if len(chain) >= 2 and chain[-1] == 1:
                    self._init_pid = child
                    return child
            time.sleep(0.05)
        raise ContainerError("no container PID 1 found:\n" + self.console())

    def host_path(self, path: str) -> Path:
        """A path inside the container, seen from the host (through /proc/<pid>/root)."""
        return Path(f"/proc/{self.init_pid()}/root") / path.lstrip("/")

    def host_pid(self, pid_inside: int) -> int:
        """The host pid of a process known by its pid inside the container."""
        ns = os.readlink(f"/proc/{self.init_pid()}/ns/pid")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "ns" / "pid") != ns:
                    continue
            except OSError:
                continue
            chain = _ns_pid_chain(int(entry.name))
            if chain and chain[-1] == pid_inside:
                return int(entry.name)
        raise ContainerError(f"no process {pid_inside} in container {self.machine}")

    def console(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    # --- running things inside --------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [*NSENTER, f"--target={self.init_pid()}", "--", *argv]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  input=input, env=TOOL_ENV, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ContainerError(f"{' '.join(argv)} timed out after {timeout:g} s") from exc
        if check and proc.returncode != 0:
            raise ContainerError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def systemctl(self, *args: str, check: bool = False,
                  timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *args, check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        args = [f"--property={p}" for p in props]
        out = self.systemctl("show", unit, *args, check=True).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def status(self, unit: str, lines: int = 15) -> str:
        return self.systemctl("status", f"--lines={lines}", "--full", unit).stdout

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "--output=cat", "-u", unit,
                        check=False).stdout

    def wait_booted(self, timeout: float = 120) -> str:
        """Wait until systemd finished the boot; returns the system state."""
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            self.init_pid()
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return state
            time.sleep(0.2)
        raise ContainerError(f"boot did not finish in {timeout:g} s (state {state!r}):\n"
                             + self.console())

    def monotonic_of(self, usec: str) -> float:
        """A systemd *TimestampMonotonic value (µs) as time.monotonic() seconds (one clock)."""
        return int(usec) / 1e6

    # --- stopping -----------------------------------------------------------------------------

    def stop(self, timeout: float = 120) -> None:
        """Power off cleanly (services stop as on a real shutdown), else kill."""
        if self._relay is not None:
            self._relay.stop()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()

    def kill(self) -> None:
        for pid in (self._init_pid, self.proc.pid):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)


class LoopRelay:
    """udev for the container: make a node in its /dev for every loop device of the host.

    The device plane sets up loop devices on the host when EC2 attaches a volume; nspawn's
    private /dev would never show them. The relay polls /sys/class/block and mknods what is
    missing (same major:minor), so the by-id link (bind-mounted from the host) resolves inside.
    """

    def __init__(self, container: Container, interval: float = 0.05) -> None:
        self.dev = container.host_path("/dev")
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="loop-relay", daemon=True)
        self.made: list[str] = []
        self.errors: list[str] = []

    def start(self) -> LoopRelay:
        self.sync()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def sync(self) -> None:
        for entry in sorted(Path("/sys/class/block").glob("loop*")):
            if not entry.name[4:].isdigit():
                continue  # partitions (loop0p1) are not used here
            node = self.dev / entry.name
            try:
                major, minor = (entry / "dev").read_text().split(":")
                want = os.makedev(int(major), int(minor))
                try:
                    if node.lstat().st_rdev == want:
                        continue
                    node.unlink()
                except FileNotFoundError:
                    pass
                os.mknod(node, stat.S_IFBLK | 0o660, want)
                self.made.append(entry.name)
            except OSError as exc:
                self.errors.append(f"{entry.name}: {exc}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sync()


@contextlib.contextmanager
def boot(root: Path, *, machine: str, log_path: Path, binds: Sequence[tuple[Path, str]] = (),
         relay_loops: bool = False, stop_timeout: float = 120) -> Iterator[Container]:
    """Boot `root` with systemd as PID 1; yields once PID 1 runs (not once booted)."""
    argv = ["systemd-nspawn", "--boot", "--register=no", "--keep-unit", f"--machine={machine}",
            f"--directory={root}", "--console=read-only"]
    argv += [f"--bind={src}:{dst}" for src, dst in binds]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **NSPAWN_ENV},
                                start_new_session=True)
    container = Container(machine, root, proc, log_path, started)
    try:
        container.init_pid()
        if relay_loops:
            container._relay = LoopRelay(container).start()
        yield container
    finally:
        container.stop(timeout=stop_timeout)


@contextlib.contextmanager
def overlay(lowers: Sequence[Path], workdir: Path) -> Iterator[Path]:
    """A writable overlay over read-only `lowers` (first is topmost); unmounted on exit."""
    upper, work, merged = workdir / "upper", workdir / "work", workdir / "merged"
    for d in (upper, work, merged):
        d.mkdir(parents=True, exist_ok=True)
    lower = ":".join(str(p) for p in lowers)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged)],
                   check=True, capture_output=True, timeout=30)
    try:
        yield merged
    finally:
        unmount(merged)


def unmount(path: Path) -> None:
    """Unmount `path` (lazily if it is still busy: test cleanup must not leave it mounted)."""
    if subprocess.run(["umount", str(path)], capture_output=True, timeout=60).returncode != 0:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=60)
