"""Shared pieces of the benchmark drivers: machine description and JSON output."""
from __future__ import annotations

import json
import os
import platform
import subprocess

import torch


def machine_description() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cores": len(os.sched_getaffinity(0)), "kernel": platform.release()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    with open("/proc/meminfo") as handle:
        info["memory_gib"] = round(int(handle.readline().split()[1]) / 2**20, 1)
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
    print(f"wrote {path}")
