"""Checkpoint benchmark: stall, write and read bandwidth, GIL contention, training overhead.

    .venv/bin/python bench/checkpoint.py [--size-gib 1] [--dir DIR] [--interval 10]
                                         [--skip-io | --skip-throughput]

Every figure is a ratio against a baseline measured in the same run on the same disk (these
machines are shared and noisy): measurements are interleaved; bandwidth ratios are printed for
the medians and for the best run of each side (the least-disturbed capability of both, which is
what the targets are checked against: other users' I/O and CPU load make single runs vary by
+-50 % here).

1. Write: bytes of the committed checkpoint / time from the writer's start to the commit
   (tensors, state, manifest, fsyncs, rename, `latest`), against raw sequential writes of the
   same byte count (64 MiB os.write + fsync, like `dd conv=fsync`). Target >= 0.8.
2. Read: `CheckpointStore.load()` of the newest checkpoint (maps tensors.bin copy-on-write and
   verifies every checksum in one sequential pass), against a raw sequential read of a file of
   the same size. The page cache is dropped for every file before each read (fdatasync +
   posix_fadvise DONTNEED), so both read from the disk. Target >= 0.8.
3. Stall: the time the training thread is blocked per checkpoint while it trains an MLP whose
   state (parameters + Adam moments) is >= size GiB, through `Session` (snapshot at the step
   boundary + any wait in the optimizer pre-step hook for the deferred copy), against a
   synchronous `torch.save` + fsync of the same state. Target <= 5 %. The stall of copying
   everything at the boundary (`defer_copy=False`) is printed too.
4. GIL: iterations/s of a pure-Python loop on the main thread while the writer thread writes
   the checkpoint, against the loop while a separate process runs the same writer on a state of
   the same size (no GIL shared: the difference is GIL contention, the rest is CPU/memory
   contention), and, for contrast, while `torch.save` runs on a thread.
5. Throughput: a ResNet-18 (64 px, CPU) training loop through `Session` with a checkpoint every
   N steps, N chosen so the interval is `--interval` seconds (scaled down from ~1 minute to keep
   the run short). The throughput without checkpoints comes from the same run: every step that
   overlapped a save (snapshot, deferred copy, writer) is replaced by the mean time of the steps
   that did not, so both figures see the same machine load (separate runs or alternating blocks
   differ by tens of percent on these shared machines). Target overhead <= 2 %.

Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spottrainer import fsio
from spottrainer.asyncsave import AsyncCheckpointer, SaveResult, SaveStatus
from spottrainer.codec import encode
from spottrainer.resnet import ResNet
from spottrainer.session import Session
from spottrainer.state import TrainState
from spottrainer.store import CheckpointStore

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 64 * MiB


def say(line: str = "") -> None:
    print(line, flush=True)


class BigMLP(nn.Module):
    """`layers` bias-free 4096x4096 linear layers (64 MiB of parameters each)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4096, 4096, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Trainer:
    """The big MLP with Adam: its state (parameters + two moments) is >= `size_gib` GiB."""

    def __init__(self, size_gib: float, device: torch.device, batch: int) -> None:
        layers = max(1, math.ceil(size_gib * GiB / 3 / (64 * MiB)))
        torch.manual_seed(0)
        self.model = BigMLP(layers).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.state = TrainState(model=self.model, optimizer=self.opt)
        self.x = torch.randn(batch, 4096, device=device)
        self.y = torch.randn(batch, 4096, device=device)
        self.step()  # creates the Adam moments

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()


def state_bytes(state: TrainState) -> int:
    return encode(state.capture()).total_bytes


def raw_write(path: Path, buf: memoryview, nbytes: int) -> float:
    """Seconds to write `nbytes` sequentially (64 MiB writes) and fsync; like dd conv=fsync."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            n = os.write(fd, buf[:min(left, len(buf))])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: Path, buf: memoryview) -> float:
    fsio.drop_page_cache(path)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def torch_save_sync(state: TrainState, path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state.capture(), f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def save_once(saver: AsyncCheckpointer, state: TrainState, step: int) -> SaveResult:
    state.step = step
    saver.save(step, state.capture)
    saver.wait()
    result = saver.last_result
    assert result is not None and result.status is SaveStatus.COMMITTED, result
    return result


def python_loop(seconds: float) -> float:
    """Iterations per second of a GIL-bound pure-Python loop."""
    n = 0
    end = time.perf_counter() + seconds
    while True:
        for _ in range(1000):
            n += 1
        if time.perf_counter() >= end:
            return n / seconds


def gil_probe(work: Callable[[], Any], seconds: float) -> float:
    """Python-loop rate on this thread while `work` runs on another (clipped to its duration)."""
    thread = threading.Thread(target=work)
    t0 = time.perf_counter()
    thread.start()
    rate = python_loop(seconds)
    thread.join()
    if time.perf_counter() - t0 < seconds:
        say(f"  (note: background work finished in {time.perf_counter() - t0:.2f}s "
            f"< probe {seconds}s)")
    return rate


def training_stall(trainer: Trainer, root: Path, *, defer: bool, saves: int) -> list[float]:
    """Blocked seconds per checkpoint while training, one checkpoint in flight at a time."""
    session = Session(trainer.state, root, keep=1, install_signal_handlers=False,
                      defer_copy=defer)
    session.restore()
    assert session.saver is not None
    session.saver.wait()  # buffer pre-faulted (as after restore in a real job)
    out = []
    for _ in range(saves):
        before = session.blocked_seconds
        session.request_checkpoint()
        session.step_done()        # boundary: snapshot (and start the writer)
        trainer.step()             # forward/backward; optimizer.step waits for the copy
        while session.saver.busy:  # train on until it is committed
            session.step_done()
            trainer.step()
        out.append(session.blocked_seconds - before)
    session.close()
    return out


PROC_WRITER = """
import sys, torch
from spottrainer.asyncsave import AsyncCheckpointer
from spottrainer.store import CheckpointStore
root, nbytes = sys.argv[1], int(sys.argv[2])
tree = {"w": torch.full((nbytes // 4,), 1.5)}
saver = AsyncCheckpointer(CheckpointStore(root, keep=1))
saver.save(1, lambda: tree)  # snapshot taken; the writer thread runs now, as in the parent
print("go", flush=True)
saver.wait()
"""


def process_probe(root: Path, nbytes: int, seconds: float) -> float:
    """Python-loop rate here while another process runs the same checkpoint writer (the same
    threads, writes and CRCs) on a state of `nbytes`: no GIL is shared."""
    proc = subprocess.Popen([sys.executable, "-c", PROC_WRITER, str(root), str(nbytes)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "go"
    rate = python_loop(seconds)
    proc.wait()
    shutil.rmtree(root, ignore_errors=True)
    return rate


def bench_io(args: argparse.Namespace, root: Path, device: torch.device) -> dict[str, float]:
    trainer = Trainer(args.size_gib, device, args.mlp_batch)
    state = trainer.state
    nbytes = state_bytes(state)
    say(f"state: {nbytes / GiB:.2f} GiB in {len(encode(state.capture()).records)} tensors "
        f"on {device}; directory {root}")
    store = CheckpointStore(root / "ckpt", keep=2)
    saver = AsyncCheckpointer(store)
    saver.prepare(nbytes)
    saver.wait()
    raw_path = root / "raw.bin"
    block = memoryview(bytearray(os.urandom(CHUNK)))

    # Interleaved: torch.save, raw write, our save (x repeats).
    t_torch: list[float] = []
    t_raw_w: list[float] = []
    results: list[SaveResult] = []
    ckpt_bytes = 0
    for i in range(args.repeats):
        if i < args.torch_save_repeats:
            t_torch.append(torch_save_sync(state, root / "torch.pt"))
            (root / "torch.pt").unlink()
        t_raw_w.append(raw_write(raw_path, block, nbytes))
        res = save_once(saver, state, i + 1)
        results.append(res)
        ckpt_bytes = dir_bytes(res.path)  # type: ignore[arg-type]
    write_s = [r.write_seconds for r in results]
    torch_s = statistics.median(t_torch)
    raw_w = nbytes / statistics.median(t_raw_w)
    ours_w = ckpt_bytes / statistics.median(write_s)
    best_w = (ckpt_bytes / min(write_s)) / (nbytes / min(t_raw_w))
    say()
    say("1. write bandwidth (committed checkpoint vs raw sequential write + fsync)")
    say(f"  raw write+fsync             {raw_w / GiB:8.3f} GiB/s runs {fmt(t_raw_w)} s")
    say(f"  checkpoint commit           {ours_w / GiB:8.3f} GiB/s runs {fmt(write_s)} s")
    say(f"  torch.save + fsync          {nbytes / torch_s / GiB:8.3f} GiB/s")
    say(f"  write ratio                 {ours_w / raw_w:8.3f}    medians; best-of-{len(write_s)} "
        f"{best_w:.3f} (target >= 0.8)")

    # Reads: raw vs load, interleaved, page cache dropped before each.
    newest = results[-1].path
    assert newest is not None
    read_buf = memoryview(bytearray(CHUNK))
    t_raw_r: list[float] = []
    t_load: list[float] = []
    for _ in range(args.read_repeats):
        t_raw_r.append(raw_read(raw_path, read_buf))
        for f in newest.iterdir():
            fsio.drop_page_cache(f)
        t0 = time.perf_counter()
        loaded = store.load(newest)
        t_load.append(time.perf_counter() - t0)
        del loaded
    raw_r = nbytes / statistics.median(t_raw_r)
    ours_r = ckpt_bytes / statistics.median(t_load)
    best_r = (ckpt_bytes / min(t_load)) / (nbytes / min(t_raw_r))
    say()
    say("2. read bandwidth (page cache dropped per file with posix_fadvise DONTNEED)")
    say(f"  raw sequential read         {raw_r / GiB:8.3f} GiB/s runs {fmt(t_raw_r)} s")
    say(f"  load + verify newest        {ours_r / GiB:8.3f} GiB/s runs {fmt(t_load)} s")
    say(f"  read ratio                  {ours_r / raw_r:8.3f}    medians; best-of-{len(t_load)} "
        f"{best_r:.3f} (target >= 0.8)")

    # Stall while training: Session with the deferred copy (default) and without.
    stall_default = training_stall(trainer, root / "train", defer=True, saves=args.repeats)
    stall_boundary = training_stall(trainer, root / "train-sync", defer=False, saves=2)
    say()
    say("3. stall per checkpoint (training thread blocked), MLP + Adam training on " + str(device))
    say(f"  torch.save + fsync (sync)   {torch_s:8.3f} s   runs {fmt(t_torch)}")
    say(f"  Session, deferred copy      {statistics.median(stall_default):8.4f} s   runs "
        f"{fmt(stall_default, 4)}")
    say(f"  Session, defer_copy=False   {statistics.median(stall_boundary):8.4f} s   runs "
        f"{fmt(stall_boundary, 4)}")
    stall = statistics.median(stall_default)
    say(f"  stall fraction              {stall / torch_s:8.2%}   (target <= 5 %; "
        f"{statistics.median(stall_boundary) / torch_s:.2%} with defer_copy=False)")

    # GIL: a Python loop during our writer thread vs during the same work in another process.
    probe = args.gil_seconds
    alone = python_loop(probe)
    during_proc = process_probe(root / "proc", nbytes, probe)
    state.step = 100
    saver.save(100, state.capture)  # the stall happens here, before the probe starts
    during_ours = python_loop(probe)
    saver.wait()
    during_torch = gil_probe(lambda: torch_save_sync(state, root / "torch.pt"), probe)
    (root / "torch.pt").unlink()
    say()
    say("4. GIL contention (pure-Python loop rate on the training thread)")
    say(f"  alone                       {alone / 1e6:8.2f} M it/s")
    say(f"  same writer in a process    {during_proc / 1e6:8.2f} M it/s  ratio "
        f"{during_proc / alone:.3f}  (no GIL shared: CPU/memory contention only)")
    say(f"  during checkpoint writer    {during_ours / 1e6:8.2f} M it/s  ratio "
        f"{during_ours / alone:.3f}  (vs process: {during_ours / during_proc:.3f})")
    say(f"  during torch.save thread    {during_torch / 1e6:8.2f} M it/s  ratio "
        f"{during_torch / alone:.3f}")
    saver.close()
    raw_path.unlink()
    return {"stall": stall / torch_s, "write": best_w, "read": best_r,
            "write_median": ours_w / raw_w, "read_median": ours_r / raw_r,
            "gil": during_ours / during_proc}


def bench_throughput(args: argparse.Namespace, root: Path, device: torch.device) -> float:
    # One intra-op thread: the training thread's CPU time is then all of the training work, and
    # a second core is left for the writer, as on a GPU machine whose CPU cores are mostly idle.
    # (With two OpenMP threads on two shared cores, one preempted thread stalls every step.)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ResNet(num_classes=1000, width=64, depth=2, image_size=64).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = TrainState(model=model, optimizer=opt)
    x = torch.randn(args.batch_size, 3, 64, 64, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    session = Session(state, root / "tp", keep=2, install_signal_handlers=False)
    session.restore()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    step_s = (time.perf_counter() - t0) / 5
    every = max(2, round(args.interval / step_s))
    assert session.saver is not None
    saver = session.saver
    times: list[float] = []
    active: list[bool] = []
    cpu0, thread0 = time.process_time(), time.thread_time()
    for i in range(every * args.checkpoints + every // 2):
        if i % every == every // 2:
            session.request_checkpoint()  # taken at this step's boundary
        busy = saver.busy
        t0 = time.perf_counter()
        step()
        session.step_done()
        times.append(time.perf_counter() - t0)
        active.append(busy or saver.busy)
    saver.wait()
    writer_cpu = ((time.process_time() - cpu0) - (time.thread_time() - thread0)) / args.checkpoints
    idle = [t for t, a in zip(times, active, strict=True) if not a]
    busy_steps = sum(active)
    # Throughput without checkpoints, from the same run: every step that overlapped a save
    # (snapshot, deferred copy, writer) replaced by the mean of the steps that did not. Both
    # figures then see the same machine load (these machines are shared).
    with_ckpt = sum(times)
    without = sum(idle) + busy_steps * statistics.fmean(idle)
    overhead = with_ckpt / without - 1
    assert saver.last_committed is not None
    nbytes = saver.last_committed.nbytes
    say()
    say(f"5. training throughput (ResNet-18, 64 px, batch {args.batch_size}, 1 thread, {device}, "
        f"state {nbytes / MiB:.0f} MiB, SGD momentum)")
    say(f"  step {statistics.median(times):.3f} s; checkpoint every {every} steps = "
        f"~{every * step_s:.0f} s (scaled down from ~60 s); {args.checkpoints} checkpoints, "
        f"{len(times)} steps, {busy_steps} overlapped a save")
    overlapped = [t for t, a in zip(times, active, strict=True) if a]
    say(f"  steps overlapping a save    {statistics.fmean(overlapped):.3f} s mean; others "
        f"{statistics.fmean(idle):.3f} s mean")
    say(f"  throughput overhead         {overhead:8.2%}   (target <= 2 %)")
    say(f"  writer CPU per checkpoint   {writer_cpu:8.3f} s = {writer_cpu / (every * step_s):.2%} "
        f"of the interval (the cost on a machine with no idle core)")
    say(f"  load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus")
    session.close()
    torch.set_num_threads(threads)
    return overhead


def fmt(values: list[float], digits: int = 3) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="state size for 1-4")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--torch-save-repeats", type=int, default=2)
    p.add_argument("--read-repeats", type=int, default=5)
    p.add_argument("--gil-seconds", type=float, default=1.5)
    p.add_argument("--interval", type=float, default=10.0, help="checkpoint interval (s) for 5")
    p.add_argument("--checkpoints", type=int, default=6, help="checkpoints taken in 5")
    p.add_argument("--batch-size", type=int, default=16, help="ResNet batch for 5")
    p.add_argument("--mlp-batch", type=int, default=64, help="MLP batch for 1")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-io", action="store_true", help="only the throughput part (5)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = Path(tempfile.mkdtemp(prefix="spottrainer-bench-", dir=args.dir))
    load = os.getloadavg()[0]
    say(f"bench/checkpoint.py  torch {torch.__version__}  threads {torch.get_num_threads()}  "
        f"cpus {os.cpu_count()}  load average {load:.2f}")
    if load > (os.cpu_count() or 1) / 2:
        say("note: other processes are using this machine; CPU- and disk-bound figures vary "
            "from run to run (compare medians and best-of, rerun on a quiet machine)")
    try:
        io = ({"stall": 0.0, "write": 1.0, "read": 1.0, "gil": 1.0} if args.skip_io
              else bench_io(args, root, device))
        overhead = 0.0 if args.skip_throughput else bench_throughput(args, root, device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    say()
    say(f"summary: stall {io['stall']:.2%} (<= 5 %), write ratio {io['write']:.2f} (>= 0.8), "
        f"read ratio {io['read']:.2f} (>= 0.8) [best-of; medians {io.get('write_median', 1):.2f}"
        f" / {io.get('read_median', 1):.2f}], GIL ratio {io['gil']:.2f}, "
        f"throughput overhead {overhead:.2%} (<= 2 %)")
    ok = (io["stall"] <= 0.05 and io["write"] >= 0.8 and io["read"] >= 0.8
          and overhead <= 0.02)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
