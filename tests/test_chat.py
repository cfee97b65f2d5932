"""DeepSeek-V4 chat encoding: byte-exact fixtures, structure, round trips, errors."""

import copy
import json
import os
import pathlib
import random
import re

import pytest

from dsv4_jax import chat

SEED = 46

def _data_dir():
    """Conformance data: $DSV4_SHARED/testdata/encoding, else ../shared beside the checkout."""
    root = pathlib.Path(__file__).resolve().parents[1]
    for base in (os.environ.get("DSV4_SHARED"), root.parent / "shared", root / "shared"):
        if base and (pathlib.Path(base) / "testdata" / "encoding").is_dir():
            return pathlib.Path(base) / "testdata" / "encoding"
    return root.parent / "shared" / "testdata" / "encoding"


DATA = _data_dir()
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="conformance files not present")

# Characters for random text: ASCII, quotes, markup-ish, CJK, accents, emoji, newlines.
# No fullwidth bar "｜" so random text never forms a special token or DSML tag.
POOL = list("abcxyzABC 0189.,;:!?-_'\"()[]{}<>/\\=+*&%$#@\n\t") + list("中文测试模型€éßø😀🚀")


def rand_text(rng, lo=0, hi=40):
    return "".join(rng.choice(POOL) for _ in range(rng.randint(lo, hi)))


def rand_json_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rand_text(rng)
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.uniform(-1e3, 1e3)
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return [rand_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{j}": rand_json_value(rng, depth + 1) for j in range(rng.randint(0, 3))}


def rand_tool_call(rng, i):
    args = {f"p{j}_{rng.randint(0, 99)}": rand_json_value(rng) for j in range(rng.randint(0, 4))}
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": f"tool_{rng.randint(0, 999)}", "arguments": json.dumps(args)}}


def load_fixture(n):
    data = json.loads((DATA / f"test_input_{n}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):  # conversation + tool list: tools go on the first message
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    expected = (DATA / f"test_output_{n}.txt").read_text(encoding="utf-8")
    return messages, expected


@needs_data
@pytest.mark.parametrize("n", [1, 3])
def test_conformance_byte_exact(n):
    messages, expected = load_fixture(n)
    before = copy.deepcopy(messages)
    prompt = chat.encode_messages(messages, thinking_mode="thinking")
    assert prompt.encode("utf-8") == expected.encode("utf-8")
    assert messages == before, "encode_messages must not modify its input"


@needs_data
def test_chat_mode_of_fixture_drops_reasoning():
    # Independent derivation: chat mode = thinking-mode text with each kept reasoning block
    # "<think>...</think>" after <｜Assistant｜> collapsed to a bare "</think>".
    messages, expected = load_fixture(1)
    derived = re.sub(re.escape(chat.ASSISTANT + chat.THINK_START) + ".*?" + re.escape(chat.THINK_END),
                     chat.ASSISTANT + chat.THINK_END, expected, flags=re.S)
    assert derived != expected
    assert chat.encode_messages(messages, thinking_mode="chat") == derived


@needs_data
@pytest.mark.parametrize("n", [1, 3])
def test_fixture_assistant_turns_parse_back(n):
    messages, expected = load_fixture(n)
    assistants = [m for m in messages if m["role"] == "assistant"]
    # Each assistant turn: after "<｜Assistant｜><think>" up to and including its EOS.
    turns = re.findall(re.escape(chat.ASSISTANT + chat.THINK_START) + "(.*?" + re.escape(chat.EOS) + ")",
                       expected, flags=re.S)
    assert len(turns) == len(assistants)
    for turn, msg in zip(turns, assistants):
        got = chat.parse_completion(turn, "thinking")
        assert got["reasoning_content"] == msg["reasoning_content"]
        assert got["content"] == (msg.get("content") or "")
        want_calls = msg.get("tool_calls") or []
        assert len(got["tool_calls"]) == len(want_calls)
        for g, w in zip(got["tool_calls"], want_calls):
            assert g["type"] == "function"
            assert g["function"]["name"] == w["function"]["name"]
            assert json.loads(g["function"]["arguments"]) == json.loads(w["function"]["arguments"])


def test_generation_prompt_endings():
    rng = random.Random(SEED)
    msgs = [{"role": "system", "content": rand_text(rng, 1)}, {"role": "user", "content": rand_text(rng, 1)}]
    chat_p = chat.encode_messages(msgs, thinking_mode="chat")
    think_p = chat.encode_messages(msgs, thinking_mode="thinking")
    assert chat_p == chat.BOS + msgs[0]["content"] + chat.USER + msgs[1]["content"] + chat.ASSISTANT + chat.THINK_END
    assert think_p == chat_p[: -len(chat.THINK_END)] + chat.THINK_START
    assert think_p.endswith(chat.ASSISTANT + chat.THINK_START)
    # A tool result as the last message also hands over to the assistant.
    msgs2 = msgs + [{"role": "assistant", "content": "", "tool_calls": [rand_tool_call(rng, 0)]},
                    {"role": "tool", "tool_call_id": "call_0", "content": rand_text(rng)}]
    assert chat.encode_messages(msgs2, "thinking").endswith(chat.TOOL_RESULT_END + chat.ASSISTANT + chat.THINK_START)


def test_drop_thinking_multi_turn():
    rng = random.Random(SEED)
    n_turns = rng.randint(2, 4)
    msgs = [{"role": "system", "content": rand_text(rng, 1)}]
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"q{t}" + rand_text(rng)})
        msgs.append({"role": "assistant", "content": f"a{t}" + rand_text(rng),
                     "reasoning_content": f"r{t}" + rand_text(rng)})
    msgs.append({"role": "user", "content": "last" + rand_text(rng)})

    kept = chat.encode_messages(msgs, "thinking", drop_thinking=False)
    dropped = chat.encode_messages(msgs, "thinking", drop_thinking=True)
    for t in range(n_turns):
        r = msgs[2 + 2 * t]["reasoning_content"]
        assert chat.THINK_START + r + chat.THINK_END in kept
        assert r not in dropped
    # Independent construction of the dropped form.
    want = chat.BOS + msgs[0]["content"]
    for t in range(n_turns):
        want += chat.USER + msgs[1 + 2 * t]["content"] + chat.ASSISTANT + chat.THINK_END
        want += msgs[2 + 2 * t]["content"] + chat.EOS
    want += chat.USER + msgs[-1]["content"] + chat.ASSISTANT + chat.THINK_START
    assert dropped == want
    # Chat mode never shows reasoning and ignores drop_thinking.
    c1 = chat.encode_messages(msgs, "chat", drop_thinking=True)
    assert c1 == chat.encode_messages(msgs, "chat", drop_thinking=False)
    assert c1 == want[: -len(chat.THINK_START)] + chat.THINK_END
    # Tools anywhere turn dropping off.
    with_tools = copy.deepcopy(msgs)
    with_tools[0]["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    p = chat.encode_messages(with_tools, "thinking", drop_thinking=True)
    for t in range(n_turns):
        assert chat.THINK_START + msgs[2 + 2 * t]["reasoning_content"] + chat.THINK_END in p


def test_max_reasoning_effort_preamble():
    rng = random.Random(SEED)
    msgs = [{"role": "system", "content": rand_text(rng, 1)}, {"role": "user", "content": rand_text(rng, 1)}]
    base = chat.encode_messages(msgs, "thinking")
    maxed = chat.encode_messages(msgs, "thinking", reasoning_effort="max")
    assert maxed == chat.BOS + chat.MAX_EFFORT_PREAMBLE + base[len(chat.BOS):]
    assert maxed[len(chat.BOS):].startswith("Reasoning Effort: Absolute maximum")
    assert chat.encode_messages(msgs, "thinking", reasoning_effort="high") == base
    # Chat mode: no preamble.
    assert chat.encode_messages(msgs, "chat", reasoning_effort="max") == chat.encode_messages(msgs, "chat")


def test_tool_results_merge_and_follow_call_order():
    rng = random.Random(SEED)
    calls = [rand_tool_call(rng, i) for i in range(3)]
    results = {c["id"]: rand_text(rng, 1) for c in calls}
    order = [c["id"] for c in calls]
    shuffled = order[:]
    while shuffled == order:
        rng.shuffle(shuffled)
    msgs = [{"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": calls}]
    msgs += [{"role": "tool", "tool_call_id": i, "content": results[i]} for i in shuffled]
    msgs += [{"role": "user", "content": "follow-up"}]
    p = chat.encode_messages(msgs, "chat")
    blocks = "\n\n".join(chat.TOOL_RESULT_START + results[i] + chat.TOOL_RESULT_END for i in order)
    assert p.endswith(chat.EOS + chat.USER + blocks + "\n\nfollow-up" + chat.ASSISTANT + chat.THINK_END)
    assert p.count(chat.USER) == 2


def test_latest_reminder_and_system_after_user():
    msgs = [{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "R"},
            {"role": "user", "content": "U"}]
    assert chat.encode_messages(msgs, "chat") == (
        chat.BOS + "S" + chat.LATEST_REMINDER + "R" + chat.USER + "U" + chat.ASSISTANT + chat.THINK_END)


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_assistant_round_trip_random(mode):
    rng = random.Random(SEED)
    for trial in range(30):
        user = [{"role": "user", "content": rand_text(rng, 1)}]
        msg = {"role": "assistant", "content": rand_text(rng),
               "reasoning_content": rand_text(rng, 1),
               "tool_calls": [rand_tool_call(rng, i) for i in range(rng.randint(0, 3))]}
        prompt = chat.encode_messages(user, mode)
        full = chat.encode_messages(user + [msg], mode)
        assert full.startswith(prompt)
        completion = full[len(prompt):]
        assert completion.endswith(chat.EOS)
        got = chat.parse_completion(completion, mode)
        assert got["role"] == "assistant"
        assert got["content"] == msg["content"]
        assert got["reasoning_content"] == (msg["reasoning_content"] if mode == "thinking" else "")
        assert [c["function"]["name"] for c in got["tool_calls"]] == [c["function"]["name"] for c in msg["tool_calls"]]
        for g, w in zip(got["tool_calls"], msg["tool_calls"]):
            assert json.loads(g["function"]["arguments"]) == json.loads(w["function"]["arguments"])
        # Re-encoding the parsed message reproduces the same text (ids are not rendered).
        assert chat.encode_messages(user + [got], mode) == full


def test_parse_completion_stops_and_truncation():
    assert chat.parse_completion("hello" + chat.EOS + "junk", "chat")["content"] == "hello"
    assert chat.parse_completion("hi" + chat.USER + "more", "chat")["content"] == "hi"
    assert chat.parse_completion("no eos yet", "chat")["content"] == "no eos yet"
    cut = chat.parse_completion("still thinking", "thinking")
    assert cut["reasoning_content"] == "still thinking" and cut["content"] == ""
    assert set(chat.stop_strings()) == {chat.EOS, chat.USER}


@pytest.mark.parametrize("messages, match", [
    ([{"role": "wizard", "content": "x"}], "unknown role"),
    ([{"content": "x"}], "unknown role"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}], "no function name"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}], "not valid JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}], "JSON object"),
    ([{"role": "user", "content": "x", "tools": [{"function": {"name": "f"}}]}], "system or developer"),
    ([{"role": "system", "content": "x", "tools": [{"function": {"description": "no name"}}]}], "non-empty name"),
    ([{"role": "user", "content": 5}], "must be a string"),
    ([{"role": "user", "content": "x", "task": "dance"}], "unknown task"),
    ("not a list", "list"),
])
def test_bad_messages_raise(messages, match):
    with pytest.raises(ValueError, match=match):
        chat.encode_messages(messages, "thinking")


def test_bad_modes_raise():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="thinking_mode"):
        chat.encode_messages(msgs, "reasoning")
    with pytest.raises(ValueError, match="reasoning_effort"):
        chat.encode_messages(msgs, "thinking", reasoning_effort="ultra")
    with pytest.raises(ValueError, match="thinking_mode"):
        chat.parse_completion("x", "both")


def test_parse_malformed_tool_calls_raise():
    good = chat.encode_messages([{"role": "user", "content": "u"},
                                 {"role": "assistant", "content": "c", "tool_calls": [
                                     {"function": {"name": "f", "arguments": '{"n": 3, "s": "v"}'}}]}], "chat")
    completion = good[good.index(chat.THINK_END) + len(chat.THINK_END):]
    assert chat.parse_completion(completion, "chat")["tool_calls"][0]["function"]["name"] == "f"
    with pytest.raises(ValueError, match="not closed"):
        chat.parse_completion(completion.replace(chat.TOOL_CALLS_END, ""), "chat")
    with pytest.raises(ValueError, match="not JSON"):
        chat.parse_completion(completion.replace('string="false">3', 'string="false">three'), "chat")
    with pytest.raises(ValueError, match="without a name"):
        chat.parse_completion(completion.replace('name="f"', 'name=""'), "chat")
    with pytest.raises(ValueError, match="malformed"):
        chat.parse_completion(completion.replace(f"</{chat.DSML}invoke>", "oops</" + chat.DSML + "invoke>"), "chat")
