"""Demo data for a table delivered as Fivetran-style batch files: CSV, ZSTD, AES-256-CBC.

The table's key is rotated halfway (two table keys in the keyring) and one file carries its
own key, as Fivetran sends one key per file. Partial updates mark unchanged cells with the
table's ``unmodified_string``; binary cells are base64; NULL is the ``null_string``.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.decoding.codecs import encode_file_bytes
from cdc_platform.lib.landing.where.layout import hour_folder

CDC = ("cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp")


def _cell(value: Any, table: TableConfig) -> str:
    if value is None:
        return table.null_string or ""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return str(value)


def _events(
    rng: random.Random, table: TableConfig, start: datetime, hours: int
) -> list[dict[str, Any]]:
    unmod = table.unmodified_string
    events: list[dict[str, Any]] = []
    seq = 1000
    live: dict[int, dict[str, Any]] = {}
    for hour in range(hours):
        for i in range(rng.randint(4, 8)):
            ts = start + timedelta(
                hours=hour, seconds=rng.randint(0, 3599), milliseconds=rng.randint(0, 999)
            )
            seq += 1
            if live and rng.random() < 0.45:
                pid = rng.choice(sorted(live))
                row = dict.fromkeys(table.columns, unmod)  # a partial update: only status changes
                row |= {
                    "payment_id": pid,
                    "status": rng.choice(["settled", "refunded", "disputed"]),
                }
                if rng.random() < 0.3:
                    row["amount"] = round(rng.uniform(5, 500), 2)
                events.append(
                    {
                        **row,
                        "cdc_operation_type": "UPDATE",
                        "cdc_change_seq": seq,
                        "cdc_commit_timestamp": ts,
                    }
                )
            elif live and rng.random() < 0.1:
                pid = rng.choice(sorted(live))
                live.pop(pid)
                row = dict.fromkeys(table.columns) | {"payment_id": pid}
                events.append(
                    {
                        **row,
                        "cdc_operation_type": "DELETE",
                        "cdc_change_seq": seq,
                        "cdc_commit_timestamp": ts,
                    }
                )
            else:
                pid = 5000 + len(events) * 10 + i
                row: dict[str, Any] = {
                    "payment_id": pid,
                    "order_id": rng.randint(1, 60),
                    "amount": round(rng.uniform(5, 500), 2),
                    "method": rng.choice(["card", "sepa", "wire", None]),
                    "status": "pending",
                    "receipt": rng.randbytes(12),
                    "paid_at": ts,
                }
                live[pid] = row
                events.append(
                    {
                        **row,
                        "cdc_operation_type": "INSERT",
                        "cdc_change_seq": seq,
                        "cdc_commit_timestamp": ts,
                    }
                )
    return events


def write_encrypted_csv_table(
    landing_root: Path, keyring_path: Path, table: TableConfig, seed: int = 11, hours: int = 12
) -> int:
    """Write the table's encrypted CSV files and a keyring (mode 0600); return the event count."""
    rng = random.Random(seed)
    keys = [rng.randbytes(32), rng.randbytes(32)]
    file_key = rng.randbytes(32)
    events = _events(rng, table, table.start, hours)
    keyring: dict[str, dict[str, Any]] = {
        "tables": {table.name: [base64.b64encode(k).decode() for k in keys]},
        "files": {},
    }
    by_hour: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        hour = int((e["cdc_commit_timestamp"] - table.start).total_seconds() // 3600)
        by_hour.setdefault(hour, []).append(e)
    for hour, rows in sorted(by_hour.items()):
        folder = hour_folder(landing_root, table.name, table.start + timedelta(hours=hour))
        folder.mkdir(parents=True, exist_ok=True)
        header = list(table.columns) + list(CDC)
        rng.shuffle(header)  # readers must follow the header, never assume the order
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        for r in rows:
            writer.writerow([_cell(r.get(c), table) for c in header])
        name = f"part-{hour:05d}.csv.zst.aes"
        key = keys[0] if hour < hours // 2 else keys[1]  # key rotation halfway
        if hour == 3:
            key = file_key
            keyring["files"][os.path.relpath(folder / name, landing_root)] = base64.b64encode(
                file_key
            ).decode()
        (folder / name).write_bytes(
            encode_file_bytes(buf.getvalue().encode(), "zstd", "aes-256-cbc", key)
        )
    keyring_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(keyring_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(keyring, fh, indent=2)
    os.chmod(keyring_path, 0o600)
    return len(events)
