"""The image cache of the testbed: mirror discovery, keys, atomic publish under a lock, and a
tiny ext4 image built from a directory. The slow builds (debootstrap, torch) run in
tests/test_demo.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loopdev import needs_root

from spotagent.errors import SpotagentError
from spotagent.testbed import images
from spotagent.testbed.rootfs import build_busybox_root

DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


def _etc_apt(tmp_path: Path) -> Path:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    return etc


# --- the mirror ---------------------------------------------------------------------------------


def test_mirror_from_a_deb822_sources_file(tmp_path: Path) -> None:
    etc = _etc_apt(tmp_path)
    (etc / "sources.list.d" / "debian.sources").write_text(DEB822)
    assert images.debian_mirror("bookworm", etc) == "http://mirror.example/debian"


def test_mirror_skips_security_updates_disabled_and_non_apt_files(tmp_path: Path) -> None:
    etc = _etc_apt(tmp_path)
    d = etc / "sources.list.d"
    # apt reads only *.list and *.sources: a renamed-away file is not a source
    (d / "a.sources.disabled-by-farm").write_text(DEB822.replace("mirror.example", "no"))
    (d / "b.sources").write_text(
        "Types: deb\nURIs: http://disabled.example/debian\nSuites: bookworm\nEnabled: no\n\n"
        "Types: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://good.example/debian/\n"
        "Suites: bookworm\n  bookworm-updates\n")
    assert images.debian_mirror("bookworm", etc) == "http://good.example/debian"


def test_mirror_from_a_one_line_list_with_options(tmp_path: Path) -> None:
    etc = _etc_apt(tmp_path)
    (etc / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] https://one.example/debian bookworm main\n")
    assert images.debian_mirror("bookworm", etc) == "https://one.example/debian"
    # sources.list comes before sources.list.d, as in apt
    (etc / "sources.list.d" / "x.sources").write_text(DEB822)
    assert images.debian_mirror("bookworm", etc) == "https://one.example/debian"


def test_mirror_falls_back_to_deb_debian_org(tmp_path: Path) -> None:
    etc = _etc_apt(tmp_path)
    assert images.debian_mirror("bookworm", etc) == images.FALLBACK_MIRROR
    (etc / "sources.list.d" / "debian.sources").write_text(DEB822)
    assert images.debian_mirror("trixie", etc) == images.FALLBACK_MIRROR


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.delenv(images.CACHE_ENV, raising=False)
    assert images.cache_dir() == Path("/var/cache/spotagent")
    monkeypatch.setenv(images.CACHE_ENV, str(tmp_path))
    assert images.cache_dir() == tmp_path
    assert images.cache_dir(tmp_path / "x") == tmp_path / "x"


# --- keys ---------------------------------------------------------------------------------------


def test_cache_key_ignores_order_and_changes_with_any_input() -> None:
    assert images.cache_key({"a": 1, "b": [1, 2]}) == images.cache_key({"b": [1, 2], "a": 1})
    assert images.cache_key({"a": 1}) != images.cache_key({"a": 2})
    assert images.cache_key({"a": [1, 2]}) != images.cache_key({"a": [2, 1]})


def test_torch_key_changes_with_the_trainer_sources_and_the_suite(tmp_path: Path) -> None:
    src = tmp_path / "spottrainer"
    src.mkdir()
    (src / "train.py").write_text("print('v1')\n")
    (src / "store.py").write_text("X = 1\n")
    files = sorted(src.iterdir())
    k1 = images.torch_key(sources=files)
    assert images.torch_key(sources=list(reversed(files))) == k1
    (src / "store.py").write_text("X = 2\n")
    k2 = images.torch_key(sources=files)
    assert k2 != k1
    assert images.torch_key(sources=files, suite="trixie") != k2
    assert images.torch_key(sources=files, torch="2.14.1") != k2
    assert images.torch_key(sources=files, numpy="2.3.0") != k2
    (src / "new.py").write_text("")
    assert images.torch_key(sources=sorted(src.iterdir())) != k2


def test_trainer_sources_are_the_spottrainer_package() -> None:
    names = {p.name for p in images.trainer_sources()}
    assert {"__init__.py", "train.py", "session.py", "py.typed"} <= names
    assert not any(n.endswith(".pyc") for n in names)


# --- atomic publish -----------------------------------------------------------------------------


def test_a_built_entry_is_published_once_and_then_reused(tmp_path: Path) -> None:
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "f").write_text("x")

    lines: list[str] = []
    first = images.cached(tmp_path, "entry", build, progress=lines.append)
    assert first == tmp_path / "entry" and (first / "f").read_text() == "x"
    assert images.cached(tmp_path, "entry", build, progress=lines.append) == first
    assert len(calls) == 1
    assert calls[0].name.startswith(".entry.tmp-")
    assert not calls[0].exists()


def test_a_failing_build_leaves_no_entry_and_no_temporary(tmp_path: Path) -> None:
    def build(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        images.cached(tmp_path, "entry", build, progress=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks"]


def test_a_build_that_makes_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(images.ImageBuildError):
        images.cached(tmp_path, "entry", lambda tmp: None, progress=lambda _: None)
    assert not (tmp_path / "entry").exists()


KILLED_BUILD = """
import sys, time
from pathlib import Path
from spotagent.errors import SpotagentError
from spotagent.testbed import images

def build(tmp):
    tmp.mkdir()
    (tmp / "half").write_text("x")
    print("building", flush=True)
    time.sleep(60)

images.cached(Path(sys.argv[1]), "entry", build, progress=lambda _: None)
"""


def test_a_killed_build_publishes_nothing_and_the_next_build_cleans_up(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "building"
        # mid-build: only the temporary exists, under the builder's pid
        assert [p.name for p in tmp_path.glob(".entry.tmp-*")] == [f".entry.tmp-{proc.pid}"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert not (tmp_path / "entry").exists()
    lines: list[str] = []

    def build(tmp: Path) -> None:
        tmp.write_text("whole")

    entry = images.cached(tmp_path, "entry", build, progress=lines.append)
    assert entry.read_text() == "whole"
    assert not list(tmp_path.glob(".entry.tmp-*"))
    assert any("killed build" in line for line in lines)


def test_concurrent_builders_of_one_entry_build_it_once(tmp_path: Path) -> None:
    started = threading.Event()
    calls = []

    def slow_build(tmp: Path) -> None:
        calls.append("slow")
        started.set()
        time.sleep(0.5)
        tmp.write_text("slow")

    def other_build(tmp: Path) -> None:
        calls.append("other")
        tmp.write_text("other")

    results: list[Path] = []
    t = threading.Thread(target=lambda: results.append(
        images.cached(tmp_path, "entry", slow_build, progress=lambda _: None)))
    t.start()
    assert started.wait(10)
    lines: list[str] = []
    second = images.cached(tmp_path, "entry", other_build, progress=lines.append)
    t.join(10)
    assert calls == ["slow"]
    assert second.read_text() == "slow" and results == [second]
    assert lines == ["waiting for another build of entry"]


def test_prune_keeps_the_entries_used_last_and_skips_locked_ones(tmp_path: Path) -> None:
    import fcntl

    for i in range(5):
        e = tmp_path / f"torch-bookworm-{i}.img"
        e.write_text(str(i))
        os.utime(e, (1000 + i, 1000 + i))
    (tmp_path / "torch-root-bookworm-0").mkdir()          # another prefix: not touched
    (tmp_path / ".torch-bookworm-9.img.tmp-1").write_text("")  # a build in progress
    (tmp_path / ".locks").mkdir()
    with open(tmp_path / ".locks" / "torch-bookworm-0.img.lock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)                  # in use by someone
        removed = images.prune(tmp_path, "torch-bookworm-", keep=2, progress=lambda _: None)
    assert sorted(removed) == ["torch-bookworm-1.img", "torch-bookworm-2.img"]
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != ".locks")
    assert left == [".torch-bookworm-9.img.tmp-1", "torch-bookworm-0.img", "torch-bookworm-3.img",
                    "torch-bookworm-4.img", "torch-root-bookworm-0"]


# --- images from directories --------------------------------------------------------------------


def test_image_size_has_headroom_and_a_floor() -> None:
    assert images.image_size_mib(0) == images.MIN_IMAGE_MIB
    gib = 1 << 30
    size = images.image_size_mib(gib)
    assert 1.3 * 1024 <= size <= 1.3 * 1024 + 64


def test_a_tiny_image_from_a_directory(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("hello from the image\n")
    (src / "big").write_bytes(os.urandom(3 << 20))
    assert images.content_bytes(src) >= 3 << 20
    cache = tmp_path / "cache"
    lines: list[str] = []
    img = images.fs_image(src, "tiny.img", cache=cache, progress=lines.append)
    assert img == cache / "tiny.img"
    assert img.stat().st_size == images.MIN_IMAGE_MIB << 20
    assert img.stat().st_blocks * 512 < img.stat().st_size   # sparse
    out = subprocess.run(["debugfs", "-R", "cat /etc/hello", str(img)], capture_output=True,
                         text=True, check=True)
    assert out.stdout == "hello from the image\n"
    label = subprocess.run(["e2label", str(img)], capture_output=True, text=True, check=True)
    assert label.stdout.strip() == "spotagent"
    assert any("mkfs.ext4" in line and "done" in line for line in lines)
    # cached: the same name is not built again, even from another directory
    assert images.fs_image(tmp_path / "missing", "tiny.img", cache=cache,
                           progress=lines.append) == img


def test_an_image_of_a_missing_directory_fails_and_caches_nothing(tmp_path: Path) -> None:
    with pytest.raises(images.ImageBuildError):
        images.fs_image(tmp_path / "missing", "x.img", cache=tmp_path / "c",
                        progress=lambda _: None)
    assert not (tmp_path / "c" / "x.img").exists()
    assert not list((tmp_path / "c").glob(".x.img.tmp-*"))


@needs_root
def test_a_killed_build_that_left_mounts_is_unmounted_then_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".entry.tmp-999999"
    (stale / "proc").mkdir(parents=True)
    (stale / "sys").mkdir()
    subprocess.run(["mount", "-t", "proc", "proc", str(stale / "proc")], check=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(stale / "sys")], check=True)
        entry = images.cached(tmp_path, "entry", lambda tmp: tmp.write_text("ok"),
                              progress=lambda _: None)
        assert entry.read_text() == "ok"
        assert not stale.exists()
        assert images.mounts_under(tmp_path) == []
    finally:
        for mp in images.mounts_under(tmp_path):
            subprocess.run(["umount", "-l", mp], check=False)


@needs_root
def test_commands_in_a_root_leave_no_mount_behind(tmp_path: Path) -> None:
    root = build_busybox_root(tmp_path / "root")
    before = Path("/proc/self/mountinfo").read_text()
    out = images.in_root(root, ["/bin/sh", "-c", "read pid rest < /proc/self/stat; "
                                                  "echo $pid; id -u"], user=1000)
    pid, uid = out.stdout.split()
    assert uid == "1000"
    assert pid == "1"        # its own pid namespace, and a /proc of that namespace
    assert images.mounts_under(root) == []
    assert Path("/proc/self/mountinfo").read_text() == before
    with pytest.raises(SpotagentError):
        images.in_root(root, ["/bin/sh", "-c", "exit 3"])
    assert images.in_root(root, ["/bin/sh", "-c", "exit 3"], ok_codes=(3,)).returncode == 3
    assert images.mounts_under(root) == []
