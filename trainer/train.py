"""Reference training script: a ResNet image classifier that survives spot interruptions.

    python -m spottrainer.train --image-size 32 --width 8 --depth 1 --steps 200   # tiny, CPU
    torchrun --nproc-per-node 2 -m spottrainer.train ...                         # DDP

Checkpoints go to $SPOTAGENT_CHECKPOINT_DIR (else --checkpoint-dir). A restart resumes exactly
from the newest valid checkpoint. SIGUSR1 commits a checkpoint and continues, SIGTERM commits
and exits 0. Logs are JSON lines on stdout (event "step": step, loss, samples_per_s, lr).
Exit 0 when --steps is reached (after a final checkpoint) or after a committed SIGTERM save.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ._compat import np
from ._log import JsonLineFormatter, event
from .data import ResumableSampler, iterate, worker_init_fn
from .datasets import ImageFolder, SyntheticImages
from .errors import SpottrainerError
from .protocol import EXIT_FAILURE, SignalFlags
from .resnet import ResNet
from .session import Session
from .state import TrainState


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spottrainer.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="synthetic",
                   help="'synthetic' or PATH of an image folder (class subdirectories)")
    p.add_argument("--dataset-size", type=int, default=10_000,
                   help="number of synthetic samples per epoch")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--width", type=int, default=64, help="channels of the first stage")
    p.add_argument("--depth", type=int, default=2, help="basic blocks per stage (2: ResNet-18)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-5)
    p.add_argument("--steps", type=int, default=1000, help="total optimizer steps of the job")
    p.add_argument("--checkpoint-every-steps", type=int, default=None)
    p.add_argument("--checkpoint-every-seconds", type=float, default=None,
                   help="default 300 when neither interval is given")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to retain")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                   help="used when SPOTAGENT_CHECKPOINT_DIR is unset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="data-loader worker processes")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--amp", action="store_true", help="mixed precision (CUDA only)")
    p.add_argument("--log-every", type=int, default=10, help="log every N steps")
    args = p.parse_args(argv)
    if args.checkpoint_every_steps is None and args.checkpoint_every_seconds is None:
        args.checkpoint_every_seconds = 300.0
    return args


def configure_logging() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonLineFormatter())
    log = logging.getLogger("spottrainer")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)


def setup_distributed() -> tuple[int, int, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: NCCL on GPUs, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        tdist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
        return tdist.get_rank(), world, device
    return 0, 1, device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed)


def build_dataset(args: argparse.Namespace) -> Dataset[tuple[torch.Tensor, int]]:
    if args.data == "synthetic":
        return SyntheticImages(args.dataset_size, image_size=args.image_size,
                               num_classes=args.num_classes, seed=args.seed)
    return ImageFolder(Path(args.data), image_size=args.image_size)


def train(args: argparse.Namespace, flags: SignalFlags) -> int:
    rank, world, device = setup_distributed()
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    model: nn.Module = ResNet(num_classes=args.num_classes, width=args.width, depth=args.depth,
                              image_size=args.image_size, dropout=args.dropout).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))
    use_amp = bool(args.amp and device.type == "cuda")
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    dataset = build_dataset(args)
    sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                               seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.workers, worker_init_fn=worker_init_fn,
                        persistent_workers=args.workers > 0, pin_memory=device.type == "cuda",
                        generator=torch.Generator())
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       sampler=sampler)
    session = Session.from_env(state, checkpoint_dir=args.checkpoint_dir, keep=args.keep,
                               every_steps=args.checkpoint_every_steps,
                               every_seconds=args.checkpoint_every_seconds, flags=flags)
    start = session.restore()
    event(logging.INFO, "train_start", step=start, steps=args.steps, rank=rank, world=world,
          device=str(device), params=sum(p.numel() for p in model.parameters()))
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    t_last, n_last = time.monotonic(), 0
    samples_seen = 0
    if state.step < args.steps:
        for images, labels in iterate(loader, sampler):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, enabled=use_amp):
                loss = loss_fn(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_value = float(loss.detach())
            samples_seen += len(labels) * world
            stop = session.step_done(loss=loss_value, samples=len(labels) * world)
            if rank == 0 and (state.step % args.log_every == 0 or stop
                              or state.step >= args.steps):
                now = time.monotonic()
                rate = (samples_seen - n_last) / (now - t_last) if now > t_last else 0.0
                t_last, n_last = now, samples_seen
                event(logging.INFO, "step", step=state.step, loss=round(loss_value, 6),
                      samples_per_s=round(rate, 2), lr=scheduler.get_last_lr()[0])
            if stop or state.step >= args.steps:
                break
    code = session.exit_code if session.exit_code is not None else session.finish()
    event(logging.INFO, "train_exit", step=state.step, exit_code=code, rank=rank)
    if world > 1:
        tdist.destroy_process_group()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    # Handlers first: a SIGTERM while the model or the data set is being built is then honoured
    # at the first step boundary instead of killing the process.
    flags = SignalFlags()
    flags.install()
    configure_logging()
    args = parse_args(argv)
    try:
        return train(args, flags)
    except SpottrainerError as err:
        event(logging.ERROR, "train_failed", problem=str(err))
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
