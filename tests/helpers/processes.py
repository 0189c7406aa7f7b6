"""The processes below a pid and the TCP ports they listen on, read from /proc (no psutil)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, by parent pid (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split(" ")[1])
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> set[int]:
    """``pid`` and every live process below it (by parent pid, read from /proc)."""
    children = children_by_parent()
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def listening_addresses(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by one of ``pids``."""
    listening = {}
    for name, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A":
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc/net prints the address as host-order 32-bit words
            ip = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            listening[inode] = (str(ipaddress.ip_address(ip)), int(hex_port, 16))
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                found.append((pid, *listening[link[8:-1]]))
    return found
