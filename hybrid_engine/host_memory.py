"""How much host memory the engine's pools may take on the CPU: what the kernel reports
available (`MemAvailable`), capped by the memory limits of the process's cgroups.

A container's memory limit is invisible in `/proc/meminfo`, which describes the whole
host: pools sized against it alone can exceed the limit, and the process is then killed
(out of memory) instead of refusing to start with an error naming the flags. So each
cgroup from the process's own up to the root that sets a limit caps the answer at its
headroom: the limit minus the usage that is not file cache (the kernel reclaims file
cache, active or inactive, before it kills; `MemAvailable` counts it as available too).
Both cgroup layouts are read: v2 (one hierarchy, `memory.max`) and v1 (the memory
controller's own, `memory.limit_in_bytes`).
"""
import os

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
# (hierarchy under the root, limit file, usage file, the memory.stat keys of the file cache)
_LAYOUTS = (("", "memory.max", "memory.current", ("active_file", "inactive_file")),  # v2
            ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
             ("total_active_file", "total_inactive_file")))  # v1


def available_host_memory(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int | None:
    """Bytes of host memory new allocations can take (see the module docstring), None if
    nothing says."""
    known = [n for n in (_mem_available(), cgroup_headroom(cgroup_root, proc_cgroup)) if n is not None]
    return min(known) if known else None


def cgroup_headroom(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int | None:
    """The smallest headroom under a memory limit among the process's cgroup and its
    ancestors (both layouts), None if none sets a limit."""
    paths = _cgroup_paths(proc_cgroup)
    headrooms = []
    for hierarchy, limit_file, usage_file, cache_keys in _LAYOUTS:
        path = paths.get(hierarchy)
        if path is None:
            continue
        # (A path from outside this cgroup namespace reads "/../x": only names count.)
        parts = [p for p in path.split("/") if p not in ("", ".", "..")]
        for depth in range(len(parts), -1, -1):  # the process's own cgroup first, the root last
            folder = os.path.join(cgroup_root, hierarchy, *parts[:depth])
            limit = _read_int(os.path.join(folder, limit_file))
            if limit is None:
                continue
            usage = _read_int(os.path.join(folder, usage_file)) or 0
            reclaimable = _stat(os.path.join(folder, "memory.stat"), cache_keys)
            headrooms.append(max(0, limit - max(0, usage - reclaimable)))
    return min(headrooms) if headrooms else None


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """The process's cgroup path per hierarchy: "" for v2, "memory" for v1's memory
    controller (lines `ID:controllers:path` of /proc/self/cgroup). Without the file, the
    root of each (a container's own cgroup namespace shows its cgroup as the root)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return {"": "/", "memory": "/"}
    paths = {}
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            paths[""] = path
        elif "memory" in controllers.split(","):
            paths["memory"] = path
    return paths


def _mem_available() -> int | None:
    """The kernel's `MemAvailable` (free physical pages where there is no /proc/meminfo)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read_int(path: str) -> int | None:
    """The integer in a one-line cgroup file; None if absent or not a number ("max")."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _stat(path: str, keys: tuple[str, ...]) -> int:
    """The sum of some counters of a memory.stat file (absent ones count 0)."""
    total = 0
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in keys:
                    total += int(value)
    except (OSError, ValueError):
        pass
    return total
