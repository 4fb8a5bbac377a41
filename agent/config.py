"""Configuration: load, merge and validate; one frozen object with each value's source.

Layers, lowest to highest precedence:

1. built-in defaults;
2. the config file (TOML, `/etc/spotagent/config.toml` or `--config PATH`);
3. EC2 user data: a TOML document whose first line is `#spotagent`, or the `text/x-spotagent`
   part of a MIME multi-part user data (so cloud-init can keep the rest); anything else is
   left to cloud-init and ignored here;
4. instance tags `spotagent:<section>.<key>` (tags in instance metadata must be enabled).

The loader is pure: `build()` takes the raw layers and returns a `Config` or raises
`ConfigError` whose one line names the key, the value and its source. `gather()` is the one
function that reads the file and the metadata service.
"""

from __future__ import annotations

import email
import email.policy
import gzip
import json
import math
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from spotagent.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/spotagent/config.toml")
USER_DATA_MARKER = "#spotagent"
USER_DATA_MIME_TYPE = "text/x-spotagent"
TAG_PREFIX = "spotagent:"

Converter = Callable[[Any], Any]


# --- pure converters: each returns the typed value or raises ValueError with the reason --------


def _string(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"must be a string, not {_tname(v)}")
    if not v:
        raise ValueError("must not be empty")
    return v


def _opt_string(v: Any) -> str | None:
    return None if v == "" else _string(v)


def _pattern(regex: str, what: str) -> Converter:
    compiled = re.compile(regex)

    def conv(v: Any) -> str:
        s = _string(v)
        if not compiled.fullmatch(s):
            raise ValueError(f"must be {what}")
        return s

    return conv


def _opt(conv: Converter) -> Converter:
    def wrapped(v: Any) -> Any:
        return None if v == "" else conv(v)

    return wrapped


def _number(lo: float, hi: float, *, integer: bool = False) -> Converter:
    def conv(v: Any) -> float | int:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"must be a number, not {_tname(v)}")
        if integer and not isinstance(v, int):
            raise ValueError("must be an integer")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be finite")
        if not lo <= v <= hi:
            raise ValueError(f"must be between {lo:g} and {hi:g}")
        return int(v) if integer else float(v)

    return conv


def _choice(*choices: str) -> Converter:
    def conv(v: Any) -> str:
        s = _string(v)
        if s not in choices:
            raise ValueError("must be one of " + ", ".join(choices))
        return s

    return conv


def _boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, not {_tname(v)}")
    return v


def _abs_path(v: Any) -> Path:
    s = _string(v)
    if not s.startswith("/"):
        raise ValueError("must be an absolute path")
    return Path(s)


def _path_in_chroot(v: Any) -> str:
    s = _string(v)
    if not s.startswith("/") or "/../" in s + "/" or "\0" in s:
        raise ValueError("must be an absolute path inside the chroot without '..'")
    return s


def _http_url(v: Any) -> str:
    s = _string(v)
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", s):
        raise ValueError("must be an http:// or https:// URL")
    return s.rstrip("/")


def _argv(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        raise ValueError('must be a list of strings (an argv list such as ["python3", "train.py"]),'
                         " not a string")
    if not isinstance(v, list):
        raise ValueError(f"must be a list of strings, not {_tname(v)}")
    if not v:
        raise ValueError("must not be empty")
    if not all(isinstance(a, str) for a in v):
        raise ValueError("must be a list of strings")
    if not v[0]:
        raise ValueError("the program (first element) must not be empty")
    return tuple(v)


def _string_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(a, str) and a for a in v):
        raise ValueError("must be a list of non-empty strings")
    return tuple(v)


def _env_table(v: Any) -> Mapping[str, str]:
    if not isinstance(v, dict):
        raise ValueError(f"must be a table of NAME = \"value\", not {_tname(v)}")
    out: dict[str, str] = {}
    for k, val in v.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"environment name {k!r} is not valid")
        if k.startswith("SPOTAGENT_"):
            raise ValueError(f"{k} is reserved for the agent↔trainer protocol")
        if not isinstance(val, str):
            raise ValueError(f"value of {k} must be a string")
        out[k] = val
    return out


def _tname(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)


# --- the schema ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    conv: Converter
    default: Any
    doc: str
    required: bool = False
    file_only: bool = False  # settable only in the config file (needed before IMDS is read)


_REQUIRED = object()

SCHEMA: dict[str, dict[str, Field]] = {
    "aws": {
        "region": Field(_opt(_pattern(r"[a-z]{2}(-[a-z]+)+-\d", "an AWS region like us-east-1")),
                        None, "AWS region; default: from the instance metadata"),
        "endpoint_url": Field(_opt(_http_url), None,
                              "EC2 endpoint override (emulators, VPC endpoints)"),
        "connect_timeout": Field(_number(0.1, 60), 5.0, "EC2 connect timeout, seconds"),
        "read_timeout": Field(_number(0.1, 300), 20.0, "EC2 read timeout, seconds"),
        "max_attempts": Field(_number(1, 20, integer=True), 5,
                              "EC2 call attempts (standard retry)"),
    },
    "imds": {
        "url": Field(_http_url, "http://169.254.169.254", "instance metadata service base URL",
                     file_only=True),
        "poll_interval": Field(_number(0.05, 60), 0.5, "interruption polling interval, seconds",
                               file_only=True),
        "timeout": Field(_number(0.05, 30), 1.0, "timeout of one IMDS request, seconds",
                         file_only=True),
        "read_tags": Field(_boolean, True, "read spotagent:* instance tags from metadata",
                           file_only=True),
        "read_user_data": Field(_boolean, True, "read configuration from user data",
                                file_only=True),
    },
    "pool": {
        "name": Field(_pattern(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
                               "1-64 letters, digits, '.', '_' or '-'"),
                      _REQUIRED, "pool of warm volumes to claim from", required=True),
        "on_empty": Field(_choice("wait", "create", "fail"), "wait",
                          "what to do when no volume is free"),
        "snapshot_id": Field(_opt(_pattern(r"snap-[0-9a-f]{8,17}", "a snapshot id")), None,
                             "snapshot new volumes are made from (on_empty = create)"),
        "from_ami": Field(_opt(_pattern(r"ami-[0-9a-f]{8,17}", "an AMI id")), None,
                          "AMI whose root snapshot new volumes are made from"),
        "volume_type": Field(_choice("gp3", "gp2", "io1", "io2"), "gp3", "type of new volumes"),
        "size_gib": Field(_number(1, 65536, integer=True), 200, "size of new volumes, GiB"),
        "iops": Field(_number(100, 256000, integer=True), 3000, "IOPS of new gp3/io volumes"),
        "throughput": Field(_number(125, 2000, integer=True), 250,
                            "throughput of new gp3 volumes, MiB/s"),
        "init_rate_mib": Field(_number(0, 300, integer=True), 300,
                               "volume-initialization rate asked for volumes made from a "
                               "snapshot, MiB/s (100-300; 0: EC2's default lazy loading)"),
        "wait_max_backoff": Field(_number(1, 3600), 30.0,
                                  "longest pause between claim attempts when waiting, seconds"),
        "attach_timeout": Field(_number(1, 3600), 120.0, "longest wait for an attach, seconds"),
    },
    "devices": {
        "by_id_dir": Field(_abs_path, Path("/dev/disk/by-id"), "directory of by-id device links"),
        "timeout": Field(_number(1, 3600), 60.0, "longest wait for the block device, seconds"),
    },
    "volume": {
        "mount_point": Field(_abs_path, Path("/mnt/spotagent"),
                             "where the volume (the environment's root) is mounted"),
        "fstype": Field(_choice("ext4", "xfs"), "ext4", "file system of new empty volumes"),
        "mount_options": Field(_string_list, ("noatime",), "mount options"),
        "warmup": Field(_boolean, True, "read a cold volume end to end in the background"),
        "warmup_rate_mib": Field(_number(1, 10000), 64.0, "warm-up bandwidth cap, MiB/s"),
    },
    "trainer": {
        "command": Field(_argv, ("python3", "-m", "spottrainer.train"),
                         "argv list run inside the chroot"),
        "user": Field(_pattern(r"[a-z_][a-z0-9_-]{0,31}", "a user name"), "trainer",
                      "user (from the chroot's /etc/passwd) the trainer runs as; never root"),
        "checkpoint_dir": Field(_path_in_chroot, "/var/lib/spotagent/checkpoints",
                                "checkpoint directory, path inside the chroot"),
        "log_file": Field(_path_in_chroot, "/var/log/spotagent/trainer.log",
                          "trainer output log on the volume, path inside the chroot"),
        "workdir": Field(_path_in_chroot, "/", "working directory inside the chroot"),
        "env": Field(_env_table, {}, "extra environment for the trainer"),
        "restart_budget": Field(_number(0, 1000, integer=True), 5,
                                "restarts allowed per restart_window"),
        "restart_window": Field(_number(1, 86400), 600.0, "restart budget window, seconds"),
        "restart_backoff": Field(_number(0.1, 3600), 2.0, "first restart delay, seconds"),
    },
    "drain": {
        "release_margin": Field(_number(0, 110), 20.0,
                                "seconds before the notice's time kept back for unmount/detach"),
        "stop_deadline": Field(_number(1, 3600), 90.0,
                               "checkpoint deadline on a systemd stop or `spotagent drain`, s"),
        "on_rebalance": Field(_choice("checkpoint", "drain", "ignore"), "checkpoint",
                              "answer to a rebalance recommendation"),
    },
    "agent": {
        "state_dir": Field(_abs_path, Path("/run/spotagent"), "state file directory"),
        "on_complete": Field(_choice("stay", "poweroff"), "stay",
                             "what to do once the trainer exits 0 and the volume is released"),
    },
}


# --- the frozen result ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The effective configuration. `values[(section, key)]` is the typed value,
    `sources[(section, key)]` names where it came from."""

    values: Mapping[tuple[str, str], Any]
    sources: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def get(self, section: str, key: str) -> Any:
        return self.values[(section, key)]

    def __getattr__(self, section: str) -> _Section:
        if section in SCHEMA:
            return _Section(self, section)
        raise AttributeError(section)

    def items(self) -> list[tuple[str, Any, str]]:
        return [(f"{s}.{k}", self.values[(s, k)], self.sources[(s, k)])
                for s, keys in SCHEMA.items() for k in keys]

    def as_dict(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for (s, k), v in self.values.items():
            out.setdefault(s, {})[k] = _plain(v)
        return out


class _Section:
    """Attribute access to one section (`cfg.pool.name`); holds no field names of its own
    that could shadow a setting."""

    __slots__ = ("_cfg", "_sec")

    def __init__(self, cfg: Config, sec: str) -> None:
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_sec", sec)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._cfg.values[(self._sec, key)]
        except KeyError:
            raise AttributeError(f"{self._sec}.{key}") from None


def _plain(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, Mapping):
        return dict(v)
    return v


# --- layers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """One source of settings: a name for error lines and a nested {section: {key: value}}."""

    source: str
    data: Mapping[str, Any]
    from_tags: bool = False


def _fail(source: str, key: str, value: Any, problem: str) -> ConfigError:
    shown = json.dumps(value, default=str, ensure_ascii=False)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return ConfigError(f"config error: {source}: {key} = {shown}: {problem}")


def parse_toml(text: str, source: str) -> Layer:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config error: {source}: malformed TOML: {exc}") from exc
    return Layer(source, data)


def parse_user_data(raw: bytes | None, source: str = "user-data") -> Layer | None:
    """Return the spotagent layer of user data, or None when the user data is not ours."""
    if not raw:
        return None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ConfigError(f"config error: {source}: gzip user data does not decompress: "
                              f"{exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if raw.lstrip().startswith(USER_DATA_MARKER.encode()):
            raise ConfigError(f"config error: {source}: not UTF-8 text: {exc}") from exc
        return None
    stripped = text.lstrip("\ufeff")
    if stripped.startswith(USER_DATA_MARKER):
        first, _, rest = stripped.partition("\n")
        if first.strip() != USER_DATA_MARKER:
            raise ConfigError(f"config error: {source}: the first line must be exactly "
                              f"{USER_DATA_MARKER!r}, got {first.strip()[:60]!r}")
        return parse_toml(rest, source)
    if stripped.startswith("Content-Type: multipart/") or stripped.startswith("MIME-Version:"):
        msg = email.message_from_string(stripped, policy=email.policy.compat32)
        parts = [p for p in msg.walk() if p.get_content_type() == USER_DATA_MIME_TYPE]
        if len(parts) > 1:
            raise ConfigError(f"config error: {source}: more than one {USER_DATA_MIME_TYPE} "
                              "part in multi-part user data")
        if parts:
            payload = parts[0].get_payload(decode=True)
            if not isinstance(payload, bytes):
                raise ConfigError(f"config error: {source}: empty {USER_DATA_MIME_TYPE} part")
            try:
                body = payload.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"config error: {source}: {USER_DATA_MIME_TYPE} part is not "
                                  f"UTF-8: {exc}") from exc
            return parse_toml(body, f"{source} ({USER_DATA_MIME_TYPE} part)")
    return None


def parse_tags(tags: Mapping[str, str]) -> Layer | None:
    """Turn `spotagent:<section>.<key>` instance tags into a layer (values are strings)."""
    data: dict[str, dict[str, Any]] = {}
    for tag, value in sorted(tags.items()):
        if not tag.startswith(TAG_PREFIX):
            continue
        name = tag[len(TAG_PREFIX):]
        section, dot, key = name.partition(".")
        if not dot or not section or not key:
            raise ConfigError(f"config error: instance tag {tag}: {name} = {value!r}: "
                              "spotagent: tags on instances must be named "
                              "spotagent:<section>.<key>, e.g. spotagent:pool.name")
        data.setdefault(section, {})[key] = value
    return Layer("instance tags", data, from_tags=True) if data else None


def _from_tag_string(conv: Converter, raw: str) -> Any:
    """Tag values are strings: a setting that is not a string takes the tag's TOML meaning
    (`0.5`, `true`, `["python3", "train.py"]`)."""
    try:
        return conv(raw)
    except ValueError as as_string:
        try:
            parsed = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            raise as_string from None
        return conv(parsed)


def build(layers: Sequence[Layer]) -> Config:
    """Merge layers over the defaults, validate everything, and return the frozen Config."""
    values: dict[tuple[str, str], Any] = {}
    sources: dict[tuple[str, str], str] = {}
    for section, keys in SCHEMA.items():
        for key, dflt in keys.items():
            if dflt.default is not _REQUIRED:
                values[(section, key)] = dflt.default
                sources[(section, key)] = "default"
    for layer in layers:
        for section, body in layer.data.items():
            if section not in SCHEMA:
                where = (f"instance tag spotagent:{section}.{next(iter(body), '')}"
                         if layer.from_tags else layer.source)
                raise _fail(where, section, body,
                            "unknown section (known: " + ", ".join(SCHEMA) + ")")
            if not isinstance(body, dict):
                raise _fail(layer.source, section, body, "must be a table ([" + section + "])")
            for key, raw in body.items():
                name = f"{section}.{key}"
                src = f"instance tag spotagent:{name}" if layer.from_tags else layer.source
                f = SCHEMA[section].get(key)
                if f is None:
                    raise _fail(src, name, raw, "unknown key (known in [" + section + "]: "
                                + ", ".join(SCHEMA[section]) + ")")
                if f.file_only and layer.source.startswith(("user-data", "instance tags")):
                    raise _fail(src, name, raw, "can only be set in the config file "
                                "(it is needed before user data and tags are read)")
                try:
                    if layer.from_tags and isinstance(raw, str):
                        value = _from_tag_string(f.conv, raw)
                    else:
                        value = f.conv(raw)
                except ValueError as exc:
                    raise _fail(src, name, raw, str(exc)) from exc
                values[(section, key)] = value
                sources[(section, key)] = src
    for section, keys in SCHEMA.items():
        for key, spec in keys.items():
            if spec.required and (section, key) not in values:
                raise ConfigError(f"config error: {section}.{key} is required but not set "
                                  "(set it in the config file, in #spotagent user data or as "
                                  f"the instance tag spotagent:{section}.{key})")
    _cross_checks(values, sources)
    return Config(MappingProxyType(values), MappingProxyType(sources))


def _cross_checks(values: Mapping[tuple[str, str], Any],
                  sources: Mapping[tuple[str, str], str]) -> None:
    if values[("pool", "snapshot_id")] and values[("pool", "from_ami")]:
        raise _fail(sources[("pool", "from_ami")], "pool.from_ami", values[("pool", "from_ami")],
                    "set either pool.snapshot_id or pool.from_ami, not both")
    if (values[("pool", "on_empty")] == "create" and not values[("pool", "snapshot_id")]
            and not values[("pool", "from_ami")]):
        raise _fail(sources[("pool", "on_empty")], "pool.on_empty", "create",
                    "needs pool.snapshot_id or pool.from_ami: an empty volume holds no "
                    "environment to train in")
    rate = values[("pool", "init_rate_mib")]
    if rate and rate < 100:
        raise _fail(sources[("pool", "init_rate_mib")], "pool.init_rate_mib", rate,
                    "must be 0 (EC2's default) or between 100 and 300")
    if values[("drain", "release_margin")] >= 120:
        raise _fail(sources[("drain", "release_margin")], "drain.release_margin",
                    values[("drain", "release_margin")], "must leave time to checkpoint")


# --- gathering: the only function here with I/O ----------------------------------------------


class MetadataSource(Protocol):
    def user_data(self) -> bytes | None: ...
    def instance_tags(self) -> dict[str, str]: ...


def read_file(path: Path, *, required: bool) -> Layer | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        if required:
            raise ConfigError(f"config error: {path}: file not found") from exc
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config error: {path}: cannot read: {exc}") from exc
    return parse_toml(text, str(path))


def _partial_imds(layer: Layer | None) -> Config:
    values: dict[tuple[str, str], Any] = {}
    sources: dict[tuple[str, str], str] = {}
    for key, dflt in SCHEMA["imds"].items():
        values[("imds", key)] = dflt.default
        sources[("imds", key)] = "default"
    body = layer.data.get("imds") if layer else None
    if isinstance(body, dict) and layer is not None:
        for key, raw in body.items():
            f = SCHEMA["imds"].get(key)
            if f is None:
                raise _fail(layer.source, f"imds.{key}", raw, "unknown key (known in [imds]: "
                            + ", ".join(SCHEMA["imds"]) + ")")
            try:
                values[("imds", key)] = f.conv(raw)
            except ValueError as exc:
                raise _fail(layer.source, f"imds.{key}", raw, str(exc)) from exc
            sources[("imds", key)] = layer.source
    return Config(MappingProxyType(values), MappingProxyType(sources))


def gather(path: Path | None, metadata: Callable[[Config], MetadataSource] | None) -> Config:
    """Read the config file, then (when `metadata` is given) user data and instance tags.

    `metadata` builds the IMDS client from the file's imds.* settings, so the collector can run
    on a workstation (metadata=None) as well as on an instance.
    """
    file_layer = read_file(path or DEFAULT_CONFIG_PATH, required=path is not None)
    layers: list[Layer] = [file_layer] if file_layer else []
    if metadata is not None:
        imds_cfg = _partial_imds(file_layer)
        client = metadata(imds_cfg)
        if imds_cfg.imds.read_user_data:
            ud = parse_user_data(client.user_data())
            if ud:
                layers.append(ud)
        if imds_cfg.imds.read_tags:
            tl = parse_tags(client.instance_tags())
            if tl:
                layers.append(tl)
    return build(layers)


def render(config: Config) -> str:
    """`spotagent config check` output: one line per setting with its source."""
    rows = [(name, _show(value), source) for name, value, source in config.items()]
    w1 = max(len(r[0]) for r in rows)
    w2 = min(max(len(r[1]) for r in rows), 48)
    return "\n".join(f"{n:<{w1}}  {v:<{w2}}  # {s}" for n, v, s in rows)


def _show(v: Any) -> str:
    if v is None:
        return "(unset)"
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(f'"{a}"' for a in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f'{k} = "{val}"' for k, val in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return f"{v:g}" if isinstance(v, float) else str(v)
