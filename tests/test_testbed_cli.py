"""`spotagent testbed up` starts the emulated world in the foreground and cleans up on SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from spotagent.imds import ImdsClient

pytestmark = pytest.mark.root


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices)")
def test_testbed_up_prints_working_endpoints_and_stops_cleanly(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "spotagent", "testbed", "up", "--workdir",
                             str(tmp_path), "--instances", "2", "--volumes", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        end = time.monotonic() + 60
        while time.monotonic() < end:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("  fire a notice"):
                break
        text = "".join(lines)
        endpoint = re.search(r"EC2 endpoint\s+(\S+)", text)
        urls = re.findall(r"IMDS\s+(http://\S+/i-[0-9a-f]+)", text)
        assert endpoint and len(urls) == 2, text
        ident = ImdsClient(urls[1]).identity()
        assert ident.availability_zone == "us-east-1a"
        ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint.group(1),
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        vols = ec2.describe_volumes(Filters=[{"Name": "tag:spotagent:pool", "Values": ["dl"]}])
        assert len(vols["Volumes"]) == 2
        inst = ec2.describe_instances(InstanceIds=[ident.instance_id])
        assert inst["Reservations"][0]["Instances"][0]["State"]["Name"] == "running"
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
