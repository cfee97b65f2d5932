"""`dsv4 bench prefill`: impossible flags and a machine without Hopper fail with exit 2
and a clear message before any weight is drawn or program compiled."""
import pytest

from dsv4_jax import cli


@pytest.mark.parametrize("argv,needle", [
    (["--chunks", "0"], "--chunks must be at least 1"),
    (["--lengths", "1024", "--chunks", "2048"], "longer than every prompt"),
    (["--layers", "99"], "--layers must be in [0, 43]"),
    (["--prompts", "0"], "--prompts must be at least 1"),
    ([], "needs a Hopper GPU"),          # this CPU machine
])
def test_bench_prefill_flags_checked_before_work(capsys, monkeypatch, argv, needle):
    from benchmarks import prefill_bench

    def fail(*a, **k):
        raise AssertionError("the bench started before its flags were checked")
    monkeypatch.setattr(prefill_bench, "tensor_peak", fail)
    monkeypatch.setattr(prefill_bench, "main", fail)
    assert cli.main(["bench", "prefill", *argv]) == 2
    err = capsys.readouterr().err
    assert "dsv4 bench: error:" in err and needle in err, err
