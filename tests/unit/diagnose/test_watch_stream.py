"""The watch stream's reader: whole records only, each with its rank, while ranks start late."""

from mshpc.diagnose.watch_stream import StreamReader, StreamWriter, stream_file


def test_a_rank_that_has_not_written_its_header_yet_is_waited_for(tmp_path):
    reader = StreamReader(tmp_path, 3)
    records, rows = reader.read_new()  # no rank has started
    assert len(records) == 0 and len(rows) == 0 and reader.heads == [None, None, None]
    writers = {r: StreamWriter(stream_file(tmp_path, r), {"rank": r}) for r in (0, 2)}
    for step in (1, 2):
        for r, w in writers.items():
            w.add(step, 1.0 + r, 0.5, 0.0, 100 * step)
            w.flush()
    records, rows = reader.read_new()  # rank 1 is still missing: the others' records are read
    assert rows.tolist() == [0, 0, 2, 2] and records["step"].tolist() == [1, 2, 1, 2]
    assert records["step_s"].tolist() == [1.0, 1.0, 3.0, 3.0] and reader.heads[1] is None
    late = StreamWriter(stream_file(tmp_path, 1), {"rank": 1})
    late.add(1, 2.0, 0.5, 0.0, 100)
    late.close()
    records, rows = reader.read_new()  # never a record twice
    assert rows.tolist() == [1] and records["step_s"].tolist() == [2.0] and reader.heads[1] == {"rank": 1}
    for w in writers.values():
        w.close()
    reader.close()
