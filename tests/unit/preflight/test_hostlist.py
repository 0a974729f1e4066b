"""Slurm hostlist syntax, both ways, as `scontrol show hostnames` / `hostlist` write it."""

import random

import pytest

from mshpc.errors import ConfigError
from mshpc.preflight.hostlist import compress, expand


@pytest.mark.parametrize("text, hosts", [
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("n5", ["n5"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("login,n[1-2],a-b3", ["login", "n1", "n2", "a-b3"]),
    ("n[1-2] n3\nn2", ["n1", "n2", "n3"]),  # whitespace also separates (an exclude file); no duplicates
    ("", []),
])
def test_expand(text, hosts):
    assert expand(text) == hosts


@pytest.mark.parametrize("hosts, text", [
    (["n3", "n1", "n2", "n5"], "n[1-3,5]"),
    (["n5"], "n5"),
    (["gpu09", "gpu10", "gpu08"], "gpu[08-10]"),  # gpu10 needs no padding yet joins gpu[08-09]
    (["n1", "n01"], "n1,n01"),  # different names: n1 is not n01
    (["n8", "n10", "n9", "n12"], "n[8-10,12]"),
    (["login", "n2", "m1", "n1"], "login,m1,n[1-2]"),
    ([], ""),
])
def test_compress(hosts, text):
    assert compress(hosts) == text


def test_round_trip_of_random_node_sets():
    rng = random.Random(0)
    for _ in range(200):
        hosts = sorted({f"{rng.choice(['n', 'gpu', 'r1n'])}{rng.randint(0, 40)}" for _ in range(rng.randint(1, 12))})
        assert sorted(expand(compress(hosts))) == hosts


@pytest.mark.parametrize("text, why", [("n[1-3", "unclosed"), ("n[3-1]", "backwards"), ("n[a-b]", "not a number"),
                                       ("n[[1]]", "nest")])
def test_malformed_hostlists_say_what_is_wrong(text, why):
    with pytest.raises(ConfigError, match=why):
        expand(text)
