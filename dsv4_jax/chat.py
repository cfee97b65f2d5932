"""DeepSeek-V4 chat encoding: OpenAI-style messages <-> the model's prompt text.

The wire format (byte-exact against /work/shared/testdata/encoding/, the official fixtures):

    <BOS>[effort preamble]{system}[\\n\\n## Tools ...]
    <｜User｜>{user}<｜Assistant｜><think>{reasoning}</think>{content}[\\n\\n<DSML tool calls>]<EOS>
    <｜User｜><tool_result>{tool output}</tool_result><｜Assistant｜>...

Rules (written from the DeepSeek-V4 encoding README and the fixtures):
- BOS once at the start. System content is raw text; its `tools` / `response_format` follow
  after "\\n\\n". A `developer` message is a user turn (`<｜User｜>` + content [+ tools]).
- `tool` messages become `<tool_result>...</tool_result>` blocks of a user turn. Consecutive
  user/tool messages merge into ONE user turn whose blocks are joined by "\\n\\n"; several
  tool results in one turn are ordered like the calls of the preceding assistant message.
- After a user/developer turn that is last or followed by an assistant (or latest_reminder)
  message comes `<｜Assistant｜>` and then `<think>` (thinking mode, reasoning kept) or
  `</think>` (chat mode, or a turn whose reasoning is dropped).
- Assistant turn: `{reasoning}</think>` (thinking mode, reasoning kept) + content +
  "\\n\\n" + DSML tool-call block (if any) + EOS.
- drop_thinking (thinking mode only): reasoning of assistant turns before the last user turn
  is removed, and so are developer messages before it. Any `tools` in the conversation
  turns dropping off, since tool use needs the earlier reasoning.
- reasoning_effort="max" in thinking mode puts a fixed preamble before the first message.
- Optional per-message `task` adds a quick-instruction token (see TASK_TOKENS).

Generation stops on EOS and on the user-turn token (`stop_strings()`).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

# ---- special token strings -------------------------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
LATEST_REMINDER = "<｜latest_reminder｜>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"

# Quick-instruction task tokens, chosen per message with the optional "task" field.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Every string the tokenizer must treat as one token (order fixes the synthetic ids).
SPECIAL_TOKENS = (
    BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, LATEST_REMINDER, DSML,
    *TASK_TOKENS.values(),
)

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")  # "high" is the default behaviour: no preamble

MAX_EFFORT_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

TOOLS_PROMPT = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke "
    f'tools by writing a "{TOOL_CALLS_START}" block like the following:\n\n'
    f"{TOOL_CALLS_START}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"{TOOL_CALLS_END}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other '
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)

RESPONSE_FORMAT_PROMPT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


def stop_strings() -> list[str]:
    """Strings that end generation: EOS and the start of a new user turn."""
    return [EOS, USER]


# ---- helpers ---------------------------------------------------------------------------
def _json(value: Any) -> str:
    # Official rendering: json.dumps defaults (", " and ": ") with raw unicode.
    return json.dumps(value, ensure_ascii=False)


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: content must be a string, got {type(value).__name__}")
    return value


def _tool_schema(tool: Any, where: str) -> dict:
    # Accept OpenAI {"type": "function", "function": {...}} or a bare function dict.
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: tool definition needs a function with a non-empty name")
    return fn


def _render_tools(tools: list, where: str) -> str:
    if not isinstance(tools, list):
        raise ValueError(f"{where}: tools must be a list")
    schemas = [_json(_tool_schema(t, f"{where}[{i}]")) for i, t in enumerate(tools)]
    return TOOLS_PROMPT.replace("{schemas}", "\n".join(schemas))


def _call_arguments(call: dict, where: str) -> dict:
    args = call.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: arguments are not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}: arguments must be a JSON object, got {type(args).__name__}")
    return args


def _render_tool_calls(tool_calls: list, where: str) -> str:
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}: tool_calls must be a list")
    invokes = []
    for i, call in enumerate(tool_calls):
        w = f"{where}[{i}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError(f"{w}: tool call must be a dict with a 'function'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{w}: tool call has no function name")
        params = []
        for key, value in _call_arguments(fn, w).items():
            is_str = isinstance(value, str)
            params.append(
                f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                f"{value if is_str else _json(value)}</{DSML}parameter>"
            )
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _tool_result_text(content: Any, where: str) -> str:
    if isinstance(content, list):  # list of {"type": "text", "text": ...} blocks
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise ValueError(f"{where}: tool content blocks must be {{'type': 'text'}}")
            parts.append(_text(block.get("text"), where))
        return "\n\n".join(parts)
    return _text(content, where)


def _validate(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ValueError("messages must be a list of dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r} (expected one of {ROLES})")
        if m.get("tools") and role not in ("system", "developer"):
            raise ValueError(f"messages[{i}]: tools belong on a system or developer message")
        if m.get("tool_calls") and role != "assistant":
            raise ValueError(f"messages[{i}]: tool_calls belong on an assistant message")
        task = m.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ValueError(f"messages[{i}]: unknown task {task!r}")
        out.append(copy.deepcopy(m))
    return out


def _merge_user_turns(messages: list[dict]) -> list[dict]:
    """Fold tool and user messages into user turns carrying a list of text blocks.

    Returns new messages; user turns get "blocks": list of (kind, text, tool_call_id).
    A user message with a task starts its own turn and is never extended.
    """
    merged: list[dict] = []
    for i, m in enumerate(messages):
        role = m["role"]
        prev = merged[-1] if merged else None
        can_extend = prev is not None and prev["role"] == "user" and prev.get("task") is None
        if role == "tool":
            block = ("tool", _tool_result_text(m.get("content"), f"messages[{i}]"),
                     m.get("tool_call_id") or "")
            if can_extend:
                prev["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = ("text", _text(m.get("content"), f"messages[{i}]"), "")
            if can_extend:
                prev["blocks"].append(block)
            else:
                merged.append({**m, "blocks": [block]})
        else:
            merged.append(m)
    return merged


def _order_tool_results(messages: list[dict]) -> None:
    """Reorder tool results within a user turn to follow the preceding calls (in place)."""
    call_order: dict[str, int] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            call_order = {}
            for i, c in enumerate(m["tool_calls"]):
                cid = c.get("id") if isinstance(c, dict) else None
                if cid:
                    call_order[cid] = i
        elif m["role"] == "user" and call_order:
            slots = [i for i, b in enumerate(m["blocks"]) if b[0] == "tool"]
            if len(slots) > 1:
                ordered = sorted((m["blocks"][i] for i in slots), key=lambda b: call_order.get(b[2], 0))
                for i, b in zip(slots, ordered):
                    m["blocks"][i] = b


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] in ("user", "developer"):
            return i
    return -1


def _drop_old_thinking(messages: list[dict]) -> list[dict]:
    """Drop reasoning of assistant turns (and developer turns) before the last user turn."""
    last_user = _last_user_index(messages)
    out = []
    for i, m in enumerate(messages):
        if i >= last_user or m["role"] in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
        # other roles before the last user turn (developer) are left out, as upstream does
    return out


def _render(i: int, messages: list[dict], thinking: bool, drop: bool, effort: str | None) -> str:
    m = messages[i]
    role = m["role"]
    where = f"messages[{i}]"
    last_user = _last_user_index(messages)
    out = MAX_EFFORT_PREAMBLE if (i == 0 and thinking and effort == "max") else ""

    if role in ("system", "developer"):
        body = _text(m.get("content"), where)
        if role == "developer":
            if not body:
                raise ValueError(f"{where}: developer message needs non-empty content")
            body = USER + body
        if m.get("tools"):
            body += "\n\n" + _render_tools(m["tools"], f"{where}.tools")
        if m.get("response_format"):
            body += "\n\n" + RESPONSE_FORMAT_PROMPT.format(schema=_json(m["response_format"]))
        out += body
    elif role == "user":
        parts = [TOOL_RESULT_START + t + TOOL_RESULT_END if kind == "tool" else t
                 for kind, t, _ in m["blocks"]]
        out += USER + "\n\n".join(parts)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + _text(m.get("content"), where)
    else:  # assistant
        calls = ""
        if m.get("tool_calls"):
            calls = "\n\n" + _render_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        reasoning = ""
        after_task = i > 0 and messages[i - 1].get("task") is not None
        if thinking and not after_task and (not drop or i > last_user):
            reasoning = _text(m.get("reasoning_content"), where) + THINK_END
        out += reasoning + _text(m.get("content"), where) + calls
        if not m.get("wo_eos", False):
            out += EOS

    # Transition into the next assistant turn (only when one follows or this is the end).
    if i + 1 < len(messages) and messages[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    task = m.get("task")
    if task is not None:
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END)
        out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        keep = thinking and (not drop or i >= last_user)
        out += ASSISTANT + (THINK_START if keep else THINK_END)
    return out


# ---- public API ------------------------------------------------------------------------
def encode_messages(
    messages: list[dict],
    thinking_mode: str = "chat",
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
    add_bos: bool = True,
) -> str:
    """Encode OpenAI-style messages into a DeepSeek-V4 prompt string.

    messages: dicts with "role" in ROLES; "content"; assistant "reasoning_content",
      "tool_calls" (OpenAI style, arguments a JSON string or dict), "wo_eos"; system/developer
      "tools", "response_format"; tool "tool_call_id"; optional "task" (TASK_TOKENS).
    A conversation ending with a user/tool turn ends with the generation prompt:
      "<｜Assistant｜></think>" (chat) or "<｜Assistant｜><think>" (thinking).
    Raises ValueError on unknown roles, nameless tool calls, malformed arguments, bad modes.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    msgs = _merge_user_turns(_validate(messages))
    _order_tool_results(msgs)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_thinking(msgs)
    prompt = BOS if add_bos else ""
    for i in range(len(msgs)):
        prompt += _render(i, msgs, thinking, drop, reasoning_effort)
    return prompt


_INVOKE_RE = re.compile(rf'\s*<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_PARAM_RE = re.compile(
    rf'\s*<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S
)


def _parse_tool_calls(block: str) -> list[dict]:
    """Parse the inside of a <｜DSML｜tool_calls> block into OpenAI tool calls."""
    calls, pos = [], 0
    while True:
        m = _INVOKE_RE.match(block, pos)
        if m is None:
            break
        name, body = m.group(1), m.group(2)
        if not name:
            raise ValueError("tool call without a name in DSML block")
        args, ppos = {}, 0
        while True:
            p = _PARAM_RE.match(body, ppos)
            if p is None:
                break
            key, is_str, raw = p.groups()
            if is_str == "true":
                args[key] = raw
            else:
                try:
                    args[key] = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise ValueError(f"tool {name!r} parameter {key!r}: value is not JSON ({e})") from None
            ppos = p.end()
        if body[ppos:].strip():
            raise ValueError(f"tool {name!r}: malformed DSML parameters near {body[ppos:ppos + 40]!r}")
        calls.append({"type": "function", "function": {"name": name, "arguments": _json(args)}})
        pos = m.end()
    if block[pos:].strip():
        raise ValueError(f"malformed DSML tool_calls block near {block[pos:pos + 40]!r}")
    if not calls:
        raise ValueError("DSML tool_calls block has no invoke")
    return calls


def parse_completion(text: str, thinking_mode: str = "chat") -> dict:
    """Parse generated text (what follows the prompt) into an assistant message.

    Thinking mode: text up to "</think>" is reasoning (no "</think>" at all: everything is
    reasoning, i.e. generation was cut short). Generation ends at the first EOS or user-turn
    token; that token and anything after it are ignored, and a missing EOS is accepted.
    A DSML tool-call block ("\\n\\n" + <｜DSML｜tool_calls>...) becomes OpenAI tool_calls.
    Returns {"role": "assistant", "content", "reasoning_content", "tool_calls"}.
    Raises ValueError on a malformed tool-call block.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if not isinstance(text, str):
        raise ValueError(f"completion must be a string, got {type(text).__name__}")
    for stop in stop_strings():
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]
    reasoning = ""
    if thinking_mode == "thinking":
        end = text.find(THINK_END)
        if end < 0:
            return {"role": "assistant", "content": "", "reasoning_content": text, "tool_calls": []}
        reasoning, text = text[:end], text[end + len(THINK_END):]
    tool_calls = []
    start = text.find(TOOL_CALLS_START)
    if start >= 0:
        end = text.find(TOOL_CALLS_END, start)
        if end < 0:
            raise ValueError("DSML tool_calls block is not closed")
        if text[end + len(TOOL_CALLS_END):].strip():
            raise ValueError("text after the DSML tool_calls block")
        tool_calls = _parse_tool_calls(text[start + len(TOOL_CALLS_START):end])
        text = text[:start]
        if text.endswith("\n\n"):  # the separator belongs to the tool-call envelope
            text = text[:-2]
    return {"role": "assistant", "content": text, "reasoning_content": reasoning,
            "tool_calls": tool_calls}
