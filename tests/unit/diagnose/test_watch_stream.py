"""The watch files (one per node of ranks): every record read exactly once, with its rank, while
ranks start late, write torn records, die mid-write or restart, and past the number of
descriptors the reader may keep open."""

import json
import os
import subprocess
import sys
from pathlib import Path


from mshpc.diagnose.watch_stream import GAP_CHECKS, SPARE_FDS, StreamReader, StreamWriter, stream_file


def writer(run_dir, rank, group=4, start_step=0):
    return StreamWriter(Path(run_dir), rank, {"rank": rank}, start_step, group)


def write(w, *steps):
    for step in steps:
        w.add(step, 1.0 + step / 100, 0.5, 0.0, 100 * step)
    w.flush()


def read(reader, up_to_step=None):
    records, ranks = reader.read_new(up_to_step)
    return sorted(zip(ranks.tolist(), records["step"].tolist(), strict=True))


def test_ranks_share_a_file_per_node_and_a_late_one_is_waited_for(tmp_path):
    reader = StreamReader(tmp_path, 6, 0, 4)  # files of ranks 0-3 and 4-5
    assert read(reader) == [] and reader.missing() == list(range(6))
    writers = {r: writer(tmp_path, r) for r in (0, 2, 3, 4, 5)}
    assert {w.path.name for w in writers.values()} == {"ranks-00000.bin", "ranks-00004.bin"}
    for w in writers.values():
        write(w, 1, 2)
    assert read(reader) == [(r, s) for r in (0, 2, 3, 4, 5) for s in (1, 2)]
    assert reader.missing() == [1] and not reader.all_started() and reader.behind(2) == [1]
    records, ranks = StreamReader(tmp_path, 6, 0, 4).read_new()  # the fields come back as written
    assert records["step_s"][ranks == 4].tolist() == [1.01, 1.02]
    assert records["line_offset"][ranks == 4].tolist() == [100, 200]
    late = writer(tmp_path, 1)
    write(late, 1, 2, 3)
    for w in writers.values():
        write(w, 3)
    # the late rank's steps from the first on, the others' new step: never a record twice
    assert read(reader) == sorted([(1, 1), (1, 2), (1, 3)] + [(r, 3) for r in (0, 2, 3, 4, 5)])
    assert read(reader) == [] and reader.all_started() and reader.heads[1] == {"rank": 1}
    for w in [*writers.values(), late]:
        w.close()
    reader.close()


def test_a_torn_record_is_read_once_whole_and_a_dead_ranks_tear_harms_no_other(tmp_path):
    reader = StreamReader(tmp_path, 4, 0, 4)
    w = [writer(tmp_path, r) for r in range(4)]
    raw = os.open(w[0].path, os.O_WRONLY)
    for r in range(4):
        write(w[r], 1)
    w[1].add(2, 1.0, 0.5, 0.0, 0)
    [(offset, data)] = w[1].take_encoded()
    os.pwrite(raw, data[:20], offset)  # rank 1 is writing step 2 while the reader reads
    w[3].add(2, 1.0, 0.5, 0.0, 0)
    [(dead_at, dead)] = w[3].take_encoded()
    os.pwrite(raw, dead[:30], dead_at)  # rank 3 dies here: its step 2 is never whole
    for r in (0, 2):
        write(w[r], 2)
    assert read(reader) == [(0, 1), (0, 2), (1, 1), (2, 1), (2, 2), (3, 1)]
    os.pwrite(raw, data[20:], offset + 20)
    for r in (0, 2):
        write(w[r], 3)
    assert read(reader) == [(0, 3), (1, 2), (2, 3)]  # the torn tail once whole; nothing twice
    assert reader.behind(3) == [1, 3]
    os.close(raw)
    for x in w:
        x.close()
    reader.close()


def test_a_record_missing_behind_later_ones_holds_them_back_then_is_skipped(tmp_path):
    reader = StreamReader(tmp_path, 2, 0, 2)
    w = [writer(tmp_path, r, group=2) for r in range(2)]
    write(w[0], 1, 2, 3)
    w[1].add(1, 1.0, 0.5, 0.0, 0)
    w[1].take_encoded()  # rank 1's step 1 never reaches the file (a torn read looks the same once)
    write(w[1], 2, 3)
    assert read(reader) == [(0, 1), (0, 2), (0, 3)]
    for _ in range(GAP_CHECKS - 2):
        assert read(reader) == []
    assert read(reader) == [(1, 2), (1, 3)]  # given up on step 1, not on the rank
    write(w[1], 4)
    assert read(reader) == [(1, 4)]
    for x in w:
        x.close()
    reader.close()


def test_a_restarted_process_overwrites_its_places_and_the_old_records_are_not_read(tmp_path):
    old = [writer(tmp_path, r, start_step=10) for r in range(4)]
    for x in old:
        write(x, *range(11, 21))  # an attempt that ran to step 20, then failed
        x.close()
    new = [writer(tmp_path, r, start_step=10) for r in range(4)]  # resumed from the same checkpoint
    reader = StreamReader(tmp_path, 4, 10, 4)
    for x in new:
        write(x, 11, 12)
    assert read(reader, up_to_step=30) == [(r, s) for r in range(4) for s in (11, 12)]
    assert read(reader, up_to_step=30) == []  # steps 13-20 of the old attempt are not this one's
    for x in new:
        x.close()
    reader.close()


WORLD = 150
NOFILE = 600  # soft and hard: the reader may keep NOFILE - SPARE_FDS = 88 files open, not 150


def read_past_the_descriptor_limit(run_dir: str) -> None:
    """In a process limited to NOFILE descriptors, a file per rank: ranks write two rounds (one
    rank starting only in the second, three leaving a torn record between reads); prints what
    each read_new returned and how many descriptors the reader kept open."""
    before = len(os.listdir("/proc/self/fd"))
    writers = {r: writer(run_dir, r, group=1) for r in range(WORLD - 1)}
    reader = StreamReader(Path(run_dir), WORLD, 0, 1)
    for w in writers.values():
        write(w, 1, 2)
    raws, torn = {}, {}
    for r in (3, 100, 140):  # the reader comes while these three are writing step 3
        writers[r].add(3, 1.0, 0.5, 0.0, 0)
        [torn[r]] = writers[r].take_encoded()
        raws[r] = os.open(stream_file(Path(run_dir), r, 1), os.O_WRONLY)
        os.pwrite(raws[r], torn[r][1][:20], torn[r][0])
    reads = [read(reader)]
    for r, (offset, data) in torn.items():
        os.pwrite(raws[r], data[20:], offset + 20)
        os.close(raws[r])
    writers[WORLD - 1] = writer(run_dir, WORLD - 1, group=1)  # late
    write(writers[WORLD - 1], 1, 2, 3, 4)
    for r, w in writers.items():
        if r != WORLD - 1:
            write(w, *((4,) if r in torn else (3, 4)))
    reads.append(read(reader))
    for w in writers.values():
        w.close()
    kept = len(os.listdir("/proc/self/fd")) - before  # the writers' are closed: the reader's alone
    print(json.dumps({"kept": kept, "heads": sum(h is not None for h in reader.heads), "reads": reads}))


def test_files_past_the_descriptor_limit_are_read_once_each(tmp_path):
    limit = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE}))"
    code = f"{limit}; from test_watch_stream import *; read_past_the_descriptor_limit({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent, check=True)
    result = json.loads(done.stdout)
    assert result["kept"] == NOFILE - SPARE_FDS  # the other 62 files went through the fallback
    assert result["heads"] == WORLD
    first = sorted([(r, s) for r in range(WORLD - 1) for s in (1, 2)])
    second = sorted([(r, s) for r in range(WORLD) for s in (3, 4)] + [(WORLD - 1, s) for s in (1, 2)])
    assert result["reads"] == [[list(p) for p in first], [list(p) for p in second]]


def test_each_file_is_read_with_one_pread_per_look(tmp_path, monkeypatch):
    reader = StreamReader(tmp_path, 16, 0, 8)
    w = [writer(tmp_path, r, group=8) for r in range(16)]
    for x in w:
        write(x, 1, 2)
    read(reader)  # the headers, then the rows
    calls = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: calls.append(off) or real(fd, n, off))
    for x in w:
        write(x, 3)
    assert read(reader, up_to_step=13) == [(r, 3) for r in range(16)]
    assert len(calls) == 2  # two files of 8 ranks, not 16 reads
    for x in w:
        x.close()
    reader.close()
    assert reader.behind(3) == []
