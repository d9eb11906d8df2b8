"""Spec files a user (or an attacker) may hand over (issue 44): a key written twice, a FIFO,
a device that never ends, a link to one, a huge file. Each is one SpecError line, read
within a bounded size, never a hang."""
from __future__ import annotations

import os

import pytest

import dilgen
from conftest import run_cli

GOOD = '"name": "s", "head_dim": 16, "segment_lengths": [8], "dilation_rates": [1]'


def _refused(path, match):
    with pytest.raises(dilgen.SpecError, match=match) as info:
        dilgen.load_spec(path)
    assert "\n" not in str(info.value)


def test_a_key_written_twice_is_refused(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{' + GOOD + ', "num_heads": 2, "num_heads": 4}')
    _refused(path, "num_heads is written twice")
    path.write_text('{' + GOOD + ', "num_heads": 2, "hilbert": {"scope": "segment", "scope": "x"}}')
    _refused(path, "scope is written twice")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
@pytest.mark.timeout(30)
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file")
    code, _, err = run_cli(["compile", str(fifo)])
    assert code == 2 and "not a regular file" in err


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
@pytest.mark.timeout(30)
def test_devices_and_links_to_them_are_refused(tmp_path):
    _refused("/dev/zero", "not a regular file")
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    _refused(link, "not a regular file")


def test_a_huge_file_is_read_no_further_than_the_bound(tmp_path):
    path = tmp_path / "big.json"
    path.write_text('{' + GOOD + ', "num_heads": 2}' + " " * (dilgen.spec.MAX_SPEC_BYTES + 1))
    _refused(path, "larger than 1 MiB")


def test_a_null_num_heads_is_named_as_itself():
    with pytest.raises(dilgen.SpecError, match=r"num_heads = null: must be an integer"):
        dilgen.spec_from_dict({"name": "s", "num_heads": None, "head_dim": 16, "segment_lengths": [8],
                               "dilation_rates": [1]})
