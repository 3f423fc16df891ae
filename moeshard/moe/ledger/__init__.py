"""The ledger: an append-only, hash-chained file of signed entries, one JSON object a line.

A node's ledger holds the receipts it issued and the settlements it accepted; a coordinator's
holds the receipts it accepted, its audit results and the settlements it signed. Every line is
signed by the file's owner and carries the hash of the line before it; the first line holds
the owner's public key, so `verify` needs nothing but the file. Format: `moe/ledger/entry.py`;
appending: `writer.py`; verify and summary: `read.py`.
"""

from moeshard.moe.ledger.entry import LedgerError, audit_body, receipt_body, settlement_body
from moeshard.moe.ledger.read import NodeWork, Report, Summary, summary, verify
from moeshard.moe.ledger.writer import BackgroundLedger, LedgerWriter, default_path, open_ledger

__all__ = [
    "BackgroundLedger",
    "LedgerError",
    "LedgerWriter",
    "NodeWork",
    "Report",
    "Summary",
    "audit_body",
    "default_path",
    "open_ledger",
    "receipt_body",
    "settlement_body",
    "summary",
    "verify",
]
