"""Ways to damage files on disk, as disks, copies and stray writes do."""

from pathlib import Path


def overwrite_middle(file: Path, size: int = 4096) -> None:
    """Overwrite ``size`` bytes in the middle of ``file`` with other bytes: same size, same header."""
    data = bytearray(file.read_bytes())
    start = max(0, len(data) // 2 - size // 2)
    end = min(len(data), start + size)
    data[start:end] = bytes((b + 1) % 256 for b in data[start:end])
    file.write_bytes(bytes(data))
