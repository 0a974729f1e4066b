import multiprocessing as mp

from mshpc.events import append_event, read_events


def _writer(run_dir, who):
    for i in range(200):
        append_event(run_dir, "tick", who=who, i=i, pad="x" * 500)


def test_events_from_several_processes_never_interleave(tmp_path):
    procs = [mp.get_context("spawn").Process(target=_writer, args=(tmp_path, w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    events = read_events(tmp_path)
    assert len(events) == 600
    for who in range(3):
        assert [e["i"] for e in events if e["who"] == who] == list(range(200))


def test_torn_last_line_is_skipped(tmp_path):
    append_event(tmp_path, "start", step=0)
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"time": 1, "kind": "fail')
    assert [e["kind"] for e in read_events(tmp_path)] == ["start"]


def test_an_event_after_a_torn_line_starts_its_own_line(tmp_path):
    # a full disk or a kill mid-write leaves a line without its end; the next event must not
    # join it (and be lost with it to every reader)
    append_event(tmp_path, "start", step=0)
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"time": 1, "kind": "fail')
    append_event(tmp_path, "restart", attempt=1)
    assert [e["kind"] for e in read_events(tmp_path)] == ["start", "restart"]
