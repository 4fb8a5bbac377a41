"""An emulated AWS world on one machine: IMDS, strict EC2 and the device plane, wired together.

`World` launches emulated instances (an EC2 instance in moto, an IMDS identity, a by-id link
directory, a state directory, a config file) and makes pool volumes whose content is a real
file-system image. Tests, benchmarks, `spotagent testbed up` and `spotagent demo` use it; the
agent proper never imports it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotagent import subp
from spotagent.testbed.devices import DevicePlane
from spotagent.testbed.ec2 import StrictEc2Server
from spotagent.testbed.imds import ImdsEmulator

# Credentials the emulator accepts; given to agent processes through their environment only.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class Instance:
    """One emulated instance and the host paths its agent uses."""

    instance_id: str
    availability_zone: str
    imds_url: str
    home: Path            # everything of this instance lives below
    by_id_dir: Path
    state_dir: Path
    mount_point: Path
    config_path: Path

    def agent_env(self) -> dict[str, str]:
        """Environment for a `spotagent run` of this instance (emulator credentials)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(FAKE_CREDENTIALS)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def agent_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "spotagent", *args, "--config", str(self.config_path)]


class World:
    def __init__(self, workdir: Path, *, region: str = "us-east-1", attach_delay: float = 0.0,
                 detach_delay: float = 0.0) -> None:
        self.workdir = workdir
        self.region = region
        self.imds = ImdsEmulator()
        self.plane = DevicePlane(workdir / "images")
        self.ec2 = StrictEc2Server(region=region, attach_delay=attach_delay,
                                   detach_delay=detach_delay, device_plane=self.plane)
        self.instances: dict[str, Instance] = {}
        self._started = False

    def __enter__(self) -> World:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def start(self) -> World:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.imds.start()
        self.ec2.start()
        self.client = self.ec2.client(self.region)
        self._started = True
        return self

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        try:
            self.plane.close()
        finally:
            self.ec2.stop()
            self.imds.stop()

    # --- instances --------------------------------------------------------------------------

    def launch(self, availability_zone: str | None = None, *, pool: str | None = None,
               settings: Mapping[str, Mapping[str, Any]] | None = None,
               tags: Mapping[str, str] | None = None, user_data: bytes | None = None,
               instance_type: str = "g5.xlarge") -> Instance:
        """Run an instance in EC2, give it an IMDS identity and a config file for its agent."""
        az = availability_zone or f"{self.region}a"
        resp = self.client.run_instances(
            ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
            InstanceType=instance_type,  # type: ignore[arg-type]
            Placement={"AvailabilityZone": az},
            TagSpecifications=[{"ResourceType": "instance",
                                "Tags": [{"Key": k, "Value": v}
                                         for k, v in (tags or {}).items()]}] if tags else [])
        iid = resp["Instances"][0]["InstanceId"]
        home = self.workdir / iid
        by_id = home / "dev-disk-by-id"
        by_id.mkdir(parents=True, exist_ok=True)
        self.plane.register_instance(iid, by_id)
        url = self.imds.add_instance(iid, availability_zone=az, region=self.region,
                                     instance_type=instance_type, user_data=user_data,
                                     tags=tags)
        inst = Instance(iid, az, url, home, by_id, home / "run", home / "mnt",
                        home / "config.toml")
        self.write_config(inst, pool=pool, settings=settings)
        self.instances[iid] = inst
        return inst

    def write_config(self, inst: Instance, *, pool: str | None = None,
                     settings: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
        """The instance's config file: emulator endpoints and its own paths, plus `settings`."""
        doc: dict[str, dict[str, Any]] = {
            "aws": {"region": self.region, "endpoint_url": self.ec2.endpoint_url},
            "imds": {"url": inst.imds_url, "poll_interval": 0.2},
            "devices": {"by_id_dir": str(inst.by_id_dir), "timeout": 30},
            "volume": {"mount_point": str(inst.mount_point), "warmup": False},
            "agent": {"state_dir": str(inst.state_dir)},
            "pool": {"attach_timeout": 30},
        }
        if pool:
            doc["pool"]["name"] = pool
        for section, values in (settings or {}).items():
            doc.setdefault(section, {}).update(values)
        inst.config_path.write_text(_toml(doc))
        return inst.config_path

    def terminate(self, inst: Instance) -> None:
        self.client.terminate_instances(InstanceIds=[inst.instance_id])

    # --- volumes ----------------------------------------------------------------------------

    def make_snapshot(self, image: Path, *, size_gib: int = 1) -> str:
        """A snapshot whose volumes start as copies of `image` (a file-system image)."""
        vol = self.client.create_volume(AvailabilityZone=f"{self.region}a", Size=size_gib)
        snap = self.client.create_snapshot(VolumeId=vol["VolumeId"])["SnapshotId"]
        self.client.delete_volume(VolumeId=vol["VolumeId"])
        self.plane.register_snapshot_image(snap, image)
        return snap

    def make_pool_volumes(self, pool: str, count: int, *, availability_zone: str | None = None,
                          snapshot_id: str | None = None, size_gib: int = 1,
                          extra_tags: Mapping[str, str] | None = None) -> list[str]:
        az = availability_zone or f"{self.region}a"
        ids = []
        tags = {"spotagent:pool": pool, **(extra_tags or {})}
        for _ in range(count):
            kwargs: dict[str, Any] = {"AvailabilityZone": az, "Size": size_gib,
                                      "VolumeType": "gp3"}
            if snapshot_id:
                kwargs["SnapshotId"] = snapshot_id
            v = self.client.create_volume(
                TagSpecifications=[{"ResourceType": "volume",
                                    "Tags": [{"Key": k, "Value": val}
                                             for k, val in tags.items()]}], **kwargs)
            ids.append(v["VolumeId"])
        return ids

    def volume(self, volume_id: str) -> dict[str, Any]:
        v = self.client.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]
        out: dict[str, Any] = dict(v)
        out["TagMap"] = {t["Key"]: t["Value"] for t in v.get("Tags", [])}
        return out


def make_fs_image(path: Path, source_dir: Path, *, size_mib: int = 256,
                  fstype: str = "ext4") -> Path:
    """A file-system image holding `source_dir` (mkfs -d: no mount needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size_mib * 1024 * 1024)
    if fstype != "ext4":
        raise ValueError("only ext4 images are built from a directory")
    subp.run(["mkfs.ext4", "-q", "-F", "-L", "spotagent", "-d", str(source_dir), str(path)],
             timeout=600)
    return path


def _toml(doc: Mapping[str, Mapping[str, Any]]) -> str:
    lines: list[str] = []
    for section, values in doc.items():
        scalars = {k: v for k, v in values.items() if not isinstance(v, Mapping)}
        tables = {k: v for k, v in values.items() if isinstance(v, Mapping)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {_tval(v)}" for k, v in scalars.items()]
        for name, table in tables.items():
            lines.append(f"[{section}.{name}]")
            lines += [f"{k} = {_tval(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def _tval(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, Sequence):
        return "[" + ", ".join(_tval(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")

