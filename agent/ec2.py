"""The EC2 client: one factory with bounded retries and timeouts, and one error translation.

Every EC2 call of the agent goes through a client made by `client()` (standard retry mode,
`max_attempts`, connect/read timeouts, region, optional endpoint for emulators and VPC endpoints)
and is wrapped in `translate("Operation")`, which turns botocore's exceptions into one
`Ec2Error` whose line names the operation and the AWS error code.

The agent's clients (`model="agent"`, the default) are built on the trimmed EC2 model of
`spotagent.ec2model` (the operations the agent calls: ~15 MB less memory than botocore's full
model); when it is missing, a short-lived child process builds it, and when that fails the
client falls back to the full model with a warning. `model="full"` (the operator's `spotagent
pool`, test set-up) and `SPOTAGENT_EC2_MODEL=full` (an escape hatch) use botocore's full model.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import botocore.loaders
import botocore.session
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from spotagent import ec2model, subp
from spotagent.errors import SpotagentError
from spotagent.log import get_logger

if TYPE_CHECKING:  # the stubs are a dev dependency; the agent does not need them to run
    from mypy_boto3_ec2 import EC2Client


class Ec2Error(SpotagentError):
    """An EC2 call failed. `code` is the AWS error code (`VolumeInUse`, ...) or, for failures
    that never reached EC2, a short name of the cause (`NoCredentials`, `EndpointUnreachable`)."""

    def __init__(self, operation: str, code: str, detail: str, **context: Any) -> None:
        super().__init__(f"EC2 {operation} failed: {code}: {detail}", **context)
        self.operation = operation
        self.code = code
        self.detail = detail


log = get_logger("ec2")

Model = Literal["agent", "full"]

# The parsed EC2 service model is the costly part of a client (~0.25 s, 24 MB for the full one):
# one loader per model keeps it for every client of the process. Each client still gets its own
# session (credentials resolved afresh) and its own connection pool.
_LOADER_LOCK = threading.Lock()
_loaders: dict[Path | None, botocore.loaders.Loader] = {}  # data root (None: botocore's own)
# (state dir, $SPOTAGENT_CACHE, $SPOTAGENT_EC2_MODEL) -> trimmed data root (None: full model)
_roots: dict[tuple[Path | None, str | None, str | None], Path | None] = {}


def client(*, region: str, endpoint_url: str | None = None, connect_timeout: float = 5.0,
           read_timeout: float = 20.0, max_attempts: int = 5, model: Model = "agent",
           state_dir: Path | None = None) -> EC2Client:
    """A boto3 EC2 client with standard retries and explicit timeouts.

    Credentials come from boto3's usual chain (instance role on EC2, profile or environment on a
    workstation). `model="agent"` builds it on the trimmed EC2 model (found or built under the
    cache, `state_dir`, or a private temporary directory; see `spotagent.ec2model`), which has
    only the operations of `ec2model.OPERATIONS`; `model="full"` on botocore's whole model.
    """
    cfg = BotoConfig(
        region_name=region,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "max_attempts": max_attempts},
    )
    with _LOADER_LOCK:  # sessions and the loaders' caches are not thread-safe
        key = (state_dir, os.environ.get("SPOTAGENT_CACHE"),
               os.environ.get("SPOTAGENT_EC2_MODEL"))
        root = _trimmed_root(key) if model == "agent" else None
        if root is not None:
            try:
                made = _create(root, region, endpoint_url, cfg)
                missing = set(ec2model.OPERATIONS) - set(
                    made.meta.service_model.operation_names)
                if not missing:
                    return cast("EC2Client", made)
                reason = f"operations missing: {','.join(sorted(missing))}"
            except (BotoCoreError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            log.warning("ec2_model_fallback", reason=reason, path=str(root), model="full")
            _roots[key] = None
        made = _create(None, region, endpoint_url, cfg)
    return cast("EC2Client", made)


def _create(root: Path | None, region: str, endpoint_url: str | None, cfg: BotoConfig) -> Any:
    # A botocore client is what boto3 hands out for EC2 (boto3 adds nothing to EC2 clients);
    # going to botocore directly keeps boto3 (and its import cost) out of the agent and from
    # growing the shared loader's search path on every session.
    loader = _loaders.get(root)
    if loader is None:
        paths = [] if root is None else [str(root)]  # ours first: its service-2.json wins
        loader = _loaders[root] = botocore.loaders.Loader(extra_search_paths=paths)
    session = botocore.session.get_session()
    session.register_component("data_loader", loader)
    return session.create_client("ec2", region_name=region, endpoint_url=endpoint_url,
                                 config=cfg)


def _trimmed_root(key: tuple[Path | None, str | None, str | None]) -> Path | None:
    """The trimmed model's data root, built by a child process when missing (building parses
    the full model: done here, the agent's memory high-water mark would keep it). None: use
    the full model (asked for by SPOTAGENT_EC2_MODEL=full, or the trimmed one is unusable;
    never an error, it is only an optimisation). Decided once per process and `key`."""
    if key in _roots:
        return _roots[key]
    state_dir, _cache, choice = key
    root: Path | None = None
    if (choice or "").strip().lower() == "full":
        log.info("ec2_model_selected", model="full", reason="SPOTAGENT_EC2_MODEL=full")
    else:
        try:
            root = ec2model.find(state_dir)
            if root is None:
                root = _build(state_dir)
        except (SpotagentError, OSError) as exc:
            log.warning("ec2_model_fallback", reason=str(exc), model="full")
            root = None
        else:
            if root is not None:
                log.info("ec2_model_selected", model="trimmed", path=str(root),
                         operations=len(ec2model.OPERATIONS))
    _roots[key] = root
    return root


def _build(state_dir: Path | None) -> Path | None:
    started = time.monotonic()
    argv = [sys.executable, "-m", "spotagent.ec2model", "build"]
    for base in ec2model.bases(state_dir):
        argv += ["--base", str(base)]
    subp.run(argv, timeout=ec2model.BUILD_TIMEOUT)
    root = ec2model.find(state_dir)
    if root is None:
        log.warning("ec2_model_fallback", reason="built, but no current model found",
                    model="full")
        return None
    log.info("ec2_model_built", path=str(root),
             seconds=round(time.monotonic() - started, 3))
    return root


def client_from_config(cfg: Any, *, region: str | None = None) -> EC2Client:
    """The client for a `spotagent.config.Config` ([aws] section); `region` overrides
    aws.region (the agent passes the region from instance metadata when aws.region is unset)."""
    reg = cfg.aws.region or region
    if not reg:
        raise Ec2Error("client", "NoRegion", "aws.region is unset and no region was given")
    return client(region=reg, endpoint_url=cfg.aws.endpoint_url,
                  connect_timeout=cfg.aws.connect_timeout, read_timeout=cfg.aws.read_timeout,
                  max_attempts=cfg.aws.max_attempts, state_dir=Path(cfg.agent.state_dir))


@contextmanager
def translate(operation: str, **context: Any) -> Iterator[None]:
    """Turn botocore failures inside the block into `Ec2Error` naming `operation`."""
    try:
        yield
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code = str(err.get("Code") or "Unknown")
        detail = " ".join(str(err.get("Message") or exc).split())  # one line, always
        raise Ec2Error(operation, code, detail, **context) from exc
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise Ec2Error(operation, "NoCredentials", "no AWS credentials found (instance role, "
                       "profile or environment)", **context) from exc
    except NoRegionError as exc:
        raise Ec2Error(operation, "NoRegion", str(exc), **context) from exc
    except (EndpointConnectionError, ConnectTimeoutError) as exc:
        raise Ec2Error(operation, "EndpointUnreachable", str(exc), **context) from exc
    except ReadTimeoutError as exc:
        raise Ec2Error(operation, "ReadTimeout", str(exc), **context) from exc
    except BotoCoreError as exc:
        raise Ec2Error(operation, type(exc).__name__, str(exc), **context) from exc
