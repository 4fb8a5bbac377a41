"""The EC2 client: one factory with bounded retries and timeouts, and one error translation.

Every EC2 call of the agent goes through a client made by `client()` (standard retry mode,
`max_attempts`, connect/read timeouts, region, optional endpoint for emulators and VPC endpoints)
and is wrapped in `translate("Operation")`, which turns botocore's exceptions into one
`Ec2Error` whose line names the operation and the AWS error code.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

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

from spotagent.errors import SpotagentError

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


# The parsed EC2 service model is the costly part of a client (~0.25 s): one loader keeps it for
# every client of the process. Each client still gets its own session (credentials resolved
# afresh) and its own connection pool.
_LOADER_LOCK = threading.Lock()
_loader: botocore.loaders.Loader | None = None


def client(*, region: str, endpoint_url: str | None = None, connect_timeout: float = 5.0,
           read_timeout: float = 20.0, max_attempts: int = 5) -> EC2Client:
    """A boto3 EC2 client with standard retries and explicit timeouts.

    Credentials come from boto3's usual chain (instance role on EC2, profile or environment on a
    workstation).
    """
    global _loader
    cfg = BotoConfig(
        region_name=region,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "max_attempts": max_attempts},
    )
    with _LOADER_LOCK:  # sessions and the loader's cache are not thread-safe
        # A botocore client is what boto3 hands out for EC2 (boto3 adds nothing to EC2
        # clients); going to botocore directly keeps boto3 from growing the shared loader's
        # search path on every session.
        if _loader is None:
            _loader = botocore.loaders.create_loader()
        session = botocore.session.get_session()
        session.register_component("data_loader", _loader)
        made = session.create_client("ec2", region_name=region, endpoint_url=endpoint_url,
                                     config=cfg)
    return cast("EC2Client", made)


def client_from_config(cfg: Any, *, region: str | None = None) -> EC2Client:
    """The client for a `spotagent.config.Config` ([aws] section); `region` overrides
    aws.region (the agent passes the region from instance metadata when aws.region is unset)."""
    reg = cfg.aws.region or region
    if not reg:
        raise Ec2Error("client", "NoRegion", "aws.region is unset and no region was given")
    return client(region=reg, endpoint_url=cfg.aws.endpoint_url,
                  connect_timeout=cfg.aws.connect_timeout, read_timeout=cfg.aws.read_timeout,
                  max_attempts=cfg.aws.max_attempts)


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
