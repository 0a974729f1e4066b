"""The watch stream's reader: whole records only, each with its rank, while ranks start late and
past the number of descriptors it may keep open."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from mshpc.diagnose.watch_stream import RECORD, SPARE_FDS, StreamReader, StreamWriter, stream_file


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


WORLD = 150
NOFILE = 600  # soft and hard: the reader may keep NOFILE - SPARE_FDS = 88 ranks open, not 150


def read_past_the_descriptor_limit(run_dir: str) -> None:
    """In a process limited to NOFILE descriptors: ranks write two rounds (one rank starting only
    in the second, some leaving a torn record between reads); prints what each read_new returned
    and how many descriptors the reader kept open."""
    before = len(os.listdir("/proc/self/fd"))
    writers = {r: StreamWriter(stream_file(Path(run_dir), r), {"rank": r}) for r in range(WORLD - 1)}
    torn = {r: os.open(stream_file(Path(run_dir), r), os.O_WRONLY | os.O_APPEND) for r in (3, 100, 140)}
    reader = StreamReader(Path(run_dir), WORLD)
    torn_record = np.array([(11, 0.0, 0.5, 0.0, 0)], RECORD).tobytes()
    half = RECORD.itemsize // 2

    def write_two_steps(first_step: int) -> None:
        for w in writers.values():
            w.add(first_step, 1.0, 0.5, 0.0, 0)
            w.add(first_step + 1, 1.0, 0.5, 0.0, 0)
            w.flush()

    def read() -> list[tuple[int, int]]:
        records, rows = reader.read_new()
        return sorted(zip(rows.tolist(), records["step"].tolist(), strict=True))

    write_two_steps(1)
    for fd in torn.values():  # the reader comes while these three are writing a record
        os.write(fd, torn_record[:half])
    reads = [read()]
    for fd in torn.values():
        os.write(fd, torn_record[half:])
    writers[WORLD - 1] = StreamWriter(stream_file(Path(run_dir), WORLD - 1), {"rank": WORLD - 1})  # late
    write_two_steps(3)
    reads.append(read())
    for w in writers.values():
        w.close()
    for fd in torn.values():
        os.close(fd)
    kept = len(os.listdir("/proc/self/fd")) - before  # the writers' are closed: the reader's alone
    print(json.dumps({"kept": kept, "heads": sum(h is not None for h in reader.heads), "reads": reads}))


def test_ranks_past_the_descriptor_limit_are_read_once_each(tmp_path):
    limit = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE}))"
    code = f"{limit}; from test_watch_stream import *; read_past_the_descriptor_limit({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent, check=True)
    result = json.loads(done.stdout)
    assert result["kept"] == NOFILE - SPARE_FDS  # the other 62 ranks went through the fallback
    assert result["heads"] == WORLD
    first = sorted([(r, s) for r in range(WORLD - 1) for s in (1, 2)])
    second = sorted([(r, s) for r in range(WORLD) for s in (3, 4)] + [(r, 11) for r in (3, 100, 140)])
    assert result["reads"] == [[list(p) for p in first], [list(p) for p in second]]
