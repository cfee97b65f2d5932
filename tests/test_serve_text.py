"""The streaming text layer of `dsv4 serve` (no model): incremental detokenization with
stop strings against whole-text decoding, and the streaming chat parser against
chat.parse_completion, on seeded random texts fed token by token."""
import json

import numpy as np
import pytest

from dsv4_jax import chat
from dsv4_jax.serve.text import ChatOutputParser, IncrementalText, partial_suffix
from dsv4_jax.tokenizer import ByteTokenizer

TOK = ByteTokenizer(1024)
# pieces that hold partial markers, newlines and multi-byte characters, and cannot join
# into a whole "</think>" or tool-call opening tag
WORDS = ["hello", " world", "\n", "\n\n", "<", "<｜", "｜DSML", "</thi", "é", "€", "😀", " ",
         "x", '{"a": 1}', "tool", "calls>"]


def random_text(rng, n):
    return "".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def test_partial_suffix():
    assert partial_suffix("abc</th", "</think>") == 4
    assert partial_suffix("abc", "</think>") == 0
    assert partial_suffix("</think>", "</think>") == 0   # a whole marker is not partial
    assert partial_suffix("<", "<x") == 1


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_matches_whole_decode_cut_at_stop(seed):
    rng = np.random.default_rng(300 + seed)
    text = random_text(rng, 40)
    ids = TOK.encode(text)
    full = TOK.decode(ids)
    # stop strings: two substrings of the text (one may straddle a multi-byte character's
    # tokens), and one that never occurs
    stops = []
    for _ in range(2):
        a = int(rng.integers(5, len(full) - 4))
        stops.append(full[a:a + int(rng.integers(1, 4))])
    stops.append("NEVER")
    if seed % 3 == 0:
        stops = ["NEVER"]
    cuts = [full.find(s) for s in stops if full.find(s) >= 0]
    want = full[:min(cuts)] if cuts else full
    inc = IncrementalText(TOK.decode, tuple(stops))
    got, hit = "", False
    for t in ids:
        delta, hit = inc.push([t])
        got += delta
        assert want.startswith(got)   # never a character past the cut
        if hit:
            break
    got += inc.finish()
    assert hit == bool(cuts)
    assert got == want


def test_incremental_text_holds_incomplete_characters():
    inc = IncrementalText(TOK.decode)
    ids = TOK.encode("€")   # three bytes
    assert [inc.push([t])[0] for t in ids] == ["", "", "€"]
    inc = IncrementalText(TOK.decode)
    inc.push(ids[:2])
    assert inc.finish() == TOK.decode(ids[:2])   # an incomplete tail comes out at the end


def completion(rng, thinking: bool, tools: bool) -> str:
    text = ""
    if thinking:
        text += random_text(rng, 12) + chat.THINK_END
    text += random_text(rng, 15)
    if tools:
        calls = [{"function": {"name": "get_weather",
                               "arguments": json.dumps({"city": random_text(rng, 3),
                                                        "days": int(rng.integers(1, 9)),
                                                        "opts": {"x": [1, 2]}})}},
                 {"function": {"name": "now", "arguments": "{}"}}]
        text += "\n\n" + chat._render_tool_calls(calls, "test")
    return text


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_chat_parser_streamed_equals_parse_completion(thinking, tools, seed):
    rng = np.random.default_rng(400 + seed + 10 * thinking + 20 * tools)
    text = completion(rng, thinking, tools)
    want = chat.parse_completion(text, "thinking" if thinking else "chat")
    # the text as the server streams it: token by token through the detokenizer
    inc, parser = IncrementalText(TOK.decode), ChatOutputParser(thinking)
    events = []
    for t in TOK.encode(text):
        events += parser.feed(inc.push([t])[0])
    events += parser.feed(inc.finish()) + parser.finish()
    got = {"content": "", "reasoning": "", "calls": []}
    for kind, v in events:
        if kind == "tool_calls":
            got["calls"] += v
        else:
            assert chat.TOOL_CALLS_START not in v and chat.THINK_END not in v   # no leak
            got["content" if kind == "content" else "reasoning"] += v
    assert got["content"] == want["content"]
    assert got["reasoning"] == want["reasoning_content"]
    assert got["calls"] == want["tool_calls"]
    assert bool(got["calls"]) == tools


def test_chat_parser_keeps_an_unclosed_block_as_content():
    p = ChatOutputParser(thinking=False)
    ev = p.feed("hi\n\n" + chat.TOOL_CALLS_START + "\n<broken") + p.finish()
    assert "".join(v for k, v in ev if k == "content") == "hi" + chat.TOOL_CALLS_START + "\n<broken"
    assert all(k == "content" for k, _ in ev)


def test_incremental_text_with_a_bpe_tokenizer():
    """The embedded model's byte-level BPE: emoji, CJK and accents whose bytes span
    several ids come out whole, and the pieces join into decode(ids) exactly."""
    from dsv4_jax.embedded import embedded_checkpoint
    from dsv4_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(embedded_checkpoint(), 1 << 20)
    rng = np.random.default_rng(54)
    words = ["🚀", "日本語", "café", "naïve", "€", "Ωμέγα", "😀", " ", "\n", "def f(x):",
             "ß", "한국어"]
    for _ in range(5):
        text = "".join(words[i] for i in rng.integers(0, len(words), 30))
        ids = tok.encode(text)
        inc = IncrementalText(tok.decode)
        pieces = [inc.push([t])[0] for t in ids] + [inc.finish()]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tok.decode(ids) == text
