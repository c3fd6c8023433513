"""The ledger shape the quarantine, the applied files and the revoked files share."""

from __future__ import annotations

import pyarrow as pa

from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.storage import delta

SCHEMA = pa.schema([pa.field("file", pa.string()), pa.field("n", pa.int64())])


def test_a_ledger_reads_empty_until_written_and_changes_by_one_commit_each(tmp_path):
    ledger = Ledger(tmp_path / "ledger", SCHEMA)
    assert ledger.rows() == [] and ledger.read(["n"]).schema.names == ["n"]
    ledger.replace([], delta.in_predicate("file", ["a"]))  # nothing to write: not created
    assert not ledger.exists()
    ledger.replace([{"file": "a", "n": 1}, {"file": "b", "n": 2}], None)  # created by its rows
    version = delta.open_table(ledger.path).version()
    ledger.replace([{"file": "b", "n": 3}], delta.in_predicate("file", ["b", "it's"]))
    ledger.replace([{"file": "z", "n": 9}], None)  # an existing ledger: nothing replaced
    ledger.append([{"file": "it's", "n": 4}])
    ledger.delete(delta.in_predicate("file", ["a"]))
    assert sorted((r["file"], r["n"]) for r in ledger.rows()) == [("b", 3), ("it's", 4)]
    assert delta.open_table(ledger.path).version() == version + 3


def test_a_column_added_to_a_ledgers_schema_reaches_a_ledger_written_before_it(tmp_path):
    """The applied-files ledger gained ``etag``: a ledger written without it takes the column
    on its next commit (earlier rows null) and stays at Delta reader 1 / writer 2."""
    before = pa.schema([pa.field("file", pa.string()), pa.field("size", pa.int64())])
    after = before.append(pa.field("etag", pa.string()))
    path = tmp_path / "ledger"
    Ledger(path, before).append([{"file": "a", "size": 1}])
    Ledger(path, after).replace([{"file": "b", "size": 2, "etag": '"e"'}], "file = 'b'")
    rows = sorted(Ledger(path, after).rows(), key=lambda r: r["file"])
    assert rows == [{"file": "a", "size": 1, "etag": None}, {"file": "b", "size": 2, "etag": '"e"'}]
    protocol = delta.open_table(path).protocol()
    assert (protocol.min_reader_version, protocol.min_writer_version) == (1, 2)
