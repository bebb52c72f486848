"""Host memory available to the CPU engine's pools: MemAvailable capped by the headroom
under the memory limits of the process's cgroups (v2 and v1 layouts), on fake trees."""
import os

from hybrid_engine import host_memory
from hybrid_engine.host_memory import available_host_memory, cgroup_headroom

MIB = 1 << 20


def write(folder, **files: str) -> None:
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name.replace("_", ".", 1)), "w") as f:
            f.write(text)


def test_v2_the_tightest_limit_of_the_cgroup_and_its_ancestors_counts(tmp_path):
    root = tmp_path / "cg"
    write(root, memory_max="max\n")  # the root sets no limit
    write(root / "outer", memory_max=f"{4096 * MIB}\n", memory_current=f"{3000 * MIB}\n")
    # Its own limit: 1 GiB, 512 MiB used of which 128 + 64 MiB file cache (reclaimable).
    write(root / "outer" / "job", memory_max=f"{1024 * MIB}\n", memory_current=f"{512 * MIB}\n",
          memory_stat=f"anon 1\ninactive_file {128 * MIB}\nactive_file {64 * MIB}\nshmem 7\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/outer/job\n")
    # Own headroom 1024 - (512 - 192) = 704 MiB; the parent's 4096 - 3000 = 1096 MiB.
    assert cgroup_headroom(str(root), str(proc)) == 704 * MIB
    write(root / "outer", memory_current=f"{3800 * MIB}\n")  # now the parent is the tighter one
    assert cgroup_headroom(str(root), str(proc)) == 296 * MIB


def test_v1_memory_controller_and_no_limit(tmp_path):
    root = tmp_path / "cg"
    write(root / "memory" / "docker" / "abc", memory_limit_in_bytes=f"{2048 * MIB}\n",
          memory_usage_in_bytes=f"{2100 * MIB}\n",
          memory_stat=f"total_inactive_file {60 * MIB}\ntotal_active_file {40 * MIB}\ncache 999\n")
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\nnot a cgroup line\n0::/\n")
    assert cgroup_headroom(str(root), str(proc)) == 48 * MIB
    proc.write_text("0::/\n")  # a v2 process whose cgroups set no limit
    assert cgroup_headroom(str(root), str(proc)) is None
    # A cgroup outside this namespace (its path climbs with ".."), or not mounted here: the
    # limits of the folders that exist still count, the root's among them.
    write(root / "memory", memory_limit_in_bytes=f"{4096 * MIB}\n", memory_usage_in_bytes=f"{96 * MIB}\n")
    proc.write_text("4:memory:/../elsewhere/xyz\n")
    assert cgroup_headroom(str(root), str(proc)) == 4000 * MIB


def test_available_memory_is_the_smaller_of_the_host_and_the_cgroup(tmp_path, monkeypatch):
    root = tmp_path / "cg"
    write(root, memory_max=f"{256 * MIB}\n", memory_current="0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    monkeypatch.setattr(host_memory, "_mem_available", lambda: 8192 * MIB)
    assert available_host_memory(str(root), str(proc)) == 256 * MIB
    monkeypatch.setattr(host_memory, "_mem_available", lambda: 100 * MIB)
    assert available_host_memory(str(root), str(proc)) == 100 * MIB
    monkeypatch.setattr(host_memory, "_mem_available", lambda: None)
    assert available_host_memory(str(tmp_path / "none"), str(proc)) is None
