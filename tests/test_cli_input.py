"""Bad input to `dsv4 generate` / `dsv4 logits`: every case exits 2 with one line naming the
flag, file or field (and what would be valid) BEFORE any weight is read or program compiled;
Ctrl-C exits 130 with one line, a failure while working exits 1.

"Before any heavy work" is checked, not assumed: `no_model` makes loading weights fail
the test."""
import json

import numpy as np
import pytest

from dsv4_jax import cli, config as C, generate as G
from dsv4_jax.quant import Numerics
from dsv4_jax.tokenizer import load_tokenizer


def run(argv):
    try:
        return cli.main(argv)
    except SystemExit as e:   # argparse's own usage errors
        return e.code


@pytest.fixture
def no_model(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("weights were loaded before the input was checked")
    monkeypatch.setattr(cli, "_load_params", fail)


def bad(capsys, argv, *needles, code=2):
    """Run, expect `code` and one stderr line holding every needle."""
    assert run(argv) == code, argv
    err = capsys.readouterr().err.strip().splitlines()
    line = err[-1] if err else ""
    for n in needles:
        assert n in line, (argv, n, line)
    return line


GEN = ["generate", "--prompt", "hi"]


@pytest.mark.parametrize("argv, needles", [
    (["--max-new-tokens", "0"], ["--max-new-tokens", "at least 1"]),
    (["--max-new-tokens", "-3", "--stream"], ["--max-new-tokens", "-3"]),
    (["--temperature", "-1"], ["--temperature"]),
    (["--temperature", "nan"], ["--temperature"]),
    (["--top-p", "2", "--temperature", "1"], ["--top-p", "(0, 1]"]),
    (["--top-p", "0", "--temperature", "1"], ["--top-p"]),
    (["--top-k", "0", "--temperature", "1"], ["--top-k", "at least 1"]),
    (["--min-p", "1.5", "--temperature", "1"], ["--min-p", "[0, 1)"]),
    (["--top-p", "0.9"], ["--top-p", "--temperature"]),
    (["--top-k", "5"], ["--top-k", "--temperature"]),
    (["--min-p", "0.1"], ["--min-p", "--temperature"]),
    (["--top-k", "5", "--top-p", "0.5", "--temperature", "1"], ["--top-k", "--top-p", "one of"]),
    (["--system", "be brief"], ["--system", "--chat"]),
    (["--thinking"], ["--thinking", "--chat"]),
    (["--max-requests", "0"], ["--max-requests", "at least 1"]),
    (["--num-blocks", "-1"], ["--num-blocks"]),
    (["--max-blocks", "0"], ["--max-blocks"]),
    (["--prefill-chunk", "0"], ["--prefill-chunk"]),
    (["--devices", "-1"], ["--devices"]),
    (["--devices", "64"], ["--devices 64", "device(s)"]),
    (["--expert", "2"], ["--expert", "--devices"]),
    (["--preset", "flash"], ["--preset flash", "make-checkpoint"]),
    (["--preset", "huge"], ["--preset", "choose from"]),
    (["--index-format", "fp8", "--act-quant", "off"], ["--index-format", "--act-quant on"]),
    (["--max-blocks", "1", "--max-new-tokens", "200"], ["--max-blocks 1", "--max-blocks 2"]),
    (["--num-blocks", "1", "--max-blocks", "4", "--max-new-tokens", "300"],
     ["--num-blocks 1", "--num-blocks 3"]),
])
def test_generate_flags(capsys, no_model, argv, needles):
    line = bad(capsys, GEN + argv, *needles)
    assert line.startswith("dsv4 generate: error: ")


def test_generate_input_files(tmp_path, capsys, no_model, monkeypatch):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    bad(capsys, ["generate", "--prompts-file", str(blank)], "--prompts-file", "blank.txt",
        "no prompt")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    bad(capsys, ["generate", "--prompts-file", str(latin)], "latin1.txt", "UTF-8")
    bad(capsys, ["generate", "--prompts-file", str(tmp_path)], "--prompts-file", "directory")
    bad(capsys, ["generate", "--prompts-file", str(tmp_path / "nope.txt")], "nope.txt",
        "no such file")
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"role": "user", "content": "hi"}))
    bad(capsys, ["generate", "--chat", str(obj)], "--chat", "obj.json", "JSON list", "dict")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"role": "user",\n "content": }]')
    bad(capsys, ["generate", "--chat", str(broken)], "broken.json", "line 2")
    norole = tmp_path / "norole.json"
    norole.write_text(json.dumps([{"content": "hi"}]))
    bad(capsys, ["generate", "--chat", str(norole)], "--chat", "norole.json")
    bad(capsys, ["generate", "--prompt", "  "], "--prompt", "empty")
    # a relative / ~ path is resolved before it is read
    monkeypatch.chdir(tmp_path)
    bad(capsys, ["generate", "--prompts-file", "blank.txt"], "no prompt")
    monkeypatch.setenv("HOME", str(tmp_path))
    bad(capsys, ["generate", "--prompts-file", "~/blank.txt"], "no prompt")
    cache_file = tmp_path / "a_file"
    cache_file.write_text("x")
    bad(capsys, GEN + ["--compile-cache", str(cache_file)], "--compile-cache", "not a directory")


def _fake_checkpoint(d, **fields):
    """A directory that reads as a finished conversion whose config.json has `fields`."""
    from checkpoints.convert import MANIFEST
    d.mkdir()
    cfg = C.tiny().to_hf_dict()
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / MANIFEST).write_text("{}")
    return d


@pytest.mark.parametrize("field, value", [("rms_norm_eps", -1e-6), ("rope_theta", -10000.0),
                                          ("routed_scaling_factor", 0.0), ("hc_eps", "tiny"),
                                          ("compress_rope_theta", float("inf"))])
def test_config_values_are_checked_before_loading(tmp_path, capsys, no_model, field, value):
    ckpt = _fake_checkpoint(tmp_path / "ckpt", **{field: value})
    bad(capsys, ["generate", "--checkpoint", str(ckpt)], "config.json", field)


def test_config_fields():
    """Every float field refuses negative, zero and non-finite values; ids must fit the
    vocabulary; bools are not integers."""
    for f in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor",
              "routed_scaling_factor", "swiglu_limit"):
        for v in (-1.0, 0.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=f):
                C.tiny().replace(**{f: v})
    for f, v in (("eos_token_id", 1024), ("bos_token_id", -1), ("hidden_size", True),
                 ("num_nextn_predict_layers", -1), ("rope_original_max_position", 0)):
        with pytest.raises(ValueError, match=f):
            C.tiny().replace(**{f: v})


def test_checkpoint_paths(tmp_path, capsys, no_model, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    bad(capsys, ["generate", "--checkpoint", str(f)], "--checkpoint", "not a directory")
    bad(capsys, ["generate", "--checkpoint", str(tmp_path / "nope")], "no such file")
    bad(capsys, ["generate", "--checkpoint", str(tmp_path), "--preset", "tiny"], "--preset",
        "--checkpoint")
    bad(capsys, ["generate", "--checkpoint", str(tmp_path)], str(tmp_path))  # not a checkpoint
    _fake_checkpoint(tmp_path / "ckpt", rms_norm_eps=-1.0)
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for p in ("ckpt", "./link", "~/ckpt"):  # each reaches the config check, resolved
        bad(capsys, ["generate", "--checkpoint", p], str(tmp_path / "ckpt" / "config.json"),
            "rms_norm_eps")


def test_logits_input(tmp_path, capsys, no_model):
    rng = np.random.default_rng(11)
    ok = rng.integers(0, 1024, (2, 20))
    cases = {
        "big.npy": ok.copy(), "float.npy": ok.astype(np.float32), "bool.npy": ok > 500,
        "flat.npy": ok[0], "neg.npy": ok.copy(),
    }
    cases["big.npy"][1, 3] = 2 ** 31 + 5   # would wrap into a valid id as int32
    cases["neg.npy"][0, 7] = -2
    for name, arr in cases.items():
        np.save(tmp_path / name, arr)
    np.save(tmp_path / "ok.npy", ok)
    (tmp_path / "text.npy").write_text("not numpy")
    out = str(tmp_path / "o.npz")
    base = ["logits", "--preset", "tiny", "--prefill-len", "15", "--out", out, "--tokens"]
    bad(capsys, base + [str(tmp_path / "big.npy")], str(2 ** 31 + 5), "[1, 3]", "[0, 1024)")
    bad(capsys, base + [str(tmp_path / "neg.npy")], "-2", "[0, 7]")
    bad(capsys, base + [str(tmp_path / "float.npy")], "float.npy", "integers")
    bad(capsys, base + [str(tmp_path / "bool.npy")], "integers")
    bad(capsys, base + [str(tmp_path / "flat.npy")], "[B, T]", "(20,)")
    bad(capsys, base + [str(tmp_path / "text.npy")], "text.npy", ".npy")
    bad(capsys, base + [str(tmp_path / "nope.npy")], "--tokens", "no such file")
    bad(capsys, ["logits", "--prefill-len", "21", "--out", out, "--tokens",
                 str(tmp_path / "ok.npy")], "--prefill-len", "[1, 20]")
    bad(capsys, ["logits", "--prefill-len", "5", "--out", str(tmp_path / "missing" / "o.npz"),
                 "--tokens", str(tmp_path / "ok.npy")], "--out", "does not exist")
    (tmp_path / "d.npz").mkdir()
    bad(capsys, ["logits", "--prefill-len", "5", "--out", str(tmp_path / "d.npz"), "--tokens",
                 str(tmp_path / "ok.npy")], "--out", "is a directory")


def test_interrupt_and_failure_exit_codes(capsys, monkeypatch):
    """Ctrl-C while the model loads: 130 and one line; a runtime failure: 1 and one line;
    a bug keeps its traceback."""
    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_load_params", interrupt)
    line = bad(capsys, GEN, "interrupted", code=130)
    assert line.startswith("dsv4 generate: interrupted")

    def fail(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 12 GiB")
    monkeypatch.setattr(cli, "_load_params", fail)
    bad(capsys, GEN, "dsv4 generate: failed", "RESOURCE_EXHAUSTED", code=1)

    def bug(*a, **k):
        raise KeyError("x")
    monkeypatch.setattr(cli, "_load_params", bug)
    with pytest.raises(KeyError):
        cli.main(GEN)


def test_engine_refuses_bad_requests(tiny_model):
    """The Python API checks the same things before compiling anything."""
    cfg, params = tiny_model
    eng = G.Engine(cfg, params, numerics=Numerics(False, "float32"), progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[0, 5, 9]], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(eng.stream([[0, 5, 9]], max_new_tokens=-1))
    with pytest.raises(ValueError, match="integers"):
        eng.generate([[0.0, 5.5]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        eng.teacher_forced_logits(np.array([[1, 2, 2 ** 31 + 1]], np.int64), 2)
    assert not eng.bm.active.any()   # nothing was admitted


@pytest.mark.parametrize("argv, needles", [
    (["--batch", "1", "0"], ["--batch", "at least 1"]),
    (["--context", "-5"], ["--context"]),
    (["--steps", "0"], ["--steps"]),
    (["--layers", "99"], ["--layers", "[0, 43]"]),
    (["--devices", "64"], ["--devices 64"]),
    (["--expert", "2"], ["--expert", "--devices"]),
    (["--devices", "1", "--layout", "pipeline", "--model", "1"], ["--model", "--layout mesh"]),
    (["--preset", "huge"], ["huge", "choose from"]),
])
def test_bench_flags(capsys, monkeypatch, argv, needles):
    from benchmarks import decode_bench

    def fail(*a, **k):
        raise AssertionError("the bench started before its flags were checked")
    monkeypatch.setattr(decode_bench, "copy_bandwidth", fail)
    bad(capsys, ["bench", "decode", *argv], "dsv4 bench: error:", *needles)


def test_several_prompts_stream_as_json_lines(tmp_path, capsys, monkeypatch):
    """--stream with several prompts prints one JSON line per new piece, the prompts
    interleaved as the steps come (an engine stand-in: the real stream is test_decode's)."""
    rng = np.random.default_rng(12)
    steps = [[(0, int(rng.integers(65, 90))), (1, int(rng.integers(97, 122)))]
             for _ in range(3)]

    class Engine:
        mesh = pipeline = None
        timing = G.Timing()

        def stream(self, prompts, **kw):
            assert len(prompts) == 2 and kw["max_new_tokens"] == 3
            yield from steps

    monkeypatch.setattr(cli, "_load_params", lambda args, cfg: None)
    monkeypatch.setattr(cli, "_engine", lambda args, cfg, params: Engine())
    p = tmp_path / "p.txt"
    p.write_text("first prompt\n\nsecond one\n")
    assert run(["generate", "--preset", "tiny", "--prompts-file", str(p), "--stream",
                "--max-new-tokens", "3"]) == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    tok = load_tokenizer(None, C.tiny().vocab_size)
    assert [(l["prompt"], l["text"]) for l in lines] == \
        [(i, tok.decode([t])) for s in steps for i, t in s]


# ---- what a new user hit (issue 54) -------------------------------------------------------
NON_ASCII = "🚀 日本語のテキスト, café, naïve, €5, Ωμέγα 😀!"


class StandIn:
    """The Engine surface cmd_generate uses, replaying fixed tokens: `stream` one token a
    step per prompt, `generate` all at once; `generate` runs prompts beyond `slots` in
    waves and sums their timing, as Engine.generate does."""
    mesh = pipeline = None
    acceptance = None

    def __init__(self, outs, slots=4):
        self.outs, self.slots, self.calls = outs, slots, []
        self.timing = G.Timing()

    def stream(self, prompts, **kw):
        for k in range(max(map(len, self.outs))):
            yield [(i, o[k]) for i, o in enumerate(self.outs[:len(prompts)]) if k < len(o)]

    def generate(self, prompts, *, seed, **kw):
        if len(prompts) > self.slots:
            out, waves = [], []
            for i in range(0, len(prompts), self.slots):
                out += self.generate(prompts[i:i + self.slots], seed=seed + i, **kw)
                waves.append(self.timing)
            self.timing = G.Timing(prefill_s=sum(t.prefill_s for t in waves),
                                   first_token_s=waves[0].first_token_s,
                                   compile_s=sum(t.compile_s for t in waves),
                                   decode_s=sum(t.decode_s for t in waves),
                                   new_tokens=sum(t.new_tokens for t in waves))
            return out
        first = len(self.calls) == 0
        start = sum(n for n, _, _ in self.calls)
        self.calls.append((len(prompts), seed, [list(p) for p in prompts]))
        self.timing = G.Timing(prefill_s=0.5, first_token_s=0.5 + len(self.calls),
                               compile_s=2.0 if first else 0.0, decode_s=1.0,
                               new_tokens=10 * len(prompts))
        return [list(self.outs[(start + i) % len(self.outs)]) for i in range(len(prompts))]


def _stand_in(monkeypatch, eng):
    monkeypatch.setattr(cli, "_load_params", lambda args, cfg: None)
    monkeypatch.setattr(cli, "_engine", lambda args, cfg, params: eng)


@pytest.mark.parametrize("model", [["--preset", "tiny"], []])   # byte-level; embedded BPE
def test_streamed_text_equals_the_generated_text(capsys, monkeypatch, tmp_path, model):
    """Non-ASCII text split across tokens (an emoji's 4 bytes are 4 byte-level ids) streams
    as whole characters: the streamed text is byte for byte the non-streamed one."""
    cfg = C.tiny() if model else C.Config.from_json(
        __import__("dsv4_jax").embedded_checkpoint() / "config.json")
    tok = load_tokenizer(None if model else __import__("dsv4_jax").embedded_checkpoint(),
                         cfg.vocab_size)
    rng = np.random.default_rng(54)
    words = NON_ASCII.split(" ")
    texts = [" ".join(rng.permutation(words)) for _ in range(2)]
    outs = [tok.encode(t) for t in texts]
    assert any(len(tok.decode([i])) == 0 or "\ufffd" in tok.decode([i])
               for i in outs[0])   # some token is only part of a character
    _stand_in(monkeypatch, StandIn(outs[:1]))
    base = ["generate", *model, "--prompt", "hi", "--max-new-tokens", "64"]
    assert run(base + ["--stream"]) == 0
    streamed = capsys.readouterr().out
    assert run(base) == 0
    whole = capsys.readouterr().out
    assert streamed == texts[0] + "\n"
    assert whole.splitlines()[1:] == texts[0].splitlines()
    # several prompts: JSON lines of whole characters, each prompt's pieces its text
    _stand_in(monkeypatch, StandIn(outs))
    p = tmp_path / "p.txt"
    p.write_text("one\ntwo\n")
    assert run(["generate", *model, "--prompts-file", str(p), "--stream",
                "--max-new-tokens", "64"]) == 0
    got = ["", ""]
    for line in capsys.readouterr().out.splitlines():
        d = json.loads(line)
        assert "\ufffd" not in d["text"] and d["text"]
        got[d["prompt"]] += d["text"]
    assert got == texts


def test_generate_statistics_cover_every_wave(capsys, monkeypatch, tmp_path):
    """10 prompts on 4 slots run in 3 waves: the time to first token is the first wave's,
    the decode rate counts every wave's tokens and time; wave w is seeded as
    Engine.generate seeds its own waves."""
    eng = StandIn([[40, 41, 42]], slots=4)
    _stand_in(monkeypatch, eng)
    p = tmp_path / "p.txt"
    p.write_text("".join(f"prompt {i}\n" for i in range(10)))
    assert run(["generate", "--preset", "tiny", "--prompts-file", str(p), "--seed", "7",
                "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert [(n, s) for n, s, _ in eng.calls] == [(4, 7), (4, 11), (2, 15)]
    assert "in 3 waves of up to 4" in err
    assert "compiles its programs" in err   # said before the silent compile
    stats = err.strip().splitlines()[-1]
    assert "time to first token 1.50 s" in stats, stats   # wave 1's
    assert "decode compile 2.0 s, then 100 tokens in 3.00 s = 33.3 tokens/s" in stats, stats


def test_prompts_file_bom_and_prompt_header(capsys, monkeypatch, tmp_path):
    """A UTF-8 BOM opening --prompts-file is no part of the first prompt; the
    `--- prompt:` header marks where it cut a long prompt."""
    eng = StandIn([[40, 41]])
    _stand_in(monkeypatch, eng)
    long = "x" * 100 + "the end"
    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbffirst\n" + long.encode() + b"\n")
    assert run(["generate", "--preset", "tiny", "--prompts-file", str(p),
                "--max-new-tokens", "2"]) == 0
    tok = load_tokenizer(None, C.tiny().vocab_size)
    assert eng.calls[0][2] == [[tok.bos_id] + tok.encode("first"),
                               [tok.bos_id] + tok.encode(long)]
    out = capsys.readouterr().out
    assert "--- prompt: 'first'\n" in out
    assert f"--- prompt (its last 60 of {len(long)} characters): ...{long[-60:]!r}" in out


def test_plain_and_chat_prompts_are_not_mixed(capsys, no_model, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a prompt\n")
    bad(capsys, GEN + ["--user", "hello"], "--prompt", "--user", "one kind")
    bad(capsys, ["generate", "--prompts-file", str(f), "--user", "hi"], "--prompts-file",
        "--user")


def test_an_unwritable_compile_cache_is_refused_first(capsys, no_model, monkeypatch):
    where = "/proc/self/dsv4-cache"   # not creatable, whoever runs the test
    bad(capsys, GEN + ["--compile-cache", where], "--compile-cache", where, "cannot write")
    monkeypatch.setenv("DSV4_COMPILE_CACHE", where)
    bad(capsys, GEN, "DSV4_COMPILE_CACHE", "cannot write")


def test_bench_kernels_need_hopper_before_any_work(capsys, monkeypatch):
    import jax
    from benchmarks import decode_bench
    if jax.default_backend() == "gpu":
        pytest.skip("CPU-only check")

    def fail(*a, **k):
        raise AssertionError("the bench started before its flags were checked")
    monkeypatch.setattr(decode_bench, "copy_bandwidth", fail)
    bad(capsys, ["bench", "decode", "--layers", "1", "--kernels", "on"], "--kernels on",
        "Hopper", "cpu")
    bad(capsys, ["bench", "decode", "--layers", "1", "--matmul", "xla", "pallas"],
        "--matmul pallas", "Hopper")


def test_inspect_match_needs_tensors(capsys, tmp_path):
    bad(capsys, ["inspect", str(tmp_path), "--match", "attn"], "--match", "--tensors")
    bad(capsys, ["inspect", str(tmp_path), "--match", "attn", "--tensors", "--json"],
        "--match", "--json")


def test_the_tokenizer_is_named_and_a_fallback_warned(tmp_path, capsys, monkeypatch):
    """Which tokenizer runs is said before anything loads: the checkpoint's tokenizer.json,
    or a warning that a checkpoint without one gets the byte-level tokenizer; --tokenizer
    gives one, checked like the checkpoint's."""
    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_load_params", interrupt)
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    assert run(["generate", "--checkpoint", str(ckpt), "--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert f"warning: {ckpt} has no tokenizer.json" in err and "--tokenizer" in err
    from dsv4_jax.embedded import embedded_checkpoint
    tj = embedded_checkpoint() / "tokenizer.json"
    assert run(GEN) == 130   # the embedded model
    assert f"tokenizer: {tj}" in capsys.readouterr().err
    assert run(["generate", "--checkpoint", str(ckpt), "--tokenizer", str(tj),
                "--prompt", "hi"]) == 2   # 129k-token vocabulary, the model's is 1024
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--tokenizer" in line and "vocab_size" in line
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    bad(capsys, ["generate", "--checkpoint", str(ckpt), "--tokenizer", str(junk),
                 "--prompt", "hi"], "--tokenizer", "junk.json", "not a tokenizer.json")
    bad(capsys, ["generate", "--checkpoint", str(ckpt), "--tokenizer", str(tmp_path),
                 "--prompt", "hi"], "--tokenizer", "no tokenizer.json")


def test_version_and_help(capsys):
    from importlib.metadata import version
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dsv4 {version('dsv4-jax')}"
    ap = cli.build_parser()
    subs = next(a for a in ap._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name in ("generate", "logits", "serve"):
        p = subs.choices[name]
        for a in p._actions:
            assert a.help, (name, a.option_strings)
        text = p.format_help()
        for a in p._actions:
            if a.option_strings and a.default not in (None, False) and a.default is not \
                    __import__("argparse").SUPPRESS and "default" not in a.help:
                assert f"(default: {a.default})" in " ".join(text.split()), (name, a.dest)
    assert "(default: 32)" in subs.choices["generate"].format_help()
