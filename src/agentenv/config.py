"""Node configuration: one TOML file plus ``AENV_*`` environment overrides.

Defaults work with no file. Precedence: environment > TOML file > defaults.
The file is ``$AENV_CONFIG`` or ``$AENV_HOME/config.toml`` when it exists.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .resources import MIN_CPU_COUNT, MIN_DISK_MB, MIN_MEMORY_MB, ResourceLimits, host_capacity

DEFAULT_HOME = Path("/var/lib/aenv")


class ConfigError(ValueError):
    """A configuration value is missing or malformed."""


@dataclass
class Config:
    home: Path = DEFAULT_HOME
    host: str = "127.0.0.1"
    port: int = 8000
    # Domain of sandbox URLs, `<port>-<sandboxID>.<domain>` (the SDKs' get_host), which
    # the proxy routes by. Default `localhost:<port>`: curl and browsers resolve
    # *.localhost to loopback themselves, so on the node's machine those URLs open
    # with no DNS set-up. A real domain needs wildcard DNS (docs/configuration.md, "Sandbox URLs").
    domain: str = ""
    node_id: str = ""
    # Where templates (rootfs trees) live; shared between homes in tests.
    images_dir: Path | None = None
    # Where built envd runtime bundles are cached.
    bundle_dir: Path | None = None
    # Capacity: sandboxes (and network slots) this node runs at once; 0: derived from
    # the host (its memory over what an idle sandbox holds, and without idle freezing
    # its cores too: resources.host_capacity; 344 on a 24 GiB host), at most the
    # slots net_pool_cidr holds.
    max_sandboxes: int = 0
    default_timeout: int = 300
    max_timeout: int = 24 * 3600
    default_cpu_count: int = 2
    default_memory_mb: int = 512
    # Disk quota of a sandbox's writable layer when its template names none.
    default_disk_mb: int = 1024
    # The most one sandbox may have (0: derived from the host: all its cores, half
    # its RAM, and as much disk). Requests above are refused; values read from
    # templates, snapshots and records on disk are clamped (agentenv.resources).
    max_cpu_count: int = 0
    max_memory_mb: int = 0
    max_disk_mb: int = 0
    # Seconds between re-resolutions of the domain names in egress policies.
    egress_refresh_s: float = 60
    # Private networks (RFC 1918, 100.64.0.0/10) sandboxes may reach without an
    # allowOut naming them: IPv4 CIDRs, comma-separated (or a TOML list); the rest
    # of those networks is refused (issue 29). Link-local, loopback, the pool and
    # the host stay refused whatever this says.
    egress_private_open: str = ""
    # Registries that may be (and whose token realms and redirects may point) on
    # loopback, private or this node's own addresses, and plain http: host or
    # host:port, comma-separated (or a TOML list). Every other pull URL must be https
    # on global addresses (images/registry_hosts.py). "" refuses loopback too.
    registry_private: str = "localhost,127.0.0.1,::1"
    # Network slots: names start with this prefix; host addresses come from this /16.
    net_prefix: str = "aenv"
    net_pool_cidr: str = "10.11.0.0/16"
    net_pool_low: int = 4
    net_pool_high: int = 8
    # Snapshot repository: posix_fs (a directory, maybe a shared mount) or oss
    # (S3-compatible; bucket and region required; credentials from 0600 files,
    # else boto3's default chain).
    snapshot_backend: str = "posix_fs"
    snapshot_path: Path | None = None
    snapshot_endpoint_url: str = ""
    snapshot_bucket: str = ""
    snapshot_prefix: str = ""
    snapshot_region: str = ""
    snapshot_access_key_id_file: Path | None = None
    snapshot_secret_access_key_file: Path | None = None
    # Creates restore a boot snapshot of their template instead of booting
    # (built on a template's first use); warm_pool_size sandboxes per used
    # template are kept restored ahead of need.
    template_snapshots: bool = True
    warm_pool_size: int = 0
    # Two-tier pause: a pause freezes the sandbox and answers; its capture and commit
    # follow in the background while it stays resident (a resume is a thaw). Resident
    # paused sandboxes are evicted (memory and slot freed, the capture kept) least
    # recently paused first past resident_pause_mb (0: a quarter of the host's
    # memory), after resident_pause_idle_s, or when a launch needs their slot.
    resident_pause: bool = True
    resident_pause_mb: int = 0
    resident_pause_idle_s: int = 600
    # Milliseconds a resident pause waits before its capture: a resume within them is
    # a thaw with no capture to wait for. A node that dies meanwhile captures the
    # frozen sandbox when it restarts, so nothing is less durable.
    resident_capture_delay_ms: int = 1000
    # Idle running sandboxes are frozen in place (no CPU, memory kept; still `running`
    # to clients) after idle_freeze_s seconds with no request in flight and at most
    # idle_freeze_cpu_pct of a core used meanwhile; the next request (API, proxy,
    # envd, pause, snapshot, kill...) thaws them in under a millisecond. 0: never.
    idle_freeze_s: float = 10.0
    idle_freeze_cpu_pct: float = 10.0
    # More sandboxes awake than this (0: 16 per CPU) and the quiet window shrinks to a
    # second: a sweep of commands over hundreds of sandboxes would otherwise keep them
    # all awake for idle_freeze_s, each idling at 1-3 % of a core (gVisor's own timers),
    # until the node's own loop starves (seen: 140 awake saturated 2 cores).
    idle_freeze_crowd: int = 0
    # envd in an idle sandbox goes dormant (pid 1 becomes a tiny native stub that keeps
    # envd's port and starts envd again on the next connection: ~22 MiB less per idle
    # sandbox, but the next request waits 0.3-0.7 s for envd's start) when the host
    # needs the memory: below envd_dormancy_mb of available memory the node asks the
    # idle ones to sleep, least recently active first (orchestrator/envd_sleep.py).
    # 0: derived (memory_pressure_mb's watermark + 10 % of the host's memory, 1 GiB at
    # least); -1: never asked.
    envd_dormancy_mb: int = 0
    # Besides: envd goes dormant by itself after this many seconds with no request in
    # flight and nothing running in the sandbox, whatever the memory (shorter than
    # idle_freeze_s, or a frozen envd never gets to sleep). 0: only when asked.
    envd_dormant_after_s: float = 0.0
    # A sandbox frozen this many seconds (or one second, below envd_dormancy_mb's
    # watermark) has its memory moved out of RAM to the host's compressed swap
    # (orchestrator/cold_memory.py): ~2-3 MiB stay resident plus ~1/4 of its pages
    # compressed, envd stays awake, and the next command faults back what it touches
    # (tens of ms, not envd's 0.3-0.7 s start). With a swap, envds are then never
    # asked to sleep. 0: never.
    cold_memory_after_s: float = 60.0
    # Size (MiB of pages held) of the zram swap device the node sets up for that when
    # the host has none: 0: a quarter of the host's memory; -1: set none up (an
    # operator's own swap is used if there is one).
    cold_swap_mb: int = 0
    # When the host's available memory falls below memory_pressure_mb, running
    # sandboxes are paused to disk (captured, memory and slot freed; resumable),
    # least recently active first, instead of the OOM killer ending any. 0: 5 % of
    # the host's memory (256 MiB..2 GiB); -1: never.
    memory_pressure_mb: int = 0
    # Seconds a template build waits for its ready check to pass.
    build_ready_timeout: int = 120
    # Bytes of log a template build keeps (its steps' output); past them one
    # "log truncated" entry, and later output is dropped while the build goes on.
    build_log_max_bytes: int = 8 << 20
    # Bytes of one uploaded build context archive (a COPY's files); larger is a 413.
    build_context_max_bytes: int = 2 << 30
    # How image templates get their files, unless a pull asks ("loading"): "unpack"
    # (every layer fetched and unpacked before the first sandbox), "lazy" (each layer
    # indexed once, or converted into the snapshot repository's chunks, then served
    # read-only by a FUSE mount per layer: a sandbox starts once the indexes are here,
    # file contents arrive on first read into the bounded cache), or "auto": lazy for
    # images whose compressed layers exceed image_lazy_above_mb MiB, unpacked below
    # (where a pull is as fast: bench/results/image_lazy_threshold.md).
    # docs/lazy-images.md.
    image_loading: str = "auto"
    image_lazy_above_mb: int = 256
    # With lazy loading, a plain gzip layer of a registry image is read once to index
    # it (decompressor checkpoints and file table, stored in the repository for every
    # node) and served by range from the registry; false: converted into the
    # repository's chunks instead. docs/lazy-images.md.
    image_gzip_index: bool = True
    # With lazy loading, the files a layer's first use read are recorded beside its
    # index in the repository, and later uses (any node) fetch them ahead.
    image_prefetch: bool = True
    # A lazy layer server's wait for a registry that stops sending mid-read, before the
    # read is retried once and then fails (EIO) with nothing cached.
    image_registry_timeout_s: float = 30.0
    # Lazily loaded layers' indexes and prefetch lists in the shared repository: kept
    # while a published template names the layer or a node used it in the last this
    # many days, and (the least recently used first, never one used in the last three
    # hours) within image_index_budget_bytes (0: no bound). The snapshot garbage
    # collection removes them, and chunks only they referenced. docs/lazy-images.md.
    image_index_retention_days: float = 14.0
    image_index_budget_bytes: int = 0
    # The snapshot repository's garbage collection runs after deletes and every this
    # many seconds (one node at a time: the others find it running); 0: after deletes
    # only.
    snapshot_gc_interval_s: float = 21600.0
    # How envd's file operations act for a request's user, unless a template's
    # template.json says ("fileAccess"): "root" as E2B's envd (as root; what is created
    # is chowned to the user) or "user" (strict: with the user's own rights; for
    # templates whose user has no sudo). docs/security.md, "File operations".
    envd_file_access: str = "root"
    # Pulled images: unpacked layers live here (default <home>/cache/images).
    image_cache_dir: Path | None = None
    # One budget for the node-local cache: image layers and materialized snapshots
    # together (0: half the size of the disk holding <home>/cache). Past it the least
    # recently used go, except what a running sandbox or a pinned template
    # (comma-separated names) needs; they are fetched again on use. image_cache_bytes
    # is its older name (used when local_cache_bytes is 0).
    local_cache_bytes: int = 0
    image_cache_bytes: int = 0
    # A snapshot's cache entry used this recently stays (a restore is reading it).
    cache_snapshot_grace_s: int = 300
    pinned_templates: str = ""
    # Templates that creates from images make by themselves (img-..., setup-...) are
    # removed once unused this long (seconds; 0: never), with their boot image or
    # setup snapshot and the mounts only they need. A user's named templates never.
    image_template_idle_s: int = 86400
    # oci-layout: and docker-archive: pulls read only below this directory
    # (default <home>/imports): the API must not open any file of the host.
    image_import_dir: Path | None = None
    log_level: str = "info"
    # Slow clients: a request head must be complete within http_head_timeout
    # seconds and an API request body within http_body_timeout, else the
    # connection is closed (408 for a body); a trickling client holds nothing long.
    http_head_timeout: int = 10
    http_body_timeout: int = 30
    # Cluster (docs/cluster.md). A node with scheduler_url set registers and
    # heartbeats there, advertising advertise_url (default http://host:port).
    scheduler_url: str = ""
    advertise_url: str = ""
    heartbeat_interval_ms: int = 1000
    # The scheduler marks a node down after this long without a heartbeat.
    node_ttl_ms: int = 5000
    # Gateway and scheduler keep cluster state here.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # A node may fetch snapshot chunks from a peer that caches them (digest-verified;
    # the repository stays the source of truth).
    peer_transfer: bool = False
    # Admission (docs/rl.md): a create beyond the node's room waits up to
    # admission_queue_timeout_s (below the SDKs' 60 s request timeout) in a queue of at
    # most admission_queue_max creates, fair across API keys; past either, 429 with
    # Retry-After. Per-key quotas (0: none): concurrent sandboxes and creates per
    # second, for every key; key_quotas overrides them per key ID (`aenv keys id`):
    # [key_quotas.<key ID>] max_sandboxes = 8, creates_per_s = 2.
    admission_queue_timeout_s: float = 30.0
    admission_queue_max: int = 1024
    # Sandboxes starting at once (admitted, not yet running); more wait their turn in
    # the queue: dozens of gVisor starts at once share the CPUs and all finish late.
    # 0: 2 per CPU core, at least 4; -1: no limit.
    admission_max_starting: int = 0
    key_max_sandboxes: int = 0
    key_creates_per_s: float = 0.0
    key_quotas: dict[str, Any] = field(default_factory=dict)
    # Idempotency-Key of creates: remembered this long, at most this many (oldest go).
    idempotency_ttl_s: int = 24 * 3600
    idempotency_max_keys: int = 100_000
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def resource_limits(self) -> ResourceLimits:
        return ResourceLimits.from_config(self)

    @property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def db_path(self) -> Path:
        return self.home / "db"

    @property
    def templates_dir(self) -> Path:
        return (self.images_dir or self.home / "images") / "templates"

    @property
    def local_templates_dir(self) -> Path:
        """The templates this node pulled or built (``templates_dir`` holds the built-in ones)."""
        return self.home / "templates"

    def snapshot_repository(self) -> dict[str, Any]:
        """The repository settings in the form ``agentenv.snapshot.open_repository`` takes."""
        if self.snapshot_backend == "posix_fs":
            return {"backend": "posix_fs",
                    "path": str(self.snapshot_path or self.home / "snapshots")}
        repo: dict[str, Any] = {
            "backend": self.snapshot_backend, "endpoint_url": self.snapshot_endpoint_url or None,
            "bucket": self.snapshot_bucket, "prefix": self.snapshot_prefix,
            "region": self.snapshot_region or None,
        }
        for name in ("access_key_id_file", "secret_access_key_file"):
            value = getattr(self, f"snapshot_{name}")
            if value:
                repo[name] = str(value)
        return repo

    @property
    def image_imports_dir(self) -> Path:
        return self.image_import_dir or self.home / "imports"

    @property
    def images_cache_dir(self) -> Path:
        return self.image_cache_dir or self.home / "cache" / "images"

    @property
    def snapshot_cache_dir(self) -> Path:
        return self.home / "cache" / "snapshots"

    def cache_budget(self) -> int:
        """The node-local cache's budget in bytes (see ``local_cache_bytes``)."""
        if self.local_cache_bytes > 0 or self.image_cache_bytes > 0:
            return self.local_cache_bytes or self.image_cache_bytes
        where = self.home
        while not where.exists() and where != where.parent:
            where = where.parent
        disk = os.statvfs(where)
        return max(1 << 30, disk.f_blocks * disk.f_frsize // 2)

    @property
    def rootfs_mounts_dir(self) -> Path:
        """Where image templates' layers are mounted, one read-only overlay per image."""
        return self.run_dir / "rootfs"

    @property
    def bundles_dir(self) -> Path:
        return self.bundle_dir or self.home / "cache" / "bundles"


def _coerce(name: str, raw: Any, kind: Any) -> Any:
    # (a TOML list where a comma-separated string is expected)
    text = ",".join(map(str, raw)) if isinstance(raw, list) else str(raw)
    try:
        if kind in (Path, "Path", "Path | None"):
            return Path(text) if text else None
        if kind in (int, "int"):
            return int(text)
        if kind in (float, "float"):
            return float(text)
        if str(kind).startswith("dict"):
            value = raw if isinstance(raw, dict) else json.loads(text or "{}")
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        if kind in (bool, "bool"):
            return text.lower() in ("1", "true", "yes", "on")
        return text
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config {name}: cannot read {raw!r} as {kind}") from exc


def load_config(overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the TOML file, then ``AENV_*`` variables, then ``overrides``."""
    values: dict[str, Any] = {}
    home = Path(os.environ.get("AENV_HOME", str(DEFAULT_HOME)))
    if overrides and overrides.get("home"):
        home = Path(overrides["home"])
    path = Path(os.environ.get("AENV_CONFIG", str(home / "config.toml")))
    if path.is_file():
        try:
            values.update(tomllib.loads(path.read_text()))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    known = {f.name: f for f in fields(Config) if f.name != "extra"}
    for name in known:
        env = os.environ.get(f"AENV_{name.upper()}")
        if env is not None:
            values[name] = env
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    values["home"] = home
    extra = {k: v for k, v in values.items() if k not in known}
    kwargs = {k: _coerce(k, v, known[k].type) for k, v in values.items() if k in known}
    cfg = Config(**kwargs, extra=extra)
    if not cfg.node_id:
        cfg.node_id = os.uname().nodename
    if not cfg.domain:
        cfg.domain = f"localhost:{cfg.port}"
    if cfg.net_pool_low > cfg.net_pool_high:
        raise ConfigError("net_pool_low must not exceed net_pool_high")
    if cfg.envd_file_access not in ("root", "user"):
        raise ConfigError("envd_file_access must be 'root' or 'user'")
    if cfg.image_loading not in ("unpack", "lazy", "auto"):
        raise ConfigError("image_loading must be 'unpack', 'lazy' or 'auto'")
    if not 0 <= cfg.image_lazy_above_mb <= 1 << 30:
        raise ConfigError("image_lazy_above_mb must be 0..2^30 MiB")
    if not 0 < cfg.image_index_retention_days <= 3650:
        raise ConfigError("image_index_retention_days must be more than 0 and at most 3650")
    if cfg.snapshot_gc_interval_s < 0:
        raise ConfigError("snapshot_gc_interval_s must be 0 (after deletes only) or more")
    if cfg.image_index_budget_bytes < 0:
        raise ConfigError("image_index_budget_bytes must be 0 (no bound) or more bytes")
    for name, low in (("max_cpu_count", MIN_CPU_COUNT), ("max_memory_mb", MIN_MEMORY_MB),
                      ("max_disk_mb", MIN_DISK_MB)):
        value = getattr(cfg, name)
        if value and value < low:
            raise ConfigError(f"{name} must be 0 (derived from the host) or at least {low}")
    _check_admission(cfg)
    if not 0 <= cfg.max_sandboxes <= 16000:  # a /16 pool holds ~16k /30 slots
        raise ConfigError("max_sandboxes must be 0 (derived from the host) or 1..16000")
    if cfg.idle_freeze_s != 0 and not 1 <= cfg.idle_freeze_s <= 86400:
        raise ConfigError("idle_freeze_s must be 0 (never freeze) or 1..86400 seconds")
    if cfg.envd_dormant_after_s != 0 and not 1 <= cfg.envd_dormant_after_s <= 86400:
        raise ConfigError("envd_dormant_after_s must be 0 (never) or 1..86400 seconds")
    if cfg.image_template_idle_s < 0:
        raise ConfigError("image_template_idle_s must be 0 (never remove) or more seconds")
    if not 0 <= cfg.idle_freeze_crowd <= 100_000:
        raise ConfigError("idle_freeze_crowd must be 0 (16 per CPU) or 1..100000 sandboxes")
    if not 0 <= cfg.idle_freeze_cpu_pct <= 100:
        raise ConfigError("idle_freeze_cpu_pct must be between 0 and 100")
    if cfg.cold_memory_after_s != 0 and not 1 <= cfg.cold_memory_after_s <= 86400:
        raise ConfigError("cold_memory_after_s must be 0 (never) or 1..86400 seconds")
    if cfg.cold_swap_mb < -1:
        raise ConfigError("cold_swap_mb must be -1 (none), 0 (derived) or more MiB")
    if cfg.envd_dormancy_mb < -1:
        raise ConfigError("envd_dormancy_mb must be -1 (never), 0 (derived) or more")
    if cfg.memory_pressure_mb < -1:
        raise ConfigError("memory_pressure_mb must be -1 (never), 0 (derived) or more")
    if cfg.max_sandboxes == 0:
        try:  # (a /30 per slot; the pool checks the CIDR itself)
            slots = ipaddress.ip_network(cfg.net_pool_cidr).num_addresses // 4 - 1
        except ValueError:
            slots = 1
        cfg.max_sandboxes = max(1, min(host_capacity(cfg.idle_freeze_s > 0), slots))
    if cfg.build_log_max_bytes < 64 * 1024:
        raise ConfigError("build_log_max_bytes must be at least 65536")
    return cfg


def _check_admission(cfg: Config) -> None:
    if not 0 <= cfg.admission_queue_timeout_s <= 600:
        raise ConfigError("admission_queue_timeout_s must be between 0 and 600")
    if cfg.admission_max_starting < -1:
        raise ConfigError("admission_max_starting must be -1 (no limit), 0 (derived) or more")
    if not 1 <= cfg.admission_queue_max <= 100_000:
        raise ConfigError("admission_queue_max must be between 1 and 100000")
    if cfg.key_max_sandboxes < 0 or cfg.key_creates_per_s < 0:
        raise ConfigError("key_max_sandboxes and key_creates_per_s must not be negative")
    if not 60 <= cfg.idempotency_ttl_s <= 30 * 86400 or \
            not 100 <= cfg.idempotency_max_keys <= 10_000_000:
        raise ConfigError("idempotency_ttl_s must be 60..2592000 and idempotency_max_keys "
                          "100..10000000")
    for key_id, quota in cfg.key_quotas.items():
        if not isinstance(quota, dict) or set(quota) - {"max_sandboxes", "creates_per_s"}:
            raise ConfigError(f"key_quotas.{key_id}: expected a table of max_sandboxes "
                              "and creates_per_s")
        for name, value in quota.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"key_quotas.{key_id}.{name} must be a number >= 0")
