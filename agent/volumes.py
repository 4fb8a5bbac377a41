"""EC2 side of the pool of warm volumes: list, claim by attach, tag, release, create.

The contract with every other tool is a set of tags on the volumes (see `TAGS`); the lock is
`AttachVolume`. EC2 has no conditional tag write, so a tag can never be a lock: a volume is ours
when *our* attach succeeded, and only then do we write `spotagent:owner` and bump
`spotagent:generation`, and read the volume back to confirm. Every EC2 call of the agent lives in
this module (the IAM policy test scans it), each inside `ec2.translate`.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from spotagent.crashpoints import crash_point
from spotagent.ec2 import Ec2Error, translate
from spotagent.errors import SpotagentError
from spotagent.log import get_logger

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ec2.literals import VolumeTypeType
    from mypy_boto3_ec2.type_defs import (
        CreateVolumeRequestTypeDef,
        FilterTypeDef,
        TagTypeDef,
        VolumeTypeDef,
    )

log = get_logger("volumes")

POOL_TAG = "spotagent:pool"
OWNER_TAG = "spotagent:owner"
GENERATION_TAG = "spotagent:generation"
CHECKPOINT_STEP_TAG = "spotagent:checkpoint-step"
WARM_TAG = "spotagent:warm"
DONE_TAG = "spotagent:done"
CREATED_EMPTY_TAG = "spotagent:created-empty"
TAGS = (POOL_TAG, OWNER_TAG, GENERATION_TAG, CHECKPOINT_STEP_TAG, WARM_TAG, DONE_TAG,
        CREATED_EMPTY_TAG)
# The tags an instance writes or deletes after creation; `spotagent:pool` is not among them,
# so the instance policy can forbid moving volumes in or out of a pool.
INSTANCE_TAGS = (OWNER_TAG, GENERATION_TAG, CHECKPOINT_STEP_TAG, WARM_TAG, DONE_TAG,
                 CREATED_EMPTY_TAG)
# The tags a new volume gets at creation (TagSpecifications), as the create policy allows.
CREATE_TAGS = (POOL_TAG, GENERATION_TAG, WARM_TAG, CREATED_EMPTY_TAG)

DEFAULT_DEVICE = "/dev/sdf"  # only a hint on Nitro; the device is found by NVMe serial
# EBS Provisioned Rate for Volume Initialization, MiB/s (valid 100-300; billed per volume):
# a snapshot-restored volume is readable at this rate instead of the lazy-load trickle.
DEFAULT_INIT_RATE_MIB = 300
INIT_RATE_RANGE = (100, 300)

# Attach errors that mean "someone else got there first" (or the volume vanished): next one.
_LOST_RACE = frozenset({"VolumeInUse", "IncorrectState", "InvalidVolume.NotFound"})
# CreateVolume errors an endpoint gives for a parameter it does not know.
_UNKNOWN_PARAMETER = frozenset({"UnknownParameter", "InvalidParameter", "InvalidParameterValue",
                                "InvalidParameterCombination", "UnsupportedOperation"})


# --- errors ----------------------------------------------------------------------------------


class PoolError(SpotagentError):
    """The pool cannot do what was asked (base of the pool's errors)."""


class PoolEmptyError(PoolError):
    """No volume of the pool is free in this AZ (the caller applies pool.on_empty)."""


class AttachTimeoutError(PoolError):
    """An attach did not reach `attached` in time; the volume was handed back if EC2 let us."""


class DetachTimeoutError(PoolError):
    """A detach did not bring the volume back to `available` in time."""


class CreateTimeoutError(PoolError):
    """A new volume did not become `available` in time."""


class ClaimLostError(PoolError):
    """The volume is no longer ours: attached elsewhere, or its owner tag names someone else."""


class StillMountedError(PoolError):
    """Refused to detach: the volume's device is still mounted on this host."""


class ReleaseRefusedError(PoolError):
    """`pool release` refused: the owner is alive or the volume is attached."""


# --- what a volume looks like to the pool ------------------------------------------------------


def _int_tag(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class Volume:
    """One pool volume as EC2 described it."""

    volume_id: str
    az: str
    state: str                      # creating | available | in-use | deleting | error
    volume_type: str
    size_gib: int
    multi_attach: bool
    snapshot_id: str | None
    attached_to: str | None         # instance id of the live attachment, if any
    attachment_state: str | None    # attaching | attached | detaching | busy
    tags: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_api(cls, v: VolumeTypeDef) -> Volume:
        live = [a for a in v.get("Attachments", []) if a.get("State") != "detached"]
        att = live[0] if live else None
        return cls(
            volume_id=v.get("VolumeId", ""),
            az=v.get("AvailabilityZone", ""),
            state=v.get("State", ""),
            volume_type=v.get("VolumeType", ""),
            size_gib=v.get("Size", 0),
            multi_attach=bool(v.get("MultiAttachEnabled", False)),
            snapshot_id=v.get("SnapshotId") or None,
            attached_to=att.get("InstanceId") if att else None,
            attachment_state=att.get("State") if att else None,
            tags={t["Key"]: t.get("Value", "") for t in v.get("Tags", []) if "Key" in t},
        )

    @property
    def pool(self) -> str | None:
        return self.tags.get(POOL_TAG)

    @property
    def owner(self) -> str | None:
        return self.tags.get(OWNER_TAG) or None

    @property
    def generation(self) -> int:
        return _int_tag(self.tags.get(GENERATION_TAG)) or 0

    @property
    def checkpoint_step(self) -> int | None:
        return _int_tag(self.tags.get(CHECKPOINT_STEP_TAG))

    @property
    def warm(self) -> bool:
        return self.tags.get(WARM_TAG) == "true"

    @property
    def done(self) -> bool:
        return self.tags.get(DONE_TAG) == "true"

    @property
    def created_empty(self) -> bool:
        return self.tags.get(CREATED_EMPTY_TAG) == "true"

    def refusal(self) -> str | None:
        """Why this volume must never be claimed, or None."""
        if self.multi_attach:
            return "multi-attach enabled (an attach would not be exclusive)"
        if self.done:
            return "done (its job is complete)"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"volume_id": self.volume_id, "pool": self.pool, "az": self.az,
                "state": self.state, "owner": self.owner, "attached_to": self.attached_to,
                "generation": self.generation, "checkpoint_step": self.checkpoint_step,
                "warm": self.warm, "done": self.done, "created_empty": self.created_empty,
                "volume_type": self.volume_type, "size_gib": self.size_gib}


@dataclass(frozen=True)
class Claim:
    """A volume this instance holds: attached (state `attached`), owner tag ours."""

    volume: Volume
    instance_id: str
    reused: bool  # it was already attached to this instance (an agent restart)

    @property
    def volume_id(self) -> str:
        return self.volume.volume_id

    @property
    def generation(self) -> int:
        return self.volume.generation

    @property
    def created_empty(self) -> bool:
        return self.volume.created_empty


@dataclass(frozen=True)
class VolumeSpec:
    """How new pool volumes are made (pool.on_empty = create, `spotagent pool create`)."""

    volume_type: str = "gp3"
    size_gib: int | None = 200      # None: the snapshot's size
    iops: int | None = 3000         # gp3, io1, io2
    throughput: int | None = 250    # gp3 only, MiB/s
    snapshot_id: str | None = None
    from_ami: str | None = None     # use the AMI's root snapshot
    init_rate_mib: int | None = DEFAULT_INIT_RATE_MIB  # only for volumes from a snapshot

    def __post_init__(self) -> None:
        if self.snapshot_id and self.from_ami:
            raise PoolError("give a snapshot or an AMI to create volumes from, not both",
                            snapshot_id=self.snapshot_id, from_ami=self.from_ami)
        if not (self.snapshot_id or self.from_ami) and not self.size_gib:
            raise PoolError("an empty volume needs a size")
        lo, hi = INIT_RATE_RANGE
        if self.init_rate_mib is not None and not lo <= self.init_rate_mib <= hi:
            raise PoolError(f"volume initialization rate must be {lo}-{hi} MiB/s",
                            init_rate_mib=self.init_rate_mib)

    @classmethod
    def from_config(cls, cfg: Any) -> VolumeSpec:
        p = cfg.pool
        return cls(volume_type=p.volume_type, size_gib=p.size_gib, iops=p.iops,
                   throughput=p.throughput, snapshot_id=p.snapshot_id, from_ami=p.from_ami,
                   init_rate_mib=p.init_rate_mib or None)


# --- pure helpers ----------------------------------------------------------------------------


def order_candidates(volumes: Sequence[Volume], rng: random.Random) -> list[Volume]:
    """Newest checkpoint first, then warm before cold, then a random order among equals
    (so racing agents spread over equal volumes instead of all hitting the first)."""
    keyed = [(-(v.checkpoint_step if v.checkpoint_step is not None else -1), not v.warm,
              rng.random(), v) for v in volumes]
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


def next_backoff(attempt: int, cap: float, rng: random.Random, base: float = 1.0) -> float:
    """Seconds to wait before claim attempt `attempt + 1` (attempt counts from 0): exponential,
    capped at `cap`, with equal jitter (between half and all of the step) so waiting agents do
    not retry in lock-step."""
    step = min(cap, base * 2.0 ** min(max(attempt, 0), 62))
    return step / 2 + rng.uniform(0.0, step / 2)


def _tags(items: Mapping[str, str]) -> list[TagTypeDef]:
    return [{"Key": k, "Value": v} for k, v in items.items()]


# --- the pool --------------------------------------------------------------------------------


class Pool:
    """One named pool seen from one EC2 client.

    `clock` and `sleep` are injected so callers can bound waits; `rng` breaks ties between
    equal candidates.
    """

    def __init__(self, client: EC2Client, name: str, *, spec: VolumeSpec | None = None,
                 attach_timeout: float = 120.0, detach_timeout: float = 120.0,
                 create_timeout: float = 300.0, poll_interval: float = 1.0,
                 device: str = DEFAULT_DEVICE, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.client = client
        self.name = name
        self.spec = spec or VolumeSpec()
        self.attach_timeout = attach_timeout
        self.detach_timeout = detach_timeout
        self.create_timeout = create_timeout
        self.poll_interval = poll_interval
        self.device = device
        self.rng = rng or random.Random()
        self._clock = clock
        self._sleep = sleep

    @classmethod
    def from_config(cls, cfg: Any, client: EC2Client, **kwargs: Any) -> Pool:
        return cls(client, cfg.pool.name, spec=VolumeSpec.from_config(cfg),
                   attach_timeout=float(cfg.pool.attach_timeout), **kwargs)

    # --- reading ------------------------------------------------------------------------------

    def volumes(self, *, az: str | None = None, state: str | None = None,
                attached_to: str | None = None) -> list[Volume]:
        """The pool's volumes, filtered by EC2 (these filters work on EC2 and moto alike)."""
        filters: list[FilterTypeDef] = [{"Name": f"tag:{POOL_TAG}", "Values": [self.name]}]
        if az:
            filters.append({"Name": "availability-zone", "Values": [az]})
        if state:
            filters.append({"Name": "status", "Values": [state]})
        if attached_to:
            filters.append({"Name": "attachment.instance-id", "Values": [attached_to]})
        return _describe(self.client, Filters=filters)

    def get(self, volume_id: str) -> Volume:
        return describe_volume(self.client, volume_id)

    def is_warm(self, volume_id: str) -> bool:
        return self.get(volume_id).warm

    def attached_to(self, instance_id: str) -> Volume | None:
        """The pool volume attached (or attaching) to this instance, if any. Reads only."""
        return self._held(self.volumes(attached_to=instance_id), instance_id)

    @staticmethod
    def _held(mine: Sequence[Volume], instance_id: str) -> Volume | None:
        held = [v for v in mine if v.attached_to == instance_id
                and v.attachment_state in ("attaching", "attached", "busy")]
        if len(held) > 1:
            raise PoolError("several pool volumes are attached to this instance; detach all "
                            "but one", instance_id=instance_id,
                            volumes=",".join(v.volume_id for v in held))
        return held[0] if held else None

    def candidates(self, az: str, listing: Sequence[Volume] | None = None) -> list[Volume]:
        """Free volumes of the pool in `az`, best first; refused ones are logged and left out.
        `listing`: an already fetched listing of the pool to pick from."""
        out = []
        if listing is None:
            listing = self.volumes(az=az, state="available")
        for v in listing:
            if v.az != az or v.state != "available":
                continue
            why = v.refusal()
            if why is not None:
                log.info("candidate_refused", volume_id=v.volume_id, reason=why)
                continue
            out.append(v)
        return order_candidates(out, self.rng)

    def free_by_az(self) -> dict[str, tuple[int, int]]:
        """{az: (free, free and warm)} over claimable available volumes."""
        counts: dict[str, tuple[int, int]] = {}
        for v in self.volumes(state="available"):
            if v.refusal() is None:
                free, warm = counts.get(v.az, (0, 0))
                counts[v.az] = (free + 1, warm + int(v.warm))
        return dict(sorted(counts.items()))

    # --- claiming -----------------------------------------------------------------------------

    def claim(self, instance_id: str, az: str) -> Claim:
        """Claim one free volume of the pool for `instance_id` in `az`.

        1. One listing of the pool. A volume already attached to this instance is kept
           (agent restart: never a second one); a release of ours cut short (still detaching,
           or detached with our owner tag left) is finished first (`finish_releases`).
        2. Candidates: available, in `az`, not multi-attach, not done; newest checkpoint step
           first, then warm, then random (`order_candidates`).
        3. AttachVolume on the best candidate is the lock. VolumeInUse / IncorrectState /
           NotFound: someone else won, re-read the candidates and try the next best.
           InvalidVolume.ZoneMismatch: logged and skipped.
        4. After our attach: owner tag = us, generation + 1, then read back until the
           attachment is `attached` and the tags are ours (bounded by attach_timeout: the
           volume is handed back and AttachTimeoutError raised).

        Raises PoolEmptyError when every candidate was taken or none exists.
        """
        listing = self.volumes()  # one read serves both questions: held? and what is free?
        held = self._held(listing, instance_id)
        if held is not None:
            return self._keep(held, instance_id)
        if self.finish_releases(instance_id, listing):
            listing = self.volumes()  # those volumes are free now
        candidates = self.candidates(az, listing)
        tried: set[str] = set()
        while candidates:
            vol = candidates[0]
            tried.add(vol.volume_id)
            claim = self._try_claim(vol.volume_id, instance_id)
            if claim is not None:
                return claim
            # We lost a race, so the listing is stale: read it again rather than attach our
            # way down a list of volumes that other agents have taken (AttachVolume calls are
            # throttled harder than DescribeVolumes).
            candidates = [v for v in self.candidates(az) if v.volume_id not in tried]
        raise PoolEmptyError("no free volume in the pool", pool=self.name, az=az,
                             tried=len(tried))

    def finish_releases(self, instance_id: str,
                        listing: Sequence[Volume] | None = None) -> list[str]:
        """Finish releases of this instance that were cut short (the agent died between
        DetachVolume and dropping its owner tag): wait until such a volume is available, then
        drop our owner tag, so no claim leaks. A volume still attached to us is not touched
        (it is re-used). Returns the volumes finished."""
        done = []
        for v in listing if listing is not None else self.volumes():
            detaching = v.attached_to == instance_id and v.attachment_state == "detaching"
            stale_tag = v.attached_to is None and v.owner == instance_id
            if not (detaching or stale_tag):
                continue
            self._wait_available(v.volume_id, self.detach_timeout, DetachTimeoutError)
            self._untag_owner(v.volume_id, instance_id)
            log.info("release_finished", volume_id=v.volume_id, instance_id=instance_id)
            done.append(v.volume_id)
        return done

    def _try_claim(self, volume_id: str, instance_id: str) -> Claim | None:
        """Attach (the lock), tag, confirm. None when another instance won the volume."""
        ids = {"volume_id": volume_id, "instance_id": instance_id}
        started = self._clock()
        while True:
            try:
                with translate("AttachVolume", **ids):
                    self.client.attach_volume(VolumeId=volume_id, InstanceId=instance_id,
                                              Device=self.device)
                break
            except Ec2Error as exc:
                if exc.code == "IncorrectState" and instance_id in exc.detail:
                    # Our instance is not attachable yet (EC2 may still call it `pending` while
                    # it already runs us): wait for it, not for another volume.
                    if self._clock() - started >= self.attach_timeout:
                        raise AttachTimeoutError(
                            f"instance {instance_id} not attachable after "
                            f"{self.attach_timeout:g}s: {exc.detail}", **ids) from exc
                    log.info("instance_not_ready", detail=exc.detail, **ids)
                    self._sleep(self.poll_interval)
                    continue
                if exc.code in _LOST_RACE:
                    log.info("claim_conflict", code=exc.code, **ids)
                    return None
                if exc.code == "InvalidVolume.ZoneMismatch":
                    log.warning("claim_zone_mismatch", detail=exc.detail, **ids)
                    return None
                raise
        crash_point("after_attach")
        # The attach succeeded: nobody else can attach this volume now, so its tags are ours to
        # write. Read the generation after the attach (a describe from before it may be stale).
        generation = self.get(volume_id).generation + 1
        self._tag(volume_id, {OWNER_TAG: instance_id, GENERATION_TAG: str(generation)})
        crash_point("after_tag")
        vol = self._settle(volume_id, instance_id, generation, started)
        log.info("volume_claimed", generation=generation, checkpoint_step=vol.checkpoint_step,
                 warm=vol.warm, seconds=round(self._clock() - started, 3), **ids)
        return Claim(vol, instance_id, reused=False)

    def _keep(self, vol: Volume, instance_id: str) -> Claim:
        """The volume is already attached to us (agent restart): keep it."""
        generation = vol.generation
        if vol.owner != instance_id:
            # Crashed between attach and tag: finish the claim.
            generation += 1
            self._tag(vol.volume_id, {OWNER_TAG: instance_id, GENERATION_TAG: str(generation)})
        vol = self._settle(vol.volume_id, instance_id, generation, self._clock())
        log.info("claim_reused", volume_id=vol.volume_id, instance_id=instance_id,
                 generation=generation)
        return Claim(vol, instance_id, reused=True)

    def _settle(self, volume_id: str, instance_id: str, generation: int,
                started: float) -> Volume:
        """Poll until the attachment is ours and `attached` and the tags read back as written
        (EC2's reads are eventually consistent, so a lagging read is not yet a loss). Past
        attach_timeout: hand the volume back (detach, never forced; drop our owner tag) and
        raise AttachTimeoutError, or ClaimLostError when attached but the tags are not ours."""
        ids = {"volume_id": volume_id, "instance_id": instance_id}
        deadline = started + self.attach_timeout
        while True:
            vol = self.get(volume_id)
            if vol.attached_to is not None and vol.attached_to != instance_id:
                self._untag_owner(volume_id, instance_id)
                log.error("claim_lost", attached_to=vol.attached_to, **ids)
                raise ClaimLostError("the volume is attached to another instance",
                                     attached_to=vol.attached_to, **ids)
            attached = (vol.attached_to == instance_id
                        and vol.attachment_state in ("attached", "busy"))
            tagged = vol.owner == instance_id and vol.generation == generation
            if attached and tagged:
                return vol
            if self._clock() >= deadline:
                break
            self._sleep(self.poll_interval)
        if attached:
            self._abandon(vol, instance_id, "owner tag not ours")
            raise ClaimLostError("the owner tag is not ours", owner=vol.owner,
                                 generation=vol.generation, expected_generation=generation,
                                 **ids)
        self._abandon(vol, instance_id, "attach timeout")
        raise AttachTimeoutError(
            f"volume {volume_id} still '{vol.attachment_state or vol.state}' "
            f"{self.attach_timeout:g}s after the attach; handed back", **ids)

    def _abandon(self, vol: Volume, instance_id: str, reason: str) -> None:
        """Give up a claim: ask EC2 to detach (never force) and drop our owner tag."""
        ids = {"volume_id": vol.volume_id, "instance_id": instance_id}
        detach = "not attached"
        if vol.attached_to == instance_id:
            try:
                with translate("DetachVolume", **ids):
                    self.client.detach_volume(VolumeId=vol.volume_id, InstanceId=instance_id)
                detach = "requested"
            except Ec2Error as exc:
                detach = f"refused: {exc.code}"
        self._untag_owner(vol.volume_id, instance_id)
        log.error("claim_abandoned", reason=reason, state=vol.attachment_state or vol.state,
                  detach=detach, **ids)

    def _confirm(self, vol: Volume, instance_id: str, generation: int) -> None:
        ids = {"volume_id": vol.volume_id, "instance_id": instance_id}
        if vol.attached_to != instance_id:
            raise ClaimLostError("the volume is not attached to this instance",
                                 attached_to=vol.attached_to, **ids)
        if vol.owner != instance_id or vol.generation != generation:
            raise ClaimLostError("the owner tag is not ours", owner=vol.owner,
                                 generation=vol.generation, expected_generation=generation,
                                 **ids)

    def check_claim(self, volume_id: str, instance_id: str, generation: int) -> Volume:
        """Raise ClaimLostError unless the volume is still attached to us at `generation` (an
        instance that comes back after a stop can tell that someone else has had the volume)."""
        vol = self.get(volume_id)
        self._confirm(vol, instance_id, generation)
        return vol

    # --- creating -----------------------------------------------------------------------------

    def create(self, az: str, spec: VolumeSpec | None = None) -> str:
        """Create one volume of the pool in `az` (tagged into the pool at creation, so it is
        never an untagged orphan), wait until it is available, return its id. It is not
        claimed: `claim` takes the best free volume, which may be this one."""
        return self.create_volume(az, spec).volume_id

    def create_volume(self, az: str, spec: VolumeSpec | None = None) -> Volume:
        return self.create_volumes(az, 1, spec)[0]

    def create_volumes(self, az: str, count: int, spec: VolumeSpec | None = None
                       ) -> list[Volume]:
        """Create `count` volumes (all requests first, then one wait for all of them)."""
        spec = spec or self.spec
        snapshot = spec.snapshot_id
        if spec.from_ami:
            snapshot = root_snapshot(self.client, spec.from_ami)
        tags = {POOL_TAG: self.name, GENERATION_TAG: "0",
                WARM_TAG: "false" if snapshot else "true"}  # an empty volume has no lazy load
        if not snapshot:
            tags[CREATED_EMPTY_TAG] = "true"
        params: CreateVolumeRequestTypeDef = {
            "AvailabilityZone": az,
            "VolumeType": cast("VolumeTypeType", spec.volume_type),
            "TagSpecifications": [{"ResourceType": "volume", "Tags": _tags(tags)}],
        }
        if spec.size_gib:
            params["Size"] = spec.size_gib
        if snapshot:
            params["SnapshotId"] = snapshot
        if spec.iops and spec.volume_type in ("gp3", "io1", "io2"):
            params["Iops"] = spec.iops
        if spec.throughput and spec.volume_type == "gp3":
            params["Throughput"] = spec.throughput
        rate = spec.init_rate_mib if snapshot and self._offers_init_rate() else None
        ctx = {"pool": self.name, "az": az, "snapshot_id": snapshot}
        ids = []
        for _ in range(count):
            try:
                volume_id = self._create(params, rate, ctx)
            except Ec2Error as exc:
                if rate is None or exc.code not in _UNKNOWN_PARAMETER:
                    raise
                log.warning("init_rate_refused", code=exc.code, detail=exc.detail, **ctx)
                rate = None
                volume_id = self._create(params, None, ctx)
            log.info("volume_created", volume_id=volume_id, init_rate_mib=rate, **ctx)
            ids.append(volume_id)
        return [self._wait_available(v, self.create_timeout, CreateTimeoutError) for v in ids]

    def _create(self, params: CreateVolumeRequestTypeDef, rate: int | None,
                ctx: Mapping[str, Any]) -> str:
        # A fresh ClientToken per request: botocore's retries of this request cannot make a
        # second volume, and a retry without the rate is a new request.
        req: CreateVolumeRequestTypeDef = {**params, "ClientToken": str(uuid.uuid4())}
        if rate is not None:
            req["VolumeInitializationRate"] = rate
        with translate("CreateVolume", **ctx):
            return self.client.create_volume(**req)["VolumeId"]

    def _offers_init_rate(self) -> bool:
        shape = self.client.meta.service_model.operation_model("CreateVolume").input_shape
        return shape is not None and "VolumeInitializationRate" in shape.members

    # --- tags after the claim -----------------------------------------------------------------

    def mark_warm(self, volume_id: str) -> None:
        """Every block has been read once: later instances get full speed at once."""
        self._tag(volume_id, {WARM_TAG: "true"})
        log.info("volume_marked_warm", volume_id=volume_id)

    def clear_created_empty(self, volume_id: str) -> None:
        """The first format succeeded: from now on the volume holds data and is never
        formatted again."""
        with translate("DeleteTags", volume_id=volume_id):
            self.client.delete_tags(Resources=[volume_id], Tags=[{"Key": CREATED_EMPTY_TAG}])
        log.info("created_empty_cleared", volume_id=volume_id)

    # --- releasing ----------------------------------------------------------------------------

    def release(self, volume_id: str, instance_id: str, *, still_mounted: Callable[[], bool],
                checkpoint_step: int | None = None, done: bool | None = None) -> None:
        """Hand the volume back to the pool (EC2 half; the caller has synced and unmounted).

        The checkpoint step and done flag are written first, while the attachment still makes
        the volume ours, so the next claimer sees them the moment the volume is available. Then
        detach (never forced; refused while `still_mounted()`), wait until available, and
        delete the owner tag only if it still names us (a conditional DeleteTags: a new owner
        who claimed the volume in between keeps its tag).
        """
        ids = {"volume_id": volume_id, "instance_id": instance_id}
        vol = self.get(volume_id)
        ours = vol.attached_to == instance_id
        if not ours and not (vol.attached_to is None and vol.owner == instance_id):
            raise ClaimLostError("cannot release a volume this instance does not hold",
                                 attached_to=vol.attached_to, owner=vol.owner, **ids)
        updates: dict[str, str] = {}
        if checkpoint_step is not None:
            updates[CHECKPOINT_STEP_TAG] = str(checkpoint_step)
        if done is not None:
            updates[DONE_TAG] = "true" if done else "false"
        if updates:
            self._tag(volume_id, updates)
        if ours and vol.attachment_state != "detaching":
            if still_mounted():
                raise StillMountedError("refusing to detach a volume whose device is still "
                                        "mounted", **ids)
            with translate("DetachVolume", **ids):
                self.client.detach_volume(VolumeId=volume_id, InstanceId=instance_id)
            log.info("volume_detaching", **ids)
            crash_point("after_detach")
        self._wait_available(volume_id, self.detach_timeout, DetachTimeoutError)
        self._untag_owner(volume_id, instance_id)
        log.info("volume_released", checkpoint_step=checkpoint_step, done=done, **ids)

    # --- plumbing -----------------------------------------------------------------------------

    def _tag(self, volume_id: str, tags: Mapping[str, str]) -> None:
        with translate("CreateTags", volume_id=volume_id):
            self.client.create_tags(Resources=[volume_id], Tags=_tags(tags))

    def _untag_owner(self, volume_id: str, instance_id: str) -> None:
        with translate("DeleteTags", volume_id=volume_id, instance_id=instance_id):
            self.client.delete_tags(Resources=[volume_id],
                                    Tags=[{"Key": OWNER_TAG, "Value": instance_id}])

    def _wait_available(self, volume_id: str, timeout: float,
                        error: type[PoolError]) -> Volume:
        deadline = self._clock() + timeout
        while True:
            vol = self.get(volume_id)
            if vol.state == "available":
                return vol
            if vol.state in ("error", "deleting", "deleted"):
                raise PoolError(f"volume {volume_id} went to state '{vol.state}'",
                                volume_id=volume_id)
            if self._clock() >= deadline:
                what = vol.attachment_state or vol.state
                raise error(f"volume {volume_id} not available after {timeout:g}s "
                            f"(still '{what}')", volume_id=volume_id,
                            attached_to=vol.attached_to)
            self._sleep(self.poll_interval)


# --- calls that need no pool name --------------------------------------------------------------


def _describe(client: EC2Client, **kwargs: Any) -> list[Volume]:
    out: list[Volume] = []
    with translate("DescribeVolumes"):
        for page in client.get_paginator("describe_volumes").paginate(**kwargs):
            out.extend(Volume.from_api(v) for v in page.get("Volumes", []))
    return sorted(out, key=lambda v: (v.az, v.volume_id))


def all_pool_volumes(client: EC2Client) -> list[Volume]:
    """Volumes of every spotagent pool (those with a `spotagent:pool` tag)."""
    return _describe(client, Filters=[{"Name": "tag-key", "Values": [POOL_TAG]}])


def describe_volume(client: EC2Client, volume_id: str) -> Volume:
    with translate("DescribeVolumes", volume_id=volume_id):
        vols = client.describe_volumes(VolumeIds=[volume_id]).get("Volumes", [])
    if not vols:
        raise PoolError("volume not found", volume_id=volume_id)
    return Volume.from_api(vols[0])


def instance_state(client: EC2Client, instance_id: str) -> str | None:
    """The instance's state name (`running`, `stopped`, `terminated`, ...) or None when EC2
    does not know it."""
    try:
        with translate("DescribeInstances", instance_id=instance_id):
            resp = client.describe_instances(InstanceIds=[instance_id])
    except Ec2Error as exc:
        if exc.code == "InvalidInstanceID.NotFound":
            return None
        raise
    for res in resp.get("Reservations", []):
        for inst in res.get("Instances", []):
            if inst.get("InstanceId") == instance_id:
                return inst.get("State", {}).get("Name")
    return None


def root_snapshot(client: EC2Client, image_id: str) -> str:
    """The snapshot behind an AMI's root device (the Spotinst recipe: a pool volume made from
    the AMI's root snapshot holds the same environment as the image)."""
    with translate("DescribeImages", image_id=image_id):
        images = client.describe_images(ImageIds=[image_id]).get("Images", [])
    if not images:
        raise PoolError("AMI not found", image_id=image_id)
    image = images[0]
    root = image.get("RootDeviceName", "")
    for m in image.get("BlockDeviceMappings", []):
        if _dev(m.get("DeviceName", "")) == _dev(root):
            snap = m.get("Ebs", {}).get("SnapshotId")
            if snap:
                return snap
    raise PoolError("the AMI has no EBS root snapshot", image_id=image_id, root_device=root)


def _dev(name: str) -> str:
    return name.removeprefix("/dev/")


def release_stale_claim(client: EC2Client, volume_id: str) -> Volume:
    """Operator's `pool release`: clear the owner tag of an available volume whose owner
    instance is gone (terminated or unknown). Refuses when the volume is attached or the owner
    is alive (it would release the volume itself)."""
    vol = describe_volume(client, volume_id)
    if vol.pool is None:
        raise ReleaseRefusedError("not a pool volume (no spotagent:pool tag)",
                                  volume_id=volume_id)
    if vol.attached_to is not None or vol.state != "available":
        raise ReleaseRefusedError(
            f"volume is attached to {vol.attached_to}; its agent releases it (or stop that "
            "instance)" if vol.attached_to else f"volume is '{vol.state}', not available",
            volume_id=volume_id, state=vol.state)
    owner = vol.owner
    if owner is None:
        log.info("stale_claim_none", volume_id=volume_id)
        return vol
    state = instance_state(client, owner)
    if state not in (None, "terminated"):
        raise ReleaseRefusedError(f"owner instance {owner} is {state}, not gone",
                                  volume_id=volume_id, owner=owner)
    with translate("DeleteTags", volume_id=volume_id):
        client.delete_tags(Resources=[volume_id], Tags=[{"Key": OWNER_TAG, "Value": owner}])
    log.info("stale_claim_cleared", volume_id=volume_id, instance_id=owner,
             owner_state=state or "not-found")
    return describe_volume(client, volume_id)
