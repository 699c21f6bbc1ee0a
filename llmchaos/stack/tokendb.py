"""The token table behind the gateways' cache, and the tokens file the load reads.

Table: tokens(token TEXT PRIMARY KEY, tenant TEXT NOT NULL, revoked INTEGER NOT NULL DEFAULT 0).
Tokens file (JSON): {"tokens": [{"token": "...", "tenant": "...", "revoked": false}, ...]}.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path

from llmchaos.errors import InvalidInput
from llmchaos.files import create_private, write_text_atomic

__all__ = ["TokenRecord", "read_tokens_file", "seed_token_db"]


@dataclass(frozen=True)
class TokenRecord:
    """One row of the token table."""

    token: str
    tenant: str
    revoked: bool = False


def seed_token_db(
    db_path: Path, tokens_file: Path, *, tenants: int, tokens_per_tenant: int, revoked: int
) -> list[TokenRecord]:
    """Create the token table at `db_path` and write the same tokens to `tokens_file`."""
    records = [
        TokenRecord(f"sk-llmc-t{t:02d}-{secrets.token_hex(8)}", f"tenant-{t:02d}")
        for t in range(tenants)
        for _ in range(tokens_per_tenant)
    ]
    records += [
        TokenRecord(f"sk-llmc-revoked-{secrets.token_hex(8)}", f"tenant-{i % tenants:02d}", True)
        for i in range(revoked)
    ]
    create_private(db_path)  # SQLite gives its -wal and -shm files the database's mode
    with sqlite3.connect(db_path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(
            "CREATE TABLE IF NOT EXISTS tokens (token TEXT PRIMARY KEY, tenant TEXT NOT NULL,"
            " revoked INTEGER NOT NULL DEFAULT 0)"
        )
        db.executemany(
            "INSERT INTO tokens (token, tenant, revoked) VALUES (?, ?, ?)",
            [(r.token, r.tenant, int(r.revoked)) for r in records],
        )
    db.close()
    tokens = json.dumps({"tokens": [asdict(r) for r in records]}, indent=1)
    write_text_atomic(tokens_file, tokens, private=True)
    return records


def read_tokens_file(path: Path) -> list[TokenRecord]:
    """Tokens from a tokens file; raises InvalidInput naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidInput(f"tokens file {path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidInput(f"tokens file {path}: not JSON: {exc}") from None
    items = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise InvalidInput(f'tokens file {path}: expected {{"tokens": [...]}}')
    records = []
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("token"), str)):
            raise InvalidInput(f"tokens file {path}: tokens[{i}] needs a string 'token'")
        records.append(
            TokenRecord(item["token"], str(item.get("tenant", "")), bool(item.get("revoked")))
        )
    return records
