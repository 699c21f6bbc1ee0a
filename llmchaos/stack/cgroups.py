"""Control groups for resource faults: CPU bandwidth (throttling) and memory limits (OOM).

    group = cgroups.create("cpu", "llmc-1a2b-gpu-0", pid)   # a new cgroup holding `pid`
    group.set_cpu_max(quota_us=5000, period_us=100_000)     # 5% of one CPU
    group.cpu_stat()            # {"nr_periods", "nr_throttled", "throttled_usec"}
    group.set_memory_max(64 << 20); group.memory_events()   # {"oom_kill", "max"}
    cgroups.remove(group)       # the pids go back where they were, the folder goes

cgroup v2 (the unified hierarchy: `cpu.max`, `cpu.stat`, `memory.max`, `memory.events`) when
the controller is enabled there, else cgroup v1 (`cpu.cfs_quota_us`/`cpu.cfs_period_us`,
`cpu.stat` with `throttled_time` in ns, `memory.limit_in_bytes`, `memory.oom_control`'s
`oom_kill`): both are the kernel's own CFS bandwidth control and memory controller, so the
throttling and the OOM kill are real; hosts mounted "hybrid" (v2 without the cpu and memory
controllers, v1 beside it), as the machine this was written on, have only v1 for them.

Where the new cgroup goes: on v1, a child of the cgroup the process is in now (limits that
enclose it still apply); on v2, a child of the hierarchy's root, because v2 forbids
controllers in a cgroup that holds processes itself ("no internal processes"), and the root
is exempt. Names start with `llmc-<short stack id>-`, so the stack's teardown and `llmchaos
cleanup` find them by name like the stack's namespaces. Needs root (writes under
/sys/fs/cgroup); `support()` says why not when it cannot work.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from llmchaos.errors import StackError

__all__ = ["CGROUP_PREFIX", "Cgroup", "create", "find", "list_ours", "remove", "support"]

CGROUP_PREFIX = "llmc-"
"""Every cgroup llmchaos creates starts with this (then the stack's short id)."""
_MOUNTINFO = Path("/proc/self/mountinfo")
_SEARCH_DEPTH = 6
"""How deep cleanup looks for our cgroups below a hierarchy's root (v1 puts them under the
process's own cgroup, which sits a few levels down on systemd or container hosts)."""


@dataclass(frozen=True)
class _Hierarchy:
    version: int
    root: Path
    """Mount point of the hierarchy."""
    mount_prefix: str
    """The cgroup path the mount shows as its root (`/` on the host, deeper in a container
    that bind-mounts part of it): subtracted from /proc/<pid>/cgroup paths."""
    controllers: frozenset[str]


def _hierarchies() -> list[_Hierarchy]:
    """Every cgroup mount with the controllers it carries."""
    found = []
    try:
        lines = _MOUNTINFO.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3]
        mount_root, point = fields[3], Path(fields[4])
        if fstype == "cgroup2":
            try:
                controllers = set((point / "cgroup.controllers").read_text().split())
            except OSError:
                continue
            found.append(_Hierarchy(2, point, mount_root, frozenset(controllers)))
        elif fstype == "cgroup":
            controllers = set(options.split(",")) & {"cpu", "memory"}
            found.append(_Hierarchy(1, point, mount_root, frozenset(controllers)))
    return found


def _hierarchy(controller: str) -> _Hierarchy | None:
    """The hierarchy that carries `controller`: v2 when it is available there, else v1."""
    mounts = sorted(_hierarchies(), key=lambda h: -h.version)
    return next((h for h in mounts if controller in h.controllers), None)


def support(controller: str) -> str | None:
    """None when cgroups of `controller` (cpu, memory) can be made here, else why not."""
    if os.geteuid() != 0:
        return f"the {controller} controller needs root (cgroups are written under /sys/fs/cgroup)"
    if _hierarchy(controller) is None:
        return (
            f"no cgroup hierarchy carries the {controller} controller here (neither v2 "
            f"cgroup.controllers nor a v1 mount lists it)"
        )
    return None


@dataclass(frozen=True)
class Cgroup:
    """One cgroup of one controller's hierarchy."""

    controller: str
    version: int
    path: Path
    parent: Path
    """Where its processes go back to when it is removed."""

    def _write(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except OSError as exc:
            raise StackError(
                f"cgroup {self.path}: cannot write {value!r} to {name}: {exc}"
            ) from None

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError as exc:
            raise StackError(f"cgroup {self.path}: cannot read {name}: {exc}") from None

    @property
    def exists(self) -> bool:
        return self.path.is_dir()

    def pids(self) -> list[int]:
        """The processes in it now (none once it is gone)."""
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads) into this cgroup."""
        self._write("cgroup.procs", str(pid))

    # -- cpu ---------------------------------------------------------------------------
    def set_cpu_max(self, quota_us: int | None, period_us: int = 100_000) -> None:
        """At most `quota_us` of CPU time per `period_us` (None: no limit)."""
        if self.version == 2:
            self._write("cpu.max", f"{quota_us if quota_us else 'max'} {period_us}")
        else:
            self._write("cpu.cfs_period_us", str(period_us))
            self._write("cpu.cfs_quota_us", str(quota_us if quota_us else -1))

    def cpu_stat(self) -> dict[str, int]:
        """The kernel's throttling counters, in v2's names: nr_periods (enforcement periods
        with runnable tasks), nr_throttled (periods the group ran out of quota in) and
        throttled_usec (time its tasks waited for the next period)."""
        stat = _pairs(self._read("cpu.stat"))
        if self.version == 1:  # v1 counts the waiting time in ns as throttled_time
            stat["throttled_usec"] = stat.get("throttled_time", 0) // 1000
        return {k: stat.get(k, 0) for k in ("nr_periods", "nr_throttled", "throttled_usec")}

    # -- memory ------------------------------------------------------------------------
    def set_memory_max(self, limit_bytes: int | None) -> None:
        """Charge at most `limit_bytes` to this cgroup (None: no limit); beyond it the kernel
        reclaims and then OOM-kills a process of the cgroup."""
        if self.version == 2:
            self._write("memory.max", str(limit_bytes) if limit_bytes else "max")
        else:
            self._write("memory.limit_in_bytes", str(limit_bytes) if limit_bytes else "-1")

    def memory_events(self) -> dict[str, int]:
        """oom_kill (processes the OOM killer killed in it), max (times usage hit the limit;
        v1: memory.failcnt) and current (bytes charged now)."""
        if self.version == 2:
            events = _pairs(self._read("memory.events"))
            current = int(self._read("memory.current"))
            return {
                "oom_kill": events.get("oom_kill", 0),
                "max": events.get("max", 0),
                "current": current,
            }
        control = _pairs(self._read("memory.oom_control"))
        return {
            "oom_kill": control.get("oom_kill", 0),
            "max": int(self._read("memory.failcnt")),
            "current": int(self._read("memory.usage_in_bytes")),
        }

    def describe(self) -> str:
        return f"cgroup v{self.version} {self.path}"


def _pairs(text: str) -> dict[str, int]:
    """A cgroup file of "key number" lines (cpu.stat, memory.events, memory.oom_control)."""
    pairs = (line.split() for line in text.splitlines())
    return {fields[0]: int(fields[1]) for fields in pairs if len(fields) == 2}


def _current_path(hierarchy: _Hierarchy, pid: int) -> Path:
    """The folder of the cgroup `pid` is in now, in `hierarchy`."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError as exc:
        raise StackError(f"process {pid}: cannot read its cgroups: {exc}") from None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if hierarchy.version == 2:
            ours = number == "0"
        else:
            ours = bool(set(controllers.split(",")) & hierarchy.controllers)
        if ours:
            return hierarchy.root / path.removeprefix(hierarchy.mount_prefix).lstrip("/")
    raise StackError(f"process {pid}: in no cgroup of {hierarchy.root}")


def create(controller: str, name: str, pid: int) -> Cgroup:
    """A new cgroup `name` of `controller` holding process `pid` (see the module docstring
    for where it goes); an existing one of that name is reused. Raises StackError when the
    kernel refuses (support() says why beforehand)."""
    if not name.startswith(CGROUP_PREFIX):
        raise StackError(f"cgroup name {name!r} must start with {CGROUP_PREFIX!r}")
    reason = support(controller)
    if reason is not None:
        raise StackError(f"cgroup {controller}: {reason}")
    hierarchy = _hierarchy(controller)
    assert hierarchy is not None
    current = _current_path(hierarchy, pid)
    # back where it came from, not into one of ours, if it already is in one
    home = current.parent if current.name.startswith(CGROUP_PREFIX) else current
    if hierarchy.version == 2:
        control = hierarchy.root / "cgroup.subtree_control"
        if controller not in control.read_text().split():
            try:
                control.write_text(f"+{controller}")
            except OSError as exc:
                raise StackError(
                    f"cgroup v2: cannot enable {controller} in {control} ({exc}): the root "
                    f"of this hierarchy holds processes (inside a container without cgroup "
                    f"delegation?); run where the cgroup root is the host's"
                ) from None
        group = Cgroup(controller, 2, hierarchy.root / name, home)
    else:
        group = Cgroup(controller, 1, home / name, home)
    try:
        group.path.mkdir(exist_ok=True)
    except OSError as exc:
        raise StackError(f"cgroup {controller}: cannot create {group.path}: {exc}") from None
    group.add(pid)
    return group


def find(controller: str, name: str) -> Cgroup | None:
    """Our cgroup `name` of `controller`, wherever it is; None when there is none."""
    for group in list_ours(name.removeprefix(CGROUP_PREFIX)):
        if group.controller == controller and group.path.name == name:
            return group
    return None


def list_ours(prefix: str = "") -> list[Cgroup]:
    """Our cgroups that exist now whose name starts with `llmc-<prefix>` (a stack's short id,
    or "" for every stack's)."""
    found = []
    for hierarchy in _hierarchies():
        paths = _walk(hierarchy.root, CGROUP_PREFIX + prefix, _SEARCH_DEPTH)
        for controller in sorted(hierarchy.controllers):
            found += [Cgroup(controller, hierarchy.version, p, p.parent) for p in paths]
    return found


def _walk(folder: Path, prefix: str, depth: int) -> list[Path]:
    found = []
    try:
        children = [c for c in folder.iterdir() if c.is_dir()]
    except OSError:
        return []
    for child in children:
        if child.name.startswith(prefix):
            found.append(child)
        elif depth > 0 and not child.name.startswith(CGROUP_PREFIX):
            found += _walk(child, prefix, depth - 1)
    return found


def remove(group: Cgroup, timeout_s: float = 2.0) -> None:
    """Move what is still in `group` back to its parent, then delete it; nothing when it is
    already gone. Raises StackError when the kernel keeps it (a process stuck in it)."""
    deadline = time.monotonic() + timeout_s
    while group.exists:
        for pid in group.pids():
            with contextlib.suppress(OSError):  # gone meanwhile, or exiting
                (group.parent / "cgroup.procs").write_text(str(pid))
        try:
            group.path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise StackError(f"cannot remove {group.describe()}: {exc}") from None
            time.sleep(0.05)
