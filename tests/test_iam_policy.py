"""The IAM policies shipped in agent/iam: they parse, they allow every EC2 call the code makes,
and they allow no more than the pool needs (checked with a small evaluator of the condition
operators the policies use; an operator it does not know fails the test)."""

from __future__ import annotations

import ast
import json
import re
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotagent import volumes

IAM = Path(__file__).resolve().parent.parent / "agent" / "iam"
VOLUMES_PY = Path(volumes.__file__)
INSTANCE = "instance-policy.json"
CREATE = "instance-policy-create.json"
OPERATOR = "operator-policy.json"

ME = "arn:aws:ec2:us-east-1:111122223333:instance/i-0aaaaaaaaaaaaaaaa"
OTHER = "arn:aws:ec2:us-east-1:111122223333:instance/i-0bbbbbbbbbbbbbbbb"
VOL = "arn:aws:ec2:us-east-1:111122223333:volume/vol-0123456789abcdef0"
SNAP = "arn:aws:ec2:us-east-1::snapshot/snap-0123456789abcdef0"
POOL_VOLUME = {"aws:ResourceTag/spotagent:pool": "dl-pool"}
FROM_INSTANCE = {"ec2:SourceInstanceARN": ME}


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((IAM / name).read_text())
    return doc


def listify(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


# --- a small evaluator: Allow statements only (the policies have no Deny) ------------------------


def _substitute(pattern: str, ctx: dict[str, Any]) -> str | None:
    """Resolve ${key} policy variables; None when one is missing (the statement cannot match)."""
    missing = False

    def repl(m: re.Match[str]) -> str:
        nonlocal missing
        value = ctx.get(m.group(1))
        if not isinstance(value, str):
            missing = True
            return ""
        return value

    out = re.sub(r"\$\{([^}]+)\}", repl, pattern)
    return None if missing else out


def _condition(op: str, key: str, want: str | list[str], ctx: dict[str, Any]) -> bool:
    wants = listify(want)
    have = ctx.get(key)
    if op == "Null":
        return (have is None) == (wants == ["true"])
    if op.startswith("ForAllValues:"):
        inner = op.split(":", 1)[1]
        values = listify(have) if have is not None else []
        return all(_condition(inner, key, wants, {key: v}) for v in values)
    if have is None:
        return False
    if not isinstance(have, str):
        raise AssertionError(f"{key} is multi-valued: needs a set operator, not {op}")
    if op in ("StringEquals", "ArnEquals"):
        return have in wants
    if op in ("StringLike", "ArnLike"):
        return any(fnmatchcase(have, w) for w in wants)
    raise AssertionError(f"the test's evaluator does not know condition operator {op}")


def allowed(policy: dict[str, Any], action: str, resource: str, ctx: dict[str, Any]) -> bool:
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        if not any(fnmatchcase(action, a) for a in listify(st["Action"])):
            continue
        patterns = [_substitute(r, ctx) for r in listify(st["Resource"])]
        if not any(p is not None and fnmatchcase(resource, p) for p in patterns):
            continue
        if all(_condition(op, key, want, ctx)
               for op, pairs in st.get("Condition", {}).items()
               for key, want in pairs.items()):
            return True
    return False


def attach_allowed(policy: dict[str, Any], volume_ctx: dict[str, Any], instance: str) -> bool:
    """AttachVolume is authorised on both resources it names."""
    return (allowed(policy, "ec2:AttachVolume", VOL, {**FROM_INSTANCE, **volume_ctx})
            and allowed(policy, "ec2:AttachVolume", instance, dict(FROM_INSTANCE)))


# --- the code's calls --------------------------------------------------------------------------


def actions_called_in(path: Path) -> set[str]:
    """`client.x(...)` calls and `get_paginator("x")` in a module, as IAM action names."""
    tree = ast.parse(path.read_text())
    methods: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        target = node.func.value
        is_client = (isinstance(target, ast.Name) and target.id == "client") or (
            isinstance(target, ast.Attribute) and target.attr == "client")
        if not is_client:
            continue
        if node.func.attr == "get_paginator":
            arg = node.args[0]
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            methods.add(arg.value)
        else:
            methods.add(node.func.attr)
    mapping = boto3.session.Session().client(
        "ec2", region_name="us-east-1", aws_access_key_id="x",
        aws_secret_access_key="x").meta.method_to_api_mapping
    unknown = methods - set(mapping)
    assert not unknown, f"not EC2 API methods: {unknown}"
    return {f"ec2:{mapping[m]}" for m in methods}


def test_the_policies_parse_and_are_well_formed() -> None:
    for name in (INSTANCE, CREATE, OPERATOR):
        doc = load(name)
        assert doc["Version"] == "2012-10-17"
        for st in doc["Statement"]:
            assert set(st) <= {"Sid", "Effect", "Action", "Resource", "Condition"}, st
            assert st["Effect"] == "Allow" and st["Sid"]


def test_no_wildcard_actions_and_no_star_resource_for_mutating_actions() -> None:
    for name in (INSTANCE, CREATE, OPERATOR):
        for st in load(name)["Statement"]:
            for action in listify(st["Action"]):
                assert "*" not in action and action.startswith("ec2:"), (name, action)
                if not action.startswith("ec2:Describe"):
                    assert "*" not in listify(st["Resource"]), (name, st["Sid"])


def test_every_ec2_call_in_the_code_is_allowed_by_a_policy() -> None:
    called = actions_called_in(VOLUMES_PY)
    assert "ec2:AttachVolume" in called and "ec2:DescribeVolumes" in called  # the scan works
    granted = {a for name in (INSTANCE, CREATE, OPERATOR)
               for st in load(name)["Statement"] for a in listify(st["Action"])}
    assert called <= granted, called - granted
    # DescribeSnapshots is not called, so it is not granted (least privilege).
    assert "ec2:DescribeSnapshots" not in granted


def test_the_instance_policy_covers_claim_and_release() -> None:
    p = load(INSTANCE)
    assert allowed(p, "ec2:DescribeVolumes", "*", {})
    assert attach_allowed(p, POOL_VOLUME, ME)
    assert allowed(p, "ec2:DetachVolume", VOL, {**FROM_INSTANCE, **POOL_VOLUME})
    assert allowed(p, "ec2:DetachVolume", ME, dict(FROM_INSTANCE))
    for key in volumes.INSTANCE_TAGS:  # every tag the agent writes or deletes after creation
        ctx = {**POOL_VOLUME, "aws:TagKeys": [key]}
        assert allowed(p, "ec2:CreateTags", VOL, ctx), key
        assert allowed(p, "ec2:DeleteTags", VOL, ctx), key
    owner_and_gen = {**POOL_VOLUME,
                     "aws:TagKeys": [volumes.OWNER_TAG, volumes.GENERATION_TAG]}
    assert allowed(p, "ec2:CreateTags", VOL, owner_and_gen)  # one call at claim time


@pytest.mark.parametrize("what, check", [
    ("attach a volume outside any pool",
     lambda p: attach_allowed(p, {}, ME)),
    ("attach a pool volume to another instance",
     lambda p: attach_allowed(p, POOL_VOLUME, OTHER)),
    ("attach with credentials that are not an instance's",
     lambda p: allowed(p, "ec2:AttachVolume", ME, {})),
    ("move a volume into or out of a pool",
     lambda p: allowed(p, "ec2:CreateTags", VOL,
                       {**POOL_VOLUME, "aws:TagKeys": [volumes.POOL_TAG]})),
    ("tag a volume outside the pool",
     lambda p: allowed(p, "ec2:CreateTags", VOL, {"aws:TagKeys": [volumes.OWNER_TAG]})),
    ("write a tag that is not the agent's",
     lambda p: allowed(p, "ec2:CreateTags", VOL, {**POOL_VOLUME, "aws:TagKeys": ["Name"]})),
    ("delete every tag (DeleteTags without keys)",
     lambda p: allowed(p, "ec2:DeleteTags", VOL, dict(POOL_VOLUME))),
    ("create a volume", lambda p: allowed(p, "ec2:CreateVolume", VOL, {})),
    ("describe instances", lambda p: allowed(p, "ec2:DescribeInstances", "*", {})),
])
def test_the_instance_policy_refuses(what: str, check: Any) -> None:
    assert not check(load(INSTANCE)), what


def test_the_create_policy_allows_create_only_into_a_pool() -> None:
    p = load(CREATE)
    create_tags = list(volumes.CREATE_TAGS)  # test_volumes checks the code writes no others
    req = {"aws:RequestTag/spotagent:pool": "dl-pool", "aws:TagKeys": create_tags}
    assert allowed(p, "ec2:CreateVolume", VOL, req)
    assert allowed(p, "ec2:CreateVolume", SNAP, req)
    assert allowed(p, "ec2:CreateTags", VOL, {**req, "ec2:CreateAction": "CreateVolume"})
    assert allowed(p, "ec2:DescribeImages", "*", {})
    assert not allowed(p, "ec2:CreateVolume", VOL, {"aws:TagKeys": []})  # untagged
    assert not allowed(p, "ec2:CreateVolume", VOL, {**req, "aws:TagKeys": [*create_tags,
                                                                           "Name"]})
    assert not allowed(p, "ec2:CreateTags", VOL, req)  # tagging outside a CreateVolume


def test_the_policies_tag_key_lists_match_the_code() -> None:
    def tag_keys(name: str, sid: str) -> list[str]:
        st = next(s for s in load(name)["Statement"] if s["Sid"] == sid)
        keys: list[str] = st["Condition"]["ForAllValues:StringEquals"]["aws:TagKeys"]
        return keys

    assert tag_keys(INSTANCE, "WriteClaimTagsOnPoolVolumes") == list(volumes.INSTANCE_TAGS)
    assert tag_keys(CREATE, "CreateVolumesOnlyIntoAPool") == list(volumes.CREATE_TAGS)
    assert tag_keys(OPERATOR, "CreateVolumesOnlyIntoAPool") == list(volumes.CREATE_TAGS)


def test_the_operator_policy_clears_only_owner_tags() -> None:
    p = load(OPERATOR)
    owner = {**POOL_VOLUME, "aws:TagKeys": [volumes.OWNER_TAG]}
    assert allowed(p, "ec2:DeleteTags", VOL, owner)
    assert allowed(p, "ec2:DescribeInstances", "*", {})
    assert not allowed(p, "ec2:DeleteTags", VOL,
                       {**POOL_VOLUME, "aws:TagKeys": [volumes.POOL_TAG]})
    assert not allowed(p, "ec2:DeleteTags", VOL, dict(POOL_VOLUME))
    assert not allowed(p, "ec2:AttachVolume", VOL, owner)
