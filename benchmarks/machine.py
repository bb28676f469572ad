"""What machine a benchmark ran on (one function every benchmark reports with), and
page-cache control."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
from typing import List, Optional

import numpy as np


def machine_info(path: Optional[str] = None) -> dict:
    """CPU, memory, load and software versions; with ``path``, also the disk holding it.

    Keys: cpu_model, cpu_cache_size, nproc (usable CPUs), cpu_count, ram_gb, ram_gib
    (= mem_gib), kernel, platform, python, numpy, loadavg; with ``path``:
    disk_total_gb, disk_free_gb, filesystem, device, rotational, shm_gb, nvidia_pytriton.
    """
    info = {
        "cpu_model": "unknown",
        "cpu_cache_size": None,
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "loadavg": "?",
    }
    try:
        info["nproc"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["nproc"] = os.cpu_count()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and info["cpu_model"] == "unknown":
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                elif line.startswith("cache size") and info["cpu_cache_size"] is None:
                    info["cpu_cache_size"] = line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    kib = int(line.split()[1])
                    info["ram_gb"] = round(kib * 1024 / 1e9, 1)
                    info["ram_gib"] = info["mem_gib"] = round(kib / 2**20, 1)
    with contextlib.suppress(OSError):
        with open("/proc/loadavg") as f:
            info["loadavg"] = " ".join(f.read().split()[:3])
    if path is None:
        return info
    du = shutil.disk_usage(path)
    info["disk_total_gb"], info["disk_free_gb"] = round(du.total / 1e9), round(du.free / 1e9, 1)
    info["filesystem"] = "unknown"
    with contextlib.suppress(OSError):
        real, best = os.path.realpath(path), ""
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, info["filesystem"], info["device"] = mnt, typ, dev
    dev = os.path.basename(info.get("device", ""))
    with contextlib.suppress(OSError):
        with open(f"/sys/block/{dev}/queue/rotational") as f:
            info["rotational"] = f.read().strip() == "1"
    with contextlib.suppress(OSError):
        info["shm_gb"] = round(shutil.disk_usage("/dev/shm").total / 1e9, 1)
    with contextlib.suppress(Exception):
        import importlib.metadata as md

        info["nvidia_pytriton"] = md.version("nvidia-pytriton")
    return info


def nvidia_smi(*flags: str) -> Optional[List[str]]:
    """The non-empty lines ``nvidia-smi <flags>`` prints, None where it cannot run or fails
    (no GPU, no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", *flags], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def gpus() -> list:
    """The NVIDIA GPUs of this machine as ``nvidia-smi`` names them (name, driver, memory),
    one string each; [] without a GPU or without nvidia-smi."""
    return nvidia_smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader") or []


def machine_tag(info: Optional[dict] = None, gpu_list: Optional[list] = None) -> str:
    """A short name of this machine for a benchmark's data file: the CPU model's words, the
    usable CPUs and the first GPU's model, e.g. ``amd-epyc-2c`` or
    ``amd-epyc-9654-16c-h200`` (from :func:`machine_info` and :func:`gpus` unless given)."""
    info = machine_info() if info is None else info
    gpu_list = gpus() if gpu_list is None else gpu_list

    def slug(text: str, drop: tuple) -> str:
        text = re.sub(r"\(r\)|\(tm\)|\b\d+-core\b|@.*$|\bwith\b.*$", " ", text.lower())
        words = [w for w in re.split(r"[^a-z0-9+]+", text) if w and w not in drop]
        return "-".join(w.replace("+", "p") for w in words)[:40].strip("-")

    cpu = slug(info.get("cpu_model", "unknown"), ("cpu", "processor", "core", "nvidia"))
    parts = [cpu or "cpu", f"{info.get('nproc') or info.get('cpu_count')}c"]
    if gpu_list:
        name = gpu_list[0].split(",")[0]
        parts.append(slug(name, ("nvidia", "tesla", "sxm", "sxm4", "sxm5", "pcie", "hbm3", "nvl")))
    return "-".join(p for p in parts if p)


def evict_files(*paths: str) -> None:
    """Drop these files' pages from the page cache (written back first), for cold runs."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def process_memory_kb(pid: int, field: str = "VmRSS") -> int:
    """A process's memory figure from /proc/PID/status, in kB (``VmRSS``: resident;
    ``RssAnon``: anonymous resident, what a leak grows)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")
